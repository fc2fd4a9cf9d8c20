"""A stand-in for the parts of CuPy that lltm_cupy uses, built on NumPy, with the kernels of
cuda_src/lltm.cu compiled as host C++.

It lets the GPU backend's Python (launch arguments, contiguity, grid sizes, the sequence loops,
the cuBLAS calls, float16 handling) and the torch layer's CUDA path (DLPack in, memory from
torch's allocator, torch views out, torch's GEMM under graph capture) run in every CI run, on a
machine without a GPU. "Device memory" is host memory: a pointer is a host address.

It is strict where CuPy and cuBLAS are:

- kernel array arguments must be C-contiguous and of the kernel's dtype, or integer device
  pointers (a Python int, what CuPy passes as a 64-bit value) into live emulated memory, each
  as long as the kernel reads or writes from it (the extent follows from the size arguments); no
  range the kernel writes may overlap another argument's (every pointer is __restrict__); a
  pointer is accepted only where the kernel takes a pointer, and scalar arguments must be the
  exact NumPy types the signature needs (a Python int there would reach the kernel as long long);
- ``cuda.cublas.gemmEx`` has cuBLAS's column-major semantics over raw pointers, leading
  dimensions and transpose flags, rejects what cuBLAS rejects (a leading dimension below the
  stored rows, mixed or unsupported data types, a compute type that does not fit them), reads
  alpha and beta from host pointers, computes float16 in float32, and raises as CuPy does when
  called while a stream is being captured (``capturing`` below);
- ``cuda.runtime.memcpyAsync`` copies device to device only, between integer pointers into
  live emulated memory, ranges disjoint, on CuPy's current stream (given as its handle);
- every allocation goes through the current allocator: ``cuda.using_allocator`` as in CuPy,
  else "CuPy's pool" (counted in ``pool_allocations``).

``log`` records the device work in order, one entry per launch: "kernel:<name>", "gemm",
"copy", "fill", "elementwise", "reduce"; ``allocations`` the byte size of every allocation.
``compiles`` records every kernel compiled and loaded at first use, as CuPy does: our module
(once per dtype, as ``lltm_cupy._cuda.elementwise.get_kernels`` caches it) and CuPy's own kernels, keyed
by operation, dtypes and dimensionality (C-contiguous arrays count as 1-D, as CuPy collapses
them); a fill with 0 is a memset and compiles nothing. ``math_mode`` is the cuBLAS handle's math
mode (``cuda.cublas.getMathMode`` / ``setMathMode``); ``gemmEx`` with 16-bit data requires the
flag that disallows reduced-precision reductions (the emulator checks that it is set; what
cuBLAS does with it is beyond it).
``streams`` holds, for every ``log`` entry, the handle of the CuPy stream it ran on (CuPy's
current stream: ``cuda.Stream.null`` (handle 0), or one entered with ``with stream:``, e.g. one
made by ``cuda.Stream.from_external`` over torch's current stream). When ``torch_stream`` is set
(a callable giving torch's current stream handle, see conftest's ``emulated_cuda_torch``), device
work on any other stream raises at once: the torch layer must run everything on torch's stream.
``transfers`` records every copy between host and "device", ``("h2d" | "d2h", bytes)``: an
array made from host data (``cupy.asarray(numpy_array)``, ``cupy.array(list)``), a host array
used as an index or assigned into a device array (CuPy uploads it), and ``get()``, ``item()``,
``int()``, ``float()``, ``bool()``, ``tolist()`` of a device array (downloads, each also a
synchronisation); ``syncs`` counts every synchronisation (``Device.synchronize`` and those
downloads). While ``capturing``, each of these raises, as the driver refuses them in a capture
(CuPy stages an upload through pinned memory and queries an event; a download or a sync waits
for the device), and so does a torch GEMM on a thread that has no torch cuBLAS handle yet
(``torch_blas_threads``, see tests/conftest.py's ``emulated_cuda_torch``), since torch creates
the handle at a thread's first GEMM and ``cublasCreate`` fails in a capture.
``counts`` tallies the host-side objects a call makes, each of which costs host time on a GPU
machine: "arrays" (every CuPy array constructed, views and slices included), "dlpack" (DLPack
imports into CuPy and exports from it), "streams" (CuPy stream objects made; the torch layer's
emulation adds torch's), "launches" (kernel launches) and "gemms" (cuBLAS GEMMs); with
``allocations`` (every allocation through CuPy's current allocator) they are what the host-path
budgets of tests/budgets/test_host_budget.py pin.
``noop`` (False by default) skips the arithmetic of kernels and GEMMs and the checks of the
kernels' arguments (the emulator's own cost), for timing the host path alone
(scripts/profile_step.py --emulated).
``driver`` stands in for the CUDA driver's calls on the cluster kernels' functions (each a
handle made by ``register_function`` with its compile-time cluster size): CuPy's
``cuda.driver.funcSetAttribute`` (recorded per handle in ``functions``) and
cuOccupancyMaxActiveClusters (``occupancy_function``, what ``cluster_kernels._occupancy_function``
returns here). The query reads the CUlaunchConfig at cuda.h's offsets (x86-64) and answers from
a model: every block of a cluster on one GPC, ``gpc_sms`` SMs per GPC (a knob, by default an
H100-like 132 SMs in eight GPCs of 16 or 18), each SM holding as many blocks as its
``sm_shared_bytes`` (1 KiB of it reserved per block), 2048 threads and 32 blocks allow; clusters
larger than 8 blocks only where the function's non-portable attribute is set (else
CUDA_ERROR_INVALID_CLUSTER_SIZE), and never more blocks than a GPC has SMs' room for.
``occupancy_error`` (a CUresult, 0 by default) makes every query fail with it; ``occupancy_queries``
records each query (kernel name, cluster, grid, threads, shared bytes, answer). ``contexts``
(None by default: every thread has a CUDA context) is a set of the host threads that have one:
a query from another fails with CUDA_ERROR_INVALID_CONTEXT, and ``runtime.memGetInfo`` (as
CuPy's runtime calls) binds the calling thread's. ``refused_launches``: {kernel name
(tests/helpers/host_cluster.py's, "seq_fwd_cluster16"): CUresult} of the launches the driver
refuses, raised by the launch call as CuPy does (CUDADriverError). While ``capturing``, the
driver's occupancy query fails (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and ``runtime.memGetInfo``
raises, each noted in ``capture_queries``: the library must ask neither inside a capture.
``device`` is the current device (``runtime.getDevice``): ``with cuda.Device(i):`` makes ``i``
current until the block ends (``device_stack``); ``Device()`` is the current one.
``fault`` (None by default) is the fault injector of tests/helpers/faults.py: every allocation
from the pool ("alloc:cupy"), every first use of a kernel ("compile") and every cuBLAS GEMM
("gemm:cublas") asks it, and the occupancy query ("occupancy"), whether to fail there: it
answers None or the failure (an exception raised there, OutOfMemoryError, CompileException,
CUBLASError; or the CUresult the query returns).
What it cannot show: real concurrency, and the NVRTC-compiled code itself.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import types
import weakref

import numpy as np

from .host_kernels import SUFFIX, ptr


class CUDARuntimeError(RuntimeError):
    """cupy.cuda.runtime.CUDARuntimeError's stand-in."""


