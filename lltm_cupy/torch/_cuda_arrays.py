"""Zero-copy conversions between torch CUDA tensors and CuPy arrays for the torch layer's CUDA
path: :func:`to_array` (tensor -> CuPy array, through DLPack) and :func:`to_tensor` (CuPy array
-> torch tensor over the same memory), and :func:`imports`, the tensors a call imported.

``to_tensor`` of an array whose memory torch allocated for the call (``_interop``'s allocator)
gives a view of that allocation; of an array over an imported tensor's memory (an argument,
``weights.T``, a slice of it) a view of that tensor, found in the call's imports by the memory
object (no DLPack round trip); anything else through DLPack.
"""
from __future__ import annotations

import threading

import numpy as np
import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack as _to_dlpack

__all__ = ["to_array", "to_tensor", "imports", "TORCH_DTYPE"]

#: CuPy dtype -> torch dtype; uint16 arrays are bfloat16 bits (lltm_cupy._cuda.kernels.BFLOAT16)
TORCH_DTYPE = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
               np.dtype(np.float64): torch.float64, np.dtype(np.uint16): torch.bfloat16}

_local = threading.local()


class imports:
    """``with imports():`` the tensors :func:`to_array` imports in the block are remembered,
    by the memory object of their CuPy array, until the block ends (so :func:`to_tensor` can
    return views of them); blocks nest."""

    __slots__ = ("_outer",)

    def __enter__(self):
        self._outer = getattr(_local, "imported", None)
        _local.imported = {}
        return self

    def __exit__(self, *exc):
        _local.imported = self._outer
        return False


def to_array(t: Tensor):
    """A CuPy view of ``t`` through DLPack (a contiguous export: the well-trodden path). CuPy has
    no bfloat16: a bfloat16 tensor crosses as its bits (an int16 view), and arrives as uint16,
    which the CuPy backend reads as bfloat16.

    The capsule comes from ``torch.utils.dlpack.to_dlpack``: the capsule ``__dlpack__(stream=-1)``
    returns (no stream handshake), made by one C call instead of ``Tensor.__dlpack__``'s checks
    in Python (its device and current-device lookups cost microseconds per tensor); CuPy takes a
    capsule as it is (``cupy/_core/dlpack.pyx``, ``from_dlpack``)."""
    import cupy

    t = t.detach()
    t = t if t.is_contiguous() else t.contiguous()
    if t.dtype == torch.bfloat16:
        a = cupy.from_dlpack(_to_dlpack(t.view(torch.int16))).view(cupy.uint16)
    else:
        a = cupy.from_dlpack(_to_dlpack(t))
    imported = getattr(_local, "imported", None)
    if imported is not None:
        mem = a.data.mem
        imported[id(mem)] = (mem, t)
    return a


def to_tensor(a) -> Tensor:
    """The torch tensor over CuPy array ``a``'s memory, no copy, in the dtype the array stands
    for (bfloat16 for the uint16 bits of bfloat16).

    Memory from ``_interop``'s allocator comes back as a view of the torch allocation that owns
    it (an ordinary torch tensor); memory imported by :func:`to_array` in the current
    :class:`imports` block as a view of the imported tensor; anything else through DLPack.
    """
    data = a.data
    mem = data.mem
    owner = getattr(mem, "_owner", None)
    dtype = TORCH_DTYPE[a.dtype]
    item = a.itemsize
    if isinstance(owner, Tensor) and owner.dtype == torch.uint8:
        storage = owner.untyped_storage()
        if a.size == 0:
            return torch.empty(a.shape, dtype=dtype, device=owner.device)
        return torch.empty(0, dtype=dtype, device=owner.device).set_(
            storage, (data.ptr - storage.data_ptr()) // item, a.shape,
            [s // item for s in a.strides])
    imported = getattr(_local, "imported", None)
    found = None if imported is None else imported.get(id(mem))
    if (found is not None and found[0] is mem and found[1].dtype == dtype and a.size
            and min(a.strides) >= 0):
        t = found[1]
        return t.as_strided(a.shape, [s // item for s in a.strides],
                            t.storage_offset() + (data.ptr - t.data_ptr()) // item)
    t = torch.from_dlpack(a.__dlpack__(stream=-1))
    # CuPy exports its uint16 storage of bfloat16 as unsigned integers, which torch imports as
    # torch.uint16: reinterpret the bits (same element size, so any strides are kept).
    return t.view(dtype) if t.dtype != dtype else t
