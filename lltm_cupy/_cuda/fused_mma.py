"""GPU backend, fused sequences on tensor cores: float16 and bfloat16 sequences by
``cuda_src/lltm_fused_mma.cu``, whose steps compute the recurrent products (forward h @ W_h.T,
backward d_gates @ W_h) with warp-level ``mma.sync`` (m16n8k16, float32 accumulation) from W_h
held in shared memory in fragment order for the whole sequence, around the element-wise cell of
``lltm_fused.cu``. Same arguments and results as that file's kernels, up to the order of the
products' float32 sums.

Used by :mod:`.fused` where :func:`usable` says so: a 16-bit dtype, compute capability 8.0 or
newer (mma.sync with these shapes), and the kernel's shared memory for a one-row tile within the
device's opt-in limit per block (:func:`shared_bytes`): forward S up to 192 on sm_90 and sm_100
(232,448 bytes), 160 on sm_80 (166,912); backward 176 and 144; past that, the FMA kernels.
"""
from __future__ import annotations

import numpy as np

from . import kernels
from .kernels import FUSED_MMA as FAMILY

__all__ = ["FAMILY", "MIN_ARCH", "SOURCE_NAME", "KERNEL_NAMES", "WARPS", "source",
           "name_expression", "get_kernels", "compile_offline", "shared_bytes", "usable",
           "geometry"]

#: mma.sync.m16n8k16 with f16 / bf16 operands needs sm_80.
MIN_ARCH = 80
SOURCE_NAME, KERNEL_NAMES = FAMILY.files[-1], FAMILY.kernels
#: ``get_kernels(dtype)``: the :class:`~.kernels.FusedKernels` for float16 or bfloat16 on the
#: current device, compiled once per (device, dtype); ``compile_offline``: sm_80 and newer.
source, name_expression, get_kernels = FAMILY.source, FAMILY.name_expression, FAMILY.get_kernels
compile_offline = FAMILY.compile_offline
#: Warps per block at most (one per s-tile of 16 states and n-tile of 8 rows, round-robin).
WARPS = 8
_DTYPES = (np.dtype(np.float16), kernels.BFLOAT16)


def shared_bytes(state: int, tile: int, backward: bool = False) -> int:
    """Dynamic shared memory of one block, as ``lltm_mma_fwd_bytes`` / ``lltm_mma_bwd_bytes`` in
    the kernels: W_h's fragments 6 Sp^2 (Sp = S rounded up to 16); forward h double-buffered in
    16 bits over the tile rounded up to 8 rows with rows of Sp + 8, and c in float32; backward
    d_gates double-buffered the same way with rows of 3 Sp + 8, and d_h and d_c in float32."""
    sp = -(-state // 16) * 16
    rows = -(-tile // 8) * 8
    if backward:
        return 6 * sp * sp + 4 * rows * (3 * sp + 8) + 8 * tile * state
    return 6 * sp * sp + 4 * rows * (sp + 8) + 4 * tile * state


def usable(state: int, dtype, backward: bool = False) -> bool:
    """True when the mma forward (backward) runs ``state`` in ``dtype`` on the current device."""
    if np.dtype(dtype) not in _DTYPES or state <= 0:
        return False
    device = kernels.current_device()
    return (kernels.compute_capability(device) >= MIN_ARCH
            and shared_bytes(state, 1, backward) <= kernels.shared_memory_limit(device))


def geometry(batch: int, state: int, backward: bool = False):
    """(blocks, threads, tile, shared bytes): the batch spread over the SMs, one tile per block,
    as many rows per tile as shared memory holds; a warp per s-tile and n-tile, WARPS at most."""
    device = kernels.current_device()
    limit = kernels.shared_memory_limit(device)
    sp = -(-state // 16) * 16
    # rows that fit: shared_bytes(state, t) <= fixed + (t + 7) row + t per_row <= limit
    row, per_row = 4 * ((3 * sp if backward else sp) + 8), (8 if backward else 4) * state
    fits = (limit - 6 * sp * sp - 7 * row) // (row + per_row)
    tile = max(1, min(-(-batch // kernels._sm_count(device)), fits))
    jobs = -(-state // 16) * -(-tile // 8)
    warps = min(WARPS, jobs)
    return -(-batch // tile), 32 * warps, tile, shared_bytes(state, tile, backward)
