"""Zero-copy conversions between torch CPU tensors and NumPy arrays for the torch layer's CPU path:
:func:`to_array` (tensor -> NumPy array over its memory) and :func:`to_tensor` (NumPy array ->
torch tensor over the same memory).

Neither uses ``Tensor.numpy()`` or ``torch.from_numpy``, which would leave the tensors unlike
torch's own: ``Tensor.numpy()`` makes the tensor's storage non-resizable for good (a caller's
input, parameter or state could no longer be resized, nor be the ``out=`` of an operation that
resizes), and a ``from_numpy`` tensor's storage is NumPy's, never resizable. Here the memory is
torch's: the results come from ``torch.empty`` (``TorchGemm.empty``) and go back as views of
those tensors; an array over a tensor is a NumPy array over a ctypes buffer at the tensor's
address that holds the tensor (its ``tensor``), so the tensor lives as long as the array.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np
import torch
from torch import Tensor

from .._numpy import memory as _memory

__all__ = ["to_array", "view", "to_tensor", "empty", "NUMPY_DTYPE", "TORCH_DTYPE"]

#: the NumPy backend's dtypes, each way
NUMPY_DTYPE = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}
TORCH_DTYPE = {v: k for k, v in NUMPY_DTYPE.items()}


def _extent(n: int, stride: int) -> int:
    return (n - 1) * stride


class _BufferTypes(dict):
    """ctypes buffer types by byte size, made on first use; past 512 sizes the table restarts."""

    def __missing__(self, nbytes: int):
        if len(self) >= 512:
            self.clear()
        kind = self[nbytes] = ctypes.c_char * nbytes
        return kind


_buffer_types = _BufferTypes()


def to_array(t: Tensor) -> np.ndarray:
    """A NumPy array over the memory of the CPU tensor ``t`` (float32 or float64, any strides),
    no copy, detached; ``t`` stays as it was (its storage resizable)."""
    dtype = NUMPY_DTYPE[t.dtype]
    shape = t.shape
    if t.is_contiguous():
        nbytes, strides = t.nbytes, None
    elif 0 in shape:
        nbytes = 0
    else:
        item = dtype.itemsize
        strides = [*map(item.__mul__, t.stride())]
        nbytes = item + sum(map(_extent, shape, strides))
    if not nbytes:
        return np.empty(shape, dtype)
    # a ctypes buffer at the tensor's address that keeps it alive (what to_tensor reads)
    buffer = _buffer_types[nbytes].from_address(t.data_ptr())
    buffer.tensor = t
    return np.ndarray(shape, dtype, buffer, 0, strides)


def view(t: Tensor) -> np.ndarray:
    """As :func:`to_array`, for the length of one call in which the caller holds ``t``: the
    array does not keep ``t`` alive, and :func:`to_tensor` does not know it (one step's
    arguments and results: no attributes set on its buffer)."""
    kind = _buffer_types.get(t.nbytes)
    if kind is None or not t.is_contiguous():
        return to_array(t)
    return np.ndarray(t.shape, NUMPY_DTYPE[t.dtype], kind.from_address(t.data_ptr()))


def empty(shape, dtype) -> np.ndarray:
    """A NumPy array over a new tensor (which :func:`to_tensor` gives back): ``torch.empty``'s,
    or for a large one the memory of a tensor this thread handed out before that nothing refers
    to any more (``lltm_cupy._numpy.memory.reuse``, the rule and limits of the backend's own
    large arrays)."""
    torch_dtype = TORCH_DTYPE[dtype]
    count = math.prod(shape)
    if count * dtype.itemsize >= _memory.RECYCLE_BYTES and _use_count is not None:
        t = _memory.reuse("torch", count, torch_dtype, _unreferenced, _flat).view(shape)
    else:
        t = torch.empty(shape, dtype=torch_dtype)
    if not t.nbytes:
        return np.empty(shape, dtype)
    buffer = _buffer_types[t.nbytes].from_address(t.data_ptr())
    buffer.tensor = t
    return np.ndarray(shape, dtype, buffer)


#: a storage's reference count (torch's private call; None in a torch without it: no reuse)
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unreferenced(t: Tensor) -> bool:
    """Whether nothing refers to the memory of ``t`` (a tensor of ``memory.reuse``) but ``t``:
    no tensor, view or array (its storage's reference count is that of ``t`` and of the storage
    object this check makes)."""
    return _use_count(t.untyped_storage()._cdata) == 2


def _flat(count: int, dtype) -> Tensor:
    return torch.empty(count, dtype=dtype)


def to_tensor(a: np.ndarray) -> Tensor:
    """The torch tensor over array ``a``'s memory, no copy: where ``a`` is (a view of) an array
    of :func:`to_array` or :func:`empty`, that tensor or a view of it (an ordinary torch
    tensor); else ``torch.from_numpy(a)``."""
    owner = a.base
    while owner.__class__ is np.ndarray:
        owner = owner.base
    t = getattr(owner, "tensor", None)
    if t is None or not a.size or min(a.strides, default=0) < 0:
        return torch.from_numpy(a)
    if a.base is owner and a.shape == t.shape:
        return t                            # (the array of to_array or empty itself)
    item = a.itemsize
    offset = (a.ctypes.data - ctypes.addressof(owner)) // item
    return t.as_strided(a.shape, [s // item for s in a.strides], t.storage_offset() + offset)
