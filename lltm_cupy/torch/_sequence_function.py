"""The torch layer's autograd Function of a whole sequence, :class:`LLTMSequenceFunction`
(padded, or packed by a plan of variable lengths), and its forward alone.

Its forward runs the backend's sequence loop on arrays over the tensors' memory (the NumPy
backend on ``Tensor.numpy()`` views; on CUDA the CuPy backend on DLPack imports, with torch's
allocator, stream and GEMMs: ``_interop``), and keeps as tensors over the same memory what the
backward reads: the hidden states (the outputs are a view of them), the gate values, on CUDA the
cells, the inputs (the argument itself where the backend reads it as it is) and, with a plan,
the sorted initial state; every argument is saved too. Its backward as the step's
(``_functions``): the backend's with grad mode off, docs/derivation.md's formulas in torch
operations, step by step backward through time, with grad mode on.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .._types import LLTMSequenceSaved
from . import _cuda_sequence, _interop, reference
from ._functions import _refusal, _refuse_jvp, _refuse_vmap, _saved, _tracing, batched

__all__ = ["LLTMSequenceFunction", "sequence_forward_only"]

_autocast_on = torch.is_autocast_enabled
_CPU = _interop.CPU_CALL


@functools.lru_cache(maxsize=64)
def _stand_in(shape, dtype):
    """A read-only NaN array of ``shape`` that takes no memory (one element, broadcast): the
    CPU sequences' cells, which their backward never reads (a read would show as NaN)."""
    return np.broadcast_to(np.array(np.nan, dtype), shape)


