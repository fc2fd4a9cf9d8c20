"""The cluster kernels of ``cuda_src/lltm_fused_cluster.cu`` (the fused sequence kernels split
over the blocks of a thread-block cluster, sm_90 and newer), whose record is
:data:`.kernels.CLUSTERS` (one instance per cluster size, those past the portable size allowed
the non-portable sizes): the driver's occupancy query for clusters (which CuPy 14 has no call
for: ctypes) and the launch handle that answers a refused non-portable launch. What to launch is
:mod:`.fused_cluster`'s to plan."""
from __future__ import annotations

import ctypes
import functools

from . import kernels
from .kernels import CLUSTERS as FAMILY, current_device
from .kernels import NON_PORTABLE_CLUSTER_SIZE_ALLOWED, PORTABLE_SIZE, allow_cluster_size

__all__ = ["FAMILY", "SOURCE_NAME", "KERNEL_NAMES", "SIZES", "PORTABLE_SIZE",
           "NON_PORTABLE_CLUSTER_SIZE_ALLOWED", "source", "name_expression", "get_kernels",
           "compile_offline", "CUlaunchConfig", "OCCUPANCY_PROTOTYPE", "allow_cluster_size",
           "max_active_clusters", "refuse_under_capture", "refuse_cluster_size", "LaunchRefused",
           "REFUSALS", "guarded"]

SOURCE_NAME, KERNEL_NAMES = FAMILY.files[-1], FAMILY.kernels
#: Blocks per cluster of the cluster kernels (one instance each: ``__cluster_dims__``).
SIZES = tuple(FAMILY.instances)
#: ``get_kernels(dtype, size)``: the :class:`~.kernels.FusedKernels` in clusters of ``size``
#: blocks on the current device (every size compiled at the first call per (device, dtype));
#: ``compile_offline``: sm_90 and newer.
source, name_expression, get_kernels = FAMILY.source, FAMILY.name_expression, FAMILY.get_kernels
compile_offline = FAMILY.compile_offline


# ------------------------------------------------------ clusters the device holds at once (query)

class CUlaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig (CUDA 12 and 13; tests/kernels/test_fused_cluster_occupancy.py
    holds the layout against the header's, compiled)."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


#: ``CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func,
#: const CUlaunchConfig *config)`` (cuda.h)
OCCUPANCY_PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                       ctypes.POINTER(CUlaunchConfig))


@functools.lru_cache(maxsize=None)
def _occupancy_function():
    """cuOccupancyMaxActiveClusters of the CUDA driver library, which CuPy 14 has no call for:
    from libcuda.so.1, the library CuPy's driver module loads by that name (dlopen returns the
    library already loaded)."""
    return OCCUPANCY_PROTOTYPE(("cuOccupancyMaxActiveClusters", ctypes.CDLL("libcuda.so.1")))


_occupancy: dict = {}


def refuse_cluster_size(kernel, size: int, exc: Exception) -> None:
    """Record that the driver refused a launch of ``kernel`` in clusters of ``size`` blocks on
    the current device (``exc``, kept in ``kernels.cluster_failures``): that size is not planned
    on this device again (``kernels.refused_sizes``)."""
    device = current_device()
    kernels.note_cluster_failure(device, kernel, "launch", exc)
    kernels.refused_sizes.add((device, size))


def refuse_under_capture(what: str) -> None:
    """Raise ``lltm_cupy._packing.CaptureError`` if CuPy's current stream is being captured
    into a CUDA graph: the driver's occupancy queries, and the context a thread binds for them
    (``kernels.ensure_context``), are not made while capturing. Their answers are kept per shape,
    so the same call run eagerly once before the capture leaves the capture nothing to ask."""
    cupy = kernels.cupy_module()
    if not cupy.cuda.get_current_stream().is_capturing():
        return
    from .._packing import CaptureError

    raise CaptureError(
        f"lltm_cupy: the fused kernels' launch plan for this call asks the driver {what} the "
        f"device holds, which is not asked while a CUDA graph is being captured. Run the same "
        f"call (the same state size, batch and dtype, on this device) eagerly once before the "
        f"capture: the warm-up iterations that torch.cuda.graph and make_graphed_callables ask "
        f"for do this (lltm_cupy.warmup cannot: it does not know the shapes); the answers are "
        f"kept, and the capture then asks nothing.")


