"""What every benchmark run shares: the configuration, the timers, the interleaved timing loop
and the record it returns."""
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



def timed_record(runners: dict, cfg: Config, numpy_side, quiet, label="") -> tuple:
    """Time ``runners`` with :func:`_time_loop` and summarise them: (results, separately_timed).

    On the CPU the NumPy-side runners (``numpy_side``) are timed in a block of their own after
    the others: NumPy's OpenBLAS worker threads keep spinning for a while after each GEMM, and
    interleaved with torch's OpenMP threads on few cores both slow down by up to 10x, which
    would measure the interleaving rather than either implementation."""
    timer = _CudaTimer() if cfg.cuda else _CpuTimer()
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
    results = {}
    for name in runners:
        results[name] = {p: {"median_s": statistics.median(v), "min_s": min(v)}
                         for p, v in samples[name].items()}
        results[name]["saved_bytes"] = runners[name].saved_bytes()
    return results, [k for g in groups[1:] for k in g]
