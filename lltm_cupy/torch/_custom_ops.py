"""The LLTM as custom operators for torch.compile and shape inference (meta tensors):
``lltm_cupy::step`` / ``lltm_backward`` (one step, differentiable through the
first's autograd registration), ``lltm_cupy::sequence`` / ``lltm_sequence_backward``
(a whole sequence of one length), and ``lltm_cupy::step_inference`` /
``lltm_sequence_inference`` (forward only). The compiler treats them as opaque: no graph break,
and CUDA graphs (``mode="reduce-overhead"``) capture them like torch's own kernels. Each runs
the eager Function's own body (``_functions.step_forward`` / ``step_backward``,
``_sequence_function.sequence_forward`` / ``sequence_backward``), so that eager and compiled
calls compute with the same code and give the same bits; the eager path never calls them.

The forward ops return, besides the outputs, what their backward reads (its fake versions give
those shapes: the CPU's four factors (..., 4, B, S), CUDA's pre-activations (..., B, 3S) and
cells). A second derivative through them is refused (under torch.compile; eagerly the layer
supports it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _cuda_sequence
from ._functions import step_backward, step_forward, step_inference
from ._interop import cuda_backend
from ._sequence_function import sequence_backward, sequence_forward, sequence_inference

__all__ = ["compiled_step", "compiled_sequence", "lltm_forward_op", "lltm_inference_op",
           "sequence_forward_op", "sequence_inference_op"]


def compiled_step(tensors, backward: bool):
    """One step by the operators: ``(new_h, new_cell)``, differentiable where ``backward``
    (autograd will record the call), else forward only."""
    if backward:
        return lltm_forward_op(*tensors)[:2]
    return lltm_inference_op(*tensors)


def compiled_sequence(inputs, weights, bias, h0, c0, fused: bool, backward: bool):
    """A sequence by the operators: ``(outputs, h_n, c_n)``, differentiable where ``backward``,
    else forward only."""
    if backward:
        hs, h_n, c_n = sequence_forward_op(inputs, weights, bias, h0, c0, fused)[:3]
        return hs[1:], h_n, c_n
    return sequence_inference_op(inputs, weights, bias, h0, c0, fused)


def _refuse_double_backward() -> None:
    # The engine runs a backward with grad mode on exactly when create_graph=True. These ops'
    # backward is not differentiable; returning its result would silently give zero second
    # derivatives.
    if torch.is_grad_enabled():
        raise RuntimeError("lltm_cupy.torch: double backward (create_graph=True) is not supported "
                           "under torch.compile: the LLTM's custom operators have no second "
                           "derivative (run the model eagerly for second derivatives)")


def _fresh(grads):
    """Gradients as a custom operator returns them: contiguous (the views d_old_h and d_input of
    one GEMM copied)."""
    return tuple(g if g.is_contiguous() else g.contiguous() for g in grads)


# ------------------------------------------------------------------------------------ one step

@torch.library.custom_op("lltm_cupy::step_inference", mutates_args=())
def lltm_inference_op(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                      old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """One step, forward only: (new_h, new_cell)."""
    return step_inference(input, weights, bias, old_h, old_cell)


@lltm_inference_op.register_fake
def _(input, weights, bias, old_h, old_cell):
    return old_h.new_empty(old_h.shape), old_h.new_empty(old_h.shape)


@torch.library.custom_op("lltm_cupy::step", mutates_args=())
def lltm_forward_op(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                    old_cell: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(new_h, new_cell, first, second)``: the eager Function's forward (``step_forward``)
    and what its backward reads besides the arguments (and, on CUDA, new_cell): the CPU's
    factors and an empty tensor, CUDA's X and gate pre-activations (a fixed number of results:
    the compiler's)."""
    output = step_forward(input, weights, bias, old_h, old_cell)
    if len(output) == 3:
        return output[0], output[1], output[2], _absent(output[2])
    return output


def _absent(like: Tensor) -> Tensor:
    """The stand-in of a result a device does not have (no elements)."""
    return like.new_empty(0)


@lltm_forward_op.register_fake
def _(input, weights, bias, old_h, old_cell):
    batch, features = input.shape
    state = old_h.shape[1]
    new = input.new_empty
    if cuda_backend(input):     # X, the pre-activations
        kept = new(batch, state + features), new(batch, 3 * state)
    else:                       # the four factors
        kept = new(4, batch, state), new(0)
    return (new(batch, state), new(batch, state), *kept)


def _step_saved(args, new_cell, first, second) -> tuple:
    """What ``step_backward`` reads, from the forward op's arguments and results."""
    if cuda_backend(args[0]):
        return (*args, first, second, new_cell)
    return (*args, first)