class _Log(list):
    """The device-work log; every entry also records its stream in ``_state.streams``."""

    def append(self, what, stream=None):
        """``what`` on CuPy's current stream (or on ``stream``, a handle: torch's work)."""
        stream = _current_stream().ptr if stream is None else stream
        expected = _state.torch_stream() if _state.torch_stream is not None else stream
        assert stream == expected, \
            f"{what} launched on stream {stream:#x}, torch's current stream is {expected:#x}"
        _state.streams.append(stream)
        super().append(what)

    def extend(self, entries):
        for what in entries:
            self.append(what)

    def clear(self):
        _state.streams.clear()
        super().clear()


class _State:
    def __init__(self):
        self.streams = []
        self.torch_stream = None
        self.current_streams = []
        self.log = _Log()
        self.allocations = []
        self.pool_allocations = 0
        self.allocator = None
        self.capturing = False
        self.compiles = []
        self.compiled = set()
        self.math_mode = 0
        #: the product of ``gemmEx``'s operands in its compute type (tests may fix its order)
        self.product = np.matmul
        self.transfers = []
        self.syncs = 0
        self.torch_blas_threads = set()
        self.gemm_engines = []
        self.recorded_streams = []
        self.counts = dict.fromkeys(COUNTED, 0)
        self.noop = False
        self.functions = {}
        self.gpc_sms = H100_GPCS
        self.sm_shared_bytes = 228 * 1024
        self.occupancy_error = 0
        self.occupancy_queries = []
        self.contexts = None
        self.refused_launches = {}
        self.fault = None
        self.device = 0
        self.device_stack = []
        self.capture_queries = []

    def count(self, what, n=1):
        self.counts[what] += n

    def tally(self):
        """The counts, with allocations, launches and GEMMs read from the logs."""
        return dict(self.counts, allocations=len(self.allocations),
                    launches=sum(e.startswith("kernel:") for e in self.log),
                    gemms=self.log.count("gemm"))

    @contextlib.contextmanager
    def capture(self):
        """The current stream reported as capturing inside the block (as inside
        ``torch.cuda.graph``), and no longer after it, however the block ends."""
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False

    def reset(self):
        self.counts = dict.fromkeys(COUNTED, 0)
        self.log.clear()
        self.gemm_engines.clear()
        self.allocations.clear()
        self.pool_allocations = 0
        self.compiles.clear()
        self.transfers.clear()
        self.syncs = 0

    def transfer(self, kind, nbytes, sync=False):
        """Note a host-device copy (and the wait of a download); refused while capturing."""
        if self.capturing:
            raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: operation not permitted "
                                   f"when stream is capturing ({kind} copy of {nbytes} bytes)")
        self.transfers.append((kind, int(nbytes)))
        if sync:
            self.syncs += 1

    def synchronize(self):
        if self.capturing:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted "
                                   "when stream is capturing (synchronize)")
        self.syncs += 1


    def compile(self, *key):
        """Note a kernel's first use (a compile and a module load on a GPU); a fault injected
        there (``fault``) raises CuPy's CompileException and compiles nothing."""
        if key not in self.compiled:
            failure = _fault("compile")
            if failure is not None:
                raise failure
            self.compiled.add(key)
            self.compiles.append(key)


