"""The two paths the fault-injection tests run (tests/helpers/faults.py's :class:`Bench`):

- :class:`EmulatedCuda`: the CUDA backend, and the torch layer's CUDA path, on the emulated
  CuPy. The library's own kernel lookups run (their caches, ``kernels._cache`` among them), each
  module "compiled" by :func:`loader` (the host builds of cuda_src, as launch handles with
  CuPy's RawKernel interface: the whole shared memory allowed per block as ``kernels.load``
  allows it, a launch asking for more refused as the driver does, CUDA_ERROR_INVALID_VALUE);
  the driver's occupancy query of a cooperative kernel modelled as
  host_cluster.resident_blocks; every injection point of the emulator wired to the injector.
- :class:`Cpu`: the NumPy backend and the torch layer's CPU path: NumPy's buffers through the
  handler of tests/helpers/numpy_faults.cpp, the scratch and workspace mappings
  (``mmap.mmap``), torch's allocations, and a KeyboardInterrupt at the GEMM that starts each
  step of a sequence loop (the NumPy backend's ``mm``: ``bmm`` forward, ``addmm_`` backward).
"""
from __future__ import annotations

import gc
import importlib.util
import mmap
import shutil
import subprocess
import sys
import sysconfig
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

from lltm_cupy import _packing
from lltm_cupy._cuda import cluster_kernels, elementwise, fused_kernels, group_kernels, kernels

gemm = importlib.import_module("lltm_cupy._cuda.gemm")     # (the package's ``gemm`` is a function)

from . import emulated_cupy as emu
from . import host_cluster, host_fused
from .faults import Bench, Injector, signature, torch_allocations

#: the library's own kernel lookups (conftest's emulated_cupy replaces the element-wise one)
REAL = {"elementwise": elementwise.get_kernels, "fused": fused_kernels.get_kernels,
        "cluster": cluster_kernels.get_kernels, "group": group_kernels.get_kernels,
        "resident": group_kernels.resident_blocks}
assert all(f.__module__.startswith("lltm_cupy._cuda") for f in REAL.values()), REAL

_TYPES = {"lltm_half": np.dtype(np.float16), "float": np.dtype(np.float32),
          "double": np.dtype(np.float64), "lltm_bf16": kernels.BFLOAT16}


class _Kernel:
    """A loaded kernel as ``cupy.RawKernel`` gives it: called ``(grid, block, args,
    shared_mem=)``; ``kernel``, its function (``ptr``, and a launch without RawKernel's
    lookups); ``max_dynamic_shared_size_bytes`` (a launch asking for more dynamic shared memory
    fails as the driver's does). Every launch is an injection point of ``kind``."""

    def __init__(self, launch, kind: str, name: str, shared: int):
        self._launch, self._kind, self.__name__ = launch, kind, name
        self.shared_size_bytes = 0
        self.max_dynamic_shared_size_bytes = shared
        handle = getattr(launch, "kernel", None) or emu.register_function(name, 1)
        self.kernel = _Function(self, handle.ptr)

    def __call__(self, grid, block, args, shared_mem=0):
        failure = emu._fault(self._kind)
        if failure is not None:
            raise failure
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise emu.CUDADriverError(
                f"CUDA_ERROR_INVALID_VALUE: {self.__name__} launched with {shared_mem} bytes of "
                f"dynamic shared memory, {self.max_dynamic_shared_size_bytes} allowed",
                status=emu.CUDA_ERROR_INVALID_VALUE)
        self._launch(grid, block, args, shared_mem=shared_mem)


class _Function:
    def __init__(self, kernel: _Kernel, ptr: int):
        self._kernel, self.ptr = kernel, ptr

    def __call__(self, grid, block, args, shared_mem=0):
        self._kernel(grid, block, args, shared_mem)