@torch.library.custom_op("lltm_cupy::step_backward", mutates_args=())
def _lltm_backward_op(grad_h: Optional[Tensor], grad_cell: Optional[Tensor], input: Tensor,
                      weights: Tensor, bias: Tensor, old_h: Tensor, old_cell: Tensor,
                      new_cell: Tensor, first: Tensor,
                      second: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The eager Function's backward (``step_backward``): (d_input, d_weights, d_bias, d_old_h,
    d_old_cell), every gradient."""
    saved = _step_saved((input, weights, bias, old_h, old_cell), new_cell, first, second)
    return _fresh(step_backward(grad_h, grad_cell, saved, (True,) * 5))


@_lltm_backward_op.register_fake
def _(grad_h, grad_cell, input, weights, bias, old_h, old_cell, new_cell, first, second):
    return (input.new_empty(input.shape), weights.new_empty(weights.shape),
            bias.new_empty(bias.shape), old_h.new_empty(old_h.shape),
            old_cell.new_empty(old_cell.shape))


def _setup_context(ctx, inputs, output):
    _, new_cell, first, second = output     # (new_cell: read by CUDA's backward only)
    ctx.save_for_backward(*inputs, new_cell if cuda_backend(new_cell) else _absent(first),
                          first, second)


def _backward_op_autograd(ctx, grad_h, grad_cell, _grad_first, _grad_second):
    _refuse_double_backward()
    return _lltm_backward_op(grad_h, grad_cell, *ctx.saved_tensors)


lltm_forward_op.register_autograd(_backward_op_autograd, setup_context=_setup_context)


# ----------------------------------------------------------------------------- a sequence

@torch.library.custom_op("lltm_cupy::sequence", mutates_args=())
def sequence_forward_op(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor,
                        c0: Tensor, fused: bool = False
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(hs, h_n, c_n, gates, cells, x)``: the eager Function's forward
    (``sequence_forward``); the outputs are hs[1:] (hs = [h0, outputs...]); gates, cells and x
    what its backward reads besides the arguments and hs: the gate values, the cells (CUDA),
    the inputs' contiguous copy (where they are not contiguous), each an empty tensor where
    there is none (a fixed number of results: the compiler's)."""
    inputs_c = inputs.is_contiguous()
    _, h_n, c_n, _, hs, gates, *rest = sequence_forward(inputs, weights, bias, h0, c0, None,
                                                        fused)
    cells = rest.pop(0) if cuda_backend(inputs) else _absent(gates)
    x = _absent(gates) if inputs_c else rest.pop(0)
    return hs, h_n, c_n, gates, cells, x


@sequence_forward_op.register_fake
def _(inputs, weights, bias, h0, c0, fused=False):
    steps, batch, _ = inputs.shape
    state = h0.shape[1]
    new = inputs.new_empty
    if cuda_backend(inputs):    # the pre-activations and the cells
        gates, cells = new(steps, batch, 3 * state), new(steps, batch, state)
    else:                       # the four factors
        gates, cells = new(steps, 4, batch, state), new(0)
    x = new(0) if inputs.is_contiguous() else new(inputs.shape)
    return new(steps + 1, batch, state), new(batch, state), new(batch, state), gates, cells, x


@torch.library.custom_op("lltm_cupy::sequence_backward", mutates_args=())
def _sequence_backward_op(grad_outputs: Optional[Tensor], grad_h_n: Optional[Tensor],
                          grad_c_n: Optional[Tensor], inputs: Tensor, weights: Tensor,
                          bias: Tensor, h0: Tensor, c0: Tensor, hs: Tensor, gates: Tensor,
                          cells: Tensor, x: Tensor, fused: bool = False
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The eager Function's backward (``sequence_backward``): (d_inputs, d_weights, d_bias,
    d_h0, d_c0), every gradient; which kernels the forward ran decided again as it did."""
    cuda = cuda_backend(inputs)
    kept = (hs, gates, *((cells,) if cuda else ()), *(() if inputs.is_contiguous() else (x,)))
    ran = cuda and _cuda_sequence.fused_runs(inputs, h0.shape[1], fused)
    return _fresh(sequence_backward((grad_outputs, grad_h_n, grad_c_n),
                                    (inputs, weights, bias, h0, c0, *kept), None, ran,
                                    (True,) * 5))


@_sequence_backward_op.register_fake
def _(grad_outputs, grad_h_n, grad_c_n, inputs, weights, bias, h0, c0, hs, gates, cells, x,
      fused=False):
    return (inputs.new_empty(inputs.shape), weights.new_empty(weights.shape),
            bias.new_empty(bias.shape), h0.new_empty(h0.shape), c0.new_empty(c0.shape))


def _sequence_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5], output[0], *output[3:])
    ctx.fused = bool(inputs[5]) if len(inputs) > 5 else False


def _sequence_backward_autograd(ctx, grad_hs, grad_h_n, grad_c_n, *_):
    _refuse_double_backward()
    grad_outputs = None if grad_hs is None else grad_hs[1:]
    return _sequence_backward_op(grad_outputs, grad_h_n, grad_c_n, *ctx.saved_tensors,
                                 ctx.fused) + (None,)   # (fused has none)


sequence_forward_op.register_autograd(_sequence_backward_autograd,
                                       setup_context=_sequence_setup_context)


@torch.library.custom_op("lltm_cupy::sequence_inference", mutates_args=())
def sequence_inference_op(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor,
                          c0: Tensor, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """A sequence, forward only: (outputs, h_n, c_n)."""
    return sequence_inference(inputs, weights, bias, h0, c0, None, fused)


@sequence_inference_op.register_fake
def _(inputs, weights, bias, h0, c0, fused=False):
    steps, batch, _ = inputs.shape
    state = h0.shape[1]
    # the outputs are the hidden states after h0: [h0, h_1, ..., h_T][1:], as the eager call's
    outputs = (inputs.new_empty(steps + 1, batch, state)[1:] if steps * batch * state
               else inputs.new_empty(steps, batch, state))
    return outputs, inputs.new_empty(batch, state), inputs.new_empty(batch, state)



