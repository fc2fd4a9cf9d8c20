"""What the eager autograd Functions keep for their backward, through autograd's saved-tensor
mechanism.

A backend's forward hands back its saved state as an object (``lltm_cupy._types``:
:class:`LLTMSaved`, :class:`LLTMSequenceSaved`) whose array fields its backward reads. The
Functions do not keep that object on ``ctx``: each array goes to ``ctx.save_for_backward`` as a
tensor over the same memory (``torch.from_numpy`` or DLPack, no copy), so that
``torch.utils.checkpoint`` (both modes), ``torch.autograd.graph.save_on_cpu`` and any
``saved_tensors_hooks`` see them (and may drop, move or compress them), and the backward
rebuilds the object from ``ctx.saved_tensors``. Each array field is one of:

- an argument's memory (the weights; a sequence's inputs, reshaped): the argument itself is
  saved, so an in-place change of it before the backward raises (autograd's version check);
- the memory of a returned output (the CUDA step's ``new_cell``; a packed sequence's output
  rows): the output itself is saved, with the same check;
- memory that holds a returned output and more (a sequence's hidden states ``hs`` = [h0,
  outputs]): saved as an extra, non-differentiable output of the Function, and the returned
  output is a view of it, so that an in-place change of the output is refused (torch's rule for
  a view made inside a custom Function: "clone the output");
- a field the backend's backward does not read (:data:`UNREAD`: the CPU step's ``new_cell``,
  the CPU sequence's ``cells``): not kept at all; a NaN-filled stand-in of its shape that takes
  no memory is passed instead (a read would show as NaN gradients), and the output it was may be
  changed in place, as ``nn.LSTM`` allows;
- the backend's own arrays (the gate values, ``X``): saved as extra outputs.

The Functions' forward returns ``(*outputs, layout, *extras)`` (the style ``torch.func`` asks
for: no ``ctx`` in forward, ``setup_context`` saves), and their backward runs the backend's
backward as a Function of its own, :class:`BackendBackward`, so that ``torch.func.grad`` and
``jacrev`` (a ``vmap`` over the backward) compose, and a double backward is refused there.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import NamedTuple

import numpy as np
import torch

from . import _interop

__all__ = ["apply", "stash", "keep", "run_backward", "BackendBackward", "UNREAD", "refuse_vmap",
           "refuse_jvp"]

#: (backend, saved type) -> the array fields that backend's backward never reads (it takes only
#: their shape and dtype)
UNREAD = {("numpy", "LLTMSaved"): ("new_cell",), ("numpy", "LLTMSequenceSaved"): ("cells",)}

INPLACE_MESSAGE = (
    "lltm_cupy.torch: a tensor that the LLTM's backward reads was modified in place after the "
    "forward (see which in the error above): the weights, the inputs of a sequence, or an "
    "output whose memory the backward reads (the outputs of a sequence; new_cell of an "
    "LLTMCell on CUDA). Modify a copy instead (out = out.clone(); out.relu_()), or use the "
    "out-of-place operation (out = out.relu()).")


def apply(cls, args):
    """``cls.apply(*args)`` for the Functions here (``setup_context`` style, every argument
    given): outside torch.func's transforms through torch's C++ ``apply``, which runs forward
    and then setup_context itself. torch's Python ``Function.apply`` first binds the default
    arguments of such a Function through ``inspect.signature`` on every call, which took 2/3 of
    the time this layer adds to a small step (two calls per step: forward and backward); under
    the transforms it is needed (``custom_function_call``) and used."""
    if torch._C._are_functorch_transforms_active():
        return torch.autograd.Function.apply.__func__(cls, *args)
    return super(torch.autograd.Function, cls).apply(*args)


def _is_array(value) -> bool:
    """A NumPy or CuPy array (by type: CuPy's ``__cuda_array_interface__`` property builds a dict
    and reads the current stream on every access)."""
    if isinstance(value, np.ndarray):
        return True
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def _pointer(a) -> int:
    # (NumPy's ``a.ctypes.data`` makes a ctypes object: several times slower)
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def _span(a):
    """(first byte, one past the last byte) of a non-empty array with non-negative strides."""
    start = _pointer(a)
    return start, start + sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize


def _same_memory(a, b) -> bool:
    """Whether ``a`` is ``b``'s memory, element for element (``b`` possibly reshaped)."""
    if a.size == 0 or a.size != b.size or a.itemsize != b.itemsize or _pointer(a) != _pointer(b):
        return False
    if a.shape == b.shape and a.strides == b.strides:
        return True
    return bool(a.flags.c_contiguous and b.flags.c_contiguous)


