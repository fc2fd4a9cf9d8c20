"""``python -m lltm_cupy``: the installed package's self-check.

Prints the versions found, which backends can run here (NumPy always; CuPy when a GPU is
present; the torch layer when torch is installed, on the CPU and on CUDA where torch sees a
device), then checks every gradient of every available array backend by central finite
differences in float64 (the check of ``scripts/grad_check.py`` at its default size). Exit
status 0 when every check that could run passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import platform
import sys

import numpy as np

import lltm_cupy
from lltm_cupy import verify

TOL = 1e-6


def _versions() -> list:
    lines = [f"lltm_cupy {lltm_cupy.__version__} at {lltm_cupy.__path__[0]}",
             f"Python {platform.python_version()}, NumPy {np.__version__}"]
    try:
        import cupy
        lines.append(f"CuPy {cupy.__version__}")
    except Exception as exc:   # ImportError, or a broken CUDA install
        lines.append(f"CuPy: not importable ({exc.__class__.__name__})")
    try:
        import torch
        cuda = (f"CUDA device {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
                else "no CUDA device")
        lines.append(f"torch {torch.__version__} ({cuda})")
    except ImportError:
        lines.append("torch: not installed (pip install 'lltm_cupy[torch]' for the torch layer)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lltm_cupy", description=__doc__.splitlines()[0])
    p.add_argument("--no-torch", action="store_true", help="skip the torch layer's gradcheck")
    args = p.parse_args(argv)
    for line in _versions():
        print(line)
    reason = verify.gpu_unavailable_reason()
    print("GPU: " + ("CuPy runs on it" if reason is None else f"not used ({reason})"))

    case = verify.random_case()
    rows, skipped = [], []
    for name, run in verify.available_backends(skipped):
        rows.append((name, run(case, 1e-6)))
    print("\nfinite-difference check of every gradient (B=3, F=4, S=5), max normalised error:")
    print(verify.format_table(rows, TOL))
    failed = [n for n, errs in rows if any(not e <= TOL for e in errs.values())]
    try:
        import torch  # noqa: F401
    except ImportError:
        torch = None
    if torch is not None and not args.no_torch:
        torch_skipped = []
        for label, ok, message in verify.torch_gradchecks(case, torch_skipped):
            print(f"{label:<22}{message}  {'ok' if ok else 'FAIL'}")
            if not ok:
                failed.append(label)
        skipped += torch_skipped
    for name, why in skipped:
        print(f"not checked, {name}: {why}")
    print("FAILED: " + ", ".join(failed) if failed else "self-check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