#: SMs per GPC of the emulated device's occupancy model by default (an H100-like 132)
H100_GPCS = (16, 16, 16, 16, 16, 16, 18, 18)
#: what ``counts`` tallies itself (allocations, launches and GEMMs come from the logs)
COUNTED = ("arrays", "dlpack", "streams")
_state = _State()


def _layout(*arrays):
    """What CuPy keys a kernel on besides the operation: dtypes, and dimensionality after
    collapsing contiguous dimensions (a C-contiguous array is 1-D to it)."""
    return tuple((np.dtype(a.dtype).str, 1 if a.flags.c_contiguous else a.ndim)
                 for a in map(np.asarray, arrays))


#: every emulated memory object alive (pool, torch allocations, DLPack imports): where a kernel's
#: pointer argument may point
_live = weakref.WeakSet()


class BaseMemory:
    def __init__(self, ptr, size, device_id=0):
        self.ptr, self.size, self.device_id = ptr, size, device_id
        _live.add(self)


def _in_live_memory(address, nbytes):
    return any(m.ptr <= address and address + nbytes <= m.ptr + m.size for m in list(_live))


class _PoolMemory(BaseMemory):
    """Memory from "CuPy's pool": a NumPy buffer."""

    def __init__(self, size):
        self.buffer = np.empty(max(size, 1), np.uint8)
        super().__init__(self.buffer.ctypes.data, size)


class UnownedMemory(BaseMemory):
    def __init__(self, ptr, size, owner, device_id=-1):
        if device_id < 0 and ptr == 0:
            raise RuntimeError("UnownedMemory requires explicit device ID for a null pointer.")
        super().__init__(ptr, size, max(device_id, 0))
        self._owner = owner


class DLPackMemory(BaseMemory):
    def __init__(self, array):
        super().__init__(array.ctypes.data, array.nbytes)
        self.array = array


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id


@contextlib.contextmanager
def using_allocator(allocator=None):
    previous = _state.allocator
    _state.allocator = allocator
    try:
        yield
    finally:
        _state.allocator = previous


def _fault(kind):
    """What the fault injector (``_state.fault``, tests/helpers/faults.py) makes of this point
    of kind ``kind``: None (no fault here), or the failure (an exception to raise, or a status
    to return)."""
    return None if _state.fault is None else _state.fault(kind)


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError's stand-in (CuPy's is a MemoryError too)."""


class CompileException(Exception):
    """cupy.cuda.compiler.CompileException's stand-in (NVRTC or a module load failed)."""


def _alloc(nbytes):
    _state.allocations.append(nbytes)
    if _state.allocator is None:
        failure = _fault("alloc:cupy")
        if failure is not None:
            raise failure
        _state.pool_allocations += 1
        return MemoryPointer(_PoolMemory(nbytes), 0)
    memptr = _state.allocator(nbytes)
    assert isinstance(memptr, MemoryPointer), "an allocator must return a MemoryPointer"
    assert memptr.mem.size >= nbytes
    return memptr


def _host_view(address, count, dtype):
    """A NumPy array over ``count`` elements of host memory at ``address``."""
    dtype = np.dtype(dtype)
    if count == 0:
        return np.empty(0, dtype)
    buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(buf, dtype, count)


