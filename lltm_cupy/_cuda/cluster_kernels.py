"""The cluster kernels of ``cuda_src/lltm_fused_cluster.cu`` (the fused sequence kernels split
over the blocks of a thread-block cluster, sm_90 and newer): their module, one instantiation per
cluster size, the non-portable cluster size attribute, the driver's occupancy query for
clusters (which CuPy 14 has no call for: ctypes) and the launch handle that answers a refused
non-portable launch. What to launch is :mod:`.fused_cluster`'s to plan."""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from . import fused_kernels, kernels
from .kernels import CUDA_TYPE, FusedKernels, current_device

__all__ = ["SOURCE_NAME", "KERNEL_NAMES", "SIZES", "PORTABLE_SIZE",
           "NON_PORTABLE_CLUSTER_SIZE_ALLOWED", "source", "name_expression", "get_kernels",
           "compile_offline", "CUlaunchConfig", "OCCUPANCY_PROTOTYPE", "allow_cluster_size",
           "max_active_clusters", "refuse_under_capture", "refuse_cluster_size", "LaunchRefused",
           "REFUSALS", "guarded"]

SOURCE_NAME = "lltm_fused_cluster.cu"
KERNEL_NAMES = ("lltm_seq_fwd_cluster_kernel", "lltm_seq_bwd_cluster_kernel")
#: Blocks per cluster of the cluster kernels (one instantiation each: ``__cluster_dims__``); 16
#: is past the portable size (below) and runs only where the device holds such a cluster.
SIZES = (1, 2, 4, 8, 16)
#: The portable cluster size: every device of compute capability 9.0 or newer runs clusters of up
#: to this many blocks (CUDA C++ Programming Guide, "Thread Block Clusters"; cuda.h).
PORTABLE_SIZE = 8
#: cuda.h's CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: set to 1 on a function, it may
#: be launched in clusters larger than the portable size where the device holds them.
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


@functools.lru_cache(maxsize=None)
def source() -> str:
    """lltm.cu, lltm_fused.cu, then lltm_fused_cluster.cu: one translation unit, so that the
    cluster (and group) kernels use the one-block kernels' walk over a tile, step offsets, row
    stride and dot products (the fixed order of their sums) as well as lltm.cu's types and
    cell."""
    return kernels.joined(fused_kernels.source(), SOURCE_NAME)


def name_expression(kernel: str, dtype, size: int) -> str:
    return f"{kernel}<{CUDA_TYPE[np.dtype(dtype)]}, {size}>"


def _names(dtype):
    return [name_expression(k, dtype, p) for p in SIZES for k in KERNEL_NAMES]


def get_kernels(dtype, size: int):
    """The :class:`~.kernels.FusedKernels` (forward, backward) for ``dtype`` in clusters of
    ``size`` blocks on the current device (sm_90 or newer); every size's kernels compiled at the
    first call for the dtype, each allowed the device's whole opt-in shared memory per block,
    and those past the portable cluster size the non-portable sizes
    (:func:`allow_cluster_size`)."""
    import cupy

    def build():
        fns = kernels.load(source(), _names(dtype))
        count = len(KERNEL_NAMES)
        found = {p: FusedKernels(*fns[i * count:(i + 1) * count]) for i, p in enumerate(SIZES)}
        for p, pair in found.items():
            allow_cluster_size(pair, p)
        return found

    dtype = np.dtype(dtype)
    return kernels.cached(("cluster", cupy.cuda.Device().id, dtype.str), build)[size]


def compile_offline(dtype, arch: int, output: str = "cubin") -> bytes:
    """The kernels for ``dtype`` at every cluster size compiled by NVRTC for ``sm_<arch>``
    (sm_90 and newer; :func:`.kernels.nvrtc`)."""
    return kernels.nvrtc(source(), SOURCE_NAME, _names(dtype), arch, output)


# ------------------------------------------------------ clusters the device holds at once (query)

class CUlaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig (CUDA 12 and 13; tests/test_fused_cluster.py holds the layout
    against the header's, compiled)."""

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


def allow_cluster_size(fns, size: int) -> None:
    """Set the non-portable cluster size attribute (to 1) on the functions ``fns`` (RawKernels)
    of clusters of ``size`` blocks, where ``size`` is past the portable size: without it a
    launch (and the occupancy query) refuses the size. A failure is kept in
    ``kernels.cluster_failures``; the occupancy query then refuses the size, and the launcher
    does not use it."""
    if size <= PORTABLE_SIZE:
        return
    import cupy

    for fn in fns:
        try:
            cupy.cuda.driver.funcSetAttribute(fn.kernel.ptr, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        except Exception as exc:    # noqa: BLE001 (the size is then refused, not the module)
            _failed(current_device(), fn, "non-portable", exc)


def _failed(device: int, kernel, what, exc: Exception) -> None:
    name = getattr(kernel, "__name__", None) or repr(kernel)
    kernels.cluster_failures[(device, name, what)] = f"{type(exc).__name__}: {exc}"


def refuse_cluster_size(kernel, size: int, exc: Exception) -> None:
    """Record that the driver refused a launch of ``kernel`` in clusters of ``size`` blocks on
    the current device (``exc``, kept in ``kernels.cluster_failures``): that size is not planned
    on this device again (``kernels.refused_sizes``)."""
    device = current_device()
    _failed(device, kernel, "launch", exc)
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
    """How many clusters of ``size`` blocks of ``kernel`` (a ``cupy.RawKernel`` of the cluster
    kernels, whose cluster shape is its compile-time ``__cluster_dims__``: no launch attribute
    given, as cuOccupancyMaxActiveClusters asks of such a function) the current device can hold
    at once, each block of ``threads`` threads with ``shared`` bytes of dynamic shared memory;
    the driver's answer (``cuOccupancyMaxActiveClusters`` on the function CuPy loaded for the
    current device: ``RawKernel.kernel.ptr``, after ``kernels.ensure_context``), cached per
    (device, function, threads, bytes). None where the query fails (no driver library, an error
    status); the reason is kept in ``kernels.cluster_failures``, and a failure is not cached (the
    next call asks again: a failure may be the calling thread's, not the device's). Raises
    ``lltm_cupy._packing.CaptureError`` where the answer is not kept and the current stream is
    being captured (:func:`refuse_under_capture`)."""
    device = current_device()
    try:
        handle = kernel.kernel.ptr
    except Exception as exc:    # noqa: BLE001 (not a loaded function: planned without it)
        _failed(device, kernel, ("occupancy", threads, shared), exc)
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
        _failed(device, kernel, ("occupancy", threads, shared), exc)
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
    document says that every device whose occupancy query holds such a cluster accepts its
    launch): a launch that the driver refuses (a ``CUDADriverError`` of :data:`REFUSALS`, raised
    by the launch call itself) is recorded and raises :class:`LaunchRefused`, which the sequence
    calls answer by running on the stepped path; the size is not planned again on the device. The
    guard is a ``try`` around the launch (no cost where nothing is raised), kept on every launch."""
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
