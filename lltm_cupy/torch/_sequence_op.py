"""A whole sequence, differentiable: :func:`lltm_sequence` (padded, or with lengths) and
:func:`lltm_packed` (a PackedSequence's rows): eagerly through :class:`LLTMSequenceFunction`,
under torch.compile through the custom operators ``lltm_cupy::lltm_sequence_forward`` /
``lltm_sequence_backward``, forward only through ``lltm_cupy::lltm_sequence_inference``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _export, _interop, _saved
from .._checks import check_flag, check_packed_shapes, check_sequence_shapes
from .._types import LLTMSequenceSaved
from ._dispatch import (_autocast, _backend_name, _empty_gates, _forward_only, _fused_kw,
                        _in_float32, _needs_grad, _refuse_double_backward, _transformed,
                        eager_only)

__all__ = ["lltm_sequence", "LLTMSequenceFunction", "lltm_packed"]

_SEQ_NAMES = ("inputs", "weights", "bias", "h0", "c0")


class LLTMSequenceFunction(torch.autograd.Function):
    """A whole sequence with autograd; ``apply(inputs, weights, bias, h0, c0, plan, fused)``
    returns ``(outputs, h_n, c_n)`` followed by what the backward keeps (as
    :class:`LLTMFunction`). The outputs are a view of the hidden states the backward reads:
    an in-place change of them is refused (clone them first).

    Prefer :func:`lltm_sequence`. ``torch.func`` as for :class:`LLTMFunction`.
    """

    @classmethod
    def apply(cls, *args):
        return _saved.apply(cls, args)

    @staticmethod
    def forward(inputs, weights, bias, h0, c0, plan=None, fused=False):
        kw = {} if plan is None else {"plan": plan}
        with _interop.backend_call(inputs.device) as call:
            kw.update(_fused_kw(call, fused))
            arrays = [call.array(t) for t in (inputs, weights, bias, h0, c0)]
            outputs, h_n, c_n, saved = call.backend.forward_sequence(*arrays, **call.kw, **kw)
            outputs, layout, extras = _saved.stash(call, saved, arrays, (outputs, h_n, c_n))
        return (*outputs, layout, *extras)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _saved.keep(ctx, inputs, output, 3)

    @staticmethod
    def backward(ctx, grad_outputs, grad_h_n, grad_c_n, *_):
        return _saved.run_backward(ctx, _sequence_backward, (grad_outputs, grad_h_n, grad_c_n),
                                   tuple(ctx.needs_input_grad[:5])) + (None, None)

    vmap = staticmethod(_saved.refuse_vmap)
    jvp = staticmethod(_saved.refuse_jvp)


def _sequence_backward(call, grads, saved, needed):
    return call.backend.backward_sequence(*grads, saved, needed, **call.kw)


@torch.library.custom_op("lltm_cupy::lltm_sequence_forward", mutates_args=())
def _sequence_forward_op(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor,
                         c0: Tensor, fused: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (hs, h_n, c_n, gates, cells); the outputs are hs[1:]."""
    with _interop.backend_call(inputs.device) as call:
        _, h_n, c_n, saved = call.backend.forward_sequence(
            *(call.array(t) for t in (inputs, weights, bias, h0, c0)), **call.kw,
            **_fused_kw(call, fused))
        return tuple(call.tensor(a) for a in (saved.hs, h_n, c_n, saved.gates, saved.cells))


@_sequence_forward_op.register_fake
def _(inputs, weights, bias, h0, c0, fused=False):
    steps, batch, _ = inputs.shape
    state = h0.shape[1]
    return (inputs.new_empty(steps + 1, batch, state), inputs.new_empty(batch, state),
            inputs.new_empty(batch, state), _empty_gates(inputs, batch, state, steps),
            inputs.new_empty(steps, batch, state))


