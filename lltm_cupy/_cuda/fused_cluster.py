"""GPU backend, fused sequences split over several blocks per tile
(``cuda_src/lltm_fused_cluster.cu``): sizes and geometry of the variants that :mod:`.fused` runs
for the state sizes whose W_h does not fit one block's shared memory: on sm_90 and newer in
thread-block clusters (:mod:`.cluster_kernels`), on sm_80 to sm_89 in groups of blocks of a
cooperative launch (:mod:`.group_kernels`). It plans; those modules compile, query the driver
and launch.

P blocks (P in 1, 2, 4, 8, 16 in a cluster; 1, 2, 4, 8 in a group) run each tile of batch rows;
block r holds W_h's rows of its states r S / P .. (r + 1) S / P - 1 (at most LM = ceil(S / P))
and the blocks exchange each step's h (forward) or partial d_h (backward): in a cluster through
distributed shared memory, with one cluster barrier per step; in a group through a buffer in
global memory (in L2), with one barrier per step on a counter per tile in global memory (the
group kernels, one kernel source with the cluster ones: the same cell and dot products, the same
results). Shared memory per block (bytes; T the storage type, A the arithmetic type, float32 for
the 16-bit types; the layout is the same in every block):

    forward:  S * Q sizeof(T), Q = 3 LM rounded up as fused_kernels.wt_stride does for 3S, to
              16, plus per row of the tile (2 S + LM) sizeof(A) in a cluster, (S + LM) sizeof(A)
              in a group (one h buffer: the next h is copied in after the step's barrier)
    backward: 3 LM S sizeof(T), rounded up to 16, plus per row (5 + 2 P) LM sizeof(A) in a
              cluster, 5 LM sizeof(A) in a group (its receive buffers are in global memory)

The cluster (or group) size is the smallest of 1, 2, 4 and 8 (the portable sizes: every sm_90 device
runs them) that runs a one-row tile both ways. Where 8 blocks cannot hold W_h, 16 blocks run it if
they can and the device holds at least one cluster of 16 blocks of both kernels (the driver's
occupancy query, ``cluster_kernels.max_active_clusters``; the kernels carry the non-portable cluster
size attribute). A 16-block cluster is non-portable: it needs a GPC of at least 16 SMs with room for
one block each (an H100's GPCs have up to 18 SMs), a smaller part (a MIG slice, another product) may
hold none, or the query may fail; then those sizes run the stepped path. A 16-block launch that the
driver refuses all the same (``cluster_kernels.guarded``) runs that call on the stepped path and
marks the size refused on the device (``kernels.refused_sizes``); warmup makes that first launch
outside any CUDA-graph capture. A portable size of which the query says no cluster fits (it answers
0) is not chosen either (a failed query leaves it chosen). Groups (sm_80 to sm_89) are of 1, 2, 4 or
8 blocks only.

The tile, as in .fused: the batch spread over SMs / P clusters, as many rows as fit; then grown
until the device can hold every cluster at once, as the occupancy query says (all blocks of a
cluster must fit one GPC, so a device may hold fewer clusters than SMs / P: e.g. 32 of 4 blocks
of about 200 KB where 132 SMs form GPCs of 16 and 18 SMs). Where shared memory stops the tile
growing first, the clusters beyond the device's run in a second wave (or more) after the first;
where the query fails, the first spread stands. The group variant plans its tiles as that first
spread.

Largest state size (:func:`max_state`) on sm_90 and sm_100 (232,448 bytes per block):

    blocks   float16 / bfloat16   float32   float64
       8            544             388       272
      16            768             544       384

and in groups on sm_80 (166,912 bytes per block):

    blocks   float16 / bfloat16   float32   float64
       8            464             328       232

The group variant (``group_kernels.group_launch``) needs every block of its grid resident at once
(its blocks wait for each other): it is launched cooperatively (cuLaunchCooperativeKernel, which the
driver refuses for a grid the device cannot hold at once; but CuPy first shrinks a one-dimensional
grid to that size with a warning, which would leave tiles half launched and their blocks waiting
forever), each launch at most as many tiles as the device holds at once (the driver's occupancy
figure, ``group_kernels.resident_blocks``, which each launch's grid is checked against right before
it: an error, never a shrunk grid); a batch of more tiles runs in several launches. Its exchange
buffer and counters are allocated per call on the current stream, the counters zeroed there (one
memset per call, none per step: the n-th barrier of a launch waits for n P arrivals).
"""
from __future__ import annotations

import functools

import numpy as np

from . import cluster_kernels, group_kernels, kernels
from .fused_kernels import THREADS, acc_size, wt_stride

