"""The bridge from the torch layer to the backends: zero-copy conversions, device, stream, memory
and GEMM of a backend call, and the pointer launches of the CUDA step.

CPU tensors run the NumPy backend on ``Tensor.numpy()`` views, with the GEMMs through torch's
BLAS (one BLAS thread pool per process). CUDA tensors run the CuPy backend:

- **in**: DLPack, zero-copy (a capsule as ``__dlpack__(stream=-1)`` makes it: no stream
  handshake is needed, every kernel runs on the stream torch is on, and none is recorded, so
  the import is legal while a CUDA graph is being captured);
- **stream and device**: CuPy runs on torch's current stream of the tensors' device, read on
  every call, never cached (its raw handle, ``torch._C._cuda_getCurrentRawStream``: no torch
  Stream object; CuPy's wrapper of a handle, which holds nothing but the handle, is made at the
  handle's first use and kept), with the device entered only when it is not current already;
- **memory**: every array CuPy allocates inside a call (outputs, saved values, temporaries,
  CuPy's own scratch) comes from torch's caching allocator on that stream, through a CuPy
  allocator installed for the call only (``cupy.cuda.using_allocator``; the user's own CuPy code
  keeps CuPy's pool). torch sees and accounts for all of it, ``empty_cache`` and memory
  snapshots cover it, and during CUDA-graph capture it comes from the graph's private pool.
  The GEMMs' workspace is torch's too (its cuBLAS handles'); not from torch: the compiled kernel
  modules (see ``lltm_cupy.warmup``);
- **out**: the arrays the backend returns live in those torch allocations, and come back as
  ordinary torch tensors over them (not DLPack wrappers), so ``record_stream`` works on them
  (``_cuda_arrays``: an array over an imported tensor comes back as a view of that tensor);
- **GEMM**: torch's (``torch.mm`` / ``addmm_`` on torch views of the same memory, on the same
  stream: ``_torch_gemm.TORCH_CUDA_GEMM``), eagerly and while the stream is being captured into
  a CUDA graph alike, so that a graph's replay computes what the eager call computes. CuPy's
  cuBLAS binding cannot serve both: it refuses every cuBLAS call during a capture. So the torch
  layer's GEMMs follow torch's matmul settings, as ``torch.mm`` does (TF32 only where
  ``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision`` allow it;
  16-bit reductions as ``allow_fp16_reduced_precision_reduction`` /
  ``allow_bf16_reduced_precision_reduction`` say); the array API's GEMMs are CuPy's cuBLAS. torch
  keeps one cuBLAS handle per thread and device and creates it at the thread's first torch
  GEMM, which must not happen inside a capture (``cublasCreate`` fails there): an eager call
  makes it, and ``lltm_cupy.warmup`` makes it for the calling thread and autograd's.

The CUDA step (``_functions``) launches the kernels on the tensors' device pointers instead
(:func:`launching`: the device current and torch's current stream CuPy's, nothing else), into
``torch.empty`` tensors, with torch's GEMMs (:func:`mm`).

Autocast is switched off inside a call: the backend's GEMMs must run in the dtype the cell
computes in (``lltm_cupy.torch`` casts the arguments first, as autocast would).
"""
from __future__ import annotations

import contextlib
import functools
import threading

import numpy as np
import torch
from torch import Tensor
from .. import _numpy
from . import _cpu_arrays, _torch_gemm
from ._cuda_arrays import imports as _imports, to_array as _array_cuda, to_tensor as _tensor_cuda
from ._torch_gemm import TORCH_CUDA_GEMM, TORCH_GEMM

__all__ = ["cuda_call", "CPU_CALL", "cuda_backend", "without_autocast", "launching", "mm", "DTYPES", "KERNEL_DTYPE",
           "EMULATED_CUDA", "fused_kw", "use_plans", "prepare_capture"]

#: What each backend computes in. bfloat16 CPU tensors are computed in float32 by the layer above
#: (lltm_cupy.torch._ops), so they never reach the NumPy backend.
DTYPES = {"cpu": (torch.float32, torch.float64),
          "cuda": (torch.float16, torch.bfloat16, torch.float32, torch.float64)}

