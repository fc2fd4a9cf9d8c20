"""The arguments of a call off the eager fast path (:mod:`lltm_cupy.torch._ops`), made ready in
one pass (:func:`prepared`): under ``torch.autocast`` cast (differentiably, so gradients reach
the parameters in their own dtype) to the dtype the cell computes in: the autocast dtype on
CUDA (float16 or bfloat16), float32 under CPU autocast (NumPy has no bfloat16; float64 tensors
are left alone, as autocast leaves them); bfloat16 tensors on the CPU computed in float32 and the
results rounded to bfloat16; then checked, with messages that name the argument and the shapes
(:func:`check`)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import check_flag
from ._interop import DTYPES, cuda_backend

__all__ = ["prepared", "check", "autocast_dtype"]


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype the cell computes in under the autocast state of ``device_type``, or None when
    autocast is off there."""
    if device_type not in DTYPES or not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return dtype
    return torch.float32


def prepared(tensors, names, shapes, where=None, **flags):
    """``(tensors, flags, finish)``: the tensors cast as autocast asks and checked
    (:func:`check` with ``names`` and ``shapes``), the yes/no arguments ``flags`` checked (named
    after ``where``), and ``finish``, which takes the results back to the arguments' dtype
    (bfloat16 on the CPU, computed in float32) or is None."""
    flags = tuple(check_flag(where, k, v) for k, v in flags.items())
    first = tensors[0]
    dtype = autocast_dtype(first.device.type) if isinstance(first, Tensor) else None
    if dtype is not None and all(isinstance(t, Tensor) for t in tensors):
        tensors = tuple(t if t.dtype == torch.float64 or not t.is_floating_point()
                        else t.to(dtype) for t in tensors)
    cuda = isinstance(tensors[0], Tensor) and cuda_backend(tensors[0])
    finish = None
    if not cuda and all(isinstance(t, Tensor) and t.dtype == torch.bfloat16 for t in tensors):
        tensors = tuple(t.float() for t in tensors)
        finish = _to_bfloat16
    check(tensors, names, shapes, cuda)
    return tensors, flags, finish


def _to_bfloat16(results):
    return tuple(t.bfloat16() for t in results)


def check(tensors, names, check_shapes, cuda: bool) -> None:
    """The torch-level checks, before any conversion or kernel: type, device, dtype (those of the
    CUDA backend where ``cuda``), shapes; TypeError or ValueError naming the argument."""
    for name, t in zip(names, tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"lltm_cupy.torch: {name} must be a torch.Tensor, got "
                            f"{type(t).__qualname__}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"lltm_cupy.torch: all tensors must be on one device, got {listing}")
    device = tensors[0].device
    if device.type not in DTYPES and device.type != "meta":
        raise ValueError(f"lltm_cupy.torch: tensors on {device} are not supported (CPU or CUDA "
                         f"only)")
    # meta: shape inference only (the custom operators' fake implementations), any CUDA dtype
    kind = "cuda" if cuda or device.type == "meta" else "cpu"
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        listing = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors))
        raise TypeError(f"lltm_cupy.torch: all tensors must have the same dtype, got {listing}")
    dtype = tensors[0].dtype
    if dtype not in DTYPES[kind]:
        allowed = ", ".join(str(d) for d in DTYPES[kind])
        hint = " (float16 runs on CUDA only)" if dtype == torch.float16 else ""
        raise TypeError(f"lltm_cupy.torch: unsupported dtype {dtype} on {device.type}; expected "
                        f"one of {allowed}{hint}")
    check_shapes(*tensors)