__all__ = ["FORCED_SIZE", "MIN_ARCH", "GROUP_MIN_ARCH", "PORTABLE_SIZES", "shared_bytes",
           "cluster_size", "max_state", "held", "usable", "chosen_size", "geometry",
           "uses_clusters"]

#: The cluster size to run whatever the state size (tests; None: the launcher's own choice, see
#: the module docstring, where the one-block kernels cannot hold W_h).
FORCED_SIZE = None
#: Thread-block clusters need compute capability 9.0.
MIN_ARCH = 90
#: The group variant (no cluster) runs from compute capability 8.0 on.
GROUP_MIN_ARCH = 80


def shared_bytes(state: int, dtype, tile: int, backward: bool, size: int,
                 group: bool = False) -> int:
    """Dynamic shared memory of one block of the cluster kernels (``group``: of the group
    kernels; see the module docstring)."""
    item = np.dtype(dtype).itemsize
    most = -(-state // size)
    elements = 3 * most * state if backward else state * wt_stride(most, item)
    weights = -(-elements * item // 16) * 16
    if backward:
        per_row = (5 + (0 if group else 2 * size)) * most
    else:
        per_row = (1 if group else 2) * state + most
    return weights + tile * per_row * acc_size(dtype)


def _fits(state: int, dtype, size: int, limit: int, group: bool = False) -> bool:
    return size <= state and all(shared_bytes(state, dtype, 1, b, size, group) <= limit
                                 for b in (False, True))


#: The cluster sizes every device of compute capability 9.0 or newer runs.
PORTABLE_SIZES = tuple(p for p in cluster_kernels.SIZES if p <= cluster_kernels.PORTABLE_SIZE)


def cluster_size(state: int, dtype, limit: int, group: bool = False):
    """The smallest of :data:`PORTABLE_SIZES` whose one-row tiles of ``state`` fit ``limit``
    bytes per block both ways (``group``: in the group kernels); None if none does."""
    return next((p for p in PORTABLE_SIZES if _fits(state, dtype, p, limit, group)), None)


@functools.lru_cache(maxsize=None)
def max_state(limit: int, dtype, size: int = cluster_kernels.PORTABLE_SIZE,
              group: bool = False) -> int:
    """The largest state size a cluster (``group``: a group) of ``size`` blocks runs with
    ``limit`` bytes per block."""
    state = 0
    while shared_bytes(state + 1, dtype, 1, True, size, group) <= limit and \
            shared_bytes(state + 1, dtype, 1, False, size, group) <= limit:
        state += 1
    return state


def held(state: int, dtype, size: int):
    """The clusters of ``size`` blocks that the current device holds at once with one-row tiles
    of ``state`` (the occupancy query, the fewer of the two directions); None where a query
    fails (``kernels.cluster_failures`` says why) or the driver refused that size."""
    if (kernels.current_device(), size) in kernels.refused_sizes:
        return None
    fns = cluster_kernels.get_kernels(dtype, size)
    answers = [cluster_kernels.max_active_clusters(
        kernel, size, *_launch_shape(state, dtype, backward, size, 1))
        for backward, kernel in ((False, fns.fwd), (True, fns.bwd))]
    return None if None in answers else min(answers)


def _runs(state: int, dtype, size: int) -> bool:
    """Whether the current device may launch clusters of ``size`` blocks (the module docstring's
    rule; groups always)."""
    if not uses_clusters(kernels.current_device()):
        return True
    found = held(state, dtype, size)
    return bool(found) if size > cluster_kernels.PORTABLE_SIZE else found != 0


def _choice(state: int, dtype, limit: int):
    """The cluster size of the launcher's own choice (see the module docstring), or None."""
    size = cluster_size(state, dtype, limit, not uses_clusters(kernels.current_device()))
    if size is not None and _runs(state, dtype, size):
        return size
    if uses_clusters(kernels.current_device()):
        return next((p for p in cluster_kernels.SIZES if p > (size or 0)
                     and _fits(state, dtype, p, limit) and _runs(state, dtype, p)), None)
    return None


def uses_clusters(device: int) -> bool:
    """True where the split runs in thread-block clusters (sm_90 and newer), False where in
    groups of a cooperative launch (sm_80 to sm_89)."""
    return kernels.compute_capability(device) >= MIN_ARCH


def usable(state: int, dtype) -> bool:
    """True when the current device (sm_80 or newer) runs ``state`` split over several blocks
    (in clusters from sm_90, in groups before)."""
    device = kernels.current_device()
    if kernels.compute_capability(device) < GROUP_MIN_ARCH:
        return False
    if FORCED_SIZE is not None:
        return chosen_size(state, dtype) is not None     # raises where the size cannot run
    return _choice(state, dtype, kernels.shared_memory_limit(device)) is not None


def chosen_size(state: int, dtype) -> int:
    """The blocks per tile the launcher runs: FORCED_SIZE if set (RuntimeError, saying why,
    where it cannot run ``state`` on this device), else the launcher's own choice (or None)."""
    device = kernels.current_device()
    limit = kernels.shared_memory_limit(device)
    if FORCED_SIZE is None:
        return _choice(state, dtype, limit)
    if kernels.compute_capability(device) < GROUP_MIN_ARCH:
        raise RuntimeError(f"lltm_cupy: the fused kernels run split over several blocks only on "
                           f"compute capability {GROUP_MIN_ARCH // 10}.0 and newer (in "
                           f"thread-block clusters from {MIN_ARCH // 10}.0); device {device} "
                           f"has {kernels.compute_capability(device) / 10:.1f}")
    if not uses_clusters(device) and FORCED_SIZE not in group_kernels.SIZES:
        raise RuntimeError(f"lltm_cupy: before compute capability {MIN_ARCH // 10}.0 the fused "
                           f"kernels run in groups of {group_kernels.SIZES} blocks, not "
                           f"{FORCED_SIZE}")
    group = not uses_clusters(device)
    if not _fits(state, dtype, FORCED_SIZE, limit, group):
        sizes = ", ".join(f"{p} blocks: S <= {max_state(limit, dtype, p, group)}"
                          for p in (cluster_kernels.SIZES if uses_clusters(device)
                                    else group_kernels.SIZES))
        raise RuntimeError(f"lltm_cupy: the fused kernels cannot run state size {state} in "
                           f"{np.dtype(dtype).name} in {FORCED_SIZE} blocks per tile with "
                           f"{limit} bytes of shared memory per block ({sizes}; at least as "
                           f"many states as blocks)")
    if not _runs(state, dtype, FORCED_SIZE):
        why = "; ".join(f"{name}: {reason}" for (d, name, _), reason
                        in kernels.cluster_failures.items() if d == device)
        portable = "" if FORCED_SIZE <= cluster_kernels.PORTABLE_SIZE else \
            "a non-portable cluster size; "
        answer = ("the driver refused its launch" if (device, FORCED_SIZE) in kernels.refused_sizes
                  else f"the occupancy query answered {held(state, dtype, FORCED_SIZE)}")
        raise RuntimeError(f"lltm_cupy: device {device} holds no cluster of {FORCED_SIZE} "
                           f"blocks of the fused kernels ({portable}{answer}"
                           f"{'; ' + why if why else ''})")
    return FORCED_SIZE


def _launch_shape(state: int, dtype, backward: bool, size: int, tile: int, group: bool = False):
    """(threads, shared bytes) of a block running a tile of ``tile`` rows."""
    width = state if backward else -(-state // size)    # the widest phase's elements per row
    threads = min(THREADS, -(-tile * width // 32) * 32)
    return threads, shared_bytes(state, dtype, tile, backward, size, group)


def geometry(batch: int, state: int, dtype, backward: bool, size: int, kernel=None):
    """(blocks, threads, tile, shared bytes) of a cluster launch (a group launch on a device
    without clusters); blocks = tiles * size. The tile as the module docstring says; ``kernel``
    (the function to launch) for the occupancy query that grows it (none: the first spread)."""
    device = kernels.current_device()
    limit = kernels.shared_memory_limit(device)
    group = not uses_clusters(device)
    empty = shared_bytes(state, dtype, 0, backward, size, group)
    per_row = shared_bytes(state, dtype, 1, backward, size, group) - empty
    fits = max(1, (limit - empty) // per_row)
    clusters = max(1, kernels._sm_count(device) // size)
    tile = max(1, min(-(-batch // clusters), fits))
    if kernel is not None:
        tile = _resident_tile(kernel, batch, state, dtype, backward, size, tile,
                              min(fits, max(batch, 1)))
    threads, shared = _launch_shape(state, dtype, backward, size, tile, group)
    return -(-batch // tile) * size, threads, tile, shared


def _resident_tile(kernel, batch: int, state: int, dtype, backward: bool, size: int, tile: int,
                   largest: int) -> int:
    """The smallest tile from ``tile`` up to ``largest`` whose ceil(batch / tile) clusters the
    device holds at once (the occupancy query at that tile's threads and shared memory), else
    ``largest`` (fewest waves); ``tile`` where a query fails."""
    start = tile
    while True:
        held = cluster_kernels.max_active_clusters(
            kernel, size, *_launch_shape(state, dtype, backward, size, tile))
        if held is None:
            return start
        if -(-batch // tile) <= held or tile >= largest:
            return tile
        tile = min(largest, max(tile + 1, -(-batch // max(held, 1))))
