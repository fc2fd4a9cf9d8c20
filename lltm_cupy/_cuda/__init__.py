"""The CUDA backend: CuPy arrays on the GPU, the kernels of ``cuda_src/`` compiled by CuPy (NVRTC)
and cuBLAS GEMMs through CuPy's binding. CuPy is imported on first call, never at import.

Its modules import each other in one direction, each only those above it in this list:

    kernels          CuPy and the GPU check, the device's figures, the CUDA sources, NVRTC
                     (the one compile helper), the kernel cache, a record per kernel family
                     (files, kernels, template arguments, launch kind) and one lookup over them
    elementwise      cuda_src/lltm.cu's kernels (the cell each way, concatenation, add): their
                     launch handles
    fused_kernels    cuda_src/lltm_fused.cu's kernels (one block per tile): the layout facts
                     every fused variant shares
    fused_mma        cuda_src/lltm_fused_mma.cu's tensor-core kernels: their size and geometry
    cluster_kernels  cuda_src/lltm_fused_cluster.cu's cluster kernels: the driver's occupancy
                     query for clusters, the guard of a non-portable launch
    group_kernels    the same file's group kernels (a cooperative launch): their launcher
    gemm             cuBLAS gemmEx on row-major views, the bias reduction, a sequence's
                     parameter gradients
    step             one step each way (forward, backward) and the fused cell alone
    packed           variable-length sequences (a packing plan of lltm_cupy._packing)
    fused_cluster    the split variants' plan: blocks per tile, tiles, shared memory
    fused            the fused whole-sequence calls: which variant runs, its launch
    sequence         fixed-length sequences, and the choice of the packed and fused paths
    warmup           every kernel compiled and loaded ahead of use
"""
from __future__ import annotations

from .gemm import gemm
from .sequence import backward_sequence, forward_sequence
from .step import backward, cell_backward, cell_forward, forward
from .warmup import warmup, warmup_dtype

__all__ = ["forward", "backward", "forward_sequence", "backward_sequence", "cell_forward",
           "cell_backward", "gemm", "warmup", "warmup_dtype"]
