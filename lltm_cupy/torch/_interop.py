"""The bridge from the torch layer to the backends: device, stream, memory and GEMMs of a
backend call.

CPU tensors run the NumPy backend on arrays over the tensors' memory (``_cpu_arrays``), with the
GEMMs through torch (one BLAS thread pool per process): :data:`CPU_CALL`.

CUDA tensors run the CUDA backend's kernels on the tensors' device pointers, one way for every
case (a step, sequences of one length, variable lengths, the fused kernels and their variants):

- **stream and device**: :func:`launching`, the tensors' device current (entered only when it
  is not already) and torch's current stream there CuPy's, its raw handle read on every call,
  never cached (``torch._C._cuda_getCurrentRawStream``: no torch Stream object; CuPy's wrapper
  of a handle, which holds nothing but the handle, is made at the handle's first use and kept);
- **memory**: every buffer a ``torch.empty`` tensor (torch's caching allocator, torch's current
  stream): outputs, saved values, temporaries, the fused group variant's exchange buffer and
  counters (:func:`group_buffers`) and a packing plan's index arrays (:func:`plan_arrays`,
  uploaded once per plan and device). torch sees and accounts for all of it, ``empty_cache``
  and memory snapshots cover it, ``record_stream`` works on it (:func:`use_plans`), and during
  CUDA-graph capture it comes from the graph's private pool. Not from torch: the compiled
  kernel modules (see ``lltm_cupy.warmup``). No CuPy array, no DLPack import;
- **GEMM**: torch's (``torch.mm`` / ``addmm_``: :func:`mm`, ``_torch_gemm._mm`` /
  ``_addmm_``), eagerly and while the stream is being captured into a CUDA graph alike, so that
  a graph's replay computes what the eager call computes (CuPy's cuBLAS binding refuses every
  call during a capture). So the torch layer's GEMMs follow torch's matmul settings, as
  ``torch.mm`` does (TF32 only where ``torch.backends.cuda.matmul.allow_tf32`` or
  ``torch.set_float32_matmul_precision`` allow it; 16-bit reductions as
  ``allow_fp16_reduced_precision_reduction`` / ``allow_bf16_reduced_precision_reduction``
  say); the array API's GEMMs are CuPy's cuBLAS. torch keeps one cuBLAS handle per thread and
  device and creates it at the thread's first torch GEMM, which must not happen inside a
  capture (``cublasCreate`` fails there): an eager call makes it, and ``lltm_cupy.warmup``
  makes it for the calling thread and autograd's.

Autocast is switched off inside a call: the backend's GEMMs must run in the dtype the cell
computes in (``lltm_cupy.torch`` casts the arguments first, as autocast would).
"""
from __future__ import annotations

import threading

import numpy as np
import torch
from torch import Tensor
from .. import _numpy, _packing
from . import _cpu_arrays, _torch_gemm
from ._torch_gemm import cpu_gemm

__all__ = ["CPU_CALL", "cuda_backend", "without_autocast", "launching", "mm", "rows", "DTYPES",
           "KERNEL_DTYPE", "EMULATED_CUDA", "use_plans", "upload", "plan_arrays", "TorchArrays",
           "group_buffers", "prepare_capture"]

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


def use_plans(plans, like: Tensor, lengths=None, reverse: bool = False) -> tuple:
    """The packing plans a call runs on, made ready on ``like``'s device and returned: ``plans``,
    or (``lengths`` given) the one plan of those lengths over ``like`` (steps, batch, ...) in
    that direction, from the plan cache:

    - under CUDA-graph capture, variable-length input runs only on plans already on the device
      (and with lengths on the host: reading lengths on the GPU would wait for it): else
      CaptureError, before any work is queued; plans used under capture are kept for the
      graph's replays;
    - a plan's index arrays are torch tensors made on the stream current at their upload
      (:func:`plan_arrays`): used on another stream, that stream is recorded on them
      (``record_stream``, once per plan and stream), so that torch does not hand their memory
      out again, once the plan is dropped, before the work queued there has read them."""
    cuda = cuda_backend(like)
    if cuda:
        index = _device_index(like.device)
        stream = current_raw_stream(index)
        capturing = _cupy_stream(index, stream).is_capturing()
    if lengths is not None:
        if cuda and capturing and isinstance(lengths, Tensor) and lengths.device.type != "cpu":
            raise _packing.capture_error("with lengths on the GPU (reading them would wait for "
                                         "the device)")
        steps, batch = like.shape[:2]
        plans = (_packing.cached_plan(_packing.check_lengths(lengths, steps, batch), steps,
                                      reverse, "torch"),)
    if not cuda:
        return plans
    for p in plans:
        arrays = p.first_use_on(index, stream)
        if arrays is not None:
            for a in vars(arrays).values():
                if a is not None:
                    record_stream(a, index, stream)
    if capturing:
        if not all(p.on_device(index) for p in plans):
            raise _packing.capture_error()
        for p in plans:
            _packing.pin(p)
    return plans


