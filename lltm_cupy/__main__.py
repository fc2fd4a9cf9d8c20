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

    print("\nfinite-difference check of every gradient (B=3, F=4, S=5), max normalised error:")
    failed = verify.report_gradients(verify.random_case(), 1e-6, TOL, with_torch=not args.no_torch)
    if failed is None:   # no array backend could run
        failed = ["every array backend"]
    print("FAILED: " + ", ".join(failed) if failed else "self-check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
