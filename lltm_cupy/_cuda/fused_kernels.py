"""The fused sequence kernels of ``cuda_src/lltm_fused.cu`` (one block per tile of batch rows):
their module, and the layout facts that every fused variant's planner shares with them (threads
per block, the arithmetic type's size, the padded row stride of a transposed W_h). The cluster
and group kernels (:mod:`.cluster_kernels`, :mod:`.group_kernels`) and the tensor-core kernels
(:mod:`.fused_mma`) are compiled after this file, in the same translation unit."""
from __future__ import annotations

import functools

import numpy as np

from . import elementwise, kernels
from .kernels import CUDA_TYPE, FusedKernels

__all__ = ["SOURCE_NAME", "KERNEL_NAMES", "THREADS", "acc_size", "wt_stride", "source",
           "name_expression", "get_kernels", "compile_offline"]

SOURCE_NAME = "lltm_fused.cu"
KERNEL_NAMES = ("lltm_seq_fwd_kernel", "lltm_seq_bwd_kernel")
#: Threads per block of the fused kernels at most (fewer when the tile has fewer elements).
THREADS = 256


def acc_size(dtype) -> int:
    """Bytes of the kernels' arithmetic type for ``dtype`` (float32 for the 16-bit types)."""
    return 8 if np.dtype(dtype) == np.float64 else 4


def wt_stride(state: int, itemsize: int) -> int:
    """Row stride (elements) of the forward kernel's transposed W_h in shared memory, as
    ``lltm_fused_wt_stride`` in cuda_src/lltm_fused.cu: at least 3S, an odd number of 4-byte
    words for 2-byte types, odd for 4- and 8-byte types, so that the kernel's load (consecutive
    threads storing to consecutive rows) meets no bank conflict where a warp stores into one
    gate's column, at most a 2-way one where it straddles two (the unpadded 3S: 32-way at
    S = 128)."""
    s3 = 3 * state
    return s3 + (6 - s3 % 4) % 4 if itemsize == 2 else s3 | 1


@functools.lru_cache(maxsize=None)
def source() -> str:
    """lltm.cu followed by lltm_fused.cu: one translation unit, so that the fused kernels use
    lltm.cu's scalar types and cell functions."""
    return kernels.joined(elementwise.source(), SOURCE_NAME)


def name_expression(kernel: str, dtype) -> str:
    return f"{kernel}<{CUDA_TYPE[np.dtype(dtype)]}>"


def _names(dtype):
    return [name_expression(k, dtype) for k in KERNEL_NAMES]


def get_kernels(dtype):
    """The :class:`~.kernels.FusedKernels` for ``dtype`` on the current device, compiled once;
    each kernel is allowed the device's whole opt-in shared memory per block."""
    import cupy

    dtype = np.dtype(dtype)
    return kernels.cached(("fused", cupy.cuda.Device().id, dtype.str),
                          lambda: FusedKernels(*kernels.load(source(), _names(dtype))))


def compile_offline(dtype, arch: int, output: str = "cubin") -> bytes:
    """The kernels for ``dtype`` compiled by NVRTC for ``sm_<arch>`` (:func:`.kernels.nvrtc`)."""
    return kernels.nvrtc(source(), SOURCE_NAME, _names(dtype), arch, output)