def record_stream(tensor: Tensor, index: int, stream: int) -> None:
    """``tensor.record_stream`` of the stream with handle ``stream`` on device ``index`` (the
    tests' emulated CUDA path replaces this)."""
    tensor.record_stream(torch.cuda.ExternalStream(stream, device=torch.device("cuda", index)))


class Call:
    """What a call of the NumPy backend from the torch layer uses (:data:`CPU_CALL`): the
    backend module, its GEMM engine for a sequence of (rows a step, state, torch dtype)
    (``gemm``), and the two conversions (tensor -> array, array -> tensor)."""

    __slots__ = ("backend", "name", "gemm", "array", "tensor")

    def __init__(self, backend, name, gemm, array, tensor):
        self.backend, self.name, self.gemm = backend, name, gemm
        self.array, self.tensor = array, tensor


CPU_CALL = Call(_numpy, "numpy", cpu_gemm, _cpu_arrays.to_array, _cpu_arrays.to_tensor)


# ------------------------------------------------------------- the CUDA kernels' launches

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
    again if reading the stream fails)."""

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
    """``out = a @ b`` by torch (the CUDA path's GEMMs: torch's cuBLAS, on torch's current
    stream, under torch's matmul settings; ``_torch_gemm._mm``, which the tests' emulated CUDA
    path wraps)."""
    return _torch_gemm._mm(a, b, out=out)


def rows(t: Tensor) -> tuple:
    """(device pointer, bytes a row) of a contiguous tensor: what the backend's pointer loops
    take for a stack of steps or rows."""
    return t.data_ptr(), t.stride(0) * t.element_size()


def upload(a: np.ndarray, device: torch.device) -> Tensor:
    """A copy of the host array ``a`` on ``device`` (torch's allocator, torch's current
    stream): a packing plan's index array (the tests' emulated CUDA path notes it as a
    host-device copy, refused while capturing)."""
    return torch.from_numpy(a).to(device, copy=True)


def plan_arrays(plan, like: Tensor):
    """``plan``'s index arrays on ``like``'s device as torch tensors (``Plan.device_arrays``:
    uploaded at the plan's first use there, on torch's current stream, then kept with the plan;
    refused while a graph is being captured unless they are there already). Call it inside
    :func:`launching`."""
    device = like.device
    index = _device_index(device)
    stream = current_raw_stream(index)
    return plan.device_arrays(lambda a: upload(a, device), index, stream,
                              _cupy_stream(index, stream).is_capturing())


class TorchArrays:
    """What the CUDA backend's helpers that only allocate and index ask of their array module
    (CuPy's ``empty(shape, dtype)`` and ``zeros(shape, dtype)``), for torch tensors on
    ``device`` (``dtype`` a torch dtype): ``lltm_cupy._cuda.packed``'s, ``lltm_cupy._packing``'s
    ``unpack_rows`` and ``incoming_cell_grad``."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device):
        self.device = device

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.device)

    def zeros(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=self.device)


def group_buffers(like: Tensor, elements: int, acc, tiles: int):
    """The fused group variant's exchange buffer (``elements`` of the arithmetic type ``acc``)
    and its tiles' counters (``tiles``, zeroed) as torch tensors on ``like``'s device: the
    ``buffers`` of ``lltm_cupy._cuda.group_kernels.group_launch`` (bind ``like`` first)."""
    exchange = like.new_empty(elements, dtype=torch.float64 if acc is np.float64
                              else torch.float32)
    counters = like.new_zeros(tiles, dtype=torch.int32)     # (read as uint32: its bits)
    return exchange.data_ptr(), counters.data_ptr(), (exchange, counters)
