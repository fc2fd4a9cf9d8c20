"""Benchmark library behind scripts/benchmark.py: our LLTM against the peers a user would pick.

Implementations (names used by ``--impl``):

- ``reference``: the tutorial's pure-torch LLTM, eager (:class:`lltm_cupy.torch.ReferenceLLTMCell`);
- ``compiled``: the same module under ``torch.compile`` (where it compiles on the machine);
- ``cell``: our :class:`lltm_cupy.torch.LLTMCell`;
- ``array``: our array API (NumPy on the CPU, CuPy on the GPU), called directly;
- ``lstm``: ``torch.nn.LSTMCell`` of the same hidden size (different math, comparable work);
- ``cell-graph`` / ``reference-graph`` (CUDA only): our cell / the reference with forward and
  backward each captured in a CUDA graph (``torch.cuda.make_graphed_callables``) and replayed:
  what a training loop that captures its step pays, with no host cost per kernel;
- ``compiled-ro`` (CUDA only): the reference under ``torch.compile(mode="reduce-overhead")``
  (inductor's kernels replayed from CUDA graphs);
- ``cell-op``: our cell called through the ``lltm_cupy::lltm_forward`` custom operator in eager
  mode (the path torch.compile uses), to measure its per-call cost against ``cell``'s plain
  ``autograd.Function`` (not run unless named in ``--impl``);
- ``cell-floor``: the same backend inside a bare ``autograd.Function`` with no argument checks,
  no version checks and no module (CPU only, parameters' gradients only): not a usable op, the
  floor any NumPy-backed Function can reach (not run unless named in ``--impl``);
- ``function-floor``: a bare ``autograd.Function`` that does no LLTM work (it returns copies of
  the state and zero parameter gradients): the fixed cost of one timed step (Function, the
  tutorial's loss and the autograd engine) that any ``autograd.Function``-based cell pays on top
  of its own work (CPU only, parameters' gradients only; not run unless named in ``--impl``).

Every implementation runs the tutorial's step: ``h, c = cell(x, (h0, c0))`` then a backward of
``h`` and ``c`` with gradient one (the tutorial's ``(h.sum() + c.sum()).backward()``), with
gradients for the parameters only (add ``all_grads`` for the inputs and state too). Timings are
taken in one loop, interleaved and rotated so that machine drift hits all implementations alike:
each iteration times the forward, the backward of that forward, and a whole forward+backward.
On the GPU each timed region is bracketed by synchronisations and timed with CUDA events.
"""
from __future__ import annotations

import dataclasses
import platform
import statistics
import sys
import time

import numpy as np

__all__ = ["Config", "IMPLS", "PHASES", "CPU_SIZES", "GPU_SIZES", "ImplementationError",
           "run_size", "format_table",
           "gpu_kernel_report", "cpu_blas_report", "mixed_model_report", "machine_name",
           "plot_speedups"]

IMPLS = ("reference", "compiled", "cell", "array", "lstm")
EXTRA_IMPLS = ("cell-op", "cell-floor", "function-floor")
GRAPH_IMPLS = ("cell-graph", "reference-graph", "compiled-ro")
PHASES = ("forward", "backward", "fwd+bwd")
CPU_SIZES = ((16, 32, 128), (64, 256, 512), (256, 512, 1024))
GPU_SIZES = CPU_SIZES + ((1024, 1024, 1024), (4096, 1024, 1024))


class ImplementationError(RuntimeError):
    """An implementation named by the caller could not be set up (the cause is chained)."""


def _not_run(name, exc, skipped, strict, quiet):
    """An implementation that cannot run: an error when the caller named it (``strict``),
    else skipped with the reason printed."""
    reason = exc if isinstance(exc, str) else (
        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200])
    if strict:
        raise ImplementationError(f"{name} cannot run: {reason}") from (
            None if isinstance(exc, str) else exc)
    skipped[name] = reason
    print(f"  {name}: not run ({reason})", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Config:
    batch: int
    features: int
    state: int
    cuda: bool = False
    double: bool = False
    bf16: bool = False   # bfloat16 (CUDA; the torch implementations only: no array API dtype)
    runs: int = 100
    warmup: int = 10
    all_grads: bool = False
    seed: int = 0

    @property
    def size(self):
        return (self.batch, self.features, self.state)

    @property
    def dtype_name(self) -> str:
        return "bfloat16" if self.bf16 else "float64" if self.double else "float32"

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype_name)


_NO_BF16_ARRAYS = "the array API has no bfloat16 (NumPy and CuPy lack the dtype)"


def machine_name(cuda: bool) -> str:
    if cuda:
        import torch

        return torch.cuda.get_device_name()
    import os

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{os.cpu_count()}-core {platform.machine()} CPU" + (f" ({model})" if model else "")


def _log(quiet, *args):
    if not quiet:
        print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Timers

class _CpuTimer:
    def start(self):
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self.t0


class _CudaTimer:
    """CUDA events on torch's current stream, with a device synchronisation on both sides."""

    def __init__(self):
        import torch

        self.torch = torch
        self.e0 = torch.cuda.Event(enable_timing=True)
        self.e1 = torch.cuda.Event(enable_timing=True)

    def start(self):
        self.torch.cuda.synchronize()
        self.e0.record()

    def stop(self) -> float:
        self.e1.record()
        self.torch.cuda.synchronize()
        return self.e0.elapsed_time(self.e1) / 1e3


# ---------------------------------------------------------------------------------------------
# Implementations: each has forward() -> state, backward(state), saved_bytes()

