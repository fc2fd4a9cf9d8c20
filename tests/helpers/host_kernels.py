"""cuda_src/lltm.cu built as host C++ (tests/host_shim) and loaded with ctypes."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np

from lltm_cupy._cuda import kernels as _kernels

SHIM = Path(__file__).resolve().parents[1] / "host_shim"
SUFFIX = {np.dtype(np.float64): "f64", np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
          np.dtype(np.uint16): "bf16"}  # uint16: bfloat16 bits (lltm_cupy._cuda.kernels.BFLOAT16)


def build(out_dir: Path) -> ctypes.CDLL:
    """Compile tests/host_shim/harness.cpp (which includes lltm.cu) into out_dir and load it."""
    cxx = shutil.which("g++")
    assert cxx, "g++ is required to run the CUDA source on the CPU (apt-get install g++)"
    out = Path(out_dir) / "lltm_host.so"
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
           f"-I{_kernels.source_path().parent}", f"-I{SHIM}", str(SHIM / "harness.cpp"),
           "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"host build failed: {' '.join(cmd)}\n{proc.stderr}"
    return ctypes.CDLL(str(out))


def ptr(a):
    """The data pointer of a C-contiguous array (what a CUDA kernel argument would be)."""
    assert a.flags.c_contiguous, "kernel argument is not C-contiguous"
    return ctypes.c_void_p(a.ctypes.data)
