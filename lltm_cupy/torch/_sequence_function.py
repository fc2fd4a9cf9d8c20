"""The torch layer's autograd Function of a whole sequence, :class:`LLTMSequenceFunction`
(padded, or packed by a plan of variable lengths), and its forward alone.

Its forward runs the backend's sequence loop over the tensors' memory (on the CPU the NumPy
backend on arrays over them, ``_cpu_arrays``; on CUDA ``_cuda_sequence``'s pointer launches)
and keeps as tensors what the backward reads (:func:`_sequence`); every argument is saved too.
Its backward as the step's (``_functions``).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .._types import LLTMSequenceSaved
from . import _cuda_sequence, _interop, reference
from ._functions import _refusal, _refuse_jvp, _refuse_vmap, _saved, _tracing, batched
from ._interop import cuda_backend, without_autocast

__all__ = ["LLTMSequenceFunction", "sequence_forward", "sequence_inference",
           "sequence_backward"]

_CPU = _interop.CPU_CALL


@functools.lru_cache(maxsize=64)
def _stand_in(shape, dtype):
    """A read-only NaN array of ``shape`` that takes no memory (one element, broadcast): the
    CPU sequences' cells, which their backward never reads (a read would show as NaN)."""
    return np.broadcast_to(np.array(np.nan, dtype), shape)


class LLTMSequenceFunction(torch.autograd.Function):
    """A whole sequence with autograd: ``apply(inputs, weights, bias, h0, c0, plan, fused)``
    returns ``(outputs, h_n, c_n)`` followed by whether the fused kernels ran and what the
    backward keeps. ``plan``: None (every sequence runs all of ``inputs`` (steps, batch,
    features)) or the packed layout of variable lengths (``lltm_cupy._packing``). The outputs
    are a view of the hidden states the backward reads: an in-place change of them is refused.

    Prefer :func:`lltm_cupy.torch.lltm_sequence`. ``torch.func`` as for :class:`LLTMFunction`.
    Its bodies (:func:`sequence_forward`, :func:`sequence_backward`) are the custom operators'
    too (``_custom_ops``).
    """

    @staticmethod
    def setup_context(ctx, inputs, output):
        kept = output[4:]
        ctx.mark_non_differentiable(*kept)
        ctx.set_materialize_grads(False)
        ctx.plan = inputs[5] if len(inputs) > 5 else None
        ctx.fused = output[3]               # the fused kernels ran
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
        return (*sequence_backward((grad_outputs, grad_h_n, grad_c_n), saved, ctx.plan,
                                   ctx.fused, tuple(ctx.needs_input_grad[:5])), None, None)

    vmap = staticmethod(_refuse_vmap)
    jvp = staticmethod(_refuse_jvp)


def _sequence(inputs, weights, bias, h0, c0, plan=None, fused=False, keep=True):
    """A sequence: ``(outputs, h_n, c_n, fused_ran, *kept)``, ``kept`` what the backward reads
    besides the arguments: the hidden states [h0, outputs...] (for a plan without a gather of
    the outputs, the outputs themselves are those), the gate values, on CUDA the cells, the
    inputs where the backward does not read the argument (a contiguous copy or the gathered
    rows) and, with a plan, the sorted h0. With ``keep`` False (no backward to follow)
    ``(outputs, h_n, c_n)`` alone, the same bits, nothing computed or kept for a backward."""
    if _tracing():
        raise _refusal()
    if cuda_backend(inputs):        # torch's buffers and GEMMs, pointer launches
        return _cuda_sequence.forward(inputs, weights, bias, h0, c0, plan, keep=keep, fused=fused)
    return _cpu_sequence(inputs, weights, bias, h0, c0, plan, keep)


