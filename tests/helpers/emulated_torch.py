"""The emulated CUDA path's set-up, shared by tests/conftest.py's fixtures and
scripts/profile_step.py --emulated: the emulated CuPy installed as ``cupy``, and lltm_cupy.torch's
CUDA path run on CPU tensors with torch's streams and cuBLAS handles emulated. ``patch`` is a
``pytest.MonkeyPatch`` (its changes are undone when it is)."""
from __future__ import annotations

import contextlib
import sys
import threading

from . import emulated_cupy as emu


def install_cupy(patch, get_kernels):
    """Install a fresh emulated CuPy as ``cupy``, with ``get_kernels`` as the CUDA backend's
    kernel lookup and one "SM" (at most 8 blocks of 256 threads, so B * S above 2048 takes
    several grid strides). Returns the module."""
    from lltm_cupy._cuda import cluster_kernels, elementwise, kernels

    fake = emu.make_module()
    patch.setitem(sys.modules, "cupy", fake)
    patch.setattr(elementwise, "get_kernels", get_kernels)
    patch.setattr(elementwise, "_launches", {})   # launches hold the lookup's kernels
    patch.setattr(kernels, "_sm_count", lambda device_id: 1)
    patch.setattr(cluster_kernels, "_occupancy_function", emu._occupancy_function)
    patch.setattr(cluster_kernels, "_occupancy", {})
    patch.setattr(kernels, "cluster_failures", {})
    patch.setattr(kernels, "refused_sizes", set())
    return fake


class TorchStream:
    """What the emulated ``torch.cuda.current_stream`` returns: a stream handle."""

    _next_handle = 0x2000

    def __init__(self, handle=None, device=None, priority=0):
        if handle is None:
            TorchStream._next_handle += 0x10
            handle = TorchStream._next_handle
        self.cuda_stream = handle

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


def install_torch(patch, fake):
    """lltm_cupy.torch's CUDA path on CPU tensors over the emulated CuPy ``fake`` (see
    conftest's ``emulated_cuda_torch``). Each ``torch.cuda.current_stream()`` counts a stream
    object made (torch makes a Python Stream object per call); the raw handle
    (``torch._C._cuda_getCurrentRawStream``) is an int and counts nothing. A packing plan's
    index arrays uploaded as torch tensors (``_interop.upload``) are host-device copies to the
    emulator (``transfers``; refused while ``capturing``)."""
    import torch

    from lltm_cupy.torch import _interop

    emulator = fake.emulator
    current = [TorchStream(0)]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield s
        finally:
            current.pop()

    def current_stream(device=None):
        emulator.count("streams")
        return current[-1]

    patch.setattr(torch.cuda, "current_stream", current_stream)
    patch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: current[-1].cuda_stream,
                  raising=False)
    patch.setattr(torch.cuda, "Stream", TorchStream)
    patch.setattr(torch.cuda, "stream", stream)
    patch.setattr(_interop, "EMULATED_CUDA", True)    # CPU tensors run the CUDA backend's code
    # The CUDA step launches its kernels on tensors' data_ptr(): a tensor whose pointer is taken
    # is device memory to the emulator for as long as the tensor object lives (a kernel given a
    # pointer into a tensor already freed fails the emulator's live-memory check).
    real_data_ptr = torch.Tensor.data_ptr

    def data_ptr(t):
        storage = t.untyped_storage()
        if getattr(t, "_emulated_memory", None) is None and storage.nbytes():
            t._emulated_memory = emu.BaseMemory(storage.data_ptr(), storage.nbytes())
        return real_data_ptr(t)

    patch.setattr(torch.Tensor, "data_ptr", data_ptr)
    real_upload = _interop.upload

    def upload(a, device):      # a packing plan's index array: a host-device copy
        emulator.transfer("h2d", a.nbytes)
        return real_upload(a, device)

    patch.setattr(_interop, "upload", upload)
    # record_stream of a CPU tensor raises: noted instead
    patch.setattr(_interop, "record_stream",
                  lambda tensor, index, stream: emulator.recorded_streams.append(stream))
    emulator.torch_stream = lambda: current[-1].cuda_stream
    torch_blas(emulator, _interop, patch)
    return fake


def torch_blas(emulator, interop, patch):
    """torch's per-thread cuBLAS handles, as the emulator models them: made by
    ``create_torch_blas_handle`` or by a thread's first torch GEMM outside a capture; a torch
    GEMM inside a capture on a thread without one raises, as ``cublasCreate`` does there. Every
    torch GEMM of the CUDA path (``_torch_gemm._mm`` / ``_addmm_``) is device work: logged as
    "gemm" on its stream, its engine noted in ``emulator.gemm_engines`` ("torch"; CuPy's gemmEx
    notes "cublas"), its arithmetic skipped under ``noop``; a fault injected there (the
    emulator's ``fault``, kind "gemm:torch") raises."""
    from lltm_cupy.torch import _torch_gemm

    patch.setattr(interop, "_blas_ready", threading.local())   # a fresh process
    emulator.torch_blas_threads.clear()
    patch.setattr(interop, "create_torch_blas_handle",
                  lambda index: emulator.torch_blas_threads.add(threading.get_ident()))

    def issued(out):
        failure = emu._fault("gemm:torch")
        if failure is not None:
            raise failure
        if threading.get_ident() not in emulator.torch_blas_threads:
            if emulator.capturing:
                raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling "
                                   "`cublasCreate(handle)`")
            emulator.torch_blas_threads.add(threading.get_ident())
        if out.numel():     # torch's work: on torch's current stream, whatever CuPy's is
            emulator.log.append("gemm", emulator.torch_stream())
            emulator.gemm_engines.append("torch")
        return not emulator.noop

    real_mm, real_addmm = _torch_gemm._mm, _torch_gemm._addmm_

    def mm(a, b, *, out):
        return real_mm(a, b, out=out) if issued(out) else out

    def addmm_(out, a, b):
        return real_addmm(out, a, b) if issued(out) else out

    patch.setattr(_torch_gemm, "_mm", mm)
    patch.setattr(_torch_gemm, "_addmm_", addmm_)
