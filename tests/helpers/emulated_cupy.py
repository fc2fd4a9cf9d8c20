"""A stand-in for the parts of CuPy that lltm_cupy's GPU backend uses, built on NumPy, with the
kernels of cuda_src/lltm.cu compiled as host C++.

It lets the GPU backend's Python (launch arguments, contiguity, grid sizes, the sequence loops,
cuBLAS accumulation, float16 handling) run in every CI run, on a machine without a GPU. It is
strict where CuPy is: kernel array arguments must be C-contiguous and of the kernel's dtype,
no array the kernel writes may overlap another argument (every pointer is __restrict__),
scalar arguments must be the exact NumPy types the kernel signature needs (a Python int would
reach a RawKernel as a 64-bit long long), ``cublas.gemm`` takes float32/float64 only, and
``matmul`` accumulates float16 products in float32 as cuBLAS does. What it cannot show: real
concurrency, streams, and the NVRTC-compiled code itself (the NVRTC tests cover compilation).
"""
from __future__ import annotations

import ctypes
import types

import numpy as np

from .host_kernels import SUFFIX, ptr


class ndarray(np.ndarray):
    """A NumPy array posing as a CuPy array on device 0."""

    @property
    def device(self):
        return _Device(0)

    def get(self):
        return np.array(self)


def _wrap(a):
    return np.asarray(a).view(ndarray)


class _Device:
    def __init__(self, device_id=0):
        self.id = device_id
        self.attributes = {"MultiProcessorCount": 1}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


def _matmul(a, b, out=None):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.float16:  # cuBLAS accumulates half products in float32
        result = np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    else:
        result = np.matmul(a, b)
    if out is None:
        return _wrap(result)
    out[...] = result
    return out


def _gemm(transa, transb, a, b, out=None, alpha=1.0, beta=0.0):
    """cupy.cublas.gemm: out = alpha * op(a) @ op(b) + beta * out (float32/float64 only)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.char not in "fd" or b.dtype != a.dtype:
        raise TypeError("invalid dtype")
    op_a = a.T if transa == "T" else a
    op_b = b.T if transb == "T" else b
    result = alpha * np.matmul(op_a, op_b)
    if out is None:
        return _wrap(result)
    assert out.flags.c_contiguous or out.flags.f_contiguous, "cublas.gemm needs a contiguous out"
    assert out.shape == result.shape and out.dtype == a.dtype
    out[...] = result + beta * np.asarray(out)
    return out


def _array_fn(fn):
    def wrapped(*args, **kwargs):
        return _wrap(fn(*args, **kwargs))
    wrapped.__name__ = fn.__name__
    return wrapped


def make_module() -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.__doc__ = __doc__
    cupy.ndarray = ndarray
    for name in ("asarray", "array", "empty", "zeros", "ones", "zeros_like", "ones_like",
                 "empty_like", "ascontiguousarray", "asfortranarray", "concatenate"):
        setattr(cupy, name, _array_fn(getattr(np, name)))
    cupy.matmul = _matmul
    cupy.shares_memory = np.shares_memory
    cupy.float16, cupy.float32, cupy.float64 = np.float16, np.float32, np.float64
    cupy.cuda = types.SimpleNamespace(Device=_Device, is_available=lambda: True)
    cupy.cublas = types.ModuleType("cupy.cublas")
    cupy.cublas.gemm = _gemm
    return cupy


def host_get_kernels(lib):
    """A replacement for lltm_cupy._kernels.get_kernels that launches the host-compiled kernels."""

    def check(args, dtype, kinds, outputs):
        assert len(args) == len(kinds), f"kernel takes {len(kinds)} arguments, got {len(args)}"
        # Every pointer is __restrict__: an array the kernel writes may overlap no other argument.
        arrays = [a for a in args if isinstance(a, np.ndarray)]
        for i in outputs:
            for j, other in enumerate(arrays):
                assert j == i or not np.shares_memory(args[i], other), \
                    f"kernel output argument {i} overlaps argument {j} (restrict pointers)"
        converted = []
        for a, kind in zip(args, kinds):
            if kind == "array":
                assert isinstance(a, np.ndarray) and a.dtype == dtype, \
                    f"kernel array argument of dtype {getattr(a, 'dtype', type(a))}, expected {dtype}"
                converted.append(ptr(a))
            elif kind == "int32":
                assert type(a) is np.int32, f"expected numpy.int32, got {type(a).__name__}"
                converted.append(ctypes.c_int(int(a)))
            else:
                assert type(a) is np.int64, f"expected numpy.int64, got {type(a).__name__}"
                converted.append(ctypes.c_longlong(int(a)))
        return converted

    def get_kernels(dtype, wide=False):
        dtype = np.dtype(dtype)
        suffix = SUFFIX[dtype] + ("_wide" if wide else "")
        fwd_c = getattr(lib, f"lltm_fwd_{suffix}")
        bwd_c = getattr(lib, f"lltm_bwd_{suffix}")

        def fwd(grid, block, args):
            fwd_c(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]),
                  *check(args, dtype, ["array"] * 5 + ["int64", "int32"], outputs=(0, 3, 4)))

        def bwd(grid, block, args):
            bwd_c(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]),
                  *check(args, dtype, ["array"] * 6 + ["int32", "int32", "int64", "int32"],
                         outputs=(4, 5)))

        return fwd, bwd

    return get_kernels
