"""The CUDA backend's lowest layer: CuPy itself (imported on first use, with the GPU check), what
the launchers ask of the current device, the CUDA sources, their compilation and the kernel
cache. Every kernel family's module builds on it:

    elementwise    cuda_src/lltm.cu: the cell's kernels, their launch handles
    fused_kernels  cuda_src/lltm_fused.cu: the one-block fused sequence kernels
    fused_mma      cuda_src/lltm_fused_mma.cu: the same on tensor cores (16-bit types)
    cluster_kernels, group_kernels
                   cuda_src/lltm_fused_cluster.cu: the fused kernels split over the blocks of a
                   thread-block cluster (sm_90 and newer) or of a cooperative group

Nothing happens at import. A family compiles its module on first use with ``cupy.RawModule``
(NVRTC), cached per (family, device, dtype) by :func:`cached`; :func:`nvrtc` runs NVRTC
directly, with no GPU or driver, so the test suite can prove each source compiles for every
architecture we support (each family's ``compile_offline``).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["cupy_module", "current_device", "on_device", "shared_memory_limit",
           "compute_capability", "ensure_context", "cluster_failures", "refused_sizes",
           "BFLOAT16", "CUDA_TYPE", "ARCHITECTURES", "source_path", "read_source", "joined",
           "nvrtc", "cached", "load", "FusedKernels"]

#: bfloat16 has no NumPy or CuPy dtype: the GPU backend holds bfloat16 values as their raw bits
#: in uint16 arrays (what the torch layer hands it), and this dtype means "bfloat16" to it.
BFLOAT16 = np.dtype(np.uint16)
#: C++ type of each supported dtype in cuda_src/lltm.cu.
CUDA_TYPE = {np.dtype(np.float16): "lltm_half", np.dtype(np.float32): "float",
             np.dtype(np.float64): "double", BFLOAT16: "lltm_bf16"}
#: Extra NVRTC options given to cupy.RawModule (CuPy itself adds -ftz=true and --std=c++17).
RAWMODULE_OPTIONS: tuple = ()
#: What CuPy passes to NVRTC besides RAWMODULE_OPTIONS; nvrtc() uses the same.
CUPY_NVRTC_DEFAULTS = ("-ftz=true", "--std=c++17")
#: Oldest architecture CUDA 13 supports, and the newer ones we check the source against.
ARCHITECTURES = (75, 80, 90, 100)

_PACKAGE = Path(__file__).resolve().parents[1]     # lltm_cupy/
_lock = threading.Lock()
_cache: dict = {}
_gpu_checked = None   # the cupy module whose GPU was found usable


# ------------------------------------------------------------------------ CuPy and the device

def cupy_module():
    """Import CuPy and make sure a GPU is usable (checked once per process)."""
    global _gpu_checked
    import cupy

    if _gpu_checked is not cupy:
        if _forked:
            raise fork_error()
        if not cupy.cuda.is_available():
            raise RuntimeError("lltm_cupy: the GPU backend needs a GPU, and CuPy finds no "
                               "usable GPU (no device, or no CUDA driver)")
        _gpu_checked = cupy
    return cupy


def current_device() -> int:
    """The current CUDA device's index (one C call, no object)."""
    if _forked:
        raise fork_error()
    import cupy

    return cupy.cuda.runtime.getDevice()


# ------------------------------------------------------------------------------- after a fork
# The fork rule of the GPU backend: a CUDA context cannot be used in a process forked from the
# one that made it (nor can the kernels loaded into it, CuPy's handles or torch's). A child
# forked after this library used the GPU refuses every GPU call with :func:`fork_error`, as
# torch refuses its own CUDA calls there; the parent goes on as before. Nothing is checked per
# call but a module flag, set in the child by the fork hook.

#: True in a process forked after the GPU backend was used in its parent
_forked = False


def fork_error() -> RuntimeError:
    return RuntimeError(
        "lltm_cupy: the GPU backend cannot run in a process forked after it used CUDA in the "
        "parent (the parent's CUDA context, kernels and handles are not usable in a child). "
        "Start worker processes with the 'spawn' or 'forkserver' method (multiprocessing."
        "set_start_method('spawn'); DataLoader(..., multiprocessing_context='spawn')), or use "
        "the GPU only in the children.")


def _after_fork_in_child() -> None:
    global _forked, _gpu_checked
    if _gpu_checked is not None or _cache:     # the GPU checked, or kernels loaded
        _forked, _gpu_checked = True, None     # (cupy_module checks again, and refuses)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_SAME = contextlib.nullcontext()


def on_device(device_id: int):
    """A context in which ``device_id`` is the current device: nothing to enter (no object made)
    when it is current already, as inside the torch layer's calls."""
    if current_device() == device_id:
        return _SAME
    import cupy

    return cupy.cuda.Device(device_id)


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    """The device's streaming multiprocessors."""
    import cupy

    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


@functools.lru_cache(maxsize=None)
def shared_memory_limit(device_id: int) -> int:
    """Bytes of shared memory one block may use on this device (the opt-in maximum)."""
    import cupy

    return cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> int:
    """The device's compute capability as an int (90 for sm_90)."""
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