class ndarray(np.ndarray):
    """A NumPy array posing as a CuPy array on device 0, over memory from ``_alloc``."""

    def __array_finalize__(self, obj):
        # Every view keeps the allocation alive (NumPy collapses a view's .base to the buffer,
        # which does not own the memory).
        _state.counts["arrays"] += 1
        self._memory = getattr(obj, "_memory", None)
        self._memptr = getattr(obj, "_memptr", None)
        self._data = None

    @property
    def device(self):
        return _Device(0)

    @property
    def data(self):
        # made once per array, as CuPy's (whose ndarray.data is an attribute)
        if self._data is None:
            if self._memory is None:  # made by NumPy outside this module
                raise AssertionError("array without emulated device memory")
            self._data = MemoryPointer(self._memory, self.ctypes.data - self._memory.ptr)
        return self._data

    def get(self):
        _state.transfer("d2h", self.nbytes, sync=True)
        return np.array(self)

    # Host values of device data: a download that waits for the device.
    def item(self, *args):
        _state.transfer("d2h", self.itemsize, sync=True)
        return np.asarray(self).item(*args)

    def tolist(self):
        _state.transfer("d2h", self.nbytes, sync=True)
        return np.asarray(self).tolist()

    def __int__(self):
        _state.transfer("d2h", self.itemsize, sync=True)
        return int(np.asarray(self))

    def __float__(self):
        _state.transfer("d2h", self.itemsize, sync=True)
        return float(np.asarray(self))

    def __bool__(self):
        _state.transfer("d2h", self.itemsize, sync=True)
        return bool(np.asarray(self))

    def __dlpack__(self, *, stream=None, **kwargs):
        # CuPy takes a consumer stream (-1: no synchronisation); host memory has none.
        assert stream is None or stream == -1 or stream > 0, f"invalid DLPack stream {stream}"
        _state.count("dlpack")
        return np.asarray(self).__dlpack__(**kwargs)

    # Device work that NumPy would do silently: logged, and allocating through _alloc.
    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        args = [np.asarray(x) if isinstance(x, ndarray) else x for x in inputs]
        _state.log.append("elementwise" if method == "__call__" else "reduce")
        _state.compile(ufunc.__name__, method, _layout(*(a for a in args
                                                         if isinstance(a, np.ndarray))),
                       str(kwargs.get("dtype")), str(kwargs.get("axis")))
        with np.errstate(all="ignore"):     # CuPy computes IEEE results and never warns
            if out is not None:
                getattr(ufunc, method)(*args, out=tuple(np.asarray(o) for o in out), **kwargs)
                return out[0] if len(out) == 1 else out
            return _adopt(getattr(ufunc, method)(*args, **kwargs))

    def __getitem__(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, (np.ndarray, list)) for k in keys):   # advanced indexing: a gather
            _upload_host_keys(keys)
            _state.log.append("copy")
            _state.compile("gather", _layout(self))
            plain = tuple(np.asarray(k) if isinstance(k, ndarray) else k for k in keys)
            return _adopt(np.asarray(self)[plain if isinstance(key, tuple) else plain[0]])
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        keys = key if isinstance(key, tuple) else (key,)
        _upload_host_keys(keys)
        if isinstance(value, (np.ndarray, list)) and not isinstance(value, ndarray):
            _state.transfer("h2d", np.asarray(value).nbytes)
        _state.log.append("copy")
        plain = tuple(np.asarray(k) if isinstance(k, ndarray) else k for k in keys)
        key = plain if isinstance(key, tuple) else plain[0]
        target = np.asarray(self)[key]
        _state.compile("copy", _layout(value, target))
        np.asarray(self)[key] = np.asarray(value)

    def copy(self, order="C"):
        _state.log.append("copy")
        _state.compile("copy", _layout(self))
        return _adopt(np.asarray(self))

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        _state.log.append("copy")
        _state.compile("astype", _layout(self), np.dtype(dtype).str)
        return _adopt(np.asarray(self).astype(dtype))

    def fill(self, value):
        _state.log.append("fill")
        if value != 0:      # CuPy fills zeros with a memset
            _state.compile("fill", _layout(self))
        np.asarray(self).fill(value)

    def sum(self, axis=None, dtype=None, out=None, keepdims=False):
        # (straight to __array_ufunc__: NumPy 2.4's np.add.reduce keeps its arguments alive for
        # good when an override raises, which would show as memory left allocated after a
        # fault injected in the reduction)
        return self.__array_ufunc__(np.add, "reduce", self, axis=axis, dtype=dtype,
                                    out=None if out is None else (out,), keepdims=keepdims)


def _upload_host_keys(keys):
    """CuPy copies a host index array (NumPy array, list) to the device before indexing."""
    for k in keys:
        if isinstance(k, (np.ndarray, list)) and not isinstance(k, ndarray):
            _state.transfer("h2d", np.asarray(k).nbytes)


def _empty(shape, dtype, order="C"):
    dtype = np.dtype(dtype)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    count = int(np.prod(shape, dtype=np.int64))
    memptr = _alloc(count * dtype.itemsize)
    base = _host_view(memptr.ptr, count, dtype)
    a = base.reshape(shape, order=order).view(ndarray)
    a._memory = memptr.mem
    a._memptr = memptr  # keeps the allocation (and its owner) alive with every view
    return a


def _adopt(result):
    """Device memory for a result NumPy computed: allocate, copy in (no log: the op was logged)."""
    result = np.asarray(result)
    out = _empty(result.shape, result.dtype)
    np.asarray(out)[...] = result
    return out


class _Device:
    """``cupy.cuda.Device``: ``Device()`` (or ``Device(None)``) is the current device;
    ``with Device(i):`` makes ``i`` current (``runtime.getDevice``) until the block ends."""

    def __init__(self, device_id=None):
        self.id = _state.device if device_id is None else device_id
        self.attributes = {"MultiProcessorCount": 1}
        # no thread-block clusters (sm_90) unless a test patches kernels.compute_capability
        self.compute_capability = "80"

    def __enter__(self):
        _state.device_stack.append(_state.device)
        _state.device = self.id
        return self

    def __exit__(self, *exc):
        _state.device = _state.device_stack.pop()
        return False

    def synchronize(self):
        _state.synchronize()


class Stream:
    """A CUDA stream: ``ptr`` is its handle; ``with stream:`` makes it CuPy's current stream."""

    _next_handle = 0x1000

    def __init__(self, null=False, non_blocking=False, ptr=None):
        _state.count("streams")
        if ptr is None and not null:
            Stream._next_handle += 0x10
            ptr = Stream._next_handle
        self.ptr = 0 if null else ptr

    @classmethod
    def from_external(cls, obj):
        """As CuPy 14: a stream over a foreign one offering the CUDA stream protocol."""
        if not hasattr(obj, "__cuda_stream__"):
            raise TypeError(f"{type(obj).__name__} does not implement __cuda_stream__")
        version, handle = obj.__cuda_stream__()
        assert version == 0 and isinstance(handle, int), (version, handle)
        return cls(ptr=handle)

    def is_capturing(self):
        return _state.capturing

    def __enter__(self):
        _state.current_streams.append(self)
        return self

    def __exit__(self, *exc):
        popped = _state.current_streams.pop()
        assert popped is self, "streams entered and left out of order"
        return False

    def synchronize(self):
        _state.synchronize()


Stream.null = Stream(null=True)


