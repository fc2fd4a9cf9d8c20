#!/usr/bin/env python
"""GPU only: time and peak memory of a forward-only sequence against the block size of its
input projection (the rows of one GEMM of the input projection, ``lltm_cupy._cuda.sequence._BLOCK_ROWS``,
which the fixed-length and the variable-length paths read).

For each size (T, B, F, S) and block size: ``lltm_cupy.forward_sequence(..., return_saved=False)``
on CuPy arrays (nn.LSTM's initialisation, standard-normal inputs, zero initial state), warm-up
calls, then the median of ``--runs`` calls timed with CUDA events on CuPy's current stream, and
the peak bytes allocated during one call, outputs included (every CuPy allocation of the call
passes through a counting allocator over CuPy's pool, ``cupy.cuda.using_allocator``). "whole"
is one block for the whole sequence (T * B rows). Before timing, each block size's outputs and
final states are checked against a float64 run of the same inputs on the GPU; a mismatch fails
the run (status 1) and no time is posted for that size.

Without a usable GPU it says so and exits with status 1: there is nothing to measure on a CPU.

Usage: python scripts/block_rows.py [--sizes TxBxFxS,...] [--blocks 512,...,whole]
                                    [--runs N] [--warmup N] [--dtype float32|float64]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import lltm_cupy  # noqa: E402
from lltm_bench._common import cupy_gpu, parse_sequence_sizes  # noqa: E402
from lltm_cupy._cuda import sequence as _sequence  # noqa: E402
from lltm_cupy._packing import block_steps  # noqa: E402

DEFAULT_SIZES = "500x64x16x512,128x32x128x256"
DEFAULT_BLOCKS = "512,1024,2048,4096,8192,whole"
#: float32 against float64, max over outputs, h_n, c_n of |a - b| / (1 + |b|): the cell state
#: grows with T (nothing forgets it); the NumPy backend's float32 gives 1e-3 at (500, 64, 16, 512)
TOLERANCE = {"float32": 1e-2, "float64": 1e-9}


class _Counter:
    """Bytes live and their peak over every allocation made through :meth:`allocate`."""

    def __init__(self, cupy):
        self.cupy, self.live, self.peak = cupy, 0, 0
        self.pool = cupy.get_default_memory_pool()

    def allocate(self, nbytes):
        cupy = self.cupy
        pooled = self.pool.malloc(nbytes)
        owner = _Release(self, pooled, nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        memory = cupy.cuda.UnownedMemory(pooled.ptr, nbytes, owner, pooled.device_id)
        return cupy.cuda.MemoryPointer(memory, 0)


class _Release:
    """Owner of one counted allocation: gives it back to the pool (and the count) when the last
    array over it goes."""

    def __init__(self, counter, pooled, nbytes):
        self.counter, self.pooled, self.nbytes = counter, pooled, nbytes

    def __del__(self):
        self.counter.live -= self.nbytes


def parse_blocks(text):
    blocks = []
    for item in text.split(","):
        if item == "whole":
            blocks.append(None)
        elif item.isdigit() and int(item) > 0:
            blocks.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"--blocks: expected positive integers or 'whole', "
                                             f"got {item!r}")
    return blocks


def _case(cupy, T, B, F, S, dtype):
    rng = np.random.default_rng(0)
    k = 1 / np.sqrt(S)
    host = dict(inputs=rng.standard_normal((T, B, F)), weights=rng.uniform(-k, k, (3 * S, S + F)),
                bias=rng.uniform(-k, k, 3 * S), h0=np.zeros((B, S)), c0=np.zeros((B, S)))
    return [cupy.asarray(a.astype(dtype)) for a in host.values()]


def _error(got, want):
    return max(float(np.max(np.abs(g.get().astype(np.float64) - w) / (1 + np.abs(w)), initial=0))
               for g, w in zip(got, want))


def measure(cupy, T, B, F, S, blocks, runs, warmup, dtype):
    """Rows ``(block label, rows, steps per block, median ms, peak bytes, error)`` for one size;
    raises AssertionError where a block size's results are off the float64 run. The block
    size of the library is set for each and restored at the end."""
    default = _sequence._BLOCK_ROWS
    try:
        return _measure(cupy, T, B, F, S, blocks, runs, warmup, dtype)
    finally:
        _sequence._BLOCK_ROWS = default


def _measure(cupy, T, B, F, S, blocks, runs, warmup, dtype):
    args = _case(cupy, T, B, F, S, dtype)
    want = [a.get() for a in lltm_cupy.forward_sequence(
        *(a.astype(np.float64) for a in args), return_saved=False)[:3]]
    rows = []
    for block in blocks:
        block_rows = T * B if block is None else block
        _sequence._BLOCK_ROWS = block_rows
        got = lltm_cupy.forward_sequence(*args, return_saved=False)[:3]
        error = _error(got, want)
        assert error <= TOLERANCE[dtype], (
            f"{T}x{B}x{F}x{S}, block {block_rows} rows: {dtype} results off the float64 run by "
            f"{error:.3g} (normalised), more than {TOLERANCE[dtype]}")
        del got
        for _ in range(warmup):
            lltm_cupy.forward_sequence(*args, return_saved=False)
        counter = _Counter(cupy)
        cupy.cuda.Device().synchronize()
        with cupy.cuda.using_allocator(counter.allocate):
            result = lltm_cupy.forward_sequence(*args, return_saved=False)
        del result
        peak = counter.peak
        times = []
        for _ in range(runs):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            lltm_cupy.forward_sequence(*args, return_saved=False)
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end))
        rows.append(("whole" if block is None else str(block), block_rows,
                     min(block_steps(B, block_rows), T), statistics.median(times), peak, error))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_sequence_sizes,
                        default=parse_sequence_sizes(DEFAULT_SIZES),
                        help=f"comma-separated TxBxFxS (default {DEFAULT_SIZES})")
    parser.add_argument("--blocks", type=parse_blocks, default=parse_blocks(DEFAULT_BLOCKS),
                        help=f"block rows, or 'whole' (default {DEFAULT_BLOCKS})")
    parser.add_argument("--runs", type=int, default=7, help="timed calls per block (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        parser.error("--runs must be at least 1 and --warmup at least 0")

    gpu = cupy_gpu("block_rows.py")
    if gpu is None:
        return 1
    cupy, name = gpu
    print(f"forward only, {args.dtype}, {name}; CuPy {cupy.__version__}, "
          f"NumPy {np.__version__}; median of {args.runs} calls after {args.warmup} warm-up, "
          f"CUDA events; peak: bytes allocated during one call, outputs included")
    default, status = _sequence._BLOCK_ROWS, 0
    for T, B, F, S in args.sizes:
        out_mb = T * B * S * np.dtype(args.dtype).itemsize / 1e6
        print(f"\n(T, B, F, S) = ({T}, {B}, {F}, {S}); the outputs: {out_mb:.1f} MB")
        try:
            rows = measure(cupy, T, B, F, S, args.blocks, args.runs, args.warmup, args.dtype)
        except AssertionError as exc:
            print(f"FAIL: {exc}")
            status = 1
            continue
        base = next((r[3] for r in rows if r[1] == default), None)
        print(f"{'block':>7} {'rows':>7} {'steps/block':>11} {'ms':>9} "
              f"{'vs ' + str(default):>8} {'peak MB':>9} {'error':>9}")
        for label, block_rows, steps, ms, peak, error in rows:
            ratio = f"{ms / base:.2f}" if base else "-"
            print(f"{label:>7} {block_rows:>7} {steps:>11} {ms:>9.3f} {ratio:>8} "
                  f"{peak / 1e6:>9.1f} {error:>9.2g}")
    return status


if __name__ == "__main__":
    sys.exit(main())
