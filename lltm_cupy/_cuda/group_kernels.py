"""The group kernels of ``cuda_src/lltm_fused_cluster.cu`` (the cluster kernels' split without
clusters, sm_80 and newer: the blocks of a tile exchange through global memory and meet at a
barrier on a counter per tile, every block of the grid resident at once), whose record is
:data:`.kernels.GROUPS` (a cooperative module, one instance per group size): the driver's count
of blocks a device holds at once, and the launch handle that adds the exchange buffer and
counters and runs a grid in launches the device holds. What to launch is :mod:`.fused_cluster`'s
to plan."""
from __future__ import annotations

import numpy as np

from . import cluster_kernels, kernels
from .kernels import GROUPS as FAMILY, current_device

__all__ = ["FAMILY", "SOURCE_NAME", "KERNEL_NAMES", "SIZES", "source", "name_expression",
           "get_kernels", "compile_offline", "resident_blocks", "exchange_elements",
           "group_launch"]

SOURCE_NAME, KERNEL_NAMES = FAMILY.files[-1], FAMILY.kernels
#: Blocks per tile of the group kernels (one instance each).
SIZES = tuple(FAMILY.instances)
#: ``get_kernels(dtype, size)``: the :class:`~.kernels.FusedKernels` in groups of ``size``
#: blocks on the current device (every size compiled at the first call per (device, dtype), in
#: a cooperative module: :func:`resident_blocks` says how many blocks a launch may have);
#: ``compile_offline``: sm_80 and newer.
source, name_expression, get_kernels = FAMILY.source, FAMILY.name_expression, FAMILY.get_kernels
compile_offline = FAMILY.compile_offline


_resident: dict = {}


def resident_blocks(kernel, threads: int, shared: int) -> int:
    """How many blocks of ``kernel`` (a RawKernel of :func:`get_kernels`) with ``threads``
    threads and ``shared`` bytes of dynamic shared memory the current device holds at once: the
    driver's cuOccupancyMaxActiveBlocksPerMultiprocessor times the SMs, the figure CuPy checks
    a cooperative launch against (cupy/cuda/function.pyx v14.2). Cached per (device, kernel,
    threads, shared); asked after ``kernels.ensure_context`` (CuPy's driver call binds no
    context), never under capture (:func:`.cluster_kernels.refuse_under_capture`)."""
    import cupy

    device = current_device()
    key = (device, id(kernel), threads, shared)
    found = _resident.get(key)
    if found is None:
        cluster_kernels.refuse_under_capture(f"how many blocks of {threads} threads and {shared} "
                                             f"bytes of shared memory")
        kernels.ensure_context()
        per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.kernel.ptr, threads, shared)
        found = _resident[key] = per_sm * kernels._sm_count(device)
    return found


def exchange_elements(state: int, tile: int, backward: bool, size: int) -> int:
    """Elements (of the arithmetic type) of one tile's region of the group kernels' exchange
    buffer: two buffers of the tile's h (forward) or of the partial sums of d_h that the
    ``size`` blocks send each other, (size, size, tile, LM) (backward)."""
    most = -(-state // size)
    return 2 * (size * size * tile * most if backward else tile * state)


def _cupy_buffers(exchange: int, acc, tiles: int):
    """The group launch's buffers from CuPy's current allocator: (exchange pointer, counters
    pointer, their owners)."""
    cupy = kernels.cupy_module()
    buffer, counters = cupy.empty(exchange, acc), cupy.zeros(tiles, np.uint32)
    return buffer.data.ptr, counters.data.ptr, (buffer, counters)


def group_launch(kernel, size: int, dtype, state: int, backward: bool, buffers=None):
    """A launch handle for the group kernel ``kernel`` (``size`` blocks per tile) with the
    cluster kernels' calling convention (``launch(grid, block, args, shared_mem)``): it adds the
    exchange buffer, the tiles' zeroed counters and each launch's first tile, and runs the grid
    in launches the device holds at once, each checked right before it (RuntimeError, never a
    grid CuPy would shrink: see :mod:`.fused_cluster`). ``buffers(elements, acc, tiles)`` makes
    the exchange buffer and counters on the current device as (pointer, pointer, owners kept
    until the launches are queued): CuPy arrays by default, torch tensors for the torch layer."""
    acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32

    def launch(grid, block, args, shared_mem=0):
        tiles = grid[0] // size
        wave = min(tiles, resident_blocks(kernel, block[0], shared_mem) // size)
        if wave < 1:
            raise RuntimeError(f"lltm_cupy: the device cannot hold the {size} blocks of one tile "
                               f"of the fused kernels at once ({block[0]} threads and "
                               f"{shared_mem} bytes of shared memory per block)")
        exchange, counters, _owners = (buffers or _cupy_buffers)(
            wave * exchange_elements(state, int(args[-1]), backward, size), acc, tiles)
        for first in range(0, tiles, wave):
            blocks = min(wave, tiles - first) * size
            resident = resident_blocks(kernel, block[0], shared_mem)
            if blocks > resident:
                raise RuntimeError(f"lltm_cupy: a cooperative launch of {blocks} blocks of the "
                                   f"fused group kernels, more than the {resident} the device "
                                   f"holds at once (CuPy would shrink the grid, and the blocks "
                                   f"left out would be waited for forever)")
            kernel((blocks,), block, (*args, exchange, counters + 4 * first, np.int32(first)),
                   shared_mem=shared_mem)

    return launch