class _TorchRunner:
    def __init__(self, module, cfg, inputs):
        import torch

        self.torch = torch
        self.module = module
        self.x, self.h, self.c = inputs
        self.ones = torch.ones_like(self.h)

    def forward(self):
        return self.module(self.x, (self.h, self.c))

    def backward(self, out):
        self.torch.autograd.backward(out, (self.ones, self.ones))

    def saved_bytes(self) -> int:
        """Bytes of the tensors autograd saves for backward, other than parameters and inputs,
        plus the arrays our autograd Functions keep on their ctx (invisible to the hooks)."""
        torch = self.torch
        saved = {}
        exclude = {t.data_ptr() for t in (*self.module.parameters(), *self._inputs())}

        def pack(t):
            if t.data_ptr() not in exclude:
                saved[t.data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.forward()
        saved.update(_hidden_saved(out))
        return int(sum(saved.values()))

    def _inputs(self):
        return (self.x, self.h, self.c)


def _tensors(obj):
    if hasattr(obj, "grad_fn"):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)


def _hidden_saved(out) -> dict:
    """{pointer: bytes} of the arrays held by lltm_cupy autograd nodes reachable from ``out``."""
    found, seen = {}, set()
    stack = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        hidden = getattr(node, "lltm_saved", None)
        if hidden is not None:
            for name in ("X", "gates", "new_cell", "hs", "cells"):
                a = getattr(hidden, name, None)
                if a is not None:
                    found[a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr] = a.nbytes
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _array_side(cfg):
    """(xp, stream_ctx, conv) for timing the array API: the array module, a context that puts
    CuPy on torch's current stream (GPU), and a zero-copy tensor-to-array conversion."""
    if cfg.cuda:
        import contextlib

        import cupy
        import torch

        from .torch import _interop

        @contextlib.contextmanager
        def on_torch_stream():
            device = torch.device("cuda", torch.cuda.current_device())
            with cupy.cuda.Device(device.index), _interop._stream(device):
                yield

        return cupy, on_torch_stream, lambda t: cupy.from_dlpack(t.detach())
    import contextlib

    return np, contextlib.nullcontext, lambda t: t.detach().numpy()


class _ArrayRunner:
    def __init__(self, cfg, params, inputs):
        import lltm_cupy

        self.lltm = lltm_cupy
        xp, self.stream_ctx, conv = _array_side(cfg)
        w, b = params
        self.args = [conv(t) for t in (inputs[0], w, b, inputs[1], inputs[2])]
        self.ones = xp.ones_like(self.args[3])
        self.needed = None if cfg.all_grads else (False, False, True, True, False)

    def forward(self):
        with self.stream_ctx():
            return self.lltm.forward(*self.args)

    def backward(self, out):
        with self.stream_ctx():
            self.lltm.backward(self.ones, self.ones, out[2], needed=self.needed)

    def saved_bytes(self) -> int:
        return self.forward()[2].nbytes


def _function_cell(ref, function):
    """A module calling ``function.apply(x, weights, bias, h, c)`` with copies of ``ref``'s
    parameters: the bare-Function measurements ``cell-floor`` and ``function-floor``."""
    import torch

    class FunctionCell(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.Parameter(ref.weights.detach().clone())
            self.bias = torch.nn.Parameter(ref.bias.detach().clone())

        def forward(self, x, state):
            return function.apply(x, self.weights, self.bias, *state)

    return FunctionCell()


def _FloorCell(ref):
    """A module running the NumPy backend in a bare autograd.Function (see ``cell-floor``)."""
    import torch

    from . import _numpy
    from .torch._interop import torch_mm

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b, h, c):
            new_h, new_cell, ctx.lltm_saved = _numpy.forward(
                x.numpy(), w.detach().numpy(), b.detach().numpy(), h.numpy(), c.numpy(),
                mm=torch_mm)
            return torch.from_numpy(new_h), torch.from_numpy(new_cell)

        @staticmethod
        def backward(ctx, grad_h, grad_cell):
            g = _numpy.backward(grad_h.numpy(), grad_cell.numpy(), ctx.lltm_saved,
                                (False, False, True, True, False), mm=torch_mm)
            return None, torch.from_numpy(g.d_weights), torch.from_numpy(g.d_bias), None, None

    return _function_cell(ref, Floor)


def _EmptyCell(ref):
    """A module whose autograd.Function does no LLTM work (see ``function-floor``)."""
    import torch

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b, h, c):
            return h.clone(), c.clone()

        @staticmethod
        def backward(ctx, grad_h, grad_cell):
            return None, torch.zeros_like(ref.weights), torch.zeros_like(ref.bias), None, None

    return _function_cell(ref, Empty)