#: The tests' emulated CUDA path (tests/helpers/emulated_torch.py) sets this: CPU tensors then
#: run the CUDA backend's code, on the emulated CuPy.
EMULATED_CUDA = False

#: torch dtype -> the CUDA kernels' dtype (bfloat16: its bits, lltm_cupy._cuda.kernels.BFLOAT16)
KERNEL_DTYPE = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(np.uint16),
                torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


def cuda_backend(t: Tensor) -> bool:
    """Whether the tensor ``t`` runs on the CUDA backend (a CUDA tensor, or any under the tests'
    emulated CUDA path): the one test the torch layer makes of it."""
    return t.is_cuda or EMULATED_CUDA


_any_autocast = torch._C._is_any_autocast_enabled
_DisableAutocast = torch._C._DisableAutocast


def without_autocast(body, name=None, **bound):
    """``body`` as a function of the caller's arguments (and the keywords ``bound``), run with
    torch's autocast off (on every device, where any is on): the one way the torch layer
    switches it off, around the bodies of its Functions and custom operators. The backends'
    GEMMs run in the dtype the layer computes in, which it cast the arguments to (as autocast
    would: ``_ops``); left on, autocast would cast the GEMMs' operands again (to bfloat16 under
    CPU autocast, which NumPy cannot hold). The result takes positional arguments only, and
    shows no other signature (an autograd Function's forward: ``torch.func`` passes each
    parameter of its signature, defaults included)."""
    def run(*args):
        if not _any_autocast():
            return body(*args, **bound)
        with _DisableAutocast():
            return body(*args, **bound)
    run.__name__ = run.__qualname__ = name or body.__name__
    run.__doc__, run.__module__ = body.__doc__, body.__module__
    return run


# ------------------------------------------------------------------------------------ CPU


# ----------------------------------------------------------------------------------- CUDA

