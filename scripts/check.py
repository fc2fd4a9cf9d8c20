#!/usr/bin/env python
"""Compare forward and backward of every backend (NumPy, CuPy, torch CPU, torch CUDA) and dtype
against the pure-torch reference LLTM in float64; print a table; exit 1 on any mismatch.

Errors are max |ours - reference| / max(1, max |reference|) per output, against the per-dtype
tolerances of lltm_cupy.verify.TOLERANCE. A second table gives, per array backend and dtype,
the largest error in ulps of the element-wise outputs against the exact reference
(lltm_cupy.exact, mpmath; bounds lltm_cupy.exact.ULP_BOUND) and the largest relative error
against the torch reference (shown, not judged). Needs torch (and mpmath, which comes with it).
Usage: python scripts/check.py [-h]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lltm_cupy import verify  # noqa: E402

COLUMNS = ("new_h", "new_cell", *verify.GRAD_OF)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("-b", "--batch-size", type=int, default=16)
    p.add_argument("-f", "--features", type=int, default=32)
    p.add_argument("-s", "--state-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("scripts/check.py needs torch (pip install .[torch])")
        return 2

    case = verify.random_case(args.batch_size, args.features, args.state_size, args.seed)
    skipped = []
    rows = verify.compare_backends(case, skipped)
    head = f"{'backend':<12}{'dtype':<9}" + "".join(f"{c:>11}" for c in COLUMNS) + "     tol  result"
    print(head)
    print("-" * len(head))
    for label, dtype, errors, ok in rows:
        tol = verify.TOLERANCE[__import__("numpy").dtype(dtype)]
        print(f"{label:<12}{dtype:<9}" + "".join(f"{errors[c]:>11.2e}" for c in COLUMNS)
              + f"{tol:>8.0e}  {'ok' if ok else 'FAIL'}")
    for name, why in skipped:
        print(f"skipped {name}: {why}")
    failed = [f"{label} {dtype}" for label, dtype, _, ok in rows if not ok]

    print("\nElement-wise outputs against the exact reference, judged in ulps against the bound "
          "in parentheses.\n'rel vs torch' is for information, not judged: the largest "
          "element-wise relative error\nof any output against the float64 torch reference, "
          "large where a value lies near 0 (an absolute\nerror of one float32 ulp of 1 there "
          "is a large relative one; the first table judges those).")
    from lltm_cupy import exact

    ulp_cols = ("new_h", "new_cell", "d_old_cell")
    head = f"{'backend':<12}{'dtype':<9}" + "".join(f"{c:>16}" for c in ulp_cols) + \
        f"{'rel vs torch':>15}  result"
    print(head)
    print("-" * len(head))
    for label, dtype, errors, ok in verify.elementwise_accuracy(case, []):
        bound = exact.ULP_BOUND[__import__("numpy").dtype(dtype)]
        print(f"{label:<12}{dtype:<9}"
              + "".join(f"{errors[c]:>9.2f} ({bound[c]:>3g})" for c in ulp_cols)
              + f"{errors['max_rel_vs_torch']:>15.2e}  {'ok' if ok else 'FAIL'}")
        if not ok:
            failed.append(f"{label} {dtype} (ulps)")
    print(("FAILED: " + ", ".join(failed)) if failed else "all backends match the torch reference",
          f"(B={args.batch_size}, F={args.features}, S={args.state_size})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
