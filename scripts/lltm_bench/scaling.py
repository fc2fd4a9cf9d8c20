"""Where a CPU call of our ``LLTM`` spends its time, at several thread counts, and what that
predicts for more cores (``scripts/cpu_scaling.py``).

A call is split into three parts, each measured, in one process, the variants interleaved:

- **GEMM**: the call's time less the same call with the torch layer's GEMMs replaced by ones
  that compute nothing (:class:`_NoGemm`: the buffers keep what a real call left in them, so
  the element-wise passes run on ordinary values);
- **element-wise**: the call without GEMMs less the same at a tiny state and input size
  (S = F = 8, the same T and B: the same blocks of steps, the same calls);
- **per-call work**: the call without GEMMs at that tiny size: Python, the library's own
  calls, and each NumPy and torch call's fixed cost.

``nn.LSTM`` (oneDNN's fused RNN) is timed whole. From the times at one and at two threads a
part's time at ``n`` threads is extrapolated by Amdahl's law, ``t(n) = t(1) * (f + (1 - f) /
n)`` with the serial fraction ``f = 2 * t(2) / t(1) - 1`` fitted to the two measured points
(clipped to [0, 1]); our element-wise and per-call parts are taken as serial (NumPy runs them
on one core), as measured. This is an extrapolation from two points: it cannot see a GEMM too
small to use many cores, memory bandwidth shared by the cores, or another BLAS's scaling.
"""
from __future__ import annotations

import statistics

import numpy as np

from ._common import interleaved, thread_clock
from .inference import TRAIN_SIZES as SIZES, sequence_call      # those of --inference training

#: the state and input size of the per-call measurement
TINY = 8


def _no_gemm():
    """The torch layer's GEMM engine with every product replaced by nothing: outputs are left
    as they are (new ones uninitialised)."""
    import torch

    from lltm_cupy.torch._torch_gemm import TorchGemm

    class _NoGemm(TorchGemm):
        __call__ = staticmethod(lambda a, b: np.empty((a.shape[0], b.shape[1]), a.dtype))

        @staticmethod
        def into(a, b, out):
            return out

        @staticmethod
        def project_gates(x, w, bias, out):
            return None

        @staticmethod
        def bmm(h, w, *, out):
            return out

        @staticmethod
        def addmm_(out, a, b):
            return out

    _NoGemm.operand = staticmethod(torch.from_numpy)
    return _NoGemm()


def parts(sizes=SIZES, threads=(1, 2), rounds: int = 7, train: bool = True) -> dict:
    """For each (T, B, F, S) and thread count: the medians over ``rounds`` interleaved rounds
    of our call (``lltm_s``), its GEMM, element-wise and per-call parts (``gemm_s``,
    ``elementwise_s``, ``per_call_s``) and ``nn.LSTM``'s call (``lstm_s``), by
    :func:`._common.thread_clock`. ``train``: forward + backward of the parameters, else a
    forward under no_grad."""
    import torch

    import lltm_cupy.torch as lt
    from lltm_cupy.torch import _interop

    real = _interop.CPU_CALL.gemm
    none = _no_gemm()
    before = torch.get_num_threads()
    report = {}
    try:
        for steps, batch, features, state in sizes:
            torch.manual_seed(0)
            ours, tiny = lt.LLTM(features, state), lt.LLTM(TINY, TINY)
            lstm = torch.nn.LSTM(features, state)
            x, x_tiny = torch.randn(steps, batch, features), torch.randn(steps, batch, TINY)

            def engine(mm, run):
                def call():
                    _interop.CPU_CALL.gemm = lambda rows, state, dtype: mm
                    try:
                        run()
                    finally:
                        _interop.CPU_CALL.gemm = real
                return call

            calls = {"lltm": sequence_call(ours, x, train),
                     "no_gemm": engine(none, sequence_call(ours, x, train)),
                     "tiny_no_gemm": engine(none, sequence_call(tiny, x_tiny, train)),
                     "lstm": sequence_call(lstm, x, train)}
            for n in threads:
                torch.set_num_threads(n)
                clock, clock_name = thread_clock(n)
                with torch.set_grad_enabled(train):   # its warm-up fills the buffers
                    times = interleaved(calls, rounds, clock)
                m = {name: statistics.median(v) for name, v in times.items()}
                report[str((steps, batch, features, state)), n] = {
                    "lltm_s": m["lltm"], "lstm_s": m["lstm"],
                    "gemm_s": m["lltm"] - m["no_gemm"],
                    "elementwise_s": m["no_gemm"] - m["tiny_no_gemm"],
                    "per_call_s": m["tiny_no_gemm"], "threads": n, "clock": clock_name}
    finally:
        torch.set_num_threads(before)
        _interop.CPU_CALL.gemm = real
    return report


def _amdahl(t1: float, t2: float, n: int) -> float:
    """t(n) by Amdahl's law with the serial fraction fitted to t(1), t(2)."""
    f = min(1.0, max(0.0, 2.0 * t2 / t1 - 1.0)) if t1 > 0 else 1.0
    return t1 * (f + (1.0 - f) / n)


def predict(report: dict, cores=(8, 16)) -> dict:
    """From :func:`parts` at 1 and 2 threads: per size, our time and nn.LSTM's at each of
    ``cores`` (see the module docstring for the model) and their ratio."""
    out = {}
    for size in dict.fromkeys(size for size, _ in report):
        one, two = report.get((size, 1)), report.get((size, 2))
        if one is None or two is None:
            continue
        rows = {}
        for n in cores:
            gemm = _amdahl(one["gemm_s"], two["gemm_s"], n)
            ours = gemm + two["elementwise_s"] + two["per_call_s"]
            lstm = _amdahl(one["lstm_s"], two["lstm_s"], n)
            rows[n] = {"lltm_s": ours, "lstm_s": lstm, "ratio": ours / lstm, "gemm_s": gemm}
        out[size] = rows
    return out


def format_parts(report: dict, prediction: dict) -> str:
    lines = [f"{'(T, B, F, S)':<22} {'threads':>7} {'LLTM ms':>9} {'GEMM':>13} "
             f"{'element-wise':>14} {'per-call':>13} {'nn.LSTM ms':>11} {'ratio':>6}"]
    for (size, n), r in report.items():
        total = r["lltm_s"]

        def part(key):
            return f"{r[key] * 1e3:.1f} ({r[key] / total:.2f})"
        lines.append(f"{size:<22} {n:>7} {total * 1e3:>9.1f} {part('gemm_s'):>13} "
                     f"{part('elementwise_s'):>14} {part('per_call_s'):>13} "
                     f"{r['lstm_s'] * 1e3:>11.1f} {total / r['lstm_s']:>6.2f}")
    if prediction:
        lines += ["", "predicted (Amdahl's law fitted to 1 and 2 threads; element-wise and "
                      "per-call work serial):",
                  f"{'(T, B, F, S)':<22} {'cores':>7} {'LLTM ms':>9} {'of it GEMM':>11} "
                  f"{'nn.LSTM ms':>11} {'ratio':>6}"]
        for size, rows in prediction.items():
            for n, r in rows.items():
                lines.append(f"{size:<22} {n:>7} {r['lltm_s'] * 1e3:>9.1f} "
                             f"{r['gemm_s'] * 1e3:>11.1f} {r['lstm_s'] * 1e3:>11.1f} "
                             f"{r['ratio']:>6.2f}")
    return "\n".join(lines)