class LLTMSequenceFunction(torch.autograd.Function):
    """A whole sequence with autograd: ``apply(inputs, weights, bias, h0, c0, plan, fused)``
    returns ``(outputs, h_n, c_n)`` followed by (whether the fused kernels ran, whether on
    torch's buffers: ``_cuda_sequence``) and what the backward keeps. ``plan``: None
    (every sequence runs all of ``inputs`` (steps, batch, features)) or the packed layout of
    variable lengths (``lltm_cupy._packing``). The outputs are a view of the hidden states the
    backward reads: an in-place change of them is refused (clone them first).

    Prefer :func:`lltm_cupy.torch.lltm_sequence`. ``torch.func`` as for :class:`LLTMFunction`.
    """

    @staticmethod
    def forward(inputs, weights, bias, h0, c0, plan=None, fused=False):
        if _tracing():
            raise _refusal()
        if inputs.is_cuda or _interop.EMULATED_CUDA:
            if plan is None:        # torch's buffers and GEMMs, pointer launches
                if _autocast_on("cuda"):
                    with torch.autocast("cuda", enabled=False):
                        found = _native_forward(inputs, weights, bias, h0, c0, fused)
                else:
                    found = _native_forward(inputs, weights, bias, h0, c0, fused)
                if found is not None:
                    return found
            with _interop.backend_call(inputs.device) as call:
                return _sequence_forward(call, inputs, weights, bias, h0, c0, plan, fused)
        if _autocast_on("cpu"):     # (the general path, under autocast: torch's GEMMs as cast)
            with torch.autocast("cpu", enabled=False):
                return _sequence_forward(_CPU, inputs, weights, bias, h0, c0, plan, False)
        return _sequence_forward(_CPU, inputs, weights, bias, h0, c0, plan, False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        kept = output[4:]
        ctx.mark_non_differentiable(*kept)
        ctx.set_materialize_grads(False)
        ctx.plan = inputs[5]
        ctx.fused, ctx.native = output[3]   # the fused kernels ran; on torch's buffers
        plan = ctx.plan
        if plan is not None and plan.packed_io and plan.data_index is None:
            ctx.save_for_backward(*inputs[:5], output[0], *kept)     # the output is hs
        else:
            ctx.save_for_backward(*inputs[:5], *kept)

    @staticmethod
    def backward(ctx, grad_outputs, grad_h_n, grad_c_n, *_):
        saved = _saved(ctx)
        if grad_outputs is None and grad_h_n is None and grad_c_n is None:
            return (None,) * 7
        inputs, weights, bias, h0, c0 = saved[:5]
        if not torch.is_grad_enabled():
            try:
                return _backend_backward(ctx, (grad_outputs, grad_h_n, grad_c_n), saved)
            except RuntimeError:    # (a batch of gradients reaches the backend: no memory)
                if not batched(grad_outputs, grad_h_n, grad_c_n):
                    raise
        # create_graph=True, torch.func, batched gradients: BPTT by the formulas
        grads = _differentiable_sequence_backward(
            grad_outputs, grad_h_n, grad_c_n, inputs, weights, bias, h0, c0, ctx.plan,
            ctx.needs_input_grad[:5])
        return (*grads, None, None)

    vmap = staticmethod(_refuse_vmap)
    jvp = staticmethod(_refuse_jvp)


def _backend_backward(ctx, grads, saved):
    """The sequence Function's backward by the backend (grad mode off)."""
    inputs = saved[0]
    if inputs.is_cuda or _interop.EMULATED_CUDA:
        if ctx.native:
            if _autocast_on("cuda"):
                with torch.autocast("cuda", enabled=False):
                    return _native_backward(ctx, grads, saved)
            return _native_backward(ctx, grads, saved)
        with _interop.backend_call(inputs.device) as call:
            return _sequence_backward(call, ctx, grads, saved)
    if _autocast_on("cpu"):
        with torch.autocast("cpu", enabled=False):
            return _sequence_backward(_CPU, ctx, grads, saved)
    return _sequence_backward(_CPU, ctx, grads, saved)


def _sequence_forward(call, inputs, weights, bias, h0, c0, plan, fused):
    """The sequence Function's forward in the backend ``call`` gives (see its docstring)."""
    contiguous = inputs.contiguous()
    kw = {} if plan is None else {"plan": plan}
    if fused:
        kw.update(_interop.fused_kw(call))
    array = call.array
    outputs, h_n, c_n, saved = call.backend.forward_sequence(
        array(contiguous), array(weights), array(bias), array(h0), array(c0), **call.kw, **kw)
    tensor = call.tensor
    hs = tensor(saved.hs)
    # the outputs: a view of the hidden states (the rows after h0), or (a PackedSequence's data
    # in its own order) the packed rows themselves, which are then kept as the output (so that
    # an in-place change of it is seen)
    if outputs is saved.hs:
        out, kept = hs, []
    else:
        out, kept = (hs[1:] if plan is None else tensor(outputs)), [hs]
    kept.append(tensor(saved.gates))
    if call is not _CPU:            # (the CPU backward never reads cells)
        kept.append(tensor(saved.cells))
    # the inputs as the backward reads them: a view of ``contiguous`` (kept unless it is the
    # argument itself, which is saved anyway), or a gather of their rows
    if not _direct(plan):
        kept.append(tensor(saved.inputs))
    elif contiguous is not inputs:
        kept.append(contiguous)
    if plan is not None:
        kept.append(tensor(saved.h0))
    return (out, tensor(h_n), tensor(c_n), (saved.fused, False), *kept)


def _native_forward(inputs, weights, bias, h0, c0, fused):
    """CUDA, one length for all: ``_cuda_sequence`` (torch's buffers and GEMMs)."""
    contiguous = inputs.contiguous()
    found = _cuda_sequence.forward(contiguous, weights, bias, h0, c0, fused=fused)
    if found is _cuda_sequence.GROUP:       # the fused group variant: the backend's arrays
        return None
    hs, h_n, c_n, gates, cells, ran = found
    kept = (hs, gates, cells) if contiguous is inputs else (hs, gates, cells, contiguous)
    return (hs[1:], h_n, c_n, (ran, True), *kept)


def _native_backward(ctx, grads, saved):
    inputs, weights, bias = saved[:3]
    hs, gates, cells = saved[5:8]
    x = inputs if len(saved) == 8 else saved[8]
    d = _cuda_sequence.backward(*grads, x.view(-1, x.shape[-1]), hs, gates, cells, weights,
                                bias.shape, tuple(ctx.needs_input_grad[:5]), ctx.fused)
    return (*d, None, None)


def _sequence_backward(call, ctx, grads, saved):
    """The sequence Function's backward in the backend ``call`` gives, from what
    ``setup_context`` saved: the arguments, then [hs, gates, cells (CUDA), inputs (where not
    the argument), h0 sorted (with a plan)]."""
    inputs, weights, bias = saved[:3]
    kept = list(saved[5:])
    plan = ctx.plan
    array = call.array
    hs, gates = array(kept.pop(0)), array(kept.pop(0))
    cells = (array(kept.pop(0)) if call is not _CPU
             else _stand_in(hs.shape if plan is not None else (hs.shape[0] - 1,) + hs.shape[1:],
                            hs.dtype))
    x = array(inputs if _direct(plan) and inputs.is_contiguous() else kept.pop(0))
    h0s = array(kept.pop(0)) if plan is not None else None
    state = LLTMSequenceSaved(call.name, x.reshape(-1, x.shape[-1]), hs, gates, cells,
                              array(weights), tuple(bias.shape), plan=plan, h0=h0s,
                              fused=ctx.fused)
    grad_outputs, grad_h_n, grad_c_n = grads
    d = call.backend.backward_sequence(
        None if grad_outputs is None else array(grad_outputs),
        None if grad_h_n is None else array(grad_h_n),
        None if grad_c_n is None else array(grad_c_n), state, tuple(ctx.needs_input_grad[:5]),
        **call.kw)
    tensor = call.tensor
    return (*(None if g is None else tensor(g) for g in d), None, None)


def _direct(plan) -> bool:
    """Whether the backend reads a sequence's inputs as they are (every sequence full length,
    or a PackedSequence's data in the forward direction), not a gather of their rows."""
    return plan is None or (plan.packed_io and plan.data_index is None)


def sequence_forward_only(inputs, weights, bias, h0, c0, plan=None, fused=False):
    """A sequence with no backward to follow: ``(outputs, h_n, c_n)``, the same bits as
    :class:`LLTMSequenceFunction`'s, nothing computed or kept for a backward."""
    if (inputs.is_cuda or _interop.EMULATED_CUDA) and plan is None:
        if _autocast_on("cuda"):
            with torch.autocast("cuda", enabled=False):
                return sequence_forward_only(inputs, weights, bias, h0, c0, fused=fused)
        found = _cuda_sequence.forward(inputs, weights, bias, h0, c0, keep=False, fused=fused)
        if found is not _cuda_sequence.GROUP:
            return found[0][1:], found[1], found[2]
    kw = {} if plan is None else {"plan": plan}
    with _interop.backend_call(inputs.device) as call:
        if fused:
            kw.update(_interop.fused_kw(call))
        results = call.backend.forward_sequence(*(call.array(t) for t in (inputs, weights, bias,
                                                                           h0, c0)),
                                                keep=False, **call.kw, **kw)
        return tuple(call.tensor(a) for a in results[:3])


def _differentiable_sequence_backward(grad_outputs, grad_h_n, grad_c_n, inputs, weights, bias,
                                      h0, c0, plan, needs):
    """The gradients of a sequence in differentiable torch operations
    (:func:`reference.lltm_sequence_backward_reference` on the plan's per-step rows)."""
    if plan is None:
        d_xs, d_w, d_b, d_h0, d_c0 = reference.lltm_sequence_backward_reference(
            None if grad_outputs is None else list(grad_outputs.unbind(0)), grad_h_n, grad_c_n,
            list(inputs.unbind(0)), weights, bias, h0, c0)
        d_inputs = torch.stack(d_xs) if d_xs else torch.zeros_like(inputs)
    else:
        device = inputs.device
        index = {name: None if a is None else torch.from_numpy(a).to(device)
                 for name, a in (("t", plan.t_index), ("b", plan.b_index),
                                 ("data", plan.data_index), ("perm", plan.perm))}

        def rows(a):        # (T, B, ...) or PackedSequence data -> the packed rows (N, ...)
            if not plan.packed_io:
                return a[index["t"], index["b"]]
            return a if index["data"] is None else a[index["data"]]

        def steps(a):
            return [a[plan.offsets[t]: plan.offsets[t + 1]] for t in range(len(plan.batch_sizes))]

        perm = index["perm"]
        d_xs, d_w, d_b, d_h0s, d_c0s = reference.lltm_sequence_backward_reference(
            None if grad_outputs is None else steps(rows(grad_outputs)),
            None if grad_h_n is None else grad_h_n[perm],
            None if grad_c_n is None else grad_c_n[perm],
            steps(rows(inputs)), weights, bias, h0[perm], c0[perm])
        d_rows = torch.cat(d_xs) if d_xs else inputs.new_zeros(0, inputs.shape[-1])
        if not plan.packed_io:
            d_inputs = inputs.new_zeros(inputs.shape).index_put((index["t"], index["b"]), d_rows)
        elif index["data"] is None:
            d_inputs = d_rows
        else:
            d_inputs = inputs.new_zeros(inputs.shape).index_put((index["data"],), d_rows)
        d_h0 = d_h0s.new_zeros(d_h0s.shape).index_put((perm,), d_h0s)
        d_c0 = d_c0s.new_zeros(d_c0s.shape).index_put((perm,), d_c0s)
    grads = (d_inputs, d_w, d_b, d_h0, d_c0)
    return tuple(g if need else None for g, need in zip(grads, needs))