class Event:
    """A CUDA event: ``record`` notes the host clock (no device work is asynchronous here)."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.time = None

    def record(self, stream=None):
        import time

        self.time = time.perf_counter()

    def synchronize(self):
        _state.synchronize()


def _elapsed_time(start, end):
    """Milliseconds between two recorded events, as ``cupy.cuda.get_elapsed_time``."""
    assert start.time is not None and end.time is not None, "an event was not recorded"
    return (end.time - start.time) * 1e3


class _MemoryPool:
    """``cupy.get_default_memory_pool()``: its ``malloc`` takes "CuPy's pool" memory whatever
    allocator is current (as CuPy's pool does)."""

    def malloc(self, nbytes):
        failure = _fault("alloc:cupy")
        if failure is not None:
            raise failure
        _state.pool_allocations += 1
        return MemoryPointer(_PoolMemory(nbytes), 0)


def _current_stream():
    return _state.current_streams[-1] if _state.current_streams else Stream.null


def _empty_like_shape(a):
    return _empty(np.shape(a), np.asarray(a).dtype)


def _zeros(shape, dtype=np.float64):
    out = _empty(shape, dtype)
    out.fill(0)
    return out


def _full(shape, fill_value, dtype):
    out = _empty(shape, dtype)
    out.fill(fill_value)
    return out


def _array(obj, dtype=None, order="K", copy=True):
    if not isinstance(obj, ndarray):    # host data: an upload
        _state.transfer("h2d", np.asarray(obj, dtype=dtype).nbytes)
    _state.log.append("copy")
    _state.compile("copy", _layout(obj), str(dtype))
    return _adopt(np.array(np.asarray(obj), dtype=dtype, order="C"))


def _ascontiguousarray(a, dtype=None):
    if isinstance(a, ndarray) and a.flags.c_contiguous and (dtype is None or a.dtype == dtype):
        return a
    return _array(a, dtype=dtype)


def _asfortranarray(a):
    _state.log.append("copy")
    out = _empty(np.shape(a), np.asarray(a).dtype, order="F")
    np.asarray(out)[...] = np.asarray(a)
    return out


def _concatenate(arrays, axis=0):
    result = np.concatenate([np.asarray(a) for a in arrays], axis=axis)
    if len(arrays) > 8 and len({np.asarray(a).dtype for a in arrays}) == 1 and \
            result.nbytes < 2 * 1024 * 1024 * len(arrays):
        # CuPy's single-kernel concatenation uploads the inputs' pointers (and, unless all
        # are C-contiguous and of one shape, their offsets and strides)
        _state.transfer("h2d", 8 * len(arrays))
    _state.compile("concatenate", tuple(sorted(set(_layout(*arrays)))))   # not by count
    _state.log.extend(["copy"] * len(arrays))   # CuPy copies each input into its slice
    return _adopt(result)


class _DLPackCapsule:
    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU: the emulator's "device" memory is host memory


def _from_dlpack(obj):
    _state.count("dlpack")
    host = np.from_dlpack(_DLPackCapsule(obj) if not hasattr(obj, "__dlpack__") else obj)
    assert host.flags.c_contiguous, "the torch layer exports contiguous tensors"
    # NumPy marks DLPack imports read-only; device memory imported by CuPy is writable.
    a = _host_view(host.ctypes.data, host.size, host.dtype).reshape(host.shape).view(ndarray)
    a._memory = DLPackMemory(host)
    return a


# ------------------------------------------------------------------------------ CUDA driver

class CUDADriverError(RuntimeError):
    """cupy_backends.cuda.api.driver.CUDADriverError's stand-in (``status``: the CUresult)."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_CLUSTER_SIZE = 1, 912
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900


def _mem_get_info():
    """cudaMemGetInfo: binds the calling thread's context (see ``contexts``); refused while
    capturing (noted in ``capture_queries``)."""
    if _state.capturing:
        _state.capture_queries.append("memGetInfo")
        raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted "
                               "when stream is capturing (cudaMemGetInfo)")
    if _state.contexts is not None:
        _state.contexts.add(threading.get_ident())
    return (1 << 34, 1 << 35)


class Function:
    """What ``RawKernel.kernel`` gives: a loaded function, ``ptr`` its CUfunction handle."""

    def __init__(self, ptr):
        self.ptr = ptr


def register_function(name: str, cluster: int) -> Function:
    """A handle for a kernel ``name`` whose compile-time cluster size is ``cluster``."""
    handle = 0x7000 + 0x10 * len(_state.functions)
    _state.functions[handle] = {"name": name, "cluster": cluster, "attributes": {}}
    return Function(handle)


def _func_set_attribute(f, attribute, value):
    if f not in _state.functions:
        raise CUDADriverError("CUDA_ERROR_INVALID_HANDLE: invalid resource handle")
    _state.functions[f]["attributes"][attribute] = value


def _blocks_per_sm(threads, shared):
    """Blocks of ``threads`` threads and ``shared`` bytes one SM of the model holds."""
    warps = -(-threads // 32) * 32
    return min(_state.sm_shared_bytes // (shared + 1024), 2048 // warps, 32)


def _max_active_clusters(count, func, config):
    """cuOccupancyMaxActiveClusters of the model (see the module docstring)."""
    raw = ctypes.string_at(ctypes.cast(config, ctypes.c_void_p).value, 56)
    import struct

    grid_x, grid_y, grid_z, block_x, block_y, block_z, shared = struct.unpack_from("<7I", raw)
    stream, attrs = struct.unpack_from("<QQ", raw, 32)
    (num_attrs,) = struct.unpack_from("<I", raw, 48)
    entry = _state.functions.get(func)
    answer = None
    if _state.capturing:
        _state.capture_queries.append("cuOccupancyMaxActiveClusters")
        status = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    elif (failure := _fault("occupancy")) is not None:
        status = failure
    elif _state.occupancy_error:
        status = _state.occupancy_error
    elif _state.contexts is not None and threading.get_ident() not in _state.contexts:
        status = CUDA_ERROR_INVALID_CONTEXT
    elif entry is None or num_attrs != 0 or block_y != 1 or block_z != 1 or grid_y != 1 \
            or grid_z != 1 or grid_x % entry["cluster"]:
        status = CUDA_ERROR_INVALID_VALUE
    elif entry["cluster"] > 8 and not entry["attributes"].get(14):
        status = CUDA_ERROR_INVALID_CLUSTER_SIZE
    else:
        status = 0
        per_sm = _blocks_per_sm(block_x, shared)
        answer = sum(n * per_sm // entry["cluster"] for n in _state.gpc_sms)
        count[0] = answer
    _state.occupancy_queries.append((entry and entry["name"], entry and entry["cluster"],
                                     grid_x, block_x, shared, answer if status == 0 else status))
    return status


def _occupancy_function():
    """The model's cuOccupancyMaxActiveClusters as a C function of the library's prototype."""
    from lltm_cupy._cuda import cluster_kernels

    global _OCCUPANCY
    if _OCCUPANCY is None:
        _OCCUPANCY = cluster_kernels.OCCUPANCY_PROTOTYPE(_max_active_clusters)
    return _OCCUPANCY


_OCCUPANCY = None


# ------------------------------------------------------------------------------------ cuBLAS

class CUBLASError(RuntimeError):
    pass


_CUBLAS_CONSTANTS = dict(CUBLAS_OP_N=0, CUBLAS_OP_T=1, CUBLAS_GEMM_DEFAULT=-1,
                         CUBLAS_COMPUTE_32F=68, CUBLAS_COMPUTE_64F=70)
_RUNTIME_CONSTANTS = dict(CUDA_R_32F=0, CUDA_R_64F=1, CUDA_R_16F=2, CUDA_R_16BF=14,
                          memcpyDeviceToDevice=3)
#: cuBLAS data type -> the storage dtype here; bfloat16 (CUDA_R_16BF) is stored as uint16 bits
_DATA_TYPES = {0: np.float32, 1: np.float64, 2: np.float16, 14: np.uint16}
_COMPUTE_OF = {np.float32: (68, np.float32), np.float16: (68, np.float32),
               np.float64: (70, np.float64), np.uint16: (68, np.float32)}


def _to_compute(a, dtype, scalar):
    if dtype == np.uint16:  # bfloat16 bits: widening is a shift
        return (a.astype(np.uint32) << 16).view(np.float32).astype(scalar)
    return a.astype(scalar)


def _from_compute(x, dtype):
    if dtype == np.uint16:  # round to nearest even, as cuBLAS does
        import ml_dtypes

        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return x.astype(dtype)


def _colmajor(address, rows, cols, ld, dtype):
    """The column-major (rows, cols) matrix at ``address`` with leading dimension ``ld``."""
    dtype = np.dtype(dtype)
    if rows == 0 or cols == 0:
        return np.empty((rows, cols), dtype)
    base = _host_view(address, (cols - 1) * ld + rows, dtype)
    strides = (dtype.itemsize, ld * dtype.itemsize)
    return np.lib.stride_tricks.as_strided(base, (rows, cols), strides)


def _gemm_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C,
             Ctype, ldc, computeType, algo):
    """cublasGemmEx: C = alpha * op(A) @ op(B) + beta * C, column-major, from raw pointers."""
    if _state.capturing:
        raise NotImplementedError("calling cuBLAS API during stream capture is currently "
                                  "unsupported")
    failure = _fault("gemm:cublas")
    if failure is not None:
        raise failure
    if transa not in (0, 1) or transb not in (0, 1) or min(m, n, k) < 0:
        raise CUBLASError("CUBLAS_STATUS_INVALID_VALUE: transpose flag or size")
    a_rows = m if transa == 0 else k
    b_rows = k if transb == 0 else n
    if lda < max(1, a_rows) or ldb < max(1, b_rows) or ldc < max(1, m):
        raise CUBLASError(f"CUBLAS_STATUS_INVALID_VALUE: leading dimension (lda={lda} for "
                          f"{a_rows} rows, ldb={ldb} for {b_rows}, ldc={ldc} for {m})")
    if not (Atype == Btype == Ctype) or Atype not in _DATA_TYPES:
        raise CUBLASError("CUBLAS_STATUS_NOT_SUPPORTED: data types")
    dtype = _DATA_TYPES[Atype]
    compute, scalar = _COMPUTE_OF[dtype]
    if computeType != compute:
        raise CUBLASError("CUBLAS_STATUS_NOT_SUPPORTED: compute type for these data types")
    if dtype in (np.float16, np.uint16):
        assert _state.math_mode & _DISALLOW_REDUCED_PRECISION, \
            "16-bit gemmEx without CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION"
    _state.log.append("gemm")
    _state.gemm_engines.append("cublas")
    if m == 0 or n == 0 or _state.noop:
        return
    a = _colmajor(A, a_rows, k if transa == 0 else m, lda, dtype)
    b = _colmajor(B, b_rows, n if transb == 0 else k, ldb, dtype)
    c = _colmajor(C, m, n, ldc, dtype)
    for operand in (a, b):
        assert not np.shares_memory(operand, c), "gemmEx: C overlaps an input"
    op_a = _to_compute(a if transa == 0 else a.T, dtype, scalar)
    op_b = _to_compute(b if transb == 0 else b.T, dtype, scalar)
    alpha_v = _host_view(alpha, 1, scalar)[0]
    beta_v = _host_view(beta, 1, scalar)[0]
    with np.errstate(all="ignore"):     # IEEE results, as on the GPU; no NumPy warnings
        result = alpha_v * _state.product(op_a, op_b)
        if beta_v != 0:  # cuBLAS does not read C when beta == 0 (it may hold NaN)
            result = result + beta_v * _to_compute(c, dtype, scalar)
        c[...] = _from_compute(result, dtype)


_DISALLOW_REDUCED_PRECISION = 16   # CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION


def _memcpy_async(dst, src, size, kind, stream):
    """cudaMemcpyAsync (``cuda.runtime.memcpyAsync``) from device to device, on raw pointers:
    both ranges in live emulated memory and disjoint, on CuPy's current stream (logged as a
    "copy"). Other kinds are host-device transfers, which nothing here makes this way."""
    assert kind == _RUNTIME_CONSTANTS["memcpyDeviceToDevice"], f"memcpyAsync of kind {kind}"
    assert stream == _current_stream().ptr, \
        f"memcpyAsync on stream {stream:#x}, CuPy's current stream is {_current_stream().ptr:#x}"
    assert type(dst) is int and type(src) is int and type(size) is int and size >= 0
    for name, address in (("destination", dst), ("source", src)):
        assert size == 0 or _in_live_memory(address, size), \
            f"memcpyAsync {name} {address:#x} (+{size} bytes) is in no live device memory"
    assert dst + size <= src or src + size <= dst, "memcpyAsync ranges overlap"
    _state.log.append("copy")
    if size and not _state.noop:
        ctypes.memmove(dst, src, size)


def _set_math_mode(handle, mode):
    _state.math_mode = int(mode)


def _matmul(a, b, out=None):
    failure = _fault("gemm:cublas")
    if failure is not None:
        raise failure
    _state.log.append("gemm")
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.float16:  # cuBLAS accumulates half products in float32
        result = np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    else:
        result = np.matmul(a, b)
    if out is None:
        return _adopt(result)
    np.asarray(out)[...] = result
    return out


def make_module() -> types.ModuleType:
    _state.__init__()
    cupy = types.ModuleType("cupy")
    cupy.__doc__ = __doc__
    cupy.ndarray = ndarray
    cupy.empty = _empty
    cupy.zeros = _zeros
    cupy.full = _full
    cupy.empty_like = _empty_like_shape
    cupy.zeros_like = lambda a: _zeros(np.shape(a), np.asarray(a).dtype)
    cupy.ones_like = lambda a: _adopt(np.ones_like(np.asarray(a)))
    cupy.ones = lambda shape, dtype=np.float64: _adopt(np.ones(shape, dtype))
    cupy.array = _array
    cupy.asarray = lambda a, dtype=None: a if isinstance(a, ndarray) else _array(a, dtype)
    cupy.ascontiguousarray = _ascontiguousarray
    cupy.asfortranarray = _asfortranarray
    cupy.concatenate = _concatenate
    cupy.from_dlpack = _from_dlpack
    cupy.matmul = _matmul
    cupy.shares_memory = np.shares_memory
    cupy.float16, cupy.float32, cupy.float64 = np.float16, np.float32, np.float64
    cupy.int16, cupy.uint16 = np.int16, np.uint16
    cublas = types.SimpleNamespace(gemmEx=_gemm_ex, getMathMode=lambda handle: _state.math_mode,
                                   setMathMode=_set_math_mode, **_CUBLAS_CONSTANTS)
    cupy.cuda = types.SimpleNamespace(
        Device=_Device, is_available=lambda: True, cublas=cublas, Stream=Stream,
        get_current_stream=lambda device_id=-1: _current_stream(),
        runtime_error=CUDARuntimeError,
        runtime=types.SimpleNamespace(
            getDevice=lambda: _state.device, getDeviceProperties=lambda device_id: {
            "name": b"emulated CuPy (host memory)"}, memcpyAsync=_memcpy_async,
            memGetInfo=_mem_get_info,
            **_RUNTIME_CONSTANTS),
        Event=Event, get_elapsed_time=_elapsed_time,
        device=types.SimpleNamespace(get_cublas_handle=lambda: 1),
        driver=types.SimpleNamespace(funcSetAttribute=_func_set_attribute,
                                     CUDADriverError=CUDADriverError),
        using_allocator=using_allocator, UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
        BaseMemory=BaseMemory, memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
        compiler=types.SimpleNamespace(CompileException=CompileException))
    cupy.get_default_memory_pool = _MemoryPool
    cupy.__version__ = "emulated"
    cupy.emulator = _state
    return cupy


def convert_kernel_args(args, dtype, kinds, outputs, extents=None, index_extents=False):
    """ctypes arguments for a host-compiled kernel, as strict as a RawKernel launch: ``kinds``
    names each argument ("array": an emulated array of ``dtype``, or an int device pointer;
    "index": an array of int64, or (with ``index_extents``) a pointer; "int32", "int64": NumPy
    scalars of exactly that type), and no range the kernel writes (``outputs``, argument
    indices) may overlap another argument's: every pointer is __restrict__. ``extents(args)``:
    the elements the kernel touches from each "array" argument (and, with ``index_extents``,
    each "index" one), in order (a pointer must have them in live memory, an array at least
    them); without it pointers are refused."""
    assert len(args) == len(kinds), f"kernel takes {len(kinds)} arguments, got {len(args)}"
    sizes = iter(extents(args) if extents is not None else ())
    spans = []
    converted = []
    for i, (a, kind) in enumerate(zip(args, kinds)):
        if kind in ("array", "index") and type(a) is int:
            item = np.dtype(dtype if kind == "array" else np.int64).itemsize
            assert extents is not None, f"argument {i}: this kernel takes no pointers"
            nbytes = next(sizes) * item
            assert nbytes == 0 or _in_live_memory(a, nbytes), \
                f"argument {i}: pointer {a:#x} (+{nbytes} bytes) is in no live device memory"
            spans.append((i, a, nbytes))
            converted.append(ctypes.c_void_p(a))
        elif kind in ("array", "index"):
            want = np.dtype(dtype) if kind == "array" else np.dtype(np.int64)
            assert isinstance(a, ndarray) and a.dtype == want, \
                f"kernel array argument of dtype {getattr(a, 'dtype', type(a))}, expected {want}"
            if extents is not None and (kind == "array" or index_extents):
                need = next(sizes)
                assert a.size >= need, f"argument {i}: {a.size} elements, the kernel reads {need}"
            converted.append(ptr(a))
            spans.append((i, a.ctypes.data, a.nbytes))
        elif kind == "int32":
            assert type(a) is np.int32, f"expected numpy.int32, got {type(a).__name__}"
            converted.append(ctypes.c_int(int(a)))
        else:
            assert type(a) is np.int64, f"expected numpy.int64, got {type(a).__name__}"
            converted.append(ctypes.c_longlong(int(a)))
    for i in outputs:
        _, start, size = next(s for s in spans if s[0] == i)
        for j, other, other_size in spans:
            assert j == i or not size or not other_size or \
                start + size <= other or other + other_size <= start, \
                f"kernel output argument {i} overlaps argument {j} (restrict pointers)"
    return converted


def host_get_kernels(lib):
    """A replacement for lltm_cupy._cuda.elementwise.get_kernels that launches the host-compiled
    kernels (``lib``; None: no kernel runs, the arguments are checked as ever)."""
    from lltm_cupy._cuda.elementwise import Kernels

    check = convert_kernel_args

    def kernel(fn, name, kinds, outputs, dtype):
        extents = _EXTENTS[name]

        def launch(grid, block, args, shared_mem=0, stream=None):
            assert grid[0] > 0 and block[0] > 0, "a launch with an empty grid is an error"
            assert shared_mem == 0 and stream is None, "on CuPy's current stream, no shared memory"
            _state.log.append(f"kernel:{name}")
            if _state.noop:
                return
            converted = check(args, dtype, kinds, outputs, extents)
            if fn is not None:
                fn(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), *converted)
        return launch

    made = {}

    def get_kernels(dtype, wide=False):
        dtype = np.dtype(dtype)
        _state.compile("lltm.cu", dtype.str)   # one module per dtype holds both index widths
        if (dtype, wide) not in made:
            made[dtype, wide] = make(dtype, wide)
        return made[dtype, wide]

    def make(dtype, wide):
        suffix = SUFFIX[dtype] + ("_wide" if wide else "")

        def symbol(name):
            return None if lib is None else getattr(lib, f"{name}_{suffix}")

        return Kernels(
            kernel(symbol("lltm_fwd"), "fwd",
                   ["array"] * 5 + ["int64", "int32"], (0, 3, 4), dtype),
            kernel(symbol("lltm_bwd"), "bwd",
                   ["array"] * 6 + ["int32", "int32", "int64", "int32"], (4, 5), dtype),
            kernel(symbol("lltm_concat"), "concat",
                   ["array"] * 3 + ["int64", "int32", "int32"], (2,), dtype),
            kernel(symbol("lltm_add"), "add", ["array"] * 2 + ["int64"], (0,),
                   dtype))

    return get_kernels


def _concat_extents(args):
    total, state, features = int(args[3]), int(args[4]), int(args[5])
    rows = total // (state + features)
    return rows * state, rows * features, total


#: elements each kernel of cuda_src/lltm.cu touches from its array arguments, from its sizes
_EXTENTS = {
    "fwd": lambda a: (3 * int(a[5]), 3 * int(a[6]), int(a[5]), int(a[5]), int(a[5])),
    "bwd": lambda a: (int(a[8]), int(a[8]), 3 * int(a[8]), int(a[8]), 3 * int(a[8]), int(a[8])),
    "concat": _concat_extents,
    "add": lambda a: (int(a[2]), int(a[2])),
}