@torch.library.custom_op("lltm_cupy::lltm_sequence_backward", mutates_args=())
def _sequence_backward_op(grad_outputs: Optional[Tensor], grad_h_n: Optional[Tensor],
                          grad_c_n: Optional[Tensor], inputs: Tensor, hs: Tensor, gates: Tensor,
                          cells: Tensor, weights: Tensor, bias_2d: bool, fused: bool = False
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (d_inputs, d_weights, d_bias, d_h0, d_c0)."""
    with _interop.backend_call(inputs.device) as call:
        steps, batch, features = inputs.shape
        state = hs.shape[2]
        saved = LLTMSequenceSaved(
            _backend_name(inputs.device),
            call.array(inputs.contiguous()).reshape(steps * batch, features),
            *(call.array(t.contiguous()) for t in (hs, gates, cells, weights)),
            (1, 3 * state) if bias_2d else (3 * state,))
        if _fused_kw(call, fused):      # as the forward chose: the fused kernels where they fit
            from .._cuda.fused import usable

            saved.fused = usable(state, saved.hs.dtype)
        grads = call.backend.backward_sequence(
            call.optional(grad_outputs), call.optional(grad_h_n), call.optional(grad_c_n), saved,
            (True,) * 5, **call.kw)
        return tuple(call.tensor(g) for g in grads)


@_sequence_backward_op.register_fake
def _(grad_outputs, grad_h_n, grad_c_n, inputs, hs, gates, cells, weights, bias_2d, fused=False):
    state = hs.shape[2]
    return (inputs.new_empty(inputs.shape), weights.new_empty(weights.shape),
            weights.new_empty((1, 3 * state) if bias_2d else (3 * state,)),
            hs.new_empty(hs.shape[1:]), hs.new_empty(hs.shape[1:]))


def _sequence_setup_context(ctx, inputs, output):
    x, weights, bias = inputs[:3]
    hs, _, _, gates, cells = output
    ctx.save_for_backward(x, hs, gates, cells, weights)
    ctx.bias_2d = bias.dim() == 2
    ctx.fused = bool(inputs[5]) if len(inputs) > 5 else False


def _sequence_backward_autograd(ctx, grad_hs, grad_h_n, grad_c_n, _grad_gates, _grad_cells):
    _refuse_double_backward()
    x, hs, gates, cells, weights = ctx.saved_tensors
    grad_outputs = None if grad_hs is None else grad_hs[1:]
    return _sequence_backward_op(grad_outputs, grad_h_n, grad_c_n, x, hs, gates, cells, weights,
                                 ctx.bias_2d, ctx.fused) + (None,)   # (fused has none)


_sequence_forward_op.register_autograd(_sequence_backward_autograd,
                                       setup_context=_sequence_setup_context)


@torch.library.custom_op("lltm_cupy::lltm_sequence_inference", mutates_args=())
def _sequence_inference_op(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor,
                           c0: Tensor, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """A sequence, forward only: (outputs, h_n, c_n)."""
    return _forward_only((inputs, weights, bias, h0, c0), True, fused)


@_sequence_inference_op.register_fake
def _(inputs, weights, bias, h0, c0, fused=False):
    steps, batch, _ = inputs.shape
    state = h0.shape[1]
    return (inputs.new_empty(steps, batch, state), inputs.new_empty(batch, state),
            inputs.new_empty(batch, state))



@eager_only
def _packed_sequence(tensors, lengths, reverse: bool, fused: bool = False):
    """Variable lengths run eagerly (a graph break under torch.compile; an error with
    fullgraph=True): the packed layout depends on the lengths' values."""
    from .. import _packing

    steps, batch = tensors[0].shape[:2]
    device = tensors[0].device
    _interop.use_plans((), device, lengths)     # lengths on the GPU: refused now
    plan = _packing.cached_plan(_packing.check_lengths(lengths, steps, batch), steps, reverse)
    _interop.use_plans((plan,), device)
    if not _needs_grad(tensors) and not _transformed(tensors):
        return _forward_only(tensors, True, fused, plan=plan)
    return LLTMSequenceFunction.apply(*tensors, plan, fused)[:3]


def lltm_packed(data: Tensor, weights: Tensor, bias: Tensor, h0: Tensor, c0: Tensor,
                plan, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """One layer and direction over a ``PackedSequence``'s ``data`` (rows, features), laid out
    as ``plan`` says (``lltm_cupy._packing.packed_plan`` of its ``batch_sizes`` and the
    direction): returns ``(out_data, h_n, c_n)``, ``out_data`` (rows, state) in the same layout;
    the states h0, c0 and h_n, c_n (batch, state) are in the sorted batch order (the caller
    applies ``sorted_indices`` / ``unsorted_indices``, as :class:`LLTM` does).
    What :class:`LLTM` runs for PackedSequence input: no padded tensor is made, in or out.
    Autocast, dtype and ``fused`` rules as :func:`lltm_sequence`; eager only."""
    fused = check_flag("lltm_cupy.torch.lltm_packed", "fused", fused)
    tensors = _autocast((data, weights, bias, h0, c0))
    if _in_float32(tensors):
        return tuple(t.bfloat16() for t in lltm_packed(*(t.float() for t in tensors), plan))
    _interop.check(tensors, _SEQ_NAMES, check_packed_shapes)
    if _export.recording():
        raise _export.refusal("packed variable-length input")
    if tensors[0].device.type == "meta":
        # shape inference: the N rows as one step of N sequences (the first state row each)
        # gives every result its shape and dtype, connected to every argument for autograd
        data, weights, bias, h0, c0 = tensors
        rows, batch = data.shape[0], h0.shape[0]
        hs, h_n, c_n, _, _ = _sequence_forward_op(data[None], weights, bias,
                                                  h0[:1].expand(rows, -1), c0[:1].expand(rows, -1))
        return hs[1], h_n[:batch], c_n[:batch]
    if not _needs_grad(tensors) and not _transformed(tensors):
        return _forward_only(tensors, True, fused, plan=plan)
    return LLTMSequenceFunction.apply(*tensors, plan, fused)[:3]


def lltm_sequence(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor, c0: Tensor,
                  lengths=None, reverse: bool = False, *,
                  fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The cell over a whole sequence, differentiable. Returns ``(outputs, h_n, c_n)``.

    inputs: (steps, batch, features)
    weights: (3 * state, state + features); bias: (3 * state,) or (1, 3 * state)
    h0, c0: (batch, state)
    lengths: optional (batch,) integers in [0, steps] (a CPU tensor, list or array; a CUDA
        tensor is copied to the host first, which waits for the device): as for
        :func:`lltm_cupy.forward_sequence`, the sequences run packed, outputs past a length are
        zero, h_n / c_n are each sequence's state at its own last step (run eagerly: a graph
        break under torch.compile). Under CUDA-graph capture the same lengths must have run
        once eagerly before (else RuntimeError, before any work is queued), and the graph
        is valid for those lengths only.
    reverse: each sequence runs from its own last valid step back to step 0
    fused: on CUDA, every step of the sequence (and of its backward) in one launch of the fused
        sequence kernel, as :func:`lltm_cupy.forward_sequence`'s ``fused``: state sizes whose
        weights fit neither a block's shared memory nor, on sm_90 and newer, a cluster's of up
        to 8 blocks (or of 16 where the device holds one), and CPU tensors, run as without it.
        Off by default until a GPU has measured it faster than the default path.

    outputs: (steps, batch, state), the hidden state after every step; h_n, c_n: (batch, state).
    Same device, dtype and autocast rules as :func:`lltm`.
    """
    reverse = check_flag("lltm_cupy.torch.lltm_sequence", "reverse", reverse)
    fused = check_flag("lltm_cupy.torch.lltm_sequence", "fused", fused)
    tensors = _autocast((inputs, weights, bias, h0, c0))
    if _in_float32(tensors):
        return tuple(t.bfloat16() for t in lltm_sequence(*(t.float() for t in tensors),
                                                           lengths=lengths, reverse=reverse,
                                                           fused=fused))
    _interop.check(tensors, _SEQ_NAMES, check_sequence_shapes)
    if tensors[0].device.type == "meta":   # shape inference: lengths, direction change none
        hs, h_n, c_n, _, _ = _sequence_forward_op(*tensors)
        return hs[1:], h_n, c_n
    if lengths is not None:
        if _export.recording():
            raise _export.refusal("lltm_sequence with lengths=")
        return _packed_sequence(tensors, lengths, reverse, fused)
    if reverse:     # every sequence full length: run the time-reversed sequence
        outputs, h_n, c_n = lltm_sequence(tensors[0].flip(0), *tensors[1:], fused=fused)
        return outputs.flip(0), h_n, c_n
    if _export.recording():     # torch.export, jit.trace: torch operators (see _export)
        return _export.sequence(*tensors)
    if not _needs_grad(tensors):
        if torch.compiler.is_compiling():
            return _sequence_inference_op(*tensors, fused)
        if not _transformed(tensors):
            return _forward_only(tensors, True, fused)
    if torch.compiler.is_compiling():
        hs, h_n, c_n, _, _ = _sequence_forward_op(*tensors, fused)
        return hs[1:], h_n, c_n
    return LLTMSequenceFunction.apply(*tensors, None, fused)[:3]