def loader(libs: dict, limit: int):
    """A stand-in for ``kernels.load``: the functions ``names`` of cuda_src's modules from the
    host builds ``libs`` ("host": lltm.cu, "fused": lltm_fused.cu, "cluster":
    lltm_fused_cluster.cu), each module's compile noted by the emulator (an injection point)."""
    element = emu.host_get_kernels(libs["host"])
    fused = host_fused.host_get_fused_kernels(libs["fused"], limit)
    cluster = host_cluster.host_get_cluster_kernels(libs["cluster"], limit)
    group = host_cluster.host_get_group_kernels(libs["cluster"], limit)

    def load(code, names, whole_shared_memory=True, cooperative=False):
        found = []
        for name in names:
            base, rest = name.split("<", 1)
            params = [p.strip() for p in rest.rstrip(">").split(",")]
            dtype = _TYPES[params[0]]
            if base in elementwise.KERNEL_NAMES:
                kernel = getattr(element(dtype, params[1] == "unsigned long long"),
                                 base[len("lltm_"):-len("_kernel")])
                kind = "launch"
            elif base in fused_kernels.KERNEL_NAMES:
                kernel, kind = fused(dtype)[fused_kernels.KERNEL_NAMES.index(base)], "launch"
            elif base in cluster_kernels.KERNEL_NAMES:
                kernel = cluster(dtype, int(params[1]))[cluster_kernels.KERNEL_NAMES.index(base)]
                kind = "launch:cluster"
            elif base in group_kernels.KERNEL_NAMES:
                assert cooperative, "the group kernels are launched cooperatively"
                kernel = group(dtype, int(params[1]))[group_kernels.KERNEL_NAMES.index(base)]
                kind = "launch:cooperative"
            else:
                raise emu.CompileException(f"no host build of {name}")
            found.append(_Kernel(kernel, kind, name, limit if whole_shared_memory else 48 * 1024))
        return found

    return load


_BUILT: dict = {}


def host_libs(tmp_path_factory, host_lib) -> dict:
    """The host builds :func:`loader` takes ("host": conftest's ``host_lib``, "fused",
    "cluster"), the last two built once per process (several test modules use them)."""
    if not _BUILT:
        _BUILT["fused"] = host_fused.build(tmp_path_factory.mktemp("bench_fused"))
        _BUILT["cluster"] = host_cluster.build(tmp_path_factory.mktemp("bench_cluster"))
    return {"host": host_lib, **_BUILT}


@pytest.fixture
def bench(monkeypatch, tmp_path_factory, host_lib):
    """``bench(cupy, **keywords)``: an :class:`EmulatedCuda` over the emulated CuPy ``cupy``
    (conftest's ``emulated_cupy`` or ``emulated_cuda_torch``), closed at the test's end. A test
    module uses it by importing it."""
    libs = host_libs(tmp_path_factory, host_lib)
    made = []

    def make(cupy, **kw):
        made.append(EmulatedCuda(cupy, monkeypatch, libs, **kw))
        return made[-1]

    yield make
    for b in made:
        b.close()