class _StreamRef:
    """A CUDA stream handle offered through the CUDA stream protocol (any torch version)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@contextlib.contextmanager
def _stream(device: torch.device):
    """CuPy's current stream = torch's current stream on ``device`` (read now, not cached)."""
    with _torch_stream(_device_index(device)) as stream:
        yield stream


def current_raw_stream(index: int) -> int:
    """The raw handle of torch's current stream on device ``index``, read now: by
    ``torch._C._cuda_getCurrentRawStream`` (no object made), else (a torch without it) by
    ``torch.cuda.current_stream(index).cuda_stream``."""
    read = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if read is not None:
        return read(index)
    return torch.cuda.current_stream(index).cuda_stream


def _torch_stream(index: int):
    """torch's current stream on device ``index`` (its handle read on every call, never cached)
    as a CuPy stream."""
    return _cupy_stream(index, current_raw_stream(index))


_cupy_streams: dict = {}
#: CuPy stream wrappers kept at most (torch reuses its streams' handles from a pool)
_STREAMS_KEPT = 256


def _cupy_stream(index: int, handle: int):
    """The CuPy stream over the raw handle ``handle`` of device ``index``: a wrapper of an
    external stream (``Stream.from_external``), which owns and remembers nothing but the handle,
    so one per (device, handle) is made at the handle's first use and kept (which stream a call
    runs on is still read on every call)."""
    stream = _cupy_streams.get((index, handle))
    if stream is None:
        import cupy

        if len(_cupy_streams) >= _STREAMS_KEPT:
            _cupy_streams.clear()
        stream = _cupy_streams[index, handle] = cupy.cuda.Stream.from_external(
            _StreamRef(handle))
    return stream


def _device_index(device: torch.device) -> int:
    return 0 if device.index is None else device.index


_ALLOCATORS: dict = {}


def _torch_allocator(device: torch.device):
    """A CuPy allocator whose every allocation is a torch tensor on ``device`` (torch's caching
    allocator, torch's current stream); the tensor is the memory's owner. One per device, made
    at its first use."""
    found = _ALLOCATORS.get(device)
    if found is not None:
        return found
    import cupy

    index = _device_index(device)
    memory, pointer = cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer

    def allocate(nbytes: int):
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return pointer(memory(buffer.data_ptr(), nbytes, buffer, index), 0)

    _ALLOCATORS[device] = allocate
    return allocate


_blas_ready = threading.local()


def create_torch_blas_handle(index: int) -> None:
    """Create torch's cuBLAS handle of the calling thread on device ``index`` now (torch creates
    it at the thread's first torch GEMM, which must not be inside a capture); the tests'
    emulated CUDA path replaces this."""
    with torch.cuda.device(index):
        torch.cuda.current_blas_handle()


def _torch_blas_ready(index: int) -> None:
    """Once per thread and device: torch's cuBLAS handle exists for this thread."""
    devices = getattr(_blas_ready, "devices", None)
    if devices is None:
        devices = _blas_ready.devices = set()
    if index not in devices:
        create_torch_blas_handle(index)
        devices.add(index)


def _prepare_thread(index: int) -> None:
    """What the calling thread needs for a capture on device ``index`` and makes only outside
    one: torch's cuBLAS handle, and a current CUDA context (``kernels.ensure_context``: CuPy binds
    a thread's context lazily, in its first runtime call; the fused kernels' occupancy queries
    need one)."""
    from .._cuda import kernels

    _torch_blas_ready(index)
    with kernels.on_device(index):
        kernels.ensure_context()


class _PrepareThread(torch.autograd.Function):
    """An identity whose backward prepares the thread autograd runs it on
    (:func:`_prepare_thread`)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.index = index
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _prepare_thread(ctx.index)
        return grad, None


def prepare_capture(index: int) -> None:
    """What a later capture on device ``index`` needs and must not make itself
    (:func:`_prepare_thread`), for the calling thread and for autograd's thread for the device
    (which runs the backward), by one tiny backward there. Nothing without a CUDA device for
    torch (but the calling thread's on the tests' emulated CUDA path)."""
    if not torch.cuda.is_available():
        if EMULATED_CUDA:
            _prepare_thread(index)
        return
    _prepare_thread(index)
    x = torch.ones(1, 1, device=torch.device("cuda", index), requires_grad=True)
    _PrepareThread.apply(torch.mm(x, x), index).sum().backward()


def use_plans(plans, like: Tensor, lengths=None) -> None:
    """Before a call that reads the packing plans' index arrays on ``device``:

    - under CUDA-graph capture, variable-length input runs only on plans already on the device
      (and with lengths on the host): else CaptureError, before any work is queued; plans used
      under capture are kept for the graph's replays;
    - a plan's index arrays are torch allocations made on the stream current at their upload:
      used on another stream, that stream is recorded on them (``record_stream``, once per plan
      and stream), so that torch does not hand their memory out again, once the plan is
      dropped, before the work queued there has read them."""
    if not cuda_backend(like):
        return
    index = _device_index(like.device)
    stream = current_raw_stream(index)
    for p in plans:
        arrays = p.first_use_on(index, stream)
        if arrays is not None:
            for a in vars(arrays).values():
                owner = None if a is None else getattr(a.data.mem, "_owner", None)
                if isinstance(owner, Tensor):
                    record_stream(owner, index, stream)
    if not _cupy_stream(index, stream).is_capturing():
        return
    from .._packing import capture_error, pin

    if isinstance(lengths, Tensor) and lengths.device.type != "cpu":
        raise capture_error("with lengths on the GPU (reading them would wait for the device)")
    if not all(p.on_device(index) for p in plans):
        raise capture_error()
    for p in plans:
        pin(p)


def record_stream(tensor: Tensor, index: int, stream: int) -> None:
    """``tensor.record_stream`` of the stream with handle ``stream`` on device ``index`` (the
    tests' emulated CUDA path replaces this)."""
    tensor.record_stream(torch.cuda.ExternalStream(stream, device=torch.device("cuda", index)))


class Call:
    """What one backend call from the torch layer uses: the backend module, its GEMM keyword,
    and the two conversions (tensor -> array, array -> tensor). Also a do-nothing context
    manager, so that the common CPU case costs no generator."""

    __slots__ = ("backend", "name", "kw", "array", "tensor")

    def __init__(self, backend, name, kw, array, tensor):
        self.backend, self.name, self.kw = backend, name, kw
        self.array, self.tensor = array, tensor

    def optional(self, t):
        return None if t is None else self.array(t)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


CPU_CALL = Call(_numpy, "numpy", {"mm": TORCH_GEMM}, _cpu_arrays.to_array, _cpu_arrays.to_tensor)


def cuda_call(device: torch.device):
    """The context of one call of the CUDA backend on its arrays for tensors on ``device``;
    ``with`` it gives a :class:`Call`. (The CPU's is :data:`CPU_CALL`, which needs none.)"""
    return _CudaCall(device)


class _CudaCall:
    """One call of the CUDA backend: the tensors' device current (entered only when it is not
    already), torch's current stream as CuPy's (its handle read now), torch's caching allocator
    as CuPy's, the call's imported tensors remembered (``_cuda_arrays.imports``), and torch's
    GEMM."""

    __slots__ = ("_device", "_entered")

    def __init__(self, device: torch.device):
        self._device = device

    def __enter__(self):
        import cupy

        from .._cuda import kernels

        device = self._device
        index = _device_index(device)
        entered = self._entered = []
        try:
            for context in (kernels.on_device(index), _torch_stream(index),
                            cupy.cuda.using_allocator(_torch_allocator(device)), _imports()):
                context.__enter__()
                entered.append(context)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return _cuda_call()

    def __exit__(self, *exc):
        while self._entered:
            self._entered.pop().__exit__(None, None, None)
        return False


_CUDA_CALL: list = []


def _cuda_call() -> Call:
    """The :class:`Call` of the CUDA backend (made at first use: it imports the backend)."""
    if not _CUDA_CALL:
        from .. import _cuda

        _CUDA_CALL.append(Call(_cuda, "cupy", {"gemm": TORCH_CUDA_GEMM}, _array_cuda,
                               _tensor_cuda))
    return _CUDA_CALL[0]


def fused_kw(call) -> dict:
    """The backend keyword of ``fused=True``: only the GPU backend has the fused sequence
    kernels."""
    return {"fused": True} if call.name == "cupy" else {}


# ---------------------------------------------------------------- the CUDA step's launches

def launching(device: torch.device):
    """``with launching(device):`` the tensors' device is CuPy's current device and torch's
    current stream there CuPy's current stream (its handle read now, never cached): what a
    pointer launch of the backend's kernels needs, and nothing else (no allocator, no
    conversion). Where the device is current already (as in the layer's calls), the CuPy stream
    itself is the context."""
    from .._cuda import kernels

    index = 0 if device.index is None else device.index
    if kernels.current_device() == index:
        return _torch_stream(index)
    return _OnDevice(index)


class _OnDevice:
    """:func:`launching` where the device is not current: enters it, then torch's stream (left
    again if reading the stream fails, as :class:`_CudaCall` does)."""

    __slots__ = ("_index", "_device", "_stream")

    def __init__(self, index: int):
        self._index = index

    def __enter__(self):
        from .._cuda import kernels

        self._device = kernels.on_device(self._index)
        self._device.__enter__()
        try:    # (reading torch's stream may fail: leave the device entered above again)
            self._stream = _torch_stream(self._index)
            self._stream.__enter__()
        except BaseException:
            self._device.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            self._stream.__exit__(None, None, None)
        finally:
            self._device.__exit__(None, None, None)
        return False


def mm(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """``out = a @ b`` by torch (the CUDA step's GEMMs: torch's cuBLAS, on torch's current
    stream, under torch's matmul settings, as the sequences' GEMMs through
    ``_torch_gemm.TORCH_CUDA_GEMM``)."""
    return _torch_gemm._mm(a, b, out=out)
