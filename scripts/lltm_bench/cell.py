"""The one-step peers: every implementation of ``h, c = cell(x, (h0, c0))`` and its backward, and
:func:`run_size`, which times them at one size. Adding a peer: a name in ``IMPLS`` (or
``EXTRA_IMPLS``), a branch in :func:`_make_runners`."""
from __future__ import annotations

import numpy as np

from ._common import _NO_BF16_ARRAYS, Config, _log, _not_run, check_outputs, timed_record

IMPLS = ("reference", "compiled", "cell", "array", "lstm")
EXTRA_IMPLS = ("cell-op", "cell-floor", "function-floor")
GRAPH_IMPLS = ("cell-graph", "reference-graph", "compiled-ro")
CPU_SIZES = ((16, 32, 128), (64, 256, 512), (256, 512, 1024))
GPU_SIZES = CPU_SIZES + ((1024, 1024, 1024), (4096, 1024, 1024))


# ---------------------------------------------------------------------------------------------
# Implementations: each has forward() -> state, backward(state), saved_bytes()

class _TorchRunner:
    """``mark_step``: the module is torch.compile(mode="reduce-overhead"), whose CUDA graphs
    overwrite their outputs at the next replay: each forward starts a new step
    (``torch.compiler.cudagraph_mark_step_begin``), as a training loop's iteration does."""

    def __init__(self, module, inputs, mark_step=False):
        import torch

        self.torch = torch
        self.module = module
        self.x, self.h, self.c = inputs
        self.ones = torch.ones_like(self.h)
        self.mark_step = getattr(torch.compiler, "cudagraph_mark_step_begin", None) \
            if mark_step else None

    def forward(self):
        if self.mark_step is not None:
            self.mark_step()
        return self.module(self.x, (self.h, self.c))

    def backward(self, out):
        self.torch.autograd.backward(out, (self.ones, self.ones))

    def saved_bytes(self) -> int:
        """Bytes of the tensors autograd saves for backward, other than parameters and inputs,
        plus the arrays a Function keeps on its ctx (invisible to the hooks: cell-floor's;
        the library's Functions save everything through autograd)."""
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
        import cupy
        import torch

        from lltm_cupy.torch import _interop

        def on_torch_stream():
            return _interop.launching(torch.device("cuda", torch.cuda.current_device()))

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