def ensure_context() -> None:
    """Make sure the calling host thread has a current CUDA context before a call to the driver
    that CuPy does not wrap (or wraps without binding one): CuPy binds the device's primary
    context lazily, inside its own runtime calls, so a thread that has made none yet (autograd's
    backward thread, for one) has no context, and such a call fails with
    CUDA_ERROR_INVALID_CONTEXT. ``cudaMemGetInfo`` (``cupy.cuda.runtime.memGetInfo``) is a
    runtime call that needs the context and so binds it; it enqueues nothing on a stream."""
    import cupy

    cupy.cuda.runtime.memGetInfo()


#: Why a query, setting or launch for the cluster kernels failed on a device, kept for
#: inspection (written by :mod:`.cluster_kernels`): ``{(device, kernel name, what): reason}``,
#: ``what`` being ("occupancy", threads, shared bytes), "non-portable" or "launch" (the driver
#: refused a launch of a non-portable cluster size). A failed occupancy query leaves the launch
#: as planned without it (and is asked again next time).
cluster_failures: dict = {}
#: ``{(device, cluster size)}``: the non-portable cluster sizes whose launch the driver refused on
#: that device; the launcher plans without them from then on (the reason in cluster_failures).
refused_sizes: set = set()


# ------------------------------------------------------------------ the sources, their compiles

def source_path(name: str = "lltm.cu") -> Path:
    """Path of a file of cuda_src (lltm.cu by default): inside the installed package, or
    ``cuda_src/`` of a source checkout."""
    for folder in (_PACKAGE / "cuda_src", _PACKAGE.parent / "cuda_src"):
        path = folder / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"lltm_cupy: CUDA source {name} not found in "
                            f"{_PACKAGE / 'cuda_src'} or {_PACKAGE.parent / 'cuda_src'}")


@functools.lru_cache(maxsize=None)
def read_source(name: str) -> str:
    """The text of ``cuda_src/<name>``, read once."""
    return source_path(name).read_text(encoding="utf-8")


def joined(first: str, name: str) -> str:
    """One translation unit: the text ``first`` (a source, or sources already joined) followed
    by ``cuda_src/<name>``, so that the later file uses the earlier ones' types and functions
    (the textual include NVRTC gets without an include path; the host build of the tests
    #includes the files the same way); ``#line`` keeps NVRTC's messages at the file's lines."""
    return first + f'\n#line 1 "{name}"\n' + read_source(name)


def nvrtc(code: str, filename: str, names, arch: int, output: str = "cubin") -> bytes:
    """Compile ``code`` (named ``filename`` in messages) with NVRTC for ``sm_<arch>``, with the
    name expressions ``names`` instantiated and the options CuPy uses; needs no GPU or driver.

    ``output`` is "cubin" (machine code, ``--gpu-architecture=sm_XX``) or "ptx"
    (``compute_XX``). Raises RuntimeError with NVRTC's log when compilation fails.
    """
    from cupy_backends.cuda.libs import nvrtc as _nvrtc

    kind = {"cubin": "sm", "ptx": "compute"}[output]
    prog = _nvrtc.createProgram(code, filename, [], [])
    try:
        for name in names:
            _nvrtc.addNameExpression(prog, name)
        options = [f"--gpu-architecture={kind}_{arch}", *CUPY_NVRTC_DEFAULTS, *RAWMODULE_OPTIONS]
        try:
            _nvrtc.compileProgram(prog, options)
        except _nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed for {names} on {kind}_{arch}:\n"
                               f"{_nvrtc.getProgramLog(prog)}") from exc
        for name in names:
            _nvrtc.getLoweredName(prog, name)  # raises if an instantiation is missing
        return _nvrtc.getCUBIN(prog) if output == "cubin" else _nvrtc.getPTX(prog)
    finally:
        _nvrtc.destroyProgram(prog)


def cached(key, build):
    """``_cache[key]``, made by ``build()`` under the lock at the first call (each family keys
    its modules by (family, device, dtype))."""
    found = _cache.get(key)
    if found is None:
        with _lock:
            found = _cache.get(key)
            if found is None:
                found = _cache[key] = build()
    return found


def load(code: str, names, whole_shared_memory: bool = True, cooperative: bool = False) -> list:
    """The functions ``names`` (RawKernels) of a module compiled by NVRTC from ``code`` on the
    current device. ``whole_shared_memory``: each allowed the device's whole opt-in shared
    memory per block (``max_dynamic_shared_size_bytes``, needed above 48 KB); ``cooperative``:
    launched with cuLaunchCooperativeKernel (CuPy's ``enable_cooperative_groups``, which
    RawModule hands to the RawKernels it gives and they to every launch: cupy/_core/raw.pyx and
    cupy/cuda/function.pyx, v14.2)."""
    import cupy

    extra = {"enable_cooperative_groups": True} if cooperative else {}
    module = cupy.RawModule(code=code, options=RAWMODULE_OPTIONS, name_expressions=names,
                            **extra)
    fns = [module.get_function(n) for n in names]
    if whole_shared_memory:
        limit = shared_memory_limit(cupy.cuda.Device().id)
        for fn in fns:
            fn.max_dynamic_shared_size_bytes = limit - fn.shared_size_bytes
    return fns


class FusedKernels(NamedTuple):
    """The compiled whole-sequence kernels (forward, backward) of one variant, (device, dtype)
    and, for the split variants, blocks per tile."""

    fwd: Any
    bwd: Any
