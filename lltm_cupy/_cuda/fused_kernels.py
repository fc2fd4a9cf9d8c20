"""The fused sequence kernels of ``cuda_src/lltm_fused.cu`` (one block per tile of batch rows),
whose record is :data:`.kernels.FUSED`, and the layout facts that every fused variant's planner
shares with them (threads per block, the arithmetic type's size, the padded row stride of a
transposed W_h). The cluster and group kernels and the tensor-core kernels are compiled after
this file, in the same translation unit."""
from __future__ import annotations

import numpy as np

from .kernels import FUSED as FAMILY

__all__ = ["FAMILY", "SOURCE_NAME", "KERNEL_NAMES", "THREADS", "acc_size", "wt_stride",
           "source", "name_expression", "get_kernels", "compile_offline"]

SOURCE_NAME, KERNEL_NAMES = FAMILY.files[-1], FAMILY.kernels
#: ``get_kernels(dtype)``: the :class:`~.kernels.FusedKernels` on the current device, compiled
#: once per (device, dtype).
source, name_expression, get_kernels = FAMILY.source, FAMILY.name_expression, FAMILY.get_kernels
compile_offline = FAMILY.compile_offline
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
