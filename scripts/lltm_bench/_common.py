"""What every benchmark run shares: the configuration, the output check, the timers and timing
loops, the record they return, and the scripts' option types."""
from __future__ import annotations

import dataclasses
import platform
import statistics
import sys
import time

PHASES = ("forward", "backward", "fwd+bwd")


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
    process_time: bool = False   # CPU: time by the process's CPU time (a loaded machine's
    #                              waits for a core are not counted; one thread: torch's default
    #                              threads would count every thread's time)

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


#: dtype name -> bound on max|output - reference| / max|reference| before an implementation is
#: timed (the reference: float64 on the same values), for one step and sequences of up to
#: CHECK_STEPS steps; longer sequences get it times steps / CHECK_STEPS. A wrong kernel or index
#: is off by O(1); rounding stays far below, but grows with the steps, since the LLTM's cell
#: state adds every step's update and never decays (float32 at (16, 32, 128) over 512 steps:
#: 3.3e-4 on the CPU, 1.4e-4 on an H200; over 64 steps ~1e-6; bfloat16 ~1e-2).
CHECK_TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 1e-1}
CHECK_STEPS = 64


def check_outputs(runners: dict, pick, expected, cfg: Config, skipped: dict, strict: bool,
                  quiet: bool, steps: int = 1) -> None:
    """Before anything is timed: the outputs of each runner, ``pick(name, runner.forward())``
    (a list of arrays or tensors, or None for one not checked), against ``expected(name)``, the
    float64 reference's (same length). A runner off by more than :data:`CHECK_TOLERANCE` (or
    with NaN) is removed and reported as not run (an error when ``strict``): a wrong
    implementation posts no time. ``steps``: the sequence length, which scales the tolerance
    beyond CHECK_STEPS."""
    import numpy as np

    from lltm_cupy.verify import to_numpy

    tol = CHECK_TOLERANCE[cfg.dtype_name] * max(1.0, steps / CHECK_STEPS)
    for name in list(runners):
        got = pick(name, runners[name].forward())
        if got is None:
            continue
        want = expected(name)
        assert len(got) == len(want), (name, len(got), len(want))
        for i, (a, b) in enumerate(zip(got, want)):
            a, b = (np.asarray(to_numpy(v), dtype=np.float64) for v in (a, b))
            err = (float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
                   if a.shape == b.shape and b.size else (0.0 if a.shape == b.shape else np.inf))
            if not err <= tol:
                del runners[name]
                _not_run(name, f"wrong results: output {i} is off the float64 reference by "
                               f"{err:.1e} (normalised; allowed {tol:.0e})", skipped, strict,
                         quiet)
                break


def machine_name(cuda: bool) -> str:
    if cuda:
        import torch

        return torch.cuda.get_device_name()
    import os

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{os.cpu_count()}-core {platform.machine()} CPU" + (f" ({model})" if model else "")


def parse_sequence_sizes(text: str, option: str = "--sizes", form: str = "TxBxFxS") -> list:
    """The scripts' ``--sizes``, an argparse type: comma-separated sizes of ``form`` (TxBxFxS:
    steps, batch, features, state), positive integers (ArgumentTypeError otherwise)."""
    import argparse

    sizes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != len(form.split("x")) or not all(p.isdigit() and int(p) > 0
                                                          for p in parts):
            raise argparse.ArgumentTypeError(f"{option}: expected {form} with positive "
                                              f"integers, got {item!r}")
        sizes.append(tuple(int(p) for p in parts))
    return sizes


def int_list(text: str) -> list:
    """An argparse type: '64,512' -> [64, 512], positive integers."""
    import argparse

    if not all(v.isdigit() and int(v) > 0 for v in text.split(",")):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got "
                                          f"{text!r}")
    return [int(v) for v in text.split(",")]