def max_active_clusters(kernel, size: int, threads: int, shared: int):
    """How many clusters of ``size`` blocks of ``kernel`` (a cluster kernel's RawKernel: its
    cluster shape is its ``__cluster_dims__``, so no launch attribute is given) the current
    device holds at once, each block of ``threads`` threads and ``shared`` bytes: the driver's
    cuOccupancyMaxActiveClusters, after ``kernels.ensure_context``, cached per (device,
    function, threads, bytes). None where the query fails (the reason in
    ``kernels.cluster_failures``; not cached: it may be the thread's failure, not the device's).
    CaptureError for an answer not kept yet under capture (:func:`refuse_under_capture`)."""
    device = current_device()
    try:
        handle = kernel.kernel.ptr
    except Exception as exc:    # noqa: BLE001 (not a loaded function: planned without it)
        kernels.note_cluster_failure(device, kernel, ("occupancy", threads, shared), exc)
        return None
    key = (device, handle, threads, shared)
    found = _occupancy.get(key, _occupancy)
    if found is not _occupancy:
        return found
    refuse_under_capture(f"how many clusters of {size} blocks ({threads} threads, {shared} bytes "
                         f"of shared memory each)")
    try:
        config = CUlaunchConfig(gridDimX=size, gridDimY=1, gridDimZ=1, blockDimX=threads,
                                blockDimY=1, blockDimZ=1, sharedMemBytes=shared)
        count = ctypes.c_int(-1)
        kernels.ensure_context()
        status = _occupancy_function()(ctypes.byref(count), handle, ctypes.byref(config))
        if status != 0 or count.value < 0:
            raise RuntimeError(f"cuOccupancyMaxActiveClusters returned CUresult {status}, "
                               f"{count.value} clusters")
        found = count.value
    except Exception as exc:    # noqa: BLE001 (any failure leaves the launch as planned)
        kernels.note_cluster_failure(device, kernel, ("occupancy", threads, shared), exc)
        return None
    _occupancy[key] = found
    return found


# ------------------------------------------------- a launch of a non-portable size, refused

class LaunchRefused(Exception):
    """A fused launch that cannot run: the driver refused a launch of a non-portable cluster
    size (recorded by :func:`refuse_cluster_size`), or no fused variant runs the state size on
    the device now (``fused.variant``): the call that made it runs on the stepped path."""


#: CUresults with which the driver refuses a cluster launch it cannot run (cuda.h):
#: CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, CUDA_ERROR_NOT_SUPPORTED,
#: CUDA_ERROR_INVALID_CLUSTER_SIZE. Any other error of a launch is raised as it is.
REFUSALS = (1, 701, 801, 912)


def guarded(kernel, size: int):
    """A launch handle for the cluster kernel ``kernel`` of a non-portable ``size`` (no NVIDIA
    document says that a device whose occupancy query holds such a cluster accepts its launch):
    a launch the driver refuses (a ``CUDADriverError`` of :data:`REFUSALS`) is recorded and
    raises :class:`LaunchRefused` (the call runs on the stepped path; the size is not planned
    again on the device). A ``try`` around the launch: no cost where nothing is raised."""
    def launch(grid, block, args, shared_mem=0):
        try:
            kernel(grid, block, args, shared_mem=shared_mem)
        except kernels.cupy_module().cuda.driver.CUDADriverError as exc:
            if getattr(exc, "status", None) not in REFUSALS:
                raise
            refuse_cluster_size(kernel, size, exc)
            raise LaunchRefused(f"lltm_cupy: the driver refused a launch in clusters of {size} "
                                f"blocks ({exc})") from exc

    return launch