def _bare_cell(ref, name):
    """A module calling a bare ``autograd.Function`` with copies of ``ref``'s parameters: the
    NumPy backend with no checks (``cell-floor``), or no LLTM work (``function-floor``)."""
    import torch

    from lltm_cupy import _numpy
    from lltm_cupy.torch._torch_gemm import torch_mm

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

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b, h, c):
            return h.clone(), c.clone()

        @staticmethod
        def backward(ctx, grad_h, grad_cell):
            return None, torch.zeros_like(ref.weights), torch.zeros_like(ref.bias), None, None

    function = Floor if name == "cell-floor" else Empty

    class FunctionCell(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.Parameter(ref.weights.detach().clone())
            self.bias = torch.nn.Parameter(ref.bias.detach().clone())

        def forward(self, x, state):
            return function.apply(x, self.weights, self.bias, *state)

    return FunctionCell()


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

    import lltm_cupy.torch as lt

    kw = dict(device="cuda" if cfg.cuda else "cpu", dtype=cfg.torch_dtype())
    _warmup(cfg)
    torch.manual_seed(cfg.seed)
    ref = lt.ReferenceLLTMCell(cfg.features, cfg.state, **kw)
    x, h, c = (torch.randn(cfg.batch, n, **kw) for n in (cfg.features, cfg.state, cfg.state))
    if cfg.all_grads:
        for t in (x, h, c):
            t.requires_grad_()

    def like_ref(cls):          # a module of class cls with the reference's parameters
        module = cls(cfg.features, cfg.state, **kw)
        module.load_state_dict(ref.state_dict())
        return module

    runners, skipped = {}, {}
    for name in impls:
        if cfg.bf16 and name in ("array", "cell-floor", "function-floor"):
            _not_run(name, _NO_BF16_ARRAYS, skipped, strict, quiet)
            continue
        try:
            warm = 0            # forward+backward calls before timing (compile, record)
            if name == "array":
                runners[name] = _ArrayRunner(cfg, (ref.weights, ref.bias), (x, h, c))
                continue
            if name == "reference":
                module = ref
            elif name == "compiled":
                _log(quiet, "  compiling the reference with torch.compile ...")
                module, warm = torch.compile(like_ref(lt.ReferenceLLTMCell), dynamic=False), 1
            elif name == "cell":
                module = like_ref(lt.LLTMCell)
            elif name == "lstm":
                module = torch.nn.LSTMCell(cfg.features, cfg.state, **kw)
            elif name in GRAPH_IMPLS:
                if not cfg.cuda:
                    raise ValueError(f"{name} needs CUDA (--cuda)")
                module, warm = like_ref(lt.LLTMCell if name == "cell-graph"
                                        else lt.ReferenceLLTMCell), 3
                if name == "compiled-ro":
                    _log(quiet, "  compiling the reference with mode='reduce-overhead' ...")
                    module = torch.compile(module, mode="reduce-overhead", dynamic=False)
                else:
                    _log(quiet, f"  capturing {name} in CUDA graphs ...")
                    module = _graphed(module, x, h, c)
            elif name == "cell-op":
                from lltm_cupy.torch._custom_ops import lltm_forward_op

                class CustomOpCell(lt.LLTMCell):
                    """LLTMCell through the custom operator even in eager mode."""

                    def forward(self, input, state=None):
                        new_h, new_cell, _, _ = lltm_forward_op(*self._args(input, state))
                        return new_h, new_cell

                module = like_ref(CustomOpCell)
            elif name in ("cell-floor", "function-floor"):
                if cfg.cuda or cfg.all_grads:
                    raise ValueError(f"{name} measures the CPU, parameter-gradient case only")
                module = _bare_cell(ref, name)
            else:
                raise ValueError(f"unknown implementation {name!r}; choose from "
                                 f"{IMPLS + EXTRA_IMPLS + GRAPH_IMPLS}")
            runner = _TorchRunner(module, (x, h, c), mark_step=name == "compiled-ro")
            for _ in range(warm):
                runner.backward(runner.forward())
            runners[name] = runner
        except Exception as exc:  # e.g. torch.compile without a working compiler
            _not_run(name, exc, skipped, strict, quiet)
    _check_cells(runners, ref, (x, h, c), cfg, skipped, strict, quiet)
    return runners, skipped


#: one-step runners whose outputs are not the LLTM cell's: the measurement floors, and
#: nn.LSTMCell (another cell, with its own parameters)
_UNCHECKED = ("cell-floor", "function-floor", "lstm")


def _check_cells(runners, ref, inputs, cfg, skipped, strict, quiet):
    """Every runner's (h, c) against the float64 reference on ``ref``'s parameters."""
    import torch

    from lltm_cupy.torch.reference import lltm_reference

    with torch.no_grad():
        want = lltm_reference(*(t.detach().double() for t in (inputs[0], ref.weights, ref.bias,
                                                                inputs[1], inputs[2])))
    check_outputs(runners, lambda name, out: None if name in _UNCHECKED else list(out[:2]),
                  lambda name: list(want), cfg, skipped, strict, quiet)


def run_size(cfg: Config, impls=None, quiet=False, strict=False) -> dict:
    """Time every implementation at one size; the JSON-ready record. On the CPU the array API
    is timed in a block of its own (:func:`timed_record`), as a NumPy program without torch
    runs it.

    strict: the caller named ``impls``; one that cannot be set up raises ImplementationError
    (otherwise it is skipped, with the reason printed and recorded under "skipped").
    """
    runners, skipped = _make_runners(cfg, list(impls or IMPLS), quiet, strict)
    return timed_record(runners, cfg, ("array",), skipped, quiet)
