#!/usr/bin/env python
"""Finite-difference gradient verification of every backend available on this machine.

Prints a table of the max normalised error of each gradient per array backend (NumPy, and CuPy
where a GPU is present; float64), then torch.autograd.gradcheck of lltm_cupy.torch.lltm per
device and dtype where torch is installed. Exits with status 1 on any failure (2 if nothing could
run). Usage: python scripts/grad_check.py [-h]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lltm_cupy import verify  # noqa: E402
from lltm_cupy.verify import available_backends, format_table  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-b", "--batch-size", type=int, default=3)
    p.add_argument("-f", "--features", type=int, default=4)
    p.add_argument("-s", "--state-size", type=int, default=5)
    p.add_argument("--eps", type=float, default=1e-6, help="finite-difference step (float64)")
    p.add_argument("--tol", type=float, default=1e-6, help="max normalised error allowed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-torch", action="store_true", help="skip torch.autograd.gradcheck")
    args = p.parse_args(argv)

    case = verify.random_case(args.batch_size, args.features, args.state_size, args.seed)
    rows, skipped = [], []
    for name, run in available_backends(skipped):
        print(f"checking {name} ...", file=sys.stderr, flush=True)
        rows.append((name, run(case, args.eps)))
    for name, why in skipped:
        print(f"skipped {name}: {why}")
    if not rows:
        print("no backend could run")
        return 2
    print(format_table(rows, args.tol))
    failed = [n for n, errs in rows if any(not e <= args.tol for e in errs.values())]

    if args.no_torch:
        print("torch gradcheck: not run (--no-torch)")
    else:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch gradcheck: skipped, torch is not installed")
        else:
            print("checking torch gradcheck ...", file=sys.stderr, flush=True)
            torch_skipped = []
            for label, ok, message in verify.torch_gradchecks(case, torch_skipped):
                print(f"{label:<22}{message}  {'ok' if ok else 'FAIL'}")
                if not ok:
                    failed.append(label)
            for name, why in torch_skipped:
                print(f"skipped {name}: {why}")
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all gradients match'} "
          f"(B={args.batch_size}, F={args.features}, S={args.state_size}, eps={args.eps:g}, "
          f"tol={args.tol:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
