"""The CUDA backend: CuPy arrays on the GPU, the kernels of ``cuda_src/`` compiled by CuPy (NVRTC)
and cuBLAS GEMMs through CuPy's binding. CuPy is imported on first call, never at import.

Its modules import each other in one direction, each only those above it in this list:

    kernels    CuPy and the GPU check, the CUDA sources, compilation, the kernel cache
    gemm       cuBLAS gemmEx on row-major views, the bias reduction, a sequence's parameter
               gradients
    step       one step each way (forward, backward) and the fused cell alone
    packed     variable-length sequences (a packing plan of lltm_cupy._packing)
    fused      the fused whole-sequence kernels (cuda_src/lltm_fused.cu)
    sequence   fixed-length sequences, and the choice of the packed and fused paths
    warmup     every kernel compiled and loaded ahead of use
"""
from __future__ import annotations

from .gemm import gemm
from .sequence import backward_sequence, forward_sequence
from .step import backward, cell_backward, cell_forward, forward
from .warmup import warmup, warmup_dtype

__all__ = ["forward", "backward", "forward_sequence", "backward_sequence", "cell_forward",
           "cell_backward", "gemm", "warmup", "warmup_dtype"]
