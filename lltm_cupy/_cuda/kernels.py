"""The CUDA backend's lowest layer: CuPy itself (imported on first use, with the GPU check), what
the launchers ask of the current device, the CUDA sources, their compilation, the kernel cache,
and the kernel families as data. A :class:`Family` record says what a family is (its cuda_src
files joined in order into one translation unit, its kernels, the template arguments of each
instance, how it is loaded and launched); one generic ``source`` / ``names`` / ``get_kernels`` /
``compile_offline`` serves every record. Each family's module keeps only what is its own:

    elementwise    cuda_src/lltm.cu: the cell's kernels, their launch handles
    fused_kernels  cuda_src/lltm_fused.cu: the one-block fused sequence kernels, layout facts
    fused_mma      cuda_src/lltm_fused_mma.cu: the same on tensor cores (16-bit types), geometry
    cluster_kernels, group_kernels
                   cuda_src/lltm_fused_cluster.cu: the fused kernels split over the blocks of a
                   thread-block cluster (sm_90 and newer; the occupancy query, the refusal
                   guard) or of a cooperative group (the group launcher)

Nothing happens at import. A family compiles its module on first use with ``cupy.RawModule``
(NVRTC), cached per (family, device, dtype) by :meth:`Family.get_kernels`; :func:`nvrtc` runs NVRTC
directly, with no GPU or driver, so the test suite can prove each source compiles for every
architecture we support (:meth:`Family.compile_offline`).
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
           "note_cluster_failure", "PORTABLE_SIZE", "NON_PORTABLE_CLUSTER_SIZE_ALLOWED",
           "allow_cluster_size", "BFLOAT16", "CUDA_TYPE", "ARCHITECTURES", "source_path",
           "read_source", "joined", "nvrtc", "load", "Kernels", "FusedKernels",
           "PLAIN", "WHOLE_SHARED", "COOPERATIVE", "CLUSTER", "Family", "ELEMENTWISE", "FUSED",
           "FUSED_MMA", "CLUSTERS", "GROUPS", "FAMILIES"]

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
    """Bind the device's primary context to the calling thread before a driver call CuPy does
    not bind one for: CuPy binds it lazily in its runtime calls, so a thread that made none
    (autograd's, for one) would get CUDA_ERROR_INVALID_CONTEXT. ``cudaMemGetInfo`` needs the
    context, so binds it, and enqueues nothing."""
    import cupy

    cupy.cuda.runtime.memGetInfo()


#: Why a query, setting or launch for the cluster kernels failed on a device, kept for
#: inspection (:func:`note_cluster_failure`): ``{(device, kernel name, what): reason}``,
#: ``what`` being ("occupancy", threads, shared bytes), "non-portable" or "launch" (the driver
#: refused a launch of a non-portable cluster size). A failed occupancy query leaves the launch
#: as planned without it (and is asked again next time).
cluster_failures: dict = {}
#: ``{(device, cluster size)}``: the non-portable cluster sizes whose launch the driver refused on
#: that device; the launcher plans without them from then on (the reason in cluster_failures).
refused_sizes: set = set()
#: The portable cluster size: every device of compute capability 9.0 or newer runs clusters of up
#: to this many blocks (CUDA C++ Programming Guide, "Thread Block Clusters"; cuda.h).
PORTABLE_SIZE = 8
#: cuda.h's CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: set to 1 on a function, it may
#: be launched in clusters larger than the portable size where the device holds them.
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


def note_cluster_failure(device: int, kernel, what, exc: Exception) -> None:
    """Keep why ``what`` failed for ``kernel`` on ``device`` in :data:`cluster_failures`."""
    name = getattr(kernel, "__name__", None) or repr(kernel)
    cluster_failures[(device, name, what)] = f"{type(exc).__name__}: {exc}"


def allow_cluster_size(fns, size: int) -> None:
    """Set the non-portable cluster size attribute on the RawKernels ``fns`` where ``size`` is
    past the portable size (without it launches and the occupancy query refuse the size); a
    failure is kept in :data:`cluster_failures`, and the launcher then does not use the size."""
    if size <= PORTABLE_SIZE:
        return
    import cupy

    for fn in fns:
        try:
            cupy.cuda.driver.funcSetAttribute(fn.kernel.ptr, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        except Exception as exc:    # noqa: BLE001 (the size is then refused, not the module)
            note_cluster_failure(current_device(), fn, "non-portable", exc)


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


@functools.lru_cache(maxsize=None)
def joined(files: tuple) -> str:
    """One translation unit: the cuda_src ``files`` one after the other, so that a later file
    uses the earlier ones' types and functions (the textual include NVRTC gets without an
    include path; the host build of the tests #includes the files the same way); ``#line``
    before each file after the first keeps NVRTC's messages at the file's lines. Made once."""
    text = read_source(files[0])
    for name in files[1:]:
        text += f'\n#line 1 "{name}"\n' + read_source(name)
    return text


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


def load(code: str, names, whole_shared_memory: bool = True, cooperative: bool = False) -> list:
    """The RawKernels ``names`` of a module NVRTC compiles from ``code`` on the current device.
    ``whole_shared_memory``: each allowed the device's opt-in shared memory per block (needed
    above 48 KB); ``cooperative``: launched by cuLaunchCooperativeKernel (CuPy's
    ``enable_cooperative_groups``, which RawModule passes to its kernels' launches, v14.2)."""
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


class Kernels(NamedTuple):
    """The element-wise kernels of one (device, dtype, index width): launch handles."""

    fwd: Any
    bwd: Any
    concat: Any
    add: Any


class FusedKernels(NamedTuple):
    """The compiled whole-sequence kernels (forward, backward) of one variant, (device, dtype)
    and, for the split variants, blocks per tile."""

    fwd: Any
    bwd: Any


# -------------------------------------------------------------------- the families, as data

#: How a family's kernels are loaded and launched (``Family.launch``). PLAIN: with the default
#: 48 KB of dynamic shared memory at most, through the loaded functions (``RawKernel.kernel``,
#: CuPy's ``Function``, called ``fn(grid, block, args)`` on CuPy's current stream without
#: RawKernel's per-call lookup of the device's module). The others: RawKernels, each allowed the
#: device's whole opt-in shared memory per block; COOPERATIVE launched with
#: cuLaunchCooperativeKernel; CLUSTER with the non-portable cluster size attribute on the
#: instances past the portable size (:func:`allow_cluster_size`).
PLAIN, WHOLE_SHARED = "plain", "whole shared memory"
COOPERATIVE, CLUSTER = "cooperative", "non-portable cluster attribute"


class Family(NamedTuple):
    """A kernel family: its cuda_src ``files``, joined in this order (:func:`joined`; the last is
    its own); its ``kernels``' names, in the order of the fields of ``handles``, the NamedTuple
    of one instance's kernels; its ``launch`` kind; its ``instances``, ``{key: the template
    argument after the dtype's C++ type, as text}`` (an index width, a cluster or group size;
    ``{None: ""}``: one instance, the dtype alone). Every instance is compiled into one module
    per (device, dtype), kept under (``name``, device, dtype)."""

    name: str
    files: tuple
    kernels: tuple
    handles: type
    launch: str
    instances: dict = {None: ""}

    def source(self) -> str:
        return joined(self.files)

    def name_expression(self, kernel: str, dtype, instance=None) -> str:
        extra = self.instances[instance]
        return f"{kernel}<{CUDA_TYPE[np.dtype(dtype)]}{', ' if extra else ''}{extra}>"

    def names(self, dtype) -> list:
        """Every instance's kernels' name expressions, instance by instance."""
        return [self.name_expression(k, dtype, i) for i in self.instances for k in self.kernels]

    def get_kernels(self, dtype, instance=None):
        """The ``handles`` of ``instance`` for ``dtype`` on the current device: the module
        loaded at the first call per (device, dtype), under the lock, and kept only once all
        of it is loaded (a failure keeps nothing; the next call loads again)."""
        import cupy

        dtype = np.dtype(dtype)
        key = (self.name, cupy.cuda.Device().id, dtype.str)
        found = _cache.get(key)
        if found is None:
            with _lock:
                found = _cache.get(key)
                if found is None:
                    found = _cache[key] = self._load(dtype)
        return found[instance]

    def _load(self, dtype) -> dict:
        fns = load(self.source(), self.names(dtype), whole_shared_memory=self.launch != PLAIN,
                   cooperative=self.launch == COOPERATIVE)
        if self.launch == PLAIN:
            fns = [f.kernel for f in fns]
        count = len(self.kernels)
        found = {instance: self.handles(*fns[i * count:(i + 1) * count])
                 for i, instance in enumerate(self.instances)}
        if self.launch == CLUSTER:
            for size, pair in found.items():
                allow_cluster_size(pair, size)
        return found

    def compile_offline(self, dtype, arch: int, output: str = "cubin") -> bytes:
        """Every instance for ``dtype`` compiled by NVRTC for ``sm_<arch>`` (:func:`nvrtc`)."""
        return nvrtc(self.source(), self.files[-1], self.names(dtype), arch, output)


_FUSED_FILES = ("lltm.cu", "lltm_fused.cu")
#: the cell's kernels, in a 32-bit and a 64-bit index instance (``elementwise.launch_config``)
ELEMENTWISE = Family("elementwise", ("lltm.cu",), ("lltm_fwd_kernel", "lltm_bwd_kernel",
                     "lltm_concat_kernel", "lltm_add_kernel"), Kernels, PLAIN,
                     {False: "unsigned int", True: "unsigned long long"})
#: the one-block fused kernels, after lltm.cu's scalar types and cell functions
FUSED = Family("fused", _FUSED_FILES, ("lltm_seq_fwd_kernel", "lltm_seq_bwd_kernel"),
               FusedKernels, WHOLE_SHARED)
#: the tensor-core kernels, after lltm_fused.cu's cell arithmetic and step offsets
FUSED_MMA = Family("fused_mma", (*_FUSED_FILES, "lltm_fused_mma.cu"),
                   ("lltm_seq_fwd_mma_kernel", "lltm_seq_bwd_mma_kernel"), FusedKernels,
                   WHOLE_SHARED)
#: the cluster kernels, one instance per cluster size (``__cluster_dims__``), after
#: lltm_fused.cu's walk over a tile, step offsets, row stride and dot products (the fixed order
#: of their sums); 16 is past the portable size and runs only where the device holds it
CLUSTERS = Family("cluster", (*_FUSED_FILES, "lltm_fused_cluster.cu"),
                  ("lltm_seq_fwd_cluster_kernel", "lltm_seq_bwd_cluster_kernel"), FusedKernels,
                  CLUSTER, {p: str(p) for p in (1, 2, 4, 8, 16)})
#: the same file's group kernels, one instance per group size, in a cooperative module
GROUPS = Family("group", CLUSTERS.files, ("lltm_seq_fwd_group_kernel",
                "lltm_seq_bwd_group_kernel"), FusedKernels, COOPERATIVE,
                {p: str(p) for p in (1, 2, 4, 8)})
FAMILIES = (ELEMENTWISE, FUSED, FUSED_MMA, CLUSTERS, GROUPS)