def _inside(a, whole) -> bool:
    """Whether non-empty ``a`` lies inside ``whole``'s memory (a view of it)."""
    if a.size == 0 or whole.size == 0 or a.itemsize != whole.itemsize or min(a.strides) < 0:
        return False
    (start, end), (lo, hi) = _span(a), _span(whole)
    return lo <= start and end <= hi and (start - lo) % a.itemsize == 0


class Layout(NamedTuple):
    """How to rebuild a saved object from what ``setup_context`` saved: its type, its non-array
    fields, and per array field where its tensor comes from: ``("input", i, shape)``,
    ``("output", j)``, ``("extra", k)`` (in the order saved), or ``("unread", shape, dtype)``."""

    kind: type
    constants: dict
    fields: tuple           # (name, source) per array field
    device: torch.device


@functools.lru_cache(maxsize=None)
def _field_names(kind) -> tuple:
    return tuple(f.name for f in dataclasses.fields(kind))


def _root(a):
    """The end of ``a``'s chain of ``base`` objects (the array or buffer that owns its memory,
    as NumPy and CuPy record it): arrays of different roots are different allocations."""
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def _identical(value, arrays, outputs, out_tensors):
    """The source of a non-empty saved array that *is* one of the arguments or (not yet taken)
    outputs, else None: what the comparison of memory below would find, without it."""
    if value.size == 0:
        return None
    for i, a in enumerate(arrays):
        if a is value:
            return "input", i, value.shape
    for j, o in enumerate(outputs):
        if o is value and out_tensors[j] is None:
            return "output", j
    return None


