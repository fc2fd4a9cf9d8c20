"""GPU backend, fused sequences on tensor cores: the forward of float16 and bfloat16 sequences
by ``cuda_src/lltm_fused_mma.cu``, whose step computes the recurrent product h @ W_h.T with
warp-level ``mma.sync`` (m16n8k16, float32 accumulation) from W_h held in shared memory in
fragment order for the whole sequence, then runs the element-wise cell as the FMA kernel of
``lltm_fused.cu`` does. Same arguments and results as that kernel's forward, up to the order of
the product's float32 sums; the backward stays on the FMA kernel.

Used by :mod:`.fused` for the forward where :func:`usable` says so: a 16-bit dtype, compute
capability 8.0 or newer (mma.sync with these shapes), and W_h's fragments plus one row's state
within the device's opt-in shared memory per block (:func:`shared_bytes`): S up to 192 on sm_90
and sm_100 (232,448 bytes), 160 on sm_80 (166,912); past that, the FMA forward.
"""
from __future__ import annotations

import functools

import numpy as np

from . import kernels

__all__ = ["MIN_ARCH", "SOURCE_NAME", "KERNEL_NAME", "WARPS", "source", "name_expression",
           "get_kernel", "compile_offline", "shared_bytes", "usable",
           "geometry"]

#: mma.sync.m16n8k16 with f16 / bf16 operands needs sm_80.
MIN_ARCH = 80
SOURCE_NAME = "lltm_fused_mma.cu"
KERNEL_NAME = "lltm_seq_fwd_mma_kernel"
#: Warps per block at most (one per s-tile of 16 states and n-tile of 8 rows, round-robin).
WARPS = 8
_DTYPES = (np.dtype(np.float16), kernels.BFLOAT16)


@functools.lru_cache(maxsize=None)
def source() -> str:
    """lltm.cu, lltm_fused.cu, then lltm_fused_mma.cu: one translation unit (the mma kernel uses
    the first two's scalar types, cell arithmetic and step offsets)."""
    return (kernels.fused_source() + f'\n#line 1 "{SOURCE_NAME}"\n'
            + kernels.source_path(SOURCE_NAME).read_text(encoding="utf-8"))


def name_expression(dtype) -> str:
    return f"{KERNEL_NAME}<{kernels.CUDA_TYPE[np.dtype(dtype)]}>"


def get_kernel(dtype):
    """The forward kernel for ``dtype`` (float16 or bfloat16) on the current device, compiled
    once, allowed the device's whole opt-in shared memory per block."""
    import cupy

    dtype = np.dtype(dtype)
    key = ("fused_mma", cupy.cuda.Device().id, dtype.str)
    kernel = kernels._cache.get(key)
    if kernel is None:
        with kernels._lock:
            kernel = kernels._cache.get(key)
            if kernel is None:
                name = name_expression(dtype)
                module = cupy.RawModule(code=source(), options=kernels.RAWMODULE_OPTIONS,
                                        name_expressions=[name])
                kernel = module.get_function(name)
                limit = kernels.shared_memory_limit(cupy.cuda.Device().id)
                kernel.max_dynamic_shared_size_bytes = limit - kernel.shared_size_bytes
                kernels._cache[key] = kernel
    return kernel


def compile_offline(dtype, arch: int, output: str = "cubin") -> bytes:
    """As :func:`lltm_cupy._cuda.kernels.compile_offline`, for the mma forward (sm_80 and
    newer)."""
    return kernels._nvrtc(source(), SOURCE_NAME, [name_expression(dtype)], arch, output)


def shared_bytes(state: int, tile: int) -> int:
    """Dynamic shared memory of one block, as ``lltm_mma_fwd_bytes`` in the kernel: W_h's
    fragments 6 Sp^2 (Sp = S rounded up to 16), h double-buffered in 16 bits over the tile
    rounded up to 8 rows with rows of Sp + 8, and c in float32."""
    sp = -(-state // 16) * 16
    rows = -(-tile // 8) * 8
    return 6 * sp * sp + 4 * rows * (sp + 8) + 4 * tile * state


def usable(state: int, dtype) -> bool:
    """True when the mma forward runs ``state`` in ``dtype`` on the current device."""
    if np.dtype(dtype) not in _DTYPES or state <= 0:
        return False
    device = kernels.current_device()
    return (kernels.compute_capability(device) >= MIN_ARCH
            and shared_bytes(state, 1) <= kernels.shared_memory_limit(device))


def geometry(batch: int, state: int):
    """(blocks, threads, tile, shared bytes): the batch spread over the SMs, one tile per block,
    as many rows per tile as shared memory holds; a warp per s-tile and n-tile, WARPS at most."""
    device = kernels.current_device()
    limit = kernels.shared_memory_limit(device)
    sp = -(-state // 16) * 16
    # rows that fit: shared_bytes(state, t) <= 6 sp^2 + 4 (t + 7)(sp + 8) + 4 t S <= limit
    fits = (limit - 6 * sp * sp - 28 * (sp + 8)) // (4 * (sp + 8) + 4 * state)
    tile = max(1, min(-(-batch // kernels._sm_count(device)), fits))
    jobs = -(-state // 16) * -(-tile // 8)
    warps = min(WARPS, jobs)
    return -(-batch // tile), 32 * warps, tile, shared_bytes(state, tile)
