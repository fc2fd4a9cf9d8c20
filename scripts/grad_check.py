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
    failed = verify.report_gradients(case, args.eps, args.tol, with_torch=not args.no_torch)
    if failed is None:
        return 2
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all gradients match'} "
          f"(B={args.batch_size}, F={args.features}, S={args.state_size}, eps={args.eps:g}, "
          f"tol={args.tol:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