def stash(call, saved, arrays, outputs):
    """After a backend's forward: ``(output tensors, layout, extra tensors)``. ``arrays``: the
    arrays the forward was given (in argument order), ``outputs``: the arrays it returned.
    Memory is compared (by address) only between arrays of one root."""
    out_tensors = [None] * len(outputs)
    extras, fields, constants = [], [], {}
    unread = UNREAD.get((saved.backend, type(saved).__name__), ())
    in_roots = out_roots = None
    for name in _field_names(type(saved)):
        value = getattr(saved, name)
        if not _is_array(value):
            constants[name] = value
            continue
        if name in unread:
            fields.append((name, ("unread", value.shape, value.dtype)))
            continue
        # the common cases first, by identity: an argument or an output array itself
        source = _identical(value, arrays, outputs, out_tensors)
        if source is not None:
            if source[0] == "output":
                out_tensors[source[1]] = call.tensor(value)
            fields.append((name, source))
            continue
        if in_roots is None:
            in_roots = [_root(a) for a in arrays]
            out_roots = [_root(o) for o in outputs]
        root = _root(value)
        source = next((("input", i, value.shape) for i, a in enumerate(arrays)
                       if in_roots[i] is root and _same_memory(value, a)), None)
        if source is None:
            source = next((("output", j) for j, o in enumerate(outputs)
                           if out_tensors[j] is None and out_roots[j] is root
                           and o.shape == value.shape and _same_memory(o, value)), None)
            if source is not None:
                out_tensors[source[1]] = call.tensor(value)
        if source is None:
            whole = call.tensor(value)
            for j, o in enumerate(outputs):
                if out_tensors[j] is None and out_roots[j] is root and _inside(o, value):
                    step = value.itemsize
                    out_tensors[j] = whole.as_strided(
                        o.shape, tuple(s // step for s in o.strides),
                        whole.storage_offset() + (_pointer(o) - _pointer(value)) // step)
            source = ("extra", len(extras))
            extras.append(whole)
        fields.append((name, source))
    out_tensors = [call.tensor(o) if t is None else t for t, o in zip(out_tensors, outputs)]
    device = out_tensors[0].device if out_tensors else extras[0].device
    return tuple(out_tensors), Layout(type(saved), constants, tuple(fields), device), extras


def keep(ctx, inputs, output, n_outputs: int) -> None:
    """``setup_context``'s part: save what ``layout`` (in ``output`` after the ``n_outputs``
    outputs) names, in its order; the extras are not differentiable."""
    layout = output[n_outputs]
    extras = output[n_outputs + 1:]
    ctx.mark_non_differentiable(*extras)
    ctx.set_materialize_grads(False)
    ctx.layout = layout
    sources = {"input": inputs, "output": output, "extra": extras}
    ctx.save_for_backward(*(sources[s[0]][s[1]] for _, s in layout.fields if s[0] != "unread"))


@functools.lru_cache(maxsize=64)
def _stand_in(shape, dtype):
    """A read-only NaN array of ``shape`` that takes no memory (one element, broadcast)."""
    return np.broadcast_to(np.array(np.nan, dtype), shape)


def _restore(call, layout: Layout, tensors):
    values, it = dict(layout.constants), iter(tensors)
    for name, source in layout.fields:
        if source[0] == "unread":
            values[name] = _stand_in(*source[1:])
            continue
        a = call.array(next(it))
        # an argument saved for a field that holds it reshaped: a sequence's (T * B, F) inputs
        values[name] = a.reshape(source[2]) if source[0] == "input" and a.shape != source[2] \
            else a
    return layout.kind(**values)


def saved_tensors(ctx):
    """``ctx.saved_tensors``, with the library's advice added to autograd's in-place error."""
    try:
        return ctx.saved_tensors
    except RuntimeError as error:
        if "modified by an inplace operation" in str(error):
            raise RuntimeError(f"{error}\n{INPLACE_MESSAGE}") from error
        raise


class BackendBackward(torch.autograd.Function):
    """A backend's backward of one call: ``apply(run, layout, needed, n_grads, *grads,
    *saved)`` returns ``run``'s gradients (tensors or None, in the forward's argument order).
    ``run(call, grads, saved, needed)`` takes arrays and the rebuilt saved object. A Function of
    its own so that torch.func sees the gradients come from one (jacrev: its ``vmap`` rule runs
    one backward per row); its backward refuses a double backward."""

    @classmethod
    def apply(cls, *args):
        return apply(cls, args)

    @staticmethod
    def forward(run, layout, needed, n_grads, *tensors):
        grads, saved = tensors[:n_grads], tensors[n_grads:]
        with _interop.backend_call(layout.device) as call:
            result = run(call, [call.optional(g) for g in grads], _restore(call, layout, saved),
                         needed)
            return tuple(None if a is None else call.tensor(a) for a in result)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("lltm_cupy.torch: double backward (differentiating the gradients of "
                           "the LLTM, e.g. a gradient penalty) is not supported: the LLTM "
                           "backward kernels are not differentiable")

    @staticmethod
    def vmap(info, in_dims, run, layout, needed, n_grads, *tensors):
        dims = in_dims[4:]
        rows = [BackendBackward.apply(run, layout, needed, n_grads, *(
            t if d is None or t is None else t.select(d, i) for t, d in zip(tensors, dims)))
            for i in range(info.batch_size)]
        out = tuple(None if r is None else torch.stack([row[k] for row in rows])
                    for k, r in enumerate(rows[0])) if rows else ()
        return out, tuple(None if o is None else 0 for o in out)


def run_backward(ctx, run, grads, needed):
    """The Functions' ``backward``: ``run`` on what ``ctx`` saved, through
    :class:`BackendBackward` where its result may be differentiated (grad mode on: the
    backward of ``create_graph=True``, torch.func's transforms); a plain call otherwise, as
    that Function would record nothing."""
    args = (run, ctx.layout, needed, len(grads), *grads, *saved_tensors(ctx))
    if torch.is_grad_enabled():
        return BackendBackward.apply(*args)
    return BackendBackward.forward(*args)


def refuse_vmap(info, in_dims, *args):
    """The Functions' ``vmap`` rule: a clear refusal."""
    raise RuntimeError(
        "lltm_cupy.torch: torch.func.vmap over the LLTM is not supported (its kernels have no "
        "batching rule): the LLTM takes a batch dimension already; put the mapped dimension "
        "into it (or loop). torch.func.grad, vjp and jacrev work.")


def refuse_jvp(ctx, *tangents):
    """The Functions' ``jvp`` rule: a clear refusal."""
    raise RuntimeError(
        "lltm_cupy.torch: forward-mode AD (torch.func.jvp, jacfwd, hessian, "
        "torch.autograd.forward_ad) is not supported by the LLTM, whose kernels have no "
        "forward derivative; use reverse mode (backward(), torch.func.grad, vjp, jacrev).")