def cupy_gpu(script: str):
    """``(cupy, "GPU <index>: <name>")`` for a script that measures on the GPU, or None, after
    saying on stderr that ``script`` needs one, where CuPy finds no usable GPU."""
    import cupy

    if not cupy.cuda.is_available():
        print(f"{script}: needs a GPU, and CuPy finds none (no device or no CUDA driver): "
              f"nothing measured", file=sys.stderr)
        return None
    device = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
    return cupy, f"GPU {device.id}: {name.decode() if isinstance(name, bytes) else name}"


def _log(quiet, *args):
    if not quiet:
        print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Timers

class _CpuTimer:
    def __init__(self, clock=time.perf_counter):
        self.clock = clock

    def start(self):
        self.t0 = self.clock()

    def stop(self) -> float:
        return self.clock() - self.t0


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
            if progress is not None:
                progress({"label": label, "runs_done": r + 1, "runs": cfg.runs,
                          "results": _summary(samples)})
    return samples


#: called with the medians so far after every quarter of a timing loop (scripts/benchmark.py
#: writes them to its --json file, so a run cut off mid-size keeps what it measured)
progress = None


def _summary(samples) -> dict:
    return {name: {p: {"median_s": statistics.median(v), "min_s": min(v)}
                   for p, v in phases.items() if v}
            for name, phases in samples.items()}


def timed_record(runners: dict, cfg: Config, numpy_side, skipped: dict, quiet, label="",
                 **fields) -> dict:
    """Time ``runners`` with :func:`_time_loop`; the JSON-ready record of the size: ``cfg``'s,
    the results, ``skipped`` and ``fields``.

    On the CPU the NumPy-side runners (``numpy_side``) are timed in a block of their own after
    the others: NumPy's OpenBLAS worker threads keep spinning for a while after each GEMM, and
    interleaved with torch's OpenMP threads on few cores both slow down by up to 10x, which
    would measure the interleaving rather than either implementation."""
    timer = _CudaTimer() if cfg.cuda else _CpuTimer(
        time.process_time if cfg.process_time else time.perf_counter)
    groups = [runners]
    numpy_side = [k for k in runners if k in numpy_side]
    if not cfg.cuda and numpy_side and len(numpy_side) < len(runners):
        groups = [{k: v for k, v in runners.items() if k not in numpy_side},
                  {k: runners[k] for k in numpy_side}]
    samples = {}
    for group in groups:
        samples.update(_time_loop(group, cfg, timer, quiet, label=f"{label}{'/'.join(group)}: "))
    if len(groups) > 1:
        time.sleep(0.5)  # let OpenBLAS's workers go idle before anything else runs
    results = _summary(samples)
    for name in runners:
        try:
            results[name]["saved_bytes"] = runners[name].saved_bytes()
        except Exception as exc:    # e.g. saved-tensor hooks refused under torch.compile
            _log(quiet, f"  {name}: saved bytes not measured ({type(exc).__name__}: {exc})"[:200])
            results[name]["saved_bytes"] = None
    return {"batch": cfg.batch, "features": cfg.features, "state": cfg.state,
            "device": "cuda" if cfg.cuda else "cpu", "dtype": cfg.dtype_name, "runs": cfg.runs,
            "all_grads": cfg.all_grads, "separately_timed": [k for g in groups[1:] for k in g],
            "results": results, "skipped": skipped, **fields}


def thread_clock(threads: int) -> tuple:
    """(clock, its name in the records) for a measurement at ``threads`` threads: process CPU
    time with one (what a loaded machine disturbs least), wall time with more (process time
    would count the threads' spin-waiting, which OpenMP does between parallel regions)."""
    return (time.process_time, "process") if threads == 1 else (time.perf_counter, "wall")


#: a record's clock name as the tables say it
CLOCK_TEXT = {"process": "process CPU time", "wall": "wall time"}


def interleaved(calls: dict, rounds: int, clock, warmup: int = 2) -> dict:
    """Each call's time per round, the calls interleaved (in turn reversed every other round)
    after ``warmup`` calls each."""
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = clock()
            calls[name]()
            times[name].append(clock() - t0)
    return times
