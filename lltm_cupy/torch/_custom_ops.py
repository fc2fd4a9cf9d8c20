"""The LLTM as custom operators for torch.compile and shape inference (meta tensors):
``lltm_cupy::lltm_forward`` / ``lltm_backward`` (one step, differentiable through the
first's autograd registration), ``lltm_cupy::lltm_sequence_forward`` / ``lltm_sequence_backward``
(a whole sequence), and ``lltm_cupy::lltm_inference`` / ``lltm_sequence_inference`` (forward
only). The compiler treats them as opaque: no graph break, and CUDA graphs
(``mode="reduce-overhead"``) capture them like torch's own kernels. They run the same backends
as the eager Functions (``_functions``) and give the same bits; the eager path never calls
them.

The forward ops return, besides the outputs, what their backward reads (its fake versions give
those shapes: the CPU's four factors (..., 4, B, S), CUDA's pre-activations (..., B, 3S)). A
second derivative through them is refused (under torch.compile; eagerly the layer supports
it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._types import LLTMSequenceSaved
from . import _interop
from ._functions import (LLTMFunction, cpu_step_backward, cuda_step_backward, cuda_step_forward,
                         step_forward_only)
from ._sequence_function import sequence_forward_only

__all__ = ["lltm_forward_op", "lltm_inference_op", "sequence_forward_op",
           "sequence_inference_op"]


def _empty_gates(like: Tensor, batch: int, state: int, *steps: int) -> Tensor:
    """An empty tensor shaped like the backend's saved gate values: the four backward factors
    (..., 4, B, S) from the NumPy backend (CPU), the pre-activations (..., B, 3S) from the CuPy
    backend (CUDA)."""
    if not _interop.uses_cupy(like.device):
        return like.new_empty(*steps, 4, batch, state)
    return like.new_empty(*steps, batch, 3 * state)


def _refuse_double_backward() -> None:
    # The engine runs a backward with grad mode on exactly when create_graph=True. These ops'
    # backward is not differentiable; returning its result would silently give zero second
    # derivatives.
    if torch.is_grad_enabled():
        raise RuntimeError("lltm_cupy.torch: double backward (create_graph=True) is not supported "
                           "under torch.compile: the LLTM's custom operators have no second "
                           "derivative (run the model eagerly for second derivatives)")


# LLTMGrads order (d_old_h, d_input, d_weights, d_bias, d_old_cell) <-> forward argument order
# (input, weights, bias, old_h, old_cell).
def _to_argument_order(g):
    return g[1], g[2], g[3], g[0], g[4]


@torch.library.custom_op("lltm_cupy::lltm_inference", mutates_args=())
def lltm_inference_op(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                      old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """One step, forward only: (new_h, new_cell)."""
    return step_forward_only(input, weights, bias, old_h, old_cell)


@lltm_inference_op.register_fake
def _(input, weights, bias, old_h, old_cell):
    return old_h.new_empty(old_h.shape), old_h.new_empty(old_h.shape)


@torch.library.custom_op("lltm_cupy::lltm_forward", mutates_args=())
def lltm_forward_op(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                    old_cell: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (new_h, new_cell, X, gates): the outputs plus what the backward op needs (the
    eager Function's computation, so the same bits)."""
    if input.is_cuda or _interop.EMULATED_CUDA:
        return cuda_step_forward(input, weights, bias, old_h, old_cell)
    new_h, new_cell, factors = LLTMFunction.forward(input, weights, bias, old_h, old_cell)
    return new_h, new_cell, torch.cat((old_h, input), 1), factors


@lltm_forward_op.register_fake
def _(input, weights, bias, old_h, old_cell):
    batch, features = input.shape
    state = old_h.shape[1]
    return (input.new_empty(batch, state), input.new_empty(batch, state),
            input.new_empty(batch, state + features), _empty_gates(input, batch, state))


@torch.library.custom_op("lltm_cupy::lltm_backward", mutates_args=())
def _lltm_backward_op(grad_h: Optional[Tensor], grad_cell: Optional[Tensor], X: Tensor,
                      gates: Tensor, new_cell: Tensor, weights: Tensor,
                      bias_2d: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (d_old_h, d_input, d_weights, d_bias, d_old_cell), as the eager Function's
    backward computes them (custom ops return fresh tensors: views are cloned)."""
    state = new_cell.shape[1]
    bias_shape = (1, 3 * state) if bias_2d else (3 * state,)
    if X.is_cuda or _interop.EMULATED_CUDA:
        grads = cuda_step_backward(grad_h, grad_cell, X, gates, new_cell, weights, bias_shape,
                                   (True,) * 5)
    else:
        grads = cpu_step_backward(grad_h, grad_cell, gates, weights, bias_shape, (True,) * 5,
                                  X=X)
    d_input, d_weights, d_bias, d_old_h, d_old_cell = (
        g if g.is_contiguous() else g.contiguous() for g in grads)
    return d_old_h, d_input, d_weights, d_bias, d_old_cell


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


lltm_forward_op.register_autograd(_backward_op_autograd, setup_context=_setup_context)


@torch.library.custom_op("lltm_cupy::lltm_sequence_forward", mutates_args=())
def sequence_forward_op(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor,
                        c0: Tensor, fused: bool = False
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (hs, h_n, c_n, gates, cells); the outputs are hs[1:]."""
    with _interop.backend_call(inputs.device) as call:
        _, h_n, c_n, saved = call.backend.forward_sequence(
            *(call.array(t) for t in (inputs, weights, bias, h0, c0)), **call.kw,
            **(_interop.fused_kw(call) if fused else {}))
        return tuple(call.tensor(a) for a in (saved.hs, h_n, c_n, saved.gates, saved.cells))


@sequence_forward_op.register_fake
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
            _interop.backend_name(inputs.device),
            call.array(inputs.contiguous()).reshape(steps * batch, features),
            *(call.array(t.contiguous()) for t in (hs, gates, cells, weights)),
            (1, 3 * state) if bias_2d else (3 * state,))
        if fused and _interop.fused_kw(call):      # as the forward chose: the fused kernels where they fit
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


sequence_forward_op.register_autograd(_sequence_backward_autograd,
                                       setup_context=_sequence_setup_context)


@torch.library.custom_op("lltm_cupy::lltm_sequence_inference", mutates_args=())
def sequence_inference_op(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor,
                          c0: Tensor, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """A sequence, forward only: (outputs, h_n, c_n)."""
    return sequence_forward_only(inputs, weights, bias, h0, c0, fused=fused)


@sequence_inference_op.register_fake
def _(inputs, weights, bias, h0, c0, fused=False):
    steps, batch, _ = inputs.shape
    state = h0.shape[1]
    # the outputs are the hidden states after h0: [h0, h_1, ..., h_T][1:], as the eager call's
    outputs = (inputs.new_empty(steps + 1, batch, state)[1:] if steps * batch * state
               else inputs.new_empty(steps, batch, state))
    return outputs, inputs.new_empty(batch, state), inputs.new_empty(batch, state)



