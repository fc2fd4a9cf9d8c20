#!/usr/bin/env python
"""GPU only: the fused sequence kernels' own time per step, forward and backward, measured with
CUDA events around each launch of the kernels (nothing else: no input-projection GEMM, no host
work), beside the whole call's time per step (the GPU backend's ``forward_sequence(...,
fused=True)`` then ``backward_sequence``, CUDA events around both calls, host work included).

For each size (T, B, F, S) and dtype: nn.LSTM's initialisation, standard-normal inputs, zero
initial state, every gradient given. Before timing, the fused results (outputs, final states and
every gradient) are checked against a float64 run on the GPU: they must be within four times the
default (stepped) path's error, or within the dtype's floor, whichever is larger (both paths
drift from float64 over long sequences, in orders of their own); a size that fails posts no time
and the run exits with status 1. Then ``--warmup`` untimed calls and the median of ``--runs``.
The last column says which kernels ran: 1 block per tile of batch rows, or the blocks per tile
of the split (hidden sizes one block cannot hold: the cluster variant on sm_90 and newer, its
group variant on sm_80 to sm_89, whose time is the sum of its launches' where a batch needs
several).
The kernels timed in float16 and bfloat16 on sm_80 and newer are the tensor-core ones
(``cuda_src/lltm_fused_mma.cu``) where they apply, as in the calls.

Without a usable GPU it says so and exits with status 1: there is nothing to measure on a CPU.

Usage: python scripts/fused_kernel_time.py [--sizes TxBxFxS,...] [--dtypes float32,bfloat16,...]
                                           [--runs N] [--warmup N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lltm_cupy import _cuda  # noqa: E402
from lltm_bench._common import cupy_gpu, parse_sequence_sizes  # noqa: E402
from lltm_cupy._cuda import cluster_kernels as _cluster_kernels, fused as _fused  # noqa: E402
from lltm_cupy._cuda import fused_kernels as _fused_kernels, fused_mma as _mma  # noqa: E402
from lltm_cupy._cuda import group_kernels as _group_kernels, kernels as _kernels  # noqa: E402

DEFAULT_SIZES = "64x16x32x128,512x16x32x128"
DEFAULT_DTYPES = "float32,bfloat16"
#: the smallest error (|a - b| / (1 + |b|), max over every result) refused outright per dtype
FLOOR = {"float64": 1e-9, "float32": 1e-3, "float16": 5e-2, "bfloat16": 1e-1}
STORAGE = {"float64": np.float64, "float32": np.float32, "float16": np.float16,
           "bfloat16": np.uint16}
NAMES = ("outputs", "h_n", "c_n", "d_inputs", "d_weights", "d_bias", "d_h0", "d_c0")


def parse_dtypes(text):
    dtypes = text.split(",")
    for d in dtypes:
        if d not in STORAGE:
            raise argparse.ArgumentTypeError(f"--dtypes: {d!r} is not one of {sorted(STORAGE)}")
    return dtypes


def _to_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values in the backend's storage of ``dtype`` (bfloat16: its bits as uint16,
    rounded to nearest even)."""
    if dtype != "bfloat16":
        return a.astype(STORAGE[dtype])
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _values(a: np.ndarray) -> np.ndarray:
    """float64 values of a backend result (bfloat16 bits widened)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def _case(T, B, F, S):
    rng = np.random.default_rng(0)
    k = 1 / np.sqrt(S)
    return dict(inputs=rng.standard_normal((T, B, F)), weights=rng.uniform(-k, k, (3 * S, S + F)),
                bias=rng.uniform(-k, k, 3 * S), h0=np.zeros((B, S)), c0=np.zeros((B, S)),
                grad_outputs=rng.standard_normal((T, B, S)), grad_h_n=rng.standard_normal((B, S)),
                grad_c_n=rng.standard_normal((B, S)))


def _run(cupy, arrays, fused):
    """The eight results of a forward and backward through the GPU backend (called directly: the
    public API has no bfloat16 arrays, which the torch layer passes as their bits)."""
    a = arrays
    outputs, h_n, c_n, saved = _cuda.forward_sequence(
        a["inputs"], a["weights"], a["bias"], a["h0"], a["c0"], fused=fused)
    g = _cuda.backward_sequence(a["grad_outputs"], a["grad_h_n"], a["grad_c_n"], saved)
    return [outputs, h_n, c_n, g.d_inputs, g.d_weights, g.d_bias, g.d_h0, g.d_c0]


def _error(got, want):
    return max(float(np.max(np.abs(_values(g.get()) - w) / (1 + np.abs(w)), initial=0))
               for g, w in zip(got, want))


class _Timed:
    """A stand-in for a fused variant's ``get_kernels`` (``fused_kernels.get_kernels``, the
    cluster, group or tensor-core kernels' own) that records a CUDA event pair around every
    launch of the fused kernels: ``events`` holds (kernel, start, end), a list of its own or the
    one given."""

    def __init__(self, cupy, real, events=None):
        self.cupy, self.real, self.events = cupy, real, [] if events is None else events

    def __call__(self, dtype, *size):
        kernels = self.real(dtype, *size)
        return _kernels.FusedKernels(self._wrap(kernels.fwd, "fwd"),
                                     self._wrap(kernels.bwd, "bwd"))

    def _wrap(self, kernel, name):
        def launch(*args, **kwargs):
            start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
            start.record()
            kernel(*args, **kwargs)
            end.record()
            self.events.append((name, start, end))
        if hasattr(kernel, "kernel"):   # the loaded function, which the cluster planner queries
            launch.kernel = kernel.kernel
            launch.__name__ = getattr(kernel, "__name__", name)
        return launch


def measure(cupy, T, B, F, S, dtype, runs, warmup):
    """``(fwd kernel us/step, bwd kernel us/step, whole call us/step, fused error, default
    error)`` for one size and dtype; raises AssertionError where the fused results are off the
    float64 run (see the module docstring)."""
    case = _case(T, B, F, S)
    want = [a.get() for a in _run(cupy, {k: cupy.asarray(v) for k, v in case.items()}, False)]
    arrays = {k: cupy.asarray(_to_storage(v, dtype)) for k, v in case.items()}
    fused_error = _error(_run(cupy, arrays, True), want)
    default_error = _error(_run(cupy, arrays, False), want)
    allowed = max(FLOOR[dtype], 4 * default_error)
    assert fused_error <= allowed, (
        f"{T}x{B}x{F}x{S} {dtype}: the fused results are {fused_error:.3g} off the float64 run "
        f"(normalised), the default path's {default_error:.3g}; more than {allowed:.3g}")
    for _ in range(warmup):
        _run(cupy, arrays, True)
    real, real_cluster = _fused_kernels.get_kernels, _cluster_kernels.get_kernels
    real_group = _group_kernels.get_kernels     # the split on sm_80 to sm_89 (no clusters)
    timed = _Timed(cupy, real)
    real_mma = _mma.get_kernels         # the 16-bit kernels on tensor cores (sm_80 and newer)
    fwd, bwd, whole, launched = [], [], [], set()
    try:
        _fused_kernels.get_kernels = timed
        _cluster_kernels.get_kernels = _Timed(cupy, real_cluster, timed.events)
        _group_kernels.get_kernels = _Timed(cupy, real_group, timed.events)
        _mma.get_kernels = _Timed(cupy, real_mma, timed.events)
        for _ in range(runs):
            timed.events.clear()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            _run(cupy, arrays, True)
            end.record()
            end.synchronize()
            whole.append(cupy.cuda.get_elapsed_time(start, end))
            launched.update(name for name, _, _ in timed.events)
            for kind, times in (("fwd", fwd), ("bwd", bwd)):
                times.append(sum(cupy.cuda.get_elapsed_time(s, e)
                                 for name, s, e in timed.events if name == kind))
    finally:
        _fused_kernels.get_kernels, _cluster_kernels.get_kernels = real, real_cluster
        _group_kernels.get_kernels = real_group
        _mma.get_kernels = real_mma
    assert launched == {"fwd", "bwd"}, (
        f"{T}x{B}x{F}x{S} {dtype}: the fused kernels did not run (a state size whose weights do "
        f"not fit a block's shared memory, or on sm_90 and newer an 8-block cluster's or a "
        f"16-block one the device holds, or on sm_80 to sm_89 8 blocks', runs the default "
        f"path; cluster query failures: {_kernels.cluster_failures or 'none'})")
    per_step = 1000 / T      # ms per call -> us per step
    return (statistics.median(fwd) * per_step, statistics.median(bwd) * per_step,
            statistics.median(whole) * per_step, fused_error, default_error)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_sequence_sizes,
                        default=parse_sequence_sizes(DEFAULT_SIZES),
                        help=f"comma-separated TxBxFxS (default {DEFAULT_SIZES})")
    parser.add_argument("--dtypes", type=parse_dtypes, default=parse_dtypes(DEFAULT_DTYPES),
                        help=f"comma-separated (default {DEFAULT_DTYPES})")
    parser.add_argument("--runs", type=int, default=10, help="timed calls per size (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        parser.error("--runs must be at least 1 and --warmup at least 0")

    gpu = cupy_gpu("fused_kernel_time.py")
    if gpu is None:
        return 1
    cupy, name = gpu
    print(f"fused sequence kernels, {name}; CuPy {cupy.__version__}, NumPy "
          f"{np.__version__}; median of {args.runs} forward + backward calls after "
          f"{args.warmup} warm-up, CUDA events; us per step")
    print(f"{'T':>5} {'B':>4} {'F':>4} {'S':>4} {'dtype':>9} {'fwd kernel':>11} "
          f"{'bwd kernel':>11} {'whole call':>11} {'error':>9} {'default':>9} {'blocks':>6}")
    status = 0
    for T, B, F, S in args.sizes:
        for dtype in args.dtypes:
            try:
                fwd, bwd, whole, err, default = measure(cupy, T, B, F, S, dtype, args.runs,
                                                        args.warmup)
            except AssertionError as exc:
                print(f"FAIL: {exc}")
                status = 1
                continue
            blocks = _fused.cluster_size(S, np.dtype(STORAGE[dtype])) or 1
            print(f"{T:>5} {B:>4} {F:>4} {S:>4} {dtype:>9} {fwd:>11.2f} {bwd:>11.2f} "
                  f"{whole:>11.2f} {err:>9.2g} {default:>9.2g} {blocks:>6}")
    return status


if __name__ == "__main__":
    sys.exit(main())
