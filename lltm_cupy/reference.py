"""The naive float64 NumPy transcription of the tutorial's LLTM note: the spec for every test.

Deliberately unoptimised and written to read like the C++ of the tutorial's note (the note's
``lltm_forward`` / ``lltm_backward``), with its defects corrected:

- ``d_sigmoid`` is defined; ``d_elu(0) == 1``, as PyTorch's autograd gives (the note's version
  gives 0 there);
- ``sigmoid``, ``d_sigmoid``, ``elu`` and ``d_tanh`` are evaluated in forms with the same
  value that keep it in floating point: the tutorial's ``s * (1 - s)`` and ``1 - tanh(z)^2``
  are exactly 0 once ``s`` or ``tanh`` rounds to 1 (|z| > 37 and > 19 in float64) although the
  true values (e^-37, 4 e^-38) are far from 0, ``1 / (1 + exp(-z))`` is 0 below z = -709,
  where the value (e^z) is still representable, and ``exp(z) - 1`` is 0 for tiny z, where the
  value is z (``expm1``). A spec that rounds a value to 0 would also say ``inf * 0 = NaN``
  where the limit is infinite.

Everything is computed in float64 whatever the input dtype. IEEE arithmetic gives the limits
at infinities (sigmoid(-inf) = 0, elu(-inf) = -1, tanh'(inf) = 0) and NaN for the
indeterminate forms (inf * 0, inf - inf); NumPy's warnings about them are silenced here.
"""
from __future__ import annotations

import numpy as np

__all__ = ["lltm_forward", "lltm_backward", "lltm_backward_gates", "sigmoid", "d_sigmoid", "elu",
           "d_elu", "d_tanh"]

_QUIET = dict(over="ignore", invalid="ignore", divide="ignore", under="ignore")


def sigmoid(z):
    # 1 / (1 + exp(-z)), from e = exp(-|z|): no overflow, and no underflow before the value's
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0, e) / (1.0 + e)


def d_sigmoid(z):
    # s * (1 - s) = e / (1 + e)^2 with e = exp(-|z|)
    e = np.exp(-np.abs(z))
    return e / (1.0 + e) ** 2


def elu(z, alpha=1.0):
    # alpha * (exp(z) - 1) as expm1: exp(z) - 1 is 0 for |z| < 1e-16, where the value is z
    return np.where(z > 0, z, alpha * np.expm1(z))


def d_elu(z, alpha=1.0):
    # PyTorch: 1 for z > 0, alpha * exp(z) for z <= 0 (so 1 at z == 0 when alpha == 1).
    return np.where(z > 0, 1.0, alpha * np.exp(z))


def d_tanh(z):
    # 1 - tanh(z)^2 = (1 / cosh(z))^2, the reciprocal first: cosh(z)^2 overflows for |z| > 355,
    # where the value is still representable (cosh itself overflows where the value underflows)
    return (1.0 / np.cosh(z)) ** 2


def _f64(a):
    return np.asarray(a, dtype=np.float64)


def lltm_forward(input, weights, bias, old_h, old_cell):
    """Return ``(new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights)``.

    input: (batch, features); weights: (3*state, state + features); bias: (3*state,) or
    (1, 3*state); old_h, old_cell: (batch, state). All results are float64.
    """
    with np.errstate(**_QUIET):
        input, weights, old_h, old_cell = map(_f64, (input, weights, old_h, old_cell))
        bias = _f64(bias).reshape(-1)
        X = np.concatenate([old_h, input], axis=1)
        gate_weights = X @ weights.T + bias
        gi, go, gc = np.split(gate_weights, 3, axis=1)
        input_gate = sigmoid(gi)
        output_gate = sigmoid(go)
        candidate_cell = elu(gc, alpha=1.0)
        new_cell = old_cell + candidate_cell * input_gate
        new_h = np.tanh(new_cell) * output_gate
        return new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights


def lltm_backward_gates(grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell,
                        gate_weights):
    """Return ``(d_gates, d_new_cell)``: the element-wise half of the backward, in float64.

    d_gates: (batch, 3*state), the gradient w.r.t. the gate pre-activations
    [input | output | candidate]; d_new_cell: (batch, state), which is also d_old_cell.
    """
    with np.errstate(**_QUIET):
        grad_h, grad_cell = _f64(grad_h), _f64(grad_cell)
        d_output_gate = np.tanh(new_cell) * grad_h
        d_tanh_new_cell = output_gate * grad_h
        d_new_cell = d_tanh(new_cell) * d_tanh_new_cell + grad_cell

        d_candidate_cell = input_gate * d_new_cell
        d_input_gate = candidate_cell * d_new_cell

        gi, go, gc = np.split(gate_weights, 3, axis=1)
        d_input_gate = d_input_gate * d_sigmoid(gi)
        d_output_gate = d_output_gate * d_sigmoid(go)
        d_candidate_cell = d_candidate_cell * d_elu(gc)

        d_gates = np.concatenate([d_input_gate, d_output_gate, d_candidate_cell], axis=1)
        return d_gates, d_new_cell


def lltm_backward(grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X,
                  gate_weights, weights):
    """Return ``(d_old_h, d_input, d_weights, d_bias, d_old_cell)`` in float64.

    ``d_bias`` has shape (3*state,). The arguments after the two gradients are what
    :func:`lltm_forward` returned (and the weights).
    """
    d_gates, d_new_cell = lltm_backward_gates(grad_h, grad_cell, new_cell, input_gate,
                                              output_gate, candidate_cell, gate_weights)
    d_old_cell = d_new_cell
    with np.errstate(**_QUIET):
        d_weights = d_gates.T @ X
        d_bias = d_gates.sum(axis=0)
        d_X = d_gates @ _f64(weights)
    state_size = new_cell.shape[1]
    d_old_h = d_X[:, :state_size]
    d_input = d_X[:, state_size:]
    return d_old_h, d_input, d_weights, d_bias, d_old_cell
