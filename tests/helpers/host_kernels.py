"""cuda_src/lltm.cu built as host C++ (tests/host_shim) and loaded with ctypes."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from . import host_build

SUFFIX = {np.dtype(np.float64): "f64", np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
          np.dtype(np.uint16): "bf16"}  # uint16: bfloat16 bits (lltm_cupy._cuda.kernels.BFLOAT16)


def build(out_dir: Path) -> ctypes.CDLL:
    """tests/host_shim/harness.cpp (which includes lltm.cu) built, or found in the run's cache
    (tests/helpers/host_build.py), and loaded from a copy in out_dir."""
    return host_build.build("harness.cpp", out_dir, "lltm_host.so")


def ptr(a):
    """The data pointer of a C-contiguous array (what a CUDA kernel argument would be)."""
    assert a.flags.c_contiguous, "kernel argument is not C-contiguous"
    return ctypes.c_void_p(a.ctypes.data)
