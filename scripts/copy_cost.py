#!/usr/bin/env python
"""What the array API's private copies cost on the CPU: forward_sequence + backward_sequence
through the public calls (the outputs copied, the inputs copied when the backend would keep
them) against the same checks and backend calls without the copies; and what a copy of the
weights in forward_sequence would cost (the copy the API does not make).

Interleaved in one process, rotated each round, process CPU time; prints per size the median
and interquartile range of the per-round ratios. Run it with one BLAS thread
(OPENBLAS_NUM_THREADS=1) on a quiet machine.
Usage: python scripts/copy_cost.py [--sizes TxBxFxS,...] [--rounds N]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import lltm_cupy  # noqa: E402
from lltm_cupy import _checks, _numpy  # noqa: E402


def measure(T, B, F, S, rounds, reps=5):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((T, B, F), dtype=np.float32)
    W = rng.uniform(-0.1, 0.1, (3 * S, S + F)).astype(np.float32)
    b = np.zeros(3 * S, np.float32)
    h = np.zeros((B, S), np.float32)
    g = np.ones((T, B, S), np.float32)

    def public():
        *_, saved = lltm_cupy.forward_sequence(xs, W, b, h, h)
        lltm_cupy.backward_sequence(g, None, None, saved)

    def no_copies():
        _checks.check_forward_sequence(xs, W, b, h, h)
        *_, saved = _numpy.forward_sequence(xs, W, b, h, h)
        _checks.check_backward_sequence(g, None, None, saved)
        _numpy.backward_sequence(g, None, None, saved)

    def weights_copied():
        lltm_cupy.forward_sequence(xs, W.copy(), b, h, h)

    def forward_only():
        lltm_cupy.forward_sequence(xs, W, b, h, h)

    calls = {"public": public, "no copies": no_copies, "weights copied": weights_copied,
             "forward": forward_only}
    ratios, weights, base = [], [], []
    for r in range(rounds):
        names = list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]
        t = {}
        for name in names:
            t0 = time.process_time()
            for _ in range(reps):
                calls[name]()
            t[name] = (time.process_time() - t0) / reps
        ratios.append(t["public"] / t["no copies"])
        weights.append(t["weights copied"] / t["forward"])
        base.append(t["no copies"])
    q = lambda a: (np.median(a), np.percentile(a, 25), np.percentile(a, 75))  # noqa: E731
    print(f"T={T} B={B} F={F} S={S}: fwd+bwd {np.median(base) * 1e3:.2f} ms without the copies; "
          f"with them x{q(ratios)[0]:.3f} (IQR {q(ratios)[1]:.3f}-{q(ratios)[2]:.3f}); "
          f"a weights copy: forward x{q(weights)[0]:.3f} "
          f"(IQR {q(weights)[1]:.3f}-{q(weights)[2]:.3f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--sizes", default="64x16x32x128,32x64x256x512,16x4x8x16")
    p.add_argument("--rounds", type=int, default=41)
    args = p.parse_args(argv)
    for size in args.sizes.split(","):
        measure(*(int(v) for v in size.split("x")), rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
