"""The CUDA backend's lowest layer: CuPy itself (imported on first use, with the GPU check), the
CUDA sources, how they are compiled, and the per-(device, dtype) cache.

Nothing happens at import. ``get_kernels`` compiles on first use with ``cupy.RawModule`` (NVRTC)
and caches the launch handles per (device, dtype); ``launch`` caches, per (device, dtype, size),
the grid, the kernels of the index width it needs and the size arguments as the kernels' scalar
types, so that a launch makes no object but its argument tuple: the kernels are called with
integer device pointers (CuPy passes a Python int as a 64-bit value, what a pointer parameter
takes: ``cupy/cuda/function.pyx``, ``_pointer``; ``cupy/_core/_scalar.pyx``,
``numpy_dtype_from_pyscalar``, v14.2) and NumPy scalars of the exact C types.
``compile_offline`` runs NVRTC directly, with no GPU or driver, so the test suite can prove the
source compiles for every architecture we support.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["cupy_module", "current_device", "on_device", "Launch", "launch", "FLAG",
           "SOURCE_NAME", "KERNEL_NAMES", "Kernels", "BFLOAT16", "CUDA_TYPE", "INDEX_TYPE",
           "source_path", "source", "name_expression", "get_kernels", "launch_config",
           "needs_wide_index", "compile_offline",
           "ARCHITECTURES", "FUSED_SOURCE_NAME", "FUSED_KERNEL_NAMES", "FusedKernels",
           "fused_source", "fused_name_expression", "get_fused_kernels", "compile_offline_fused",
           "CLUSTER_SOURCE_NAME", "CLUSTER_KERNEL_NAMES", "CLUSTER_SIZES", "cluster_source",
           "cluster_name_expression", "get_cluster_kernels", "compile_offline_cluster",
           "compute_capability", "PORTABLE_CLUSTER_SIZE", "NON_PORTABLE_CLUSTER_SIZE_ALLOWED",
           "CUlaunchConfig", "OCCUPANCY_PROTOTYPE", "cluster_failures", "max_active_clusters",
           "allow_cluster_size", "refused_sizes", "refuse_cluster_size", "ensure_context",
           "GROUP_KERNEL_NAMES", "get_group_kernels", "compile_offline_group",
           "resident_blocks", "GROUP_SIZES"]

SOURCE_NAME = "lltm.cu"
KERNEL_NAMES = ("lltm_fwd_kernel", "lltm_bwd_kernel", "lltm_concat_kernel", "lltm_add_kernel")


class Kernels(NamedTuple):
    """The compiled kernels of one (device, dtype, index width), in KERNEL_NAMES order."""

    fwd: Any
    bwd: Any
    concat: Any
    add: Any


#: bfloat16 has no NumPy or CuPy dtype: the GPU backend holds bfloat16 values as their raw bits
#: in uint16 arrays (what the torch layer hands it), and this dtype means "bfloat16" to it.
BFLOAT16 = np.dtype(np.uint16)
#: C++ type of each supported dtype in cuda_src/lltm.cu.
CUDA_TYPE = {np.dtype(np.float16): "lltm_half", np.dtype(np.float32): "float",
             np.dtype(np.float64): "double", BFLOAT16: "lltm_bf16"}
#: Extra NVRTC options given to cupy.RawModule (CuPy itself adds -ftz=true and --std=c++17).
RAWMODULE_OPTIONS: tuple = ()
#: What CuPy passes to NVRTC besides RAWMODULE_OPTIONS; compile_offline uses the same.
CUPY_NVRTC_DEFAULTS = ("-ftz=true", "--std=c++17")
#: Oldest architecture CUDA 13 supports, and the newer ones we check the source against.
ARCHITECTURES = (75, 80, 90, 100)
#: Threads per block of the element-wise kernels, and blocks per SM at most in the grid-stride.
THREADS = 256
BLOCKS_PER_SM = 8

_PACKAGE = Path(__file__).resolve().parents[1]     # lltm_cupy/
_lock = threading.Lock()
_cache: dict = {}
_gpu_checked = None   # the cupy module whose GPU was found usable


def cupy_module():
    """Import CuPy and make sure a GPU is usable (checked once per process)."""
    global _gpu_checked
    import cupy

    if _gpu_checked is not cupy:
        if not cupy.cuda.is_available():
            raise RuntimeError("lltm_cupy: the GPU backend needs a GPU, and CuPy finds no "
                               "usable GPU (no device, or no CUDA driver)")
        _gpu_checked = cupy
    return cupy


def source_path(name: str = SOURCE_NAME) -> Path:
    """Path of lltm.cu (or another file of cuda_src): inside the installed package, or
    ``cuda_src/`` of a source checkout."""
    for folder in (_PACKAGE / "cuda_src", _PACKAGE.parent / "cuda_src"):
        path = folder / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"lltm_cupy: CUDA source {name} not found in "
                            f"{_PACKAGE / 'cuda_src'} or {_PACKAGE.parent / 'cuda_src'}")


@functools.lru_cache(maxsize=None)
def source() -> str:
    return source_path().read_text(encoding="utf-8")


#: Index type of the kernels: 32-bit unless an index could pass 2**32 (see ``launch_config``).
INDEX_TYPE = {False: "unsigned int", True: "unsigned long long"}


def name_expression(kernel: str, dtype, wide: bool = False) -> str:
    return f"{kernel}<{CUDA_TYPE[np.dtype(dtype)]}, {INDEX_TYPE[wide]}>"


def _all_names(dtype):
    return [name_expression(k, dtype, w) for w in (False, True) for k in KERNEL_NAMES]


def get_kernels(dtype, wide: bool = False):
    """Return the :class:`Kernels` for ``dtype`` on the current device, compiling once: launch
    handles (``RawKernel.kernel``, CuPy's ``Function``: ``fn(grid, block, args, shared_mem=0)``
    on CuPy's current stream, without RawKernel's per-call lookup of the device's module).

    wide: the 64-bit index instantiation (``launch_config`` says when it is needed).
    """
    import cupy

    dtype = np.dtype(dtype)
    key = (cupy.cuda.Device().id, dtype.str)
    kernels = _cache.get(key)
    if kernels is None:
        with _lock:
            kernels = _cache.get(key)
            if kernels is None:
                names = _all_names(dtype)
                module = cupy.RawModule(code=source(), options=RAWMODULE_OPTIONS,
                                        name_expressions=names)
                fns = [module.get_function(n).kernel for n in names]
                count = len(KERNEL_NAMES)
                kernels = {False: Kernels(*fns[:count]), True: Kernels(*fns[count:])}
                _cache[key] = kernels
    return kernels[wide]


def current_device() -> int:
    """The current CUDA device's index (one C call, no object)."""
    import cupy

    return cupy.cuda.runtime.getDevice()


_SAME = contextlib.nullcontext()


def on_device(device_id: int):
    """A context in which ``device_id`` is the current device: nothing to enter (no object made)
    when it is current already, as inside the torch layer's calls."""
    if current_device() == device_id:
        return _SAME
    import cupy

    return cupy.cuda.Device(device_id)


class Launch(NamedTuple):
    """The element-wise kernels' launch over ``n`` = rows * state elements: geometry, the
    kernels of the index width it needs, and the size arguments as the kernels take them."""

    grid: tuple
    block: tuple
    kernels: Kernels
    n: np.int64
    state: np.int32


#: the kernels' int flags (``FLAG[condition]``), made once
FLAG = (np.int32(0), np.int32(1))

_launches: dict = {}
#: distinct (device, dtype, n, state) kept at most; then the cache starts again
_LAUNCHES_KEPT = 4096


def launch(dtype, n: int, state: int) -> Launch:
    """The :class:`Launch` of the element-wise kernels for ``n`` > 0 elements of rows of
    ``state`` on the current device, cached per (device, dtype, n, state)."""
    key = (current_device(), dtype, n, state)
    found = _launches.get(key)
    if found is None:
        grid, block, wide = launch_config(n)
        if len(_launches) >= _LAUNCHES_KEPT:
            _launches.clear()
        found = _launches[key] = Launch(grid, block, get_kernels(dtype, wide), np.int64(n),
                                        np.int32(state))
    return found


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


def launch_config(n: int) -> tuple:
    """(grid, block, wide) for a grid-stride loop over n = B * S > 0 elements on this device.

    wide is True when a 32-bit index could overflow: the gates index reaches 3 * n, and the
    grid-stride adds up to grid * block past the last element.
    """
    blocks = min(-(-n // THREADS), _sm_count(current_device()) * BLOCKS_PER_SM)
    return (blocks,), (THREADS,), needs_wide_index(n, blocks * THREADS)


def needs_wide_index(n: int, threads: int) -> bool:
    return 3 * n + threads >= 2**32


def compile_offline(dtype, arch: int, output: str = "cubin") -> bytes:
    """Compile the kernels for ``dtype`` with NVRTC for ``sm_<arch>``; needs no GPU or driver.

    ``output`` is "cubin" (machine code, ``--gpu-architecture=sm_XX``) or "ptx"
    (``compute_XX``). Raises RuntimeError with NVRTC's log when compilation fails.
    """
    return _nvrtc(source(), SOURCE_NAME, _all_names(dtype), arch, output)


def _nvrtc(code: str, filename: str, names, arch: int, output: str) -> bytes:
    from cupy_backends.cuda.libs import nvrtc

    kind = {"cubin": "sm", "ptx": "compute"}[output]
    prog = nvrtc.createProgram(code, filename, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        options = [f"--gpu-architecture={kind}_{arch}", *CUPY_NVRTC_DEFAULTS, *RAWMODULE_OPTIONS]
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed for {names} on {kind}_{arch}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        for name in names:
            nvrtc.getLoweredName(prog, name)  # raises if an instantiation is missing
        return nvrtc.getCUBIN(prog) if output == "cubin" else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


# ------------------------------------------------------------------------- fused sequence kernels

FUSED_SOURCE_NAME = "lltm_fused.cu"
FUSED_KERNEL_NAMES = ("lltm_seq_fwd_kernel", "lltm_seq_bwd_kernel")


class FusedKernels(NamedTuple):
    """The compiled whole-sequence kernels of one (device, dtype), in FUSED_KERNEL_NAMES order."""

    fwd: Any
    bwd: Any


@functools.lru_cache(maxsize=None)
def fused_source() -> str:
    """lltm.cu followed by lltm_fused.cu: one translation unit, so that the fused kernels use
    lltm.cu's scalar types and cell functions (the textual include NVRTC gets without an include
    path; the host build of the tests #includes both files the same way)."""
    return (source() + f'\n#line 1 "{FUSED_SOURCE_NAME}"\n'
            + source_path(FUSED_SOURCE_NAME).read_text(encoding="utf-8"))


def fused_name_expression(kernel: str, dtype) -> str:
    return f"{kernel}<{CUDA_TYPE[np.dtype(dtype)]}>"


def get_fused_kernels(dtype):
    """The :class:`FusedKernels` for ``dtype`` on the current device, compiled once; each kernel
    is allowed the device's whole opt-in shared memory per block (``max_dynamic_shared_size_bytes``,
    needed above 48 KB)."""
    import cupy

    dtype = np.dtype(dtype)
    names = [fused_name_expression(k, dtype) for k in FUSED_KERNEL_NAMES]
    return _cached(("fused", cupy.cuda.Device().id, dtype.str),
                   lambda: FusedKernels(*_whole_shared_memory(fused_source(), names)))


def _cached(key, build):
    """``_cache[key]``, made by ``build()`` under the lock at the first call."""
    found = _cache.get(key)
    if found is None:
        with _lock:
            found = _cache.get(key)
            if found is None:
                found = _cache[key] = build()
    return found


def _whole_shared_memory(code: str, names, cooperative: bool = False) -> list:
    """The functions ``names`` of a module compiled from ``code`` on the current device, each
    allowed the device's whole opt-in shared memory per block; ``cooperative``: launched with
    cuLaunchCooperativeKernel (CuPy's ``enable_cooperative_groups``, which RawModule hands to the
    RawKernels it gives and they to every launch: cupy/_core/raw.pyx and cupy/cuda/function.pyx,
    v14.2)."""
    import cupy

    extra = {"enable_cooperative_groups": True} if cooperative else {}
    module = cupy.RawModule(code=code, options=RAWMODULE_OPTIONS, name_expressions=names,
                            **extra)
    fns = [module.get_function(n) for n in names]
    limit = shared_memory_limit(cupy.cuda.Device().id)
    for fn in fns:
        fn.max_dynamic_shared_size_bytes = limit - fn.shared_size_bytes
    return fns


@functools.lru_cache(maxsize=None)
def shared_memory_limit(device_id: int) -> int:
    """Bytes of shared memory one block may use on this device (the opt-in maximum)."""
    import cupy

    return cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]


def compile_offline_fused(dtype, arch: int, output: str = "cubin") -> bytes:
    """As :func:`compile_offline`, for the fused sequence kernels (``lltm_fused.cu``)."""
    return _nvrtc(fused_source(), FUSED_SOURCE_NAME,
                  [fused_name_expression(k, dtype) for k in FUSED_KERNEL_NAMES], arch, output)


# ------------------------------------------------- fused sequence kernels across a block cluster

CLUSTER_SOURCE_NAME = "lltm_fused_cluster.cu"
CLUSTER_KERNEL_NAMES = ("lltm_seq_fwd_cluster_kernel", "lltm_seq_bwd_cluster_kernel")
#: Blocks per cluster of the cluster kernels (one instantiation each: ``__cluster_dims__``); 16
#: is past the portable size (below) and runs only where the device holds such a cluster.
CLUSTER_SIZES = (1, 2, 4, 8, 16)
#: The portable cluster size: every device of compute capability 9.0 or newer runs clusters of up
#: to this many blocks (CUDA C++ Programming Guide, "Thread Block Clusters"; cuda.h).
PORTABLE_CLUSTER_SIZE = 8
#: cuda.h's CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: set to 1 on a function, it may
#: be launched in clusters larger than the portable size where the device holds them.
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


@functools.lru_cache(maxsize=None)
def cluster_source() -> str:
    """lltm.cu, lltm_fused.cu, then lltm_fused_cluster.cu: one translation unit, so that the
    cluster kernels use the one-block kernels' walk over a tile, step offsets, row stride and
    dot products (the fixed order of their sums) as well as lltm.cu's types and cell."""
    return (fused_source() + f'\n#line 1 "{CLUSTER_SOURCE_NAME}"\n'
            + source_path(CLUSTER_SOURCE_NAME).read_text(encoding="utf-8"))


def cluster_name_expression(kernel: str, dtype, size: int) -> str:
    return f"{kernel}<{CUDA_TYPE[np.dtype(dtype)]}, {size}>"


def _cluster_names(dtype):
    return [cluster_name_expression(k, dtype, p) for p in CLUSTER_SIZES
            for k in CLUSTER_KERNEL_NAMES]


def get_cluster_kernels(dtype, size: int):
    """The :class:`FusedKernels` (forward, backward) for ``dtype`` in clusters of ``size``
    blocks on the current device (sm_90 or newer); every size's kernels compiled at the first
    call for the dtype, each allowed the device's whole opt-in shared memory per block, and
    those past the portable cluster size the non-portable sizes (:func:`allow_cluster_size`)."""
    import cupy

    def build():
        fns = _whole_shared_memory(cluster_source(), _cluster_names(dtype))
        count = len(CLUSTER_KERNEL_NAMES)
        found = {p: FusedKernels(*fns[i * count:(i + 1) * count])
                 for i, p in enumerate(CLUSTER_SIZES)}
        for p, pair in found.items():
            allow_cluster_size(pair, p)
        return found

    dtype = np.dtype(dtype)
    return _cached(("cluster", cupy.cuda.Device().id, dtype.str), build)[size]


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> int:
    """The device's compute capability as an int (90 for sm_90)."""
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


def compile_offline_cluster(dtype, arch: int, output: str = "cubin") -> bytes:
    """As :func:`compile_offline`, for the cluster kernels (``lltm_fused_cluster.cu``, every
    cluster size; sm_90 and newer)."""
    return _nvrtc(cluster_source(), CLUSTER_SOURCE_NAME, _cluster_names(dtype), arch, output)


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
#: Why a query, setting or launch for the cluster kernels failed, kept for inspection:
#: ``{(device, kernel name, what): reason}``, ``what`` being ("occupancy", threads, shared bytes),
#: "non-portable" or "launch" (the driver refused a launch of a non-portable cluster size). A
#: failed occupancy query leaves the launch as planned without it (and is asked again next time).
cluster_failures: dict = {}
#: ``{(device, cluster size)}``: the non-portable cluster sizes whose launch the driver refused on
#: that device; the launcher plans without them from then on (the reason in cluster_failures).
refused_sizes: set = set()


def allow_cluster_size(fns, size: int) -> None:
    """Set the non-portable cluster size attribute (to 1) on the functions ``fns`` (RawKernels)
    of clusters of ``size`` blocks, where ``size`` is past the portable size: without it a
    launch (and the occupancy query) refuses the size. A failure is kept in
    :data:`cluster_failures`; the occupancy query then refuses the size, and the launcher does
    not use it."""
    if size <= PORTABLE_CLUSTER_SIZE:
        return
    import cupy

    for fn in fns:
        try:
            cupy.cuda.driver.funcSetAttribute(fn.kernel.ptr, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        except Exception as exc:    # noqa: BLE001 (the size is then refused, not the module)
            _failed(current_device(), fn, "non-portable", exc)


def _failed(device: int, kernel, what, exc: Exception) -> None:
    name = getattr(kernel, "__name__", None) or repr(kernel)
    cluster_failures[(device, name, what)] = f"{type(exc).__name__}: {exc}"


def refuse_cluster_size(kernel, size: int, exc: Exception) -> None:
    """Record that the driver refused a launch of ``kernel`` in clusters of ``size`` blocks on
    the current device (``exc``, kept in :data:`cluster_failures`): that size is not planned on
    this device again (:data:`refused_sizes`)."""
    device = current_device()
    _failed(device, kernel, "launch", exc)
    refused_sizes.add((device, size))


def ensure_context() -> None:
    """Make sure the calling host thread has a current CUDA context before a call to the driver
    that CuPy does not wrap (or wraps without binding one): CuPy binds the device's primary
    context lazily, inside its own runtime calls, so a thread that has made none yet (autograd's
    backward thread, for one) has no context, and such a call fails with
    CUDA_ERROR_INVALID_CONTEXT. ``cudaMemGetInfo`` (``cupy.cuda.runtime.memGetInfo``) is a
    runtime call that needs the context and so binds it; it enqueues nothing on a stream."""
    import cupy

    cupy.cuda.runtime.memGetInfo()


def max_active_clusters(kernel, size: int, threads: int, shared: int):
    """How many clusters of ``size`` blocks of ``kernel`` (a ``cupy.RawKernel`` of the cluster
    kernels, whose cluster shape is its compile-time ``__cluster_dims__``: no launch attribute
    given, as cuOccupancyMaxActiveClusters asks of such a function) the current device can hold
    at once, each block of ``threads`` threads with ``shared`` bytes of dynamic shared memory;
    the driver's answer (``cuOccupancyMaxActiveClusters`` on the function CuPy loaded for the
    current device: ``RawKernel.kernel.ptr``, after :func:`ensure_context`), cached per (device,
    function, threads, bytes). None where the query fails (no driver library, an error status);
    the reason is kept in :data:`cluster_failures`, and a failure is not cached (the next call
    asks again: a failure may be the calling thread's, not the device's)."""
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
    try:
        config = CUlaunchConfig(gridDimX=size, gridDimY=1, gridDimZ=1, blockDimX=threads,
                                blockDimY=1, blockDimZ=1, sharedMemBytes=shared)
        count = ctypes.c_int(-1)
        ensure_context()
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


# ------------------------------- the same split without clusters: a cooperative group per tile

GROUP_KERNEL_NAMES = ("lltm_seq_fwd_group_kernel", "lltm_seq_bwd_group_kernel")
#: Blocks per tile of the group kernels (one instantiation each).
GROUP_SIZES = (1, 2, 4, 8)


def _group_names(dtype):
    return [cluster_name_expression(k, dtype, p) for p in GROUP_SIZES
            for k in GROUP_KERNEL_NAMES]


def get_group_kernels(dtype, size: int):
    """The :class:`FusedKernels` (forward, backward) of the group variant of the cluster kernels
    (``lltm_fused_cluster.cu``'s group kernels: no cluster, the blocks of a tile exchanging
    through global memory; sm_80 and newer) for ``dtype`` in groups of ``size`` blocks on the
    current device: every size's kernels compiled at the first call for the dtype, in a module
    whose launches are cooperative (every block of the grid resident at once:
    :func:`resident_blocks` says how many may be; CuPy shrinks a larger one-dimensional grid to
    that with a warning rather than failing, so the launcher never launches one), each allowed
    the device's whole opt-in shared memory per block."""
    import cupy

    def build():
        fns = _whole_shared_memory(cluster_source(), _group_names(dtype), cooperative=True)
        count = len(GROUP_KERNEL_NAMES)
        return {p: FusedKernels(*fns[i * count:(i + 1) * count])
                for i, p in enumerate(GROUP_SIZES)}

    dtype = np.dtype(dtype)
    return _cached(("group", cupy.cuda.Device().id, dtype.str), build)[size]


_resident: dict = {}


def resident_blocks(kernel, threads: int, shared: int) -> int:
    """How many blocks of ``kernel`` (a RawKernel of :func:`get_group_kernels`) with ``threads``
    threads and ``shared`` bytes of dynamic shared memory the current device holds at once: the
    driver's cuOccupancyMaxActiveBlocksPerMultiprocessor times the SMs (what CuPy checks a
    cooperative launch against, cupy/cuda/function.pyx v14.2, which, for a one-dimensional grid
    past it, shrinks the grid with a warning instead of failing: the launcher never launches one
    past it). Cached per (device, kernel, threads, shared); the query made after
    :func:`ensure_context` (CuPy's driver call binds no context to the calling thread)."""
    import cupy

    device = current_device()
    key = (device, id(kernel), threads, shared)
    found = _resident.get(key)
    if found is None:
        ensure_context()
        per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.kernel.ptr, threads, shared)
        found = _resident[key] = per_sm * _sm_count(device)
    return found


def compile_offline_group(dtype, arch: int, output: str = "cubin") -> bytes:
    """As :func:`compile_offline`, for the group kernels (``lltm_fused_cluster.cu``, every group
    size; sm_80 and newer)."""
    return _nvrtc(cluster_source(), CLUSTER_SOURCE_NAME, _group_names(dtype), arch, output)