def _graphed(module, x, h, c):
    """``module`` with forward and backward captured in CUDA graphs (make_graphed_callables),
    called as ``graphed(x, (h, c))`` like a cell."""
    import torch

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = module

        def forward(self, x, h, c):
            return self.cell(x, (h, c))

    graphed = torch.cuda.make_graphed_callables(Flat(), (x, h, c))

    class Cell(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.graphed = graphed

        def forward(self, x, state):
            return self.graphed(x, *state)

    return Cell()


def _warmup(cfg: Config) -> None:
    """Compile our GPU kernels before anything is captured or timed (lltm_cupy.warmup)."""
    if cfg.cuda:
        import lltm_cupy

        lltm_cupy.warmup(cfg.torch_dtype())


def _make_runners(cfg: Config, impls, quiet, strict=False):
    import torch

    from . import torch as lt

    device = "cuda" if cfg.cuda else "cpu"
    dtype = cfg.torch_dtype()
    _warmup(cfg)
    torch.manual_seed(cfg.seed)
    ref = lt.ReferenceLLTMCell(cfg.features, cfg.state, device=device, dtype=dtype)
    x = torch.randn(cfg.batch, cfg.features, device=device, dtype=dtype)
    h = torch.randn(cfg.batch, cfg.state, device=device, dtype=dtype)
    c = torch.randn(cfg.batch, cfg.state, device=device, dtype=dtype)
    if cfg.all_grads:
        for t in (x, h, c):
            t.requires_grad_()
    runners, skipped = {}, {}
    for name in impls:
        if cfg.bf16 and name in ("array", "cell-floor", "function-floor"):
            _not_run(name, _NO_BF16_ARRAYS, skipped, strict, quiet)
            continue
        try:
            if name == "reference":
                runners[name] = _TorchRunner(ref, cfg, (x, h, c))
            elif name == "compiled":
                _log(quiet, "  compiling the reference with torch.compile ...")
                module = lt.ReferenceLLTMCell(cfg.features, cfg.state, device=device, dtype=dtype)
                module.load_state_dict(ref.state_dict())
                runner = _TorchRunner(torch.compile(module, dynamic=False), cfg, (x, h, c))
                runner.backward(runner.forward())  # compile now, not in the timed loop
                runners[name] = runner
            elif name == "cell":
                cell = lt.LLTMCell(cfg.features, cfg.state, device=device, dtype=dtype)
                cell.load_state_dict(ref.state_dict())
                runners[name] = _TorchRunner(cell, cfg, (x, h, c))
            elif name == "array":
                runners[name] = _ArrayRunner(cfg, (ref.weights, ref.bias), (x, h, c))
            elif name == "lstm":
                lstm = torch.nn.LSTMCell(cfg.features, cfg.state, device=device, dtype=dtype)
                runners[name] = _TorchRunner(lstm, cfg, (x, h, c))
            elif name in GRAPH_IMPLS:
                if not cfg.cuda:
                    raise ValueError(f"{name} needs CUDA (--cuda)")
                cls = lt.ReferenceLLTMCell if name != "cell-graph" else lt.LLTMCell
                module = cls(cfg.features, cfg.state, device=device, dtype=dtype)
                module.load_state_dict(ref.state_dict())
                if name == "compiled-ro":
                    _log(quiet, "  compiling the reference with mode='reduce-overhead' ...")
                    module = torch.compile(module, mode="reduce-overhead", dynamic=False)
                else:
                    _log(quiet, f"  capturing {name} in CUDA graphs ...")
                    module = _graphed(module, x, h, c)
                runner = _TorchRunner(module, cfg, (x, h, c))
                for _ in range(3):  # compile / record now, not in the timed loop
                    runner.backward(runner.forward())
                runners[name] = runner
            elif name == "cell-op":
                from .torch._ops import _lltm_forward_op

                class CustomOpCell(lt.LLTMCell):
                    """LLTMCell through the custom operator even in eager mode."""

                    def forward(self, input, state=None):
                        new_h, new_cell, _, _ = _lltm_forward_op(*self._args(input, state))
                        return new_h, new_cell

                cell = CustomOpCell(cfg.features, cfg.state, device=device, dtype=dtype)
                cell.load_state_dict(ref.state_dict())
                runners[name] = _TorchRunner(cell, cfg, (x, h, c))
            elif name == "cell-floor":
                if cfg.cuda or cfg.all_grads:
                    raise ValueError("cell-floor measures the CPU, parameter-gradient case only")
                runners[name] = _TorchRunner(_FloorCell(ref), cfg, (x, h, c))
            elif name == "function-floor":
                if cfg.cuda or cfg.all_grads:
                    raise ValueError("function-floor measures the CPU, parameter-gradient case only")
                runners[name] = _TorchRunner(_EmptyCell(ref), cfg, (x, h, c))
            else:
                raise ValueError(f"unknown implementation {name!r}; choose from "
                                 f"{IMPLS + EXTRA_IMPLS + GRAPH_IMPLS}")
        except Exception as exc:  # e.g. torch.compile without a working compiler
            _not_run(name, exc, skipped, strict, quiet)
    return runners, skipped


def _time_loop(runners: dict, cfg: Config, timer, quiet, label=""):
    """Interleaved, rotated timing of ``runners``; returns {name: {phase: [seconds]}}."""
    names = list(runners)
    for name in names:
        for _ in range(cfg.warmup):
            runners[name].backward(runners[name].forward())
    samples = {n: {p: [] for p in PHASES} for n in names}
    report_every = max(1, cfg.runs // 4)
    for r in range(cfg.runs):
        for name in names[r % len(names):] + names[: r % len(names)]:
            run, s = runners[name], samples[name]
            timer.start()
            out = run.forward()
            s["forward"].append(timer.stop())
            timer.start()
            run.backward(out)
            s["backward"].append(timer.stop())
            del out
            timer.start()
            run.backward(run.forward())
            s["fwd+bwd"].append(timer.stop())
        if (r + 1) % report_every == 0:
            _log(quiet, f"  {label}{r + 1}/{cfg.runs} runs")
    return samples


def run_size(cfg: Config, impls=None, quiet=False, strict=False) -> dict:
    """Time every implementation at one size. Returns a JSON-ready dict.

    On the CPU the array API (NumPy) is timed in a block of its own after the torch
    implementations: NumPy's OpenBLAS worker threads keep spinning for a while after each GEMM,
    and interleaved with torch's OpenMP threads on few cores both slow down by up to 10x, which
    would measure the interleaving rather than either implementation. A NumPy program without
    torch, the array API's use, does not pay that. (lltm_cupy.torch runs its GEMMs through torch
    for this reason.)

    strict: the caller named ``impls``; one that cannot be set up raises ImplementationError
    (otherwise it is skipped, with the reason printed and recorded under "skipped").
    """
    impls = list(impls or IMPLS)
    runners, skipped = _make_runners(cfg, impls, quiet, strict)
    timer = _CudaTimer() if cfg.cuda else _CpuTimer()
    groups = [runners]
    if not cfg.cuda and "array" in runners and len(runners) > 1:
        groups = [{k: v for k, v in runners.items() if k != "array"}, {"array": runners["array"]}]
    samples = {}
    for group in groups:
        samples.update(_time_loop(group, cfg, timer, quiet, label=f"{'/'.join(group)}: "))
    if len(groups) > 1:
        time.sleep(0.5)  # let OpenBLAS's workers go idle before anything else runs
    results = {}
    for name in runners:
        results[name] = {p: {"median_s": statistics.median(v), "min_s": min(v)}
                         for p, v in samples[name].items()}
        results[name]["saved_bytes"] = runners[name].saved_bytes()
    return {"batch": cfg.batch, "features": cfg.features, "state": cfg.state,
            "device": "cuda" if cfg.cuda else "cpu",
            "dtype": cfg.dtype_name, "runs": cfg.runs,
            "all_grads": cfg.all_grads, "separately_timed": [k for g in groups[1:] for k in g],
            "results": results, "skipped": skipped}


_SCALES = {"s": (1.0, "s"), "ms": (1e3, "ms"), "us": (1e6, "us")}


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def format_table(record: dict, scale="us") -> str:
    """A text table: median / min per phase, speed-up of fwd+bwd over the baseline (the eager
    reference; for sequences our cell stepped from Python)."""
    factor, unit = _SCALES[scale]
    res = record["results"]
    baseline = record.get("baseline", "reference")
    base = res.get(baseline, {}).get("fwd+bwd", {}).get("median_s")
    steps = f", {record['steps']} steps" if "steps" in record else ""
    lines = [f"(batch, features, state) = ({record['batch']}, {record['features']}, {record['state']})"
             f"{steps}, {record['dtype']} on {record['device']}, {record['runs']} runs; "
             f"times in {unit}, median / min"]
    names = [*res, *record.get("skipped", {})]
    width = max(11, max(len(n) for n in names) + 2) if names else 11
    head = f"{'impl':<{width}}" + "".join(f"{p:>22}" for p in PHASES) + f"{'vs ' + baseline:>20}{'saved':>12}"
    lines += [head, "-" * len(head)]
    for name, r in res.items():
        cells = "".join(f"{r[p]['median_s'] * factor:>12.1f} /{r[p]['min_s'] * factor:>8.1f}"
                        for p in PHASES)
        ratio = f"{base / r['fwd+bwd']['median_s']:.2f}x" if base else "n/a"
        lines.append(f"{name:<{width}}{cells}{ratio:>20}{_fmt_bytes(r['saved_bytes']):>12}")
    for name, why in record["skipped"].items():
        lines.append(f"{name:<{width}}not run: {why}")
    if record.get("separately_timed"):
        lines.append(f"timed in a separate block (NumPy BLAS threads vs torch threads): "
                     f"{', '.join(record['separately_timed'])}")
    if base:
        lines.append(f"vs {baseline}: its fwd+bwd median / this fwd+bwd median "
                     f"(above 1: faster than {baseline})")
    for row, other in record.get("pairs", {}).items():
        a, b = (res[n]["fwd+bwd"]["median_s"] for n in (row, other))
        lines.append(f"{row} / {other}: {a / b:.2f}x of its fwd+bwd median "
                     f"(min: {res[row]['fwd+bwd']['min_s'] / res[other]['fwd+bwd']['min_s']:.2f}x)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# GPU: bandwidth of the element-wise kernels and the share of time in GEMMs

def gpu_kernel_report(cfg: Config, runs=50) -> dict:
    """Time the fused kernels and the GEMMs of one step alone, with CuPy and CUDA events.

    Bytes counted per element of (B, S): forward reads gates (3), bias (negligible), old_cell (1)
    and writes gates (3), new_h (1), new_cell (1): 9; backward reads grad_h, grad_cell (2),
    gates (3), new_cell (1) and writes d_gates (3), d_old_cell (1): 10.
    """
    import cupy

    from . import _kernels

    dtype = np.float64 if cfg.double else np.float32
    B, F, S = cfg.size
    rng = cupy.random.default_rng(cfg.seed)
    X = rng.standard_normal((B, S + F), dtype=dtype)
    W = rng.standard_normal((3 * S, S + F), dtype=dtype) / np.sqrt(S + F)
    bias = cupy.zeros(3 * S, dtype)
    old_cell = rng.standard_normal((B, S), dtype=dtype)
    gates = cupy.empty((B, 3 * S), dtype)
    new_h, new_cell = cupy.empty((B, S), dtype), cupy.empty((B, S), dtype)
    d_gates, d_old_cell = cupy.empty((B, 3 * S), dtype), cupy.empty((B, S), dtype)
    grad = cupy.ones((B, S), dtype)
    n = B * S
    grid, block, wide = _kernels.launch_config(n)
    kernels = _kernels.get_kernels(dtype, wide)
    fwd, bwd = kernels.fwd, kernels.bwd
    cupy.matmul(X, W.T, out=gates)

    def timed(fn):
        for _ in range(3):
            fn()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        cupy.cuda.Device().synchronize()
        start.record()
        for _ in range(runs):
            fn()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3 / runs

    t_fwd = timed(lambda: fwd(grid, block, (gates, bias, old_cell, new_h, new_cell,
                                            np.int64(n), np.int32(S))))
    t_bwd = timed(lambda: bwd(grid, block, (grad, grad, gates, new_cell, d_gates, d_old_cell,
                                            np.int32(1), np.int32(1), np.int64(n), np.int32(S))))
    t_gemm_fwd = timed(lambda: cupy.matmul(X, W.T, out=gates))
    t_gemm_bwd = timed(lambda: (cupy.matmul(d_gates.T, X), cupy.matmul(d_gates, W[:, :S]),
                                cupy.matmul(d_gates, W[:, S:])))

    import lltm_cupy

    # the step as a user calls it: contiguous input and state (slices of X would be copied)
    args = (cupy.ascontiguousarray(X[:, S:]), W, bias, cupy.ascontiguousarray(X[:, :S]),
            old_cell)

    def step():
        out = lltm_cupy.forward(*args)
        lltm_cupy.backward(grad, grad, out[2])

    t_step = timed(step)
    itemsize = np.dtype(dtype).itemsize
    peak = _peak_bandwidth()
    bw_fwd = 9 * n * itemsize / t_fwd
    bw_bwd = 10 * n * itemsize / t_bwd
    gemms = t_gemm_fwd + t_gemm_bwd
    pct = (lambda bw: 100 * bw / peak) if peak else (lambda bw: float("nan"))
    return {"fwd_kernel_s": t_fwd, "bwd_kernel_s": t_bwd, "fwd_kernel_GBps": bw_fwd / 1e9,
            "bwd_kernel_GBps": bw_bwd / 1e9, "peak_GBps": (peak or float("nan")) / 1e9,
            "fwd_kernel_pct_peak": pct(bw_fwd), "bwd_kernel_pct_peak": pct(bw_bwd),
            "gemm_fwd_s": t_gemm_fwd, "gemm_bwd_s": t_gemm_bwd, "step_s": t_step,
            "step_over_gemms": t_step / gemms, "gemm_share_pct": 100 * gemms / t_step}


#: Datasheet memory bandwidth (bytes/s) for GPUs whose driver no longer reports the memory clock
#: (CUDA 13 removed cudaDeviceProp.memoryClockRate).
_DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                        "A100-SXM4-80GB": 2.039e12, "A100": 1.555e12, "L40S": 0.864e12}


def _peak_bandwidth():
    """Peak memory bandwidth in bytes/s: from the device properties, else the datasheet, else None."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    clock, width = props.get("memoryClockRate"), props.get("memoryBusWidth")
    if clock and width:
        return 2 * clock * 1e3 * width / 8
    name = props.get("name", b"")
    name = name.decode() if isinstance(name, bytes) else str(name)
    for key, value in _DATASHEET_BANDWIDTH.items():
        if key in name:
            return value
    return None


def format_gpu_report(size, rep: dict) -> str:
    return (f"GPU kernels at {size}: forward {rep['fwd_kernel_s'] * 1e6:.1f} us = "
            f"{rep['fwd_kernel_GBps']:.0f} GB/s ({rep['fwd_kernel_pct_peak']:.0f}% of "
            f"{rep['peak_GBps']:.0f} GB/s peak), backward {rep['bwd_kernel_s'] * 1e6:.1f} us = "
            f"{rep['bwd_kernel_GBps']:.0f} GB/s ({rep['bwd_kernel_pct_peak']:.0f}%); GEMMs "
            f"{(rep['gemm_fwd_s'] + rep['gemm_bwd_s']) * 1e6:.1f} us of a "
            f"{rep['step_s'] * 1e6:.1f} us array-API step ({rep['gemm_share_pct']:.0f}%; "
            f"step / GEMMs = {rep['step_over_gemms']:.2f})")


# ---------------------------------------------------------------------------------------------
# CPU: the share of the step in BLAS, with NumPy's BLAS and with torch's

def blas_names() -> dict:
    """{"numpy": ..., "torch": ...}: the BLAS library each was built with, as they report it."""
    import torch

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        numpy_blas = f"{blas['name']} {blas.get('version', '')}".strip()
    except Exception:  # older NumPy, or a build that does not say
        numpy_blas = "unknown BLAS"
    torch_blas = "MKL" if torch.backends.mkl.is_available() else "its own BLAS"
    return {"numpy": numpy_blas, "torch": torch_blas}


def cpu_blas_report(cfg: Config, runs=100) -> dict:
    """The NumPy backend's step (forward, then the backward of the gradients the benchmark asks
    for) with its GEMMs run by NumPy's BLAS (the array API) and by torch's (what ``LLTMCell``
    runs on the CPU), and the GEMMs' part of it: every GEMM goes through a wrapper that times it.

    The two are timed one after the other, not interleaved (two BLAS thread pools taking turns
    would measure their contention). Returns medians in seconds and the GEMM share in percent.
    """
    from . import _numpy
    from .torch._interop import torch_mm as _torch_mm

    dtype = np.float64 if cfg.double else np.float32
    B, F, S = cfg.size
    rng = np.random.default_rng(cfg.seed)
    x, h, c = (rng.standard_normal(shape).astype(dtype) for shape in ((B, F), (B, S), (B, S)))
    W = (rng.standard_normal((3 * S, S + F)) / np.sqrt(S + F)).astype(dtype)
    bias = np.zeros(3 * S, dtype)
    ones = np.ones((B, S), dtype)
    needed = (True,) * 5 if cfg.all_grads else (False, False, True, True, False)
    clock = time.perf_counter
    report = {}
    for name, mm in (("numpy", np.matmul), ("torch", _torch_mm)):
        in_gemm = [0.0]

        def timed_mm(a, b, mm=mm, in_gemm=in_gemm):
            t0 = clock()
            out = mm(a, b)
            in_gemm[0] += clock() - t0
            return out

        def step():
            saved = _numpy.forward(x, W, bias, h, c, mm=timed_mm)[2]
            _numpy.backward(ones, ones, saved, needed, mm=timed_mm)

        for _ in range(cfg.warmup):
            step()
        steps, gemms = [], []
        for _ in range(runs):
            in_gemm[0] = 0.0
            t0 = clock()
            step()
            steps.append(clock() - t0)
            gemms.append(in_gemm[0])
        step_s, gemm_s = statistics.median(steps), statistics.median(gemms)
        report[name] = {"step_s": step_s, "gemm_s": gemm_s, "gemm_share_pct": 100 * gemm_s / step_s}
        time.sleep(0.5)  # let this pool's workers go idle before the other one runs
    report["torch_gemm_over_numpy_gemm"] = report["torch"]["gemm_s"] / report["numpy"]["gemm_s"]
    report["blas"] = blas_names()
    report["runs"] = runs
    return report


def format_blas_report(size, rep: dict, scale="us") -> str:
    factor, unit = _SCALES[scale]
    parts = []
    for name, who in (("numpy", "NumPy's BLAS"), ("torch", "torch's BLAS")):
        r = rep[name]
        parts.append(f"{who} ({rep['blas'][name]}{'; what LLTMCell runs' if name == 'torch' else ''}): "
                     f"step {r['step_s'] * factor:.1f} {unit}, GEMMs {r['gemm_s'] * factor:.1f} {unit} "
                     f"({r['gemm_share_pct']:.0f}%)")
    return (f"BLAS share at {size} (the NumPy backend's step, medians of {rep['runs']} runs): "
            + "; ".join(parts)
            + f"; torch's GEMMs / NumPy's GEMMs = {rep['torch_gemm_over_numpy_gemm']:.2f}")


# ---------------------------------------------------------------------------------------------
# CPU: the cell between torch layers (thread-pool contention check)

def mixed_model_report(cfg: Config, runs=200, quiet=False) -> dict:
    """Time torch layers alone, the cell alone, and both in one model, interleaved.

    Model: x -> Linear(F, F) + tanh -> cell -> Linear(S, S) + tanh -> sum. "layers alone" runs
    the two Linear layers on the same shapes without the cell, "cell alone" the cell on its own.
    With no contention, mixed ~= layers alone + cell alone. Inside the steps, the forward of the
    layer after the cell and the forward of the cell are also timed on their own, alone and in
    the mixed model, to see which side a slowdown lands on.
    """
    import torch

    from . import torch as lt

    dtype = torch.float64 if cfg.double else torch.float32
    torch.manual_seed(cfg.seed)
    B, F, S = cfg.size
    pre = torch.nn.Linear(F, F, dtype=dtype)
    post = torch.nn.Linear(S, S, dtype=dtype)
    x = torch.randn(B, F, dtype=dtype)
    h0 = torch.randn(B, S, dtype=dtype)
    c0 = torch.randn(B, S, dtype=dtype)
    clock = time.perf_counter
    results = {}
    for cell_name, cell in (("cell", lt.LLTMCell(F, S, dtype=dtype)),
                            ("reference", lt.ReferenceLLTMCell(F, S, dtype=dtype))):
        segments = {k: [] for k in ("post fwd alone", "post fwd mixed", "cell fwd alone",
                                    "cell fwd mixed")}

        def layers_only():
            y = torch.tanh(pre(x))
            t0 = clock()
            z = torch.tanh(post(h0))
            segments["post fwd alone"].append(clock() - t0)
            (y.sum() + z.sum()).backward()

        def cell_only():
            t0 = clock()
            h, c = cell(x, (h0, c0))
            segments["cell fwd alone"].append(clock() - t0)
            (h.sum() + c.sum()).backward()

        def mixed():
            y = torch.tanh(pre(x))
            t0 = clock()
            h, c = cell(y, (h0, c0))
            t1 = clock()
            z = torch.tanh(post(h))
            t2 = clock()
            segments["cell fwd mixed"].append(t1 - t0)
            segments["post fwd mixed"].append(t2 - t1)
            (z.sum() + c.sum()).backward()

        fns = {"layers alone": layers_only, "cell alone": cell_only, "mixed": mixed}
        samples = {k: [] for k in fns}
        for fn in fns.values():
            for _ in range(cfg.warmup):
                fn()
        for v in segments.values():
            v.clear()
        names = list(fns)
        for r in range(runs):
            for k in names[r % 3:] + names[: r % 3]:
                t0 = clock()
                fns[k]()
                samples[k].append(clock() - t0)
        med = {k: statistics.median(v) for k, v in samples.items()}
        med.update({k: statistics.median(v) for k, v in segments.items()})
        med["mixed / (layers + cell)"] = med["mixed"] / (med["layers alone"] + med["cell alone"])
        results[cell_name] = med
        _log(quiet, f"  mixed model with {cell_name}: done")
    return results


def format_mixed(size, rep: dict, scale="us") -> str:
    factor, unit = _SCALES[scale]
    cols = ("layers alone", "cell alone", "mixed", "post fwd alone", "post fwd mixed",
            "cell fwd alone", "cell fwd mixed")
    lines = [f"Mixed model at {size} (torch Linear+tanh before and after the cell), medians in "
             f"{unit} (fwd+bwd of each model; 'post fwd' is the forward of the layer after the "
             f"cell, 'cell fwd' the cell's forward):",
             f"{'cell':<11}" + "".join(f"{c:>16}" for c in cols) + f"{'mixed/(sum)':>13}"]
    for name, r in rep.items():
        lines.append(f"{name:<11}" + "".join(f"{r[c] * factor:>16.1f}" for c in cols)
                     + f"{r['mixed / (layers + cell)']:>13.2f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Whole sequences

SEQUENCE_IMPLS = ("sequence", "cell-stepped", "reference-stepped", "array-sequence",
                  "array-stepped", "lstm", "lltm-2x-bidir", "cells-2x-bidir", "ragged",
                  "ragged-padded")
#: Rows that time a pair (a row and what it replaces) with their ratio in the table:
#: a 2-layer bidirectional LLTM against the same built from stepped LLTMCells, and a ragged
#: batch (lengths uniform in [1, T], as a PackedSequence) against the same batch padded to T.
PAIRED_SEQUENCE_IMPLS = {"lltm-2x-bidir": "cells-2x-bidir", "ragged": "ragged-padded"}
SEQUENCE_SIZES = ((16, 32, 128), (64, 256, 512))


class _TorchSequenceRunner(_TorchRunner):
    """A torch module over T steps: one call for sequence modules, a Python loop for cells."""

    def __init__(self, module, xs, h, c, mode):
        import torch

        self.torch = torch
        self.module, self.xs, self.h, self.c, self.mode = module, xs, h, c, mode
        self.ones_h = torch.ones_like(h)

    def forward(self):
        if self.mode == "sequence":
            out, (_, c) = self.module(self.xs, (self.h, self.c))
            return [out, c]
        if self.mode == "lstm":
            out, (_, c) = self.module(self.xs, (self.h[None], self.c[None]))
            return [out, c]
        state, outs = (self.h, self.c), []
        for x in self.xs:
            state = self.module(x, state)
            outs.append(state[0])
        return outs + [state[1]]

    def backward(self, out):
        self.torch.autograd.backward(out, [self.torch.ones_like(t) for t in out])

    def _inputs(self):
        return (self.xs, self.h, self.c)


class _ArraySequenceRunner:
    def __init__(self, cfg, params, xs, h, c, stepped):
        import lltm_cupy

        self.lltm, self.stepped = lltm_cupy, stepped
        xp, self.stream_ctx, conv = _array_side(cfg)
        self.w, self.b = (conv(t) for t in params)
        self.xs, self.h, self.c = conv(xs), conv(h), conv(c)
        self.ones = xp.ones_like(self.h)
        self.ones_out = xp.ones(self.xs.shape[:2] + self.h.shape[1:], self.h.dtype)

    def forward(self):
        with self.stream_ctx():
            if not self.stepped:
                return self.lltm.forward_sequence(self.xs, self.w, self.b, self.h, self.c)
            h, c, saves = self.h, self.c, []
            for x in self.xs:
                h, c, saved = self.lltm.forward(x, self.w, self.b, h, c)
                saves.append(saved)
            return saves

    def backward(self, out):
        with self.stream_ctx():
            if not self.stepped:
                self.lltm.backward_sequence(self.ones_out, None, self.ones, out[3])
                return
            d_h, d_c, d_w, d_b = None, self.ones, 0, 0
            for saved in reversed(out):
                g = self.lltm.backward(self.ones if d_h is None else d_h + self.ones, d_c, saved,
                                       needed=(True, False, True, True, True))
                d_h, d_c = g.d_old_h, g.d_old_cell
                d_w = d_w + g.d_weights
                d_b = d_b + g.d_bias

    def saved_bytes(self) -> int:
        out = self.forward()
        return out[3].nbytes if not self.stepped else sum(s.nbytes for s in out)


class _LayeredRunner(_TorchRunner):
    """An nn.LSTM-shaped module over xs (T, B, F), or over xs as a PackedSequence of
    ``lengths``; backward of the output's sum and the final states'."""

    def __init__(self, module, xs, lengths=None):
        import torch

        self.torch, self.module, self.xs, self.lengths = torch, module, xs, lengths

    def forward(self):
        x = self.xs
        if self.lengths is not None:
            from torch.nn.utils.rnn import pack_padded_sequence

            x = pack_padded_sequence(x, self.lengths, enforce_sorted=False)
        out, (h, c) = self.module(x)
        return [out.data if self.lengths is not None else out, h, c]

    def backward(self, out):
        self.torch.autograd.backward(out, [self.torch.ones_like(t) for t in out])

    def _inputs(self):
        return (self.xs,)


def _StackedCells(lltm):
    """The same 2-layer bidirectional network as ``lltm`` (its parameters), built from
    LLTMCells stepped from Python: what the layer replaces."""
    import torch

    from . import torch as lt

    class Stacked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cells = torch.nn.ModuleList()
            for k in range(lltm.num_layers):
                for d in range(2):
                    w, b = lltm._layer_parameters(k, d)
                    cell = lt.LLTMCell(w.shape[1] - lltm.hidden_size, lltm.hidden_size,
                                       device=w.device, dtype=w.dtype)
                    cell.load_state_dict({"weights": w.detach(), "bias": b.detach()})
                    self.cells.append(cell)

        def forward(self, xs):
            h_n, c_n = [], []
            for k in range(lltm.num_layers):
                outs = []
                for d in range(2):
                    cell, state, out = self.cells[2 * k + d], None, [None] * len(xs)
                    for t in (range(len(xs)) if d == 0 else reversed(range(len(xs)))):
                        state = cell(xs[t], state)
                        out[t] = state[0]
                    outs.append(torch.stack(out))
                    h_n.append(state[0])
                    c_n.append(state[1])
                xs = torch.cat(outs, dim=2)
            return xs, (torch.stack(h_n), torch.stack(c_n))

    return Stacked()


def run_sequence(cfg: Config, steps: int, impls=None, quiet=False, strict=False) -> dict:
    """Time whole-sequence implementations over ``steps`` steps at one cell size (``strict``
    as for :func:`run_size`)."""
    import torch

    from . import torch as lt

    impls = list(impls or [i for i in SEQUENCE_IMPLS if i != "lstm" or cfg.cuda])
    device = "cuda" if cfg.cuda else "cpu"
    dtype = cfg.torch_dtype()
    torch.manual_seed(cfg.seed)
    seq = lt.LLTM(cfg.features, cfg.state, device=device, dtype=dtype)
    xs = torch.randn(steps, cfg.batch, cfg.features, device=device, dtype=dtype)
    h = torch.randn(cfg.batch, cfg.state, device=device, dtype=dtype)
    c = torch.randn(cfg.batch, cfg.state, device=device, dtype=dtype)
    _warmup(cfg)
    runners, skipped = {}, {}
    for name in impls:
        if name == "sequence":
            runners[name] = _TorchSequenceRunner(seq, xs, h, c, "sequence")
        elif name in ("cell-stepped", "reference-stepped"):
            cls = lt.LLTMCell if name == "cell-stepped" else lt.ReferenceLLTMCell
            cell = cls(cfg.features, cfg.state, device=device, dtype=dtype)
            cell.load_state_dict(seq.state_dict())
            runners[name] = _TorchSequenceRunner(cell, xs, h, c, "stepped")
        elif name in ("array-sequence", "array-stepped") and cfg.bf16:
            _not_run(name, _NO_BF16_ARRAYS, skipped, strict, quiet)
        elif name in ("array-sequence", "array-stepped"):
            runners[name] = _ArraySequenceRunner(cfg, (seq.weights, seq.bias), xs, h, c,
                                                 stepped=(name == "array-stepped"))
        elif name == "lstm":
            lstm = torch.nn.LSTM(cfg.features, cfg.state, device=device, dtype=dtype)
            runners[name] = _TorchSequenceRunner(lstm, xs, h, c, "lstm")
        elif name in ("lltm-2x-bidir", "cells-2x-bidir"):
            deep = lt.LLTM(cfg.features, cfg.state, num_layers=2, bidirectional=True,
                           device=device, dtype=dtype)
            module = deep if name == "lltm-2x-bidir" else _StackedCells(deep)
            runners[name] = _LayeredRunner(module, xs)
        elif name in ("ragged", "ragged-padded"):
            g = torch.Generator().manual_seed(cfg.seed)
            lengths = torch.randint(1, steps + 1, (cfg.batch,), generator=g)
            runners[name] = _LayeredRunner(seq, xs, lengths if name == "ragged" else None)
        else:
            raise ValueError(f"unknown sequence implementation {name!r}; choose from {SEQUENCE_IMPLS}")
    timer = _CudaTimer() if cfg.cuda else _CpuTimer()
    groups = [runners]
    numpy_side = [k for k in runners if k.startswith("array")]
    if not cfg.cuda and numpy_side and len(numpy_side) < len(runners):
        groups = [{k: v for k, v in runners.items() if k not in numpy_side},
                  {k: runners[k] for k in numpy_side}]
    samples = {}
    for group in groups:
        samples.update(_time_loop(group, cfg, timer, quiet, label=f"T={steps} {'/'.join(group)}: "))
    if len(groups) > 1:
        time.sleep(0.5)
    results = {}
    for name in runners:
        results[name] = {p: {"median_s": statistics.median(v), "min_s": min(v)}
                         for p, v in samples[name].items()}
        results[name]["saved_bytes"] = runners[name].saved_bytes()
    return {"batch": cfg.batch, "features": cfg.features, "state": cfg.state, "steps": steps,
            "device": device, "dtype": cfg.dtype_name, "runs": cfg.runs,
            "all_grads": False, "separately_timed": [k for g in groups[1:] for k in g],
            "results": results, "skipped": skipped, "baseline": "cell-stepped",
            "pairs": {a: b for a, b in PAIRED_SEQUENCE_IMPLS.items()
                      if a in results and b in results}}


# ---------------------------------------------------------------------------------------------
# Plot

def plot_speedups(records: list, path, machine: str = "") -> tuple:
    """The fwd+bwd speed-up of every implementation over the run's baseline (the eager reference;
    for sequences our cell stepped from Python), per size, as grouped bars in one PNG. Needs
    matplotlib (the examples extra). Returns the image size in pixels (width, height)."""
    from ._extras import pyplot

    plt = pyplot()
    impls = []
    for r in records:
        impls += [n for n in r["results"] if n not in impls]
    labels = [f"({r['batch']}, {r['features']}, {r['state']})"
              + (f"\nT = {r['steps']}" if "steps" in r else "") for r in records]
    baseline = records[0].get("baseline", "reference")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 + 1.1 * len(records) * max(1, len(impls)) / 3),
                                    3.8), dpi=100)
    width = 0.8 / max(1, len(impls))
    top = 1.0
    for k, name in enumerate(impls):
        xs, ys = [], []
        for i, r in enumerate(records):
            res = r["results"]
            if name in res and baseline in res:
                xs.append(i - 0.4 + width * (k + 0.5))
                ys.append(res[baseline]["fwd+bwd"]["median_s"] / res[name]["fwd+bwd"]["median_s"])
        top = max([top, *ys])
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
    ax.set_xticks(range(len(records)), labels, fontsize=8)
    ax.set_xlabel("(batch, features, state)")
    ax.set_ylabel(f"speed-up over {baseline}\n(fwd+bwd median; above 1 is faster)")
    first = records[0]
    ax.set_title(f"lltm_cupy benchmark, {first['dtype']} on {first['device']}"
                 + (f"\n{machine}" if machine else ""), fontsize=9)
    ax.set_ylim(0, top * 1.35)   # room for the legend above the bars
    ax.legend(fontsize=7, ncol=min(3, max(1, len(impls))), loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    size = tuple(int(v) for v in fig.get_size_inches() * fig.dpi)
    plt.close(fig)
    return size