def _cpu_sequence(inputs, weights, bias, h0, c0, plan, keep):
    """:func:`_sequence` on the CPU: the NumPy backend (which has no fused kernels)."""
    contiguous = inputs.contiguous()
    kw = {} if plan is None else {"plan": plan}
    array = _CPU.array
    outputs, h_n, c_n, saved = _CPU.backend.forward_sequence(
        array(contiguous), array(weights), array(bias), array(h0), array(c0),
        mm=_CPU.gemm(*h0.shape, h0.dtype), **kw, keep=keep)
    tensor = _CPU.tensor
    if not keep:
        return tensor(outputs), tensor(h_n), tensor(c_n)
    hs = tensor(saved.hs)
    # the outputs: a view of the hidden states (the rows after h0), or (a PackedSequence's data
    # in its own order) the packed rows themselves, which are then kept as the output (so that
    # an in-place change of it is seen)
    if outputs is saved.hs:
        out, kept = hs, []
    else:
        out, kept = (hs[1:] if plan is None else tensor(outputs)), [hs]
    kept.append(tensor(saved.gates))
    # the inputs as the backward reads them: a view of ``contiguous`` (kept unless it is the
    # argument itself, which is saved anyway), or a gather of their rows
    if not _direct(plan):
        kept.append(tensor(saved.inputs))
    elif contiguous is not inputs:
        kept.append(contiguous)
    if plan is not None:
        kept.append(tensor(saved.h0))
    return (out, tensor(h_n), tensor(c_n), False, *kept)


def _sequence_backward_body(grads, saved, plan, fused, needed):
    """The gradients ``(d_inputs, d_weights, d_bias, d_h0, d_c0)`` (None where ``needed`` says
    so) of ``grads`` = (outputs, h_n, c_n)'s (any None: zero), from ``saved`` = the five
    arguments and what :func:`sequence_forward` kept; ``fused``: its flag. Which backward runs:
    as ``_functions._step_backward``."""
    if not torch.is_grad_enabled():
        try:
            return _backend_backward(grads, saved, plan, fused, needed)
        except RuntimeError:        # (a batch of gradients reaches the backend: no memory)
            if not batched(*grads):
                raise
    return _differentiable_sequence_backward(*grads, *saved[:5], plan, needed)


def _backend_backward(grads, saved, plan, fused, needed):
    """:func:`sequence_backward` by the backend, from what ``setup_context`` saved: the
    arguments, then [hs, gates, cells (CUDA), inputs (where not the argument), h0 sorted (with
    a plan)]."""
    inputs, weights, bias = saved[:3]
    cuda = cuda_backend(inputs)
    kept = list(saved[5:])
    hs, gates = kept.pop(0), kept.pop(0)
    cells = kept.pop(0) if cuda else None
    x = inputs if (plan is None or _direct(plan)) and inputs.is_contiguous() else kept.pop(0)
    h0s = kept.pop(0) if plan is not None else None
    if cuda:
        return _cuda_sequence.backward(*grads, x, hs, gates, cells, weights, bias.shape, needed,
                                       fused, plan, h0s)
    array = _CPU.array
    hs = array(hs)
    # (the CPU's backward never reads cells: a stand-in)
    cells = _stand_in(hs.shape if plan is not None else (hs.shape[0] - 1,) + hs.shape[1:],
                      hs.dtype)
    x = array(x)
    state = LLTMSequenceSaved(_CPU.name, x.reshape(-1, x.shape[-1]), hs, array(gates), cells,
                              array(weights), tuple(bias.shape), plan=plan,
                              h0=None if h0s is None else array(h0s))
    grad_outputs, grad_h_n, grad_c_n = grads
    d_inputs, d_weights, d_bias, d_h0, d_c0 = _CPU.backend.backward_sequence(
        None if grad_outputs is None else array(grad_outputs),
        None if grad_h_n is None else array(grad_h_n),
        None if grad_c_n is None else array(grad_c_n), state, needed,
        mm=_CPU.gemm(*saved[3].shape, saved[3].dtype))
    tensor = _CPU.tensor
    return (None if d_inputs is None else tensor(d_inputs),
            None if d_weights is None else tensor(d_weights),
            None if d_bias is None else tensor(d_bias), None if d_h0 is None else tensor(d_h0),
            None if d_c0 is None else tensor(d_c0))


#: the Function's forward (arguments: inputs, weights, bias, h0, c0, plan, fused), and a
#: sequence's forward alone (``keep`` False): :func:`_sequence`; the Function's backward body
sequence_forward = without_autocast(_sequence, "sequence_forward", keep=True)
sequence_inference = without_autocast(_sequence, "sequence_inference", keep=False)
sequence_backward = without_autocast(_sequence_backward_body, "sequence_backward")
LLTMSequenceFunction.forward = staticmethod(sequence_forward)


def _direct(plan) -> bool:
    """Whether the backend reads a sequence's inputs as they are (every sequence full length,
    or a PackedSequence's data in the forward direction), not a gather of their rows."""
    return plan is None or (plan.packed_io and plan.data_index is None)


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