def _occupancy_blocks(func, threads, shared):
    """cuOccupancyMaxActiveBlocksPerMultiprocessor of the emulated sm_80 device (as
    host_cluster.resident_blocks, per SM); an injection point; refused while capturing."""
    if emu._state.capturing:
        emu._state.capture_queries.append("cuOccupancyMaxActiveBlocksPerMultiprocessor")
        raise emu.CUDADriverError("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                                  status=emu.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    failure = emu._fault("occupancy:group")
    if failure is not None:
        raise failure
    return min(32, 2048 // threads, host_cluster.SM_SHARED // (shared + 1024))


def _cuda_failures():
    import torch

    def driver(status, what):
        return lambda: emu.CUDADriverError(f"{what} (injected)", status=status)

    failed = driver(719, "CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure")
    return {
        "alloc:cupy": {"failed": lambda: emu.OutOfMemoryError("out of memory (injected)")},
        "alloc:torch": {"failed": lambda: torch.cuda.OutOfMemoryError(
            "CUDA out of memory (injected)")},
        "compile": {"failed": lambda: emu.CompileException("NVRTC failed (injected)")},
        "launch": {"failed": failed},
        "launch:cluster": {"failed": failed, "refused": driver(
            emu.CUDA_ERROR_INVALID_CLUSTER_SIZE, "CUDA_ERROR_INVALID_CLUSTER_SIZE")},
        "launch:cooperative": {"failed": failed, "refused": driver(
            720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE")},
        "occupancy": {"failed": lambda: 999},          # CUDA_ERROR_UNKNOWN, as a status
        "occupancy:group": {"failed": driver(999, "CUDA_ERROR_UNKNOWN")},
        "gemm:cublas": {"failed": lambda: emu.CUBLASError(
            "CUBLAS_STATUS_EXECUTION_FAILED (injected)")},
        "gemm:torch": {"failed": lambda: RuntimeError(
            "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, "
            "opa, opb, m, n, k, &falpha, a, CUDA_R_32F, lda, b, CUDA_R_32F, ldb, &fbeta, c, "
            "CUDA_R_32F, ldc, CUDA_R_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP)` (injected)")},
    }


def _one_thread():
    """torch on one thread while the faults are injected: the emulated CUDA path's GEMMs are
    torch's CPU ones, tiny, and an intra-op pool that spins beside the host kernels' threads
    makes each one cost milliseconds. Returns what to give back to :func:`_threads_back`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def _threads_back(threads):
    import torch

    torch.set_num_threads(threads)


def _drain_autograd():
    """One empty backward on this thread: torch's autograd engine (2.13) keeps the tasks left in
    the calling thread's ready queue when a backward fails (their nodes' saved tensors, the
    gradients they were given) until that thread's next backward, which drops them. That memory
    is torch's to free, not the library's: drained before memory left allocated is looked for."""
    if "torch" in sys.modules:
        import torch

        torch.ones(1, requires_grad=True).sum().backward()


class _PlanRecorder:
    """Every plan whose arrays went to a device (``Plan.device_arrays``), while it lives."""

    def __init__(self, monkeypatch):
        self.plans = weakref.WeakSet()
        real = _packing.Plan.device_arrays
        recorder = self

        def device_arrays(plan, *args, **kwargs):
            found = real(plan, *args, **kwargs)
            recorder.plans.add(plan)
            return found

        monkeypatch.setattr(_packing.Plan, "device_arrays", device_arrays)

    def picture(self) -> dict:
        found = {}
        for p in list(self.plans):
            key = (p.lengths.tobytes(), p.steps, p.reverse, p.packed_io)
            found[key] = {device: tuple(sorted(n for n, a in vars(ns).items() if a is not None))
                          for device, ns in p._device.items()}
        return found

    def arrays(self):
        for p in list(self.plans):
            for ns in p._device.values():
                yield from (a for a in vars(ns).values() if a is not None)


class EmulatedCuda(Bench):
    """The CUDA backend on the emulated CuPy ``cupy`` (conftest's ``emulated_cupy``; with
    ``torch_layer`` conftest's ``emulated_cuda_torch``): a device of compute capability
    ``arch`` with ``limit`` bytes of shared memory per block and ``sm_count`` SMs, the kernels
    from the host builds ``libs`` (see :func:`loader`). ``device``: the current device while the
    calls run (the arrays' is 0: another makes every call enter it and leave it again)."""

    def __init__(self, cupy, monkeypatch, libs, *, arch=90, limit=232448, sm_count=1,
                 torch_layer=False, device=0):
        self.cupy, self.emu = cupy, cupy.emulator
        self.torch_layer = torch_layer
        self.injector = Injector(_cuda_failures())
        self.emu.fault = self.injector
        patch = monkeypatch.setattr
        for module, name in ((elementwise, "elementwise"), (fused_kernels, "fused"),
                             (cluster_kernels, "cluster"), (group_kernels, "group")):
            patch(module, "get_kernels", REAL[name])
        patch(group_kernels, "resident_blocks", REAL["resident"])
        patch(kernels, "load", loader(libs, limit))
        patch(kernels, "_cache", {})
        patch(kernels, "shared_memory_limit", lambda device_id: limit)
        patch(kernels, "compute_capability", lambda device_id: arch)
        patch(kernels, "_sm_count", lambda device_id: sm_count)
        patch(group_kernels, "_resident", {})
        patch(gemm, "_handles", threading.local())
        patch(cupy.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor", _occupancy_blocks,
              raising=False)
        self.recorder = _PlanRecorder(monkeypatch)
        self.mode = torch_allocations(self.injector)
        self._pools = weakref.WeakSet()
        self._entered = None
        if device:
            self._entered = cupy.cuda.Device(device)
            self._entered.__enter__()
        self._threads = _one_thread()

    def close(self):
        """Leave the device entered at construction, and give torch its threads back (call at
        the end of the test)."""
        if self._entered is not None:
            self._entered.__exit__(None, None, None)
            self._entered = None
        self.emu.fault = None
        _threads_back(self._threads)

    def run_op(self, op):
        with self.mode:
            return op()

    #: tensors whose gradients a run leaves (dropped after each run)
    dropping = ()

    def drop(self):
        for t in self.dropping:
            t.grad = None

    # -- the state a call starts from
    def cold(self, state=None):
        kernels._cache.clear()
        elementwise._launches.clear()
        cluster_kernels._occupancy.clear()
        group_kernels._resident.clear()
        kernels.cluster_failures.clear()
        kernels.refused_sizes.clear()
        kernels.refused_sizes.update(state or ())
        _packing.clear_caches()
        self.emu.compiled.clear()
        gemm._handles.__dict__.clear()
        if self.torch_layer:
            from lltm_cupy.torch import _interop

            _interop._cupy_streams.clear()
            _interop._blas_ready.__dict__.clear()
            self.emu.torch_blas_threads.clear()

    def lasting(self):
        return tuple(sorted(kernels.refused_sizes))

    def documented(self, made) -> bool:
        """A status is planned around; a refused launch of a non-portable cluster size runs the
        call on the stepped path, the size recorded as refused (cluster_kernels.guarded)."""
        if not isinstance(made, BaseException):
            return True
        return (getattr(made, "status", None) in cluster_kernels.REFUSALS
                and bool(kernels.refused_sizes))

    def caches(self) -> dict:
        names = {h: f["name"] for h, f in self.emu.functions.items()}
        picture = {
            "kernels._cache": {k: signature(v) for k, v in kernels._cache.items()},
            "elementwise._launches": {k: signature(v) for k, v in elementwise._launches.items()},
            "cluster_kernels._occupancy": {(d, names.get(h), t, s): v for (d, h, t, s), v
                                           in cluster_kernels._occupancy.items()},
            "group_kernels._resident": {(d, t, s): v for (d, _, t, s), v
                                        in group_kernels._resident.items()},
            "kernels.refused_sizes": {k: True for k in kernels.refused_sizes},
            "packing plans": self.recorder.picture(),
        }
        picture["gemm._CONSTANTS"] = {k: signature(v) for k, v in gemm._CONSTANTS.items()}
        if self.torch_layer:
            from lltm_cupy.torch import _interop

            picture["_interop._cupy_streams"] = {k: signature(v)
                                                 for k, v in _interop._cupy_streams.items()}
            picture["_interop._blas_ready"] = {
                d: True for d in getattr(_interop._blas_ready, "devices", ())}
        return picture

    def context(self) -> tuple:
        import torch

        e = self.emu
        stream = torch._C._cuda_getCurrentRawStream(0) if self.torch_layer else None
        return (("device", e.device, len(e.device_stack)),
                ("CuPy streams", tuple(s.ptr for s in e.current_streams)),
                ("allocator", e.allocator), ("math mode", e.math_mode),
                ("torch stream", stream),
                ("grad", torch.is_grad_enabled()), ("errors", tuple(sorted(np.geterr().items()))))

    # -- memory
    def begin(self):
        self._pools = weakref.WeakSet(m for m in list(emu._live) if type(m) is emu._PoolMemory)
        self.mode.made.clear()

    def leaks(self) -> list:
        _drain_autograd()
        found = self._leaks()
        if found:
            gc.collect()
            found = self._leaks()
        return found

    def _leaks(self) -> list:
        pools = [m for m in list(emu._live)
                 if type(m) is emu._PoolMemory and m not in self._pools]
        storages = self.mode.alive()
        if not pools and not storages:
            return []
        owned_pools, owned_storages = set(), set()
        for a in self.recorder.arrays():    # CuPy arrays (the array API's), torch tensors
            if hasattr(a, "untyped_storage"):
                owned_storages.add(a.untyped_storage().data_ptr())
            else:
                owned_pools.add(id(a.data.mem))
        return ([f"{m.size} bytes of CuPy's pool" for m in pools if id(m) not in owned_pools]
                + [f"{n} bytes of torch's (storage {ptr:#x})" for ptr, n in storages.items()
                   if ptr not in owned_storages])


# ------------------------------------------------------------------------------------ the CPU

def build_numpy_faults(out_dir: Path):
    """Compile tests/helpers/numpy_faults.cpp into ``out_dir`` and import it."""
    cxx = shutil.which("g++")
    assert cxx, "g++ is required to build the NumPy fault handler"
    source = Path(__file__).with_name("numpy_faults.cpp")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = Path(out_dir) / f"numpy_faults{suffix}"
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
           f"-I{sysconfig.get_paths()['include']}", f"-I{np.get_include()}", str(source),
           "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"build failed: {' '.join(cmd)}\n{proc.stderr}"
    spec = importlib.util.spec_from_file_location("numpy_faults", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NativeFailure:
    """The failure of an allocation NumPy makes (NumPy raises its MemoryError itself)."""

    error = MemoryError

    def __repr__(self):
        return "a NumPy allocation failed"


class _CpuInjector(Injector):
    """The injector with NumPy's allocations as a second channel (tests/helpers/numpy_faults):
    they come after the Python points in :attr:`points`, as "alloc:numpy"."""

    def __init__(self, failures, native):
        super().__init__({**failures, "alloc:numpy": {"failed": NativeFailure}})
        self.native = native
        self._python = 0

    def start(self, target=None):
        python_target = None
        native_k = 0
        if target is not None:
            index, variant = target
            if index < getattr(self, "_python_points", 1 << 60):
                python_target = target
            else:
                native_k = index - self._python_points + 1
        super().start(python_target)
        self._native_k = native_k
        self.native.arm(native_k)

    def stop(self):
        self.native.disarm()
        super().stop()
        count, fired = self.native.stats()[:2]
        self._python = len(self.points)
        self.points += ["alloc:numpy"] * count
        if self.record_sites:
            self.sites += [()] * count
        if fired:
            self.made = NativeFailure()
            self.made_kind = "alloc:numpy"

    def freeze(self):
        """The run without a fault is done: its Python points come first."""
        self._python_points = self._python


class Cpu(Bench):
    """The NumPy backend (and, through it, the torch layer's CPU path), the NumPy fault handler
    ``native`` (:func:`build_numpy_faults`) installed while the calls run."""

    def __init__(self, monkeypatch, native):
        import torch

        from lltm_cupy._numpy import gemm as numpy_gemm
        from lltm_cupy.torch import _sequence_function, _torch_gemm

        failures = {
            "alloc:mmap": {"failed": lambda: MemoryError("cannot map memory (injected)")},
            "alloc:torch": {"failed": lambda: RuntimeError(
                "[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: not enough memory "
                "(injected)")},
            "step": {"interrupt": KeyboardInterrupt},
        }
        self.native = native
        self.injector = _CpuInjector(failures, native)
        inj = self.injector
        self.mode = torch_allocations(inj)
        self.mappings = []
        real_mmap = mmap.mmap
        bench = self

        def mapping(*args, **kwargs):
            failure = inj("alloc:mmap")
            if failure is not None:
                raise failure
            made = real_mmap(*args, **kwargs)
            if inj.counting:
                bench.mappings.append((weakref.ref(made), len(made)))
            return made

        monkeypatch.setattr(mmap, "mmap", mapping)
        for engine in (numpy_gemm.NUMPY_GEMM, _torch_gemm.TORCH_GEMM, _torch_gemm.ONEDNN_GEMM):
            if engine is None:
                continue
            for name in ("bmm", "addmm_"):
                monkeypatch.setattr(engine, name, self._step(getattr(engine, name)),
                                    raising=False)
        # the plans and stand-ins the calls make, to tell their memory from a leak
        self.plans = weakref.WeakSet()
        real_plan = _packing.plan

        def plan(*args, **kwargs):
            made = real_plan(*args, **kwargs)
            bench.plans.add(made)
            return made

        monkeypatch.setattr(_packing, "plan", plan)
        self.stand_ins = {}
        real_stand_in = _sequence_function._stand_in

        def stand_in(shape, dtype):
            made = real_stand_in(shape, dtype)
            bench.stand_ins[(shape, np.dtype(dtype).str)] = made
            return made

        monkeypatch.setattr(_sequence_function, "_stand_in", stand_in)
        self._real_stand_in = real_stand_in
        self._torch = torch

    dropping = ()

    def drop(self):
        for t in self.dropping:
            t.grad = None

    def _step(self, fn):
        inj = self.injector

        def step(*args, **kwargs):
            failure = inj("step")
            if failure is not None:
                raise failure
            return fn(*args, **kwargs)
        return step

    def run_op(self, op):
        handler = self.native.install()
        try:
            with self.mode:
                return op()
        finally:
            self.native.restore(handler)

    def cold(self, state=None):
        from lltm_cupy._numpy import memory

        memory.forget()
        _packing.clear_caches()
        self._real_stand_in.cache_clear()
        self.stand_ins.clear()

    #: the named views of a CPU workspace (lltm_cupy._numpy.memory.Workspace)
    FIELDS = ("z", "s", "product", "d", "d_c", "zero")

    def caches(self) -> dict:
        from lltm_cupy._numpy import memory

        kept = memory._kept
        workspaces = kept.workspaces
        return {
            "scratch": {dtype: "mapping" for dtype in kept.scratch},
            "workspaces": {key: tuple(getattr(getattr(w, n, None), "shape", "missing")
                                      for n in self.FIELDS)
                           for key, w in workspaces.items()},
            "workspace cells": {key: signature(getattr(w, "cells", "missing"))
                                for key, w in workspaces.items()},
            "workspace steps": {(key, made_key): signature(value) for key, w in workspaces.items()
                                for made_key, value in getattr(w, "made", {}).items()},
            "plans": {(p.lengths.tobytes(), p.steps, p.reverse, p.packed_io): True
                      for p in list(self.plans)},
        }

    def context(self) -> tuple:
        torch = self._torch
        return (("errors", tuple(sorted(np.geterr().items()))), ("grad", torch.is_grad_enabled()),
                ("autocast", torch.is_autocast_enabled("cpu")))

    def begin(self):
        self.mode.made.clear()
        self.mappings = []

    def _owned(self):
        """The mappings and NumPy buffers the backend's caches hold (data pointers)."""
        from lltm_cupy._numpy import memory

        kept = memory._kept
        arrays = [*kept.scratch.values()]
        for w in kept.workspaces.values():
            arrays += [getattr(w, n) for n in self.FIELDS if hasattr(w, n)]
        mappings = set()
        for a in arrays:
            while isinstance(a, np.ndarray):
                a = a.base
            mappings.add(id(getattr(a, "obj", a)))
        buffers = set()
        for p in list(self.plans):
            for a in vars(p).values():
                if isinstance(a, np.ndarray):
                    while a.base is not None:
                        a = a.base
                    buffers.add(a.ctypes.data)
        for a in self.stand_ins.values():
            while isinstance(a.base, np.ndarray):
                a = a.base
            buffers.add(a.ctypes.data)
        return mappings, buffers

    def leaks(self) -> list:
        _drain_autograd()
        found = self._leaks()
        if found:
            gc.collect()
            found = self._leaks()
        return found

    def _leaks(self) -> list:
        mappings = [(m(), n) for m, n in self.mappings if m() is not None]
        storages = self.mode.alive()
        numpy_live = self.native.live()
        if not mappings and not storages and not numpy_live:
            return []
        owned_mappings, owned_buffers = self._owned()
        return ([f"a mapping of {n} bytes" for m, n in mappings if id(m) not in owned_mappings]
                + [f"{n} bytes of torch's" for ptr, n in storages.items()]
                + [f"{n} bytes of NumPy's (at {ptr:#x})" for ptr, n in numpy_live.items()
                   if ptr not in owned_buffers])
