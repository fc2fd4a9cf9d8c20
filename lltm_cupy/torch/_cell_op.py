"""One differentiable LLTM step, :func:`lltm`: eagerly through :class:`LLTMFunction`, under
torch.compile through the custom operators ``lltm_cupy::lltm_forward`` / ``lltm_backward``, and
forward only through ``lltm_cupy::lltm_inference`` (see ``_dispatch`` for which runs when)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _export, _interop, _saved
from .._types import LLTMSaved
from ._dispatch import (_autocast, _backend_name, _empty_gates, _forward_only, _in_float32,
                        _needs_grad, _refuse_double_backward, _to_argument_order,
                        _to_grads_order, _transformed)

__all__ = ["lltm", "LLTMFunction"]


@torch.library.custom_op("lltm_cupy::lltm_inference", mutates_args=())
def _lltm_inference_op(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                       old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """One step, forward only: (new_h, new_cell)."""
    return _forward_only((input, weights, bias, old_h, old_cell), False)


@_lltm_inference_op.register_fake
def _(input, weights, bias, old_h, old_cell):
    return old_h.new_empty(old_h.shape), old_h.new_empty(old_h.shape)


# ---------------------------------------------------------------------------------------------
# One step, eager: a plain autograd.Function

class LLTMFunction(torch.autograd.Function):
    """One LLTM step with autograd; ``apply(input, weights, bias, old_h, old_cell)`` returns
    ``(new_h, new_cell)`` followed by what the backward keeps (``lltm_cupy.torch._saved``: a
    layout and the backend's arrays as tensors, which autograd's saved-tensor hooks see).

    Prefer :func:`lltm`, which checks the arguments first, handles autocast, returns the two
    outputs only and also works under torch.compile. Written in the style ``torch.func`` asks
    for (``setup_context``): ``torch.func.grad``, ``vjp`` and ``jacrev`` work; ``vmap`` and
    forward-mode AD are refused.
    """

    @classmethod
    def apply(cls, *args):
        return _saved.apply(cls, args)

    @staticmethod
    def forward(input, weights, bias, old_h, old_cell):
        with _interop.backend_call(input.device) as call:
            arrays = [call.array(t) for t in (input, weights, bias, old_h, old_cell)]
            new_h, new_cell, saved = call.backend.forward(*arrays, **call.kw)
            outputs, layout, extras = _saved.stash(call, saved, arrays, (new_h, new_cell))
        return (*outputs, layout, *extras)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _saved.keep(ctx, inputs, output, 2)

    @staticmethod
    def backward(ctx, grad_h, grad_cell, *_):
        if grad_h is None and grad_cell is None:
            return (None,) * 5
        return _saved.run_backward(ctx, _step_backward, (grad_h, grad_cell),
                                   _to_grads_order(ctx.needs_input_grad))

    vmap = staticmethod(_saved.refuse_vmap)
    jvp = staticmethod(_saved.refuse_jvp)


def _step_backward(call, grads, saved, needed):
    """The backend's backward of one step, gradients in the forward's argument order."""
    return _to_argument_order(call.backend.backward(*grads, saved, needed, **call.kw))


# ---------------------------------------------------------------------------------------------
# One step, compiled: custom operators

@torch.library.custom_op("lltm_cupy::lltm_forward", mutates_args=())
def _lltm_forward_op(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                     old_cell: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (new_h, new_cell, X, gates): the outputs plus what the backward op needs."""
    with _interop.backend_call(input.device) as call:
        new_h, new_cell, saved = call.backend.forward(
            *(call.array(t) for t in (input, weights, bias, old_h, old_cell)), **call.kw)
        return tuple(call.tensor(a) for a in (new_h, new_cell, saved.X, saved.gates))



@_lltm_forward_op.register_fake
def _(input, weights, bias, old_h, old_cell):
    batch, features = input.shape
    state = old_h.shape[1]
    return (input.new_empty(batch, state), input.new_empty(batch, state),
            input.new_empty(batch, state + features), _empty_gates(input, batch, state))


@torch.library.custom_op("lltm_cupy::lltm_backward", mutates_args=())
def _lltm_backward_op(grad_h: Optional[Tensor], grad_cell: Optional[Tensor], X: Tensor,
                      gates: Tensor, new_cell: Tensor, weights: Tensor,
                      bias_2d: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (d_old_h, d_input, d_weights, d_bias, d_old_cell)."""
    with _interop.backend_call(X.device) as call:
        state = new_cell.shape[1]
        saved = LLTMSaved(_backend_name(X.device),
                          *(call.array(t.contiguous()) for t in (X, gates, new_cell, weights)),
                          (1, 3 * state) if bias_2d else (3 * state,))
        grads = call.backend.backward(call.optional(grad_h), call.optional(grad_cell), saved,
                                      (True,) * 5, **call.kw)
        return tuple(call.tensor(g) for g in grads)


@_lltm_backward_op.register_fake
def _(grad_h, grad_cell, X, gates, new_cell, weights, bias_2d):
    batch, state = new_cell.shape
    features = X.shape[1] - state
    return (X.new_empty(batch, state), X.new_empty(batch, features), weights.new_empty(weights.shape),
            weights.new_empty((1, 3 * state) if bias_2d else (3 * state,)),
            X.new_empty(batch, state))


def _setup_context(ctx, inputs, output):
    _, weights, bias, _, _ = inputs
    _, new_cell, X, gates = output
    ctx.save_for_backward(X, gates, new_cell, weights)
    ctx.bias_2d = bias.dim() == 2


def _backward_op_autograd(ctx, grad_h, grad_cell, _grad_X, _grad_gates):
    _refuse_double_backward()
    X, gates, new_cell, weights = ctx.saved_tensors
    grads = _lltm_backward_op(grad_h, grad_cell, X, gates, new_cell, weights, ctx.bias_2d)
    return _to_argument_order(grads)


_lltm_forward_op.register_autograd(_backward_op_autograd, setup_context=_setup_context)


def lltm(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
         old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """One differentiable LLTM step. Returns ``(new_h, new_cell)``, each (batch, state).

    input: (batch, features)
    weights: (3 * state, state + features); the first ``state`` columns act on old_h
    bias: (3 * state,) or (1, 3 * state)
    old_h: (batch, state)
    old_cell: (batch, state)

    One device (CPU or CUDA) and one dtype for all: float32, float64, bfloat16 (on the CPU
    computed in float32 and rounded), float16 on CUDA; under ``torch.autocast`` the arguments are
    cast first (see the module docstring). Bad input raises TypeError/ValueError before any
    kernel runs.
    """
    tensors = _autocast((input, weights, bias, old_h, old_cell))
    if _in_float32(tensors):
        new_h, new_cell = lltm(*(t.float() for t in tensors))
        return new_h.bfloat16(), new_cell.bfloat16()
    _interop.check(tensors)
    if _export.recording():     # torch.export, jit.trace: torch operators (see _export)
        from .reference import lltm_reference

        return lltm_reference(*tensors)
    meta = tensors[0].device.type == "meta"     # shape inference: the ops' fake versions
    if not _needs_grad(tensors):
        if torch.compiler.is_compiling() or meta:
            return _lltm_inference_op(*tensors)
        if not _transformed(tensors):
            return _forward_only(tensors, False)
    if torch.compiler.is_compiling() or meta:
        new_h, new_cell, _, _ = _lltm_forward_op(*tensors)
        return new_h, new_cell
    return LLTMFunction.apply(*tensors)[:2]

