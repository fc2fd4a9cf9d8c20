"""The pure-torch reference: the tutorial's Python LLTM, differentiated by autograd, and its
backward by the formulas of docs/derivation.md in torch operations. The reference of the torch
tests, ``scripts/check.py`` and the benchmark, the recording tools' LLTM (``_export``) and the
layer's differentiable backward (second derivatives); never optimised."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ._module_args import _CellBase

__all__ = ["lltm_reference", "lltm_sequence_reference", "lltm_backward_reference",
           "lltm_sequence_backward_reference", "ReferenceLLTMCell"]


def lltm_reference(input, weights, bias, old_h, old_cell):
    """The tutorial's LLTM in torch ops; autograd gives the gradients. Returns (new_h, new_cell)."""
    X = torch.cat([old_h, input], dim=1)
    gate_weights = torch.addmm(bias, X, weights.t())
    gates = gate_weights.chunk(3, dim=1)
    input_gate = torch.sigmoid(gates[0])
    output_gate = torch.sigmoid(gates[1])
    candidate_cell = torch.nn.functional.elu(gates[2], alpha=1.0)
    new_cell = old_cell + candidate_cell * input_gate
    new_h = torch.tanh(new_cell) * output_gate
    return new_h, new_cell


def lltm_sequence_reference(inputs, weights, bias, h, c):
    """:func:`lltm_reference` stepped over ``inputs`` (steps, batch, features) from the states
    ``h``, ``c`` (batch, state): ``(outputs, h_n, c_n)`` as ``lltm_sequence`` returns them.
    (TorchScript compiles it as it stands: what ``torch.jit.trace`` of an LLTM records.)"""
    outputs = torch.jit.annotate(List[Tensor], [])
    for t in range(inputs.shape[0]):    # (unbind's list defeats the TorchScript ONNX exporter)
        h, c = lltm_reference(inputs[t], weights, bias, h, c)
        outputs.append(h)
    if len(outputs) == 0:
        return inputs.new_empty(0, h.shape[0], h.shape[1]), h, c
    return torch.stack(outputs), h, c


def _forward_parts(input, weights, bias, old_h, old_cell):
    """One step's forward, keeping what its backward multiplies by: (new_h, new_cell, parts)."""
    X = torch.cat([old_h, input], dim=1)
    z_i, z_o, z_c = torch.addmm(bias.reshape(-1), X, weights.t()).chunk(3, dim=1)
    input_gate, output_gate = torch.sigmoid(z_i), torch.sigmoid(z_o)
    candidate_cell = torch.nn.functional.elu(z_c, alpha=1.0)
    new_cell = old_cell + candidate_cell * input_gate
    tanh_cell = torch.tanh(new_cell)
    return (tanh_cell * output_gate, new_cell,
            (X, z_i, z_o, z_c, input_gate, output_gate, candidate_cell, new_cell, tanh_cell))


def _backward_parts(grad_h, grad_cell, parts, weights):
    """docs/derivation.md's backward of one step (grad_h / grad_cell None: zero), in the forms
    that keep relative accuracy (sigmoid'(z) = sigmoid(z) sigmoid(-z), elu'(z) =
    exp(min(z, 0)), tanh'(c) = 4 sigmoid(2c) sigmoid(-2c)) and are differentiable everywhere:
    (d_input, d_weights, d_bias (3S,), d_old_h, d_old_cell)."""
    X, z_i, z_o, z_c, input_gate, output_gate, candidate_cell, new_cell, tanh_cell = parts
    state = new_cell.shape[1]
    if grad_h is None:
        grad_h = torch.zeros_like(new_cell)
    d_tanh = 4 * torch.sigmoid(2 * new_cell) * torch.sigmoid(-2 * new_cell)
    d_new_cell = grad_h * output_gate * d_tanh
    if grad_cell is not None:
        d_new_cell = d_new_cell + grad_cell
    d_z_i = d_new_cell * candidate_cell * input_gate * torch.sigmoid(-z_i)
    d_z_o = grad_h * tanh_cell * output_gate * torch.sigmoid(-z_o)
    d_z_c = d_new_cell * input_gate * torch.exp(torch.clamp(z_c, max=0))
    d_gates = torch.cat([d_z_i, d_z_o, d_z_c], dim=1)
    d_X = d_gates.mm(weights)
    return d_X[:, state:], d_gates.t().mm(X), d_gates.sum(0), d_X[:, :state], d_new_cell


def lltm_backward_reference(grad_h, grad_cell, input, weights, bias, old_h, old_cell,
                            needed=(True,) * 5):
    """The gradients of one step (:func:`lltm_reference`) by the backward's formulas, in
    differentiable torch operations: ``(d_input, d_weights, d_bias, d_old_h, d_old_cell)``,
    each shaped like its argument (None where ``needed``, in the argument order, says so);
    ``grad_h`` / ``grad_cell`` None: zero. Differentiating the results gives second
    derivatives."""
    _, _, parts = _forward_parts(input, weights, bias, old_h, old_cell)
    d_input, d_weights, d_bias, d_old_h, d_old_cell = _backward_parts(grad_h, grad_cell, parts,
                                                                      weights)
    grads = (d_input, d_weights, d_bias.reshape(bias.shape), d_old_h, d_old_cell)
    return tuple(g if need else None for g, need in zip(grads, needed))


def lltm_sequence_backward_reference(grad_outputs, grad_h_n, grad_c_n, inputs, weights, bias,
                                     h0, c0):
    """The gradients of a sequence of steps by the backward's formulas, in differentiable
    torch operations (the forward recomputed first, then the steps backward).

    inputs: a list of (n_t, features) per step, n_t non-increasing: step t runs the first n_t
        sequences (the rows of h0, c0 (batch, state)); a sequence's last step is the last
        that runs it, and its final state its state after that step
    grad_outputs: None, or a list of (n_t, state), the gradients of each step's hidden states
    grad_h_n, grad_c_n: None, or (batch, state), the final states' gradients
    Returns ``(d_inputs, d_weights, d_bias, d_h0, d_c0)``, d_inputs a list like ``inputs``.
    """
    parts, h, c = [], h0, c0
    for x in inputs:
        n = x.shape[0]
        new_h, new_cell, p = _forward_parts(x, weights, bias, h[:n], c[:n])
        parts.append(p)
        h, c = torch.cat([new_h, h[n:]]), torch.cat([new_cell, c[n:]])
    d_h = torch.zeros_like(h0) if grad_h_n is None else grad_h_n
    d_c = torch.zeros_like(c0) if grad_c_n is None else grad_c_n
    d_inputs = [None] * len(inputs)
    d_weights, d_bias = torch.zeros_like(weights), bias.new_zeros(bias.numel())
    for t in range(len(inputs) - 1, -1, -1):
        n = inputs[t].shape[0]
        g_h = d_h[:n] if grad_outputs is None else d_h[:n] + grad_outputs[t]
        d_inputs[t], d_w, d_b, d_h_in, d_c_in = _backward_parts(g_h, d_c[:n], parts[t], weights)
        d_weights, d_bias = d_weights + d_w, d_bias + d_b
        d_h, d_c = torch.cat([d_h_in, d_h[n:]]), torch.cat([d_c_in, d_c[n:]])
    return d_inputs, d_weights, d_bias.reshape(bias.shape), d_h, d_c


class ReferenceLLTMCell(_CellBase):
    """The tutorial's pure-Python LLTM module: same parameters as :class:`LLTMCell`."""

    def forward(self, input: Tensor, state: Optional[tuple[Tensor, Tensor]] = None):
        return lltm_reference(*self._args(input, state))
