"""CPU backend: the LLTM cell in vectorised NumPy.

Same math and numerics as ``cuda_src/lltm.cu`` (see the comment at its top); the arithmetic runs in
the input dtype (float32 stays float32). Arguments were checked by ``lltm_cupy._checks``.
"""
from __future__ import annotations

import numpy as np

from ._types import LLTMGrads, LLTMSaved

__all__ = ["forward", "backward"]


def _sigmoid(z):
    """Return (sigmoid(z), sigmoid'(z)) without overflow: e = exp(-|z|), r = 1 / (1 + e)."""
    e = np.abs(z)
    np.negative(e, out=e)
    np.exp(e, out=e)
    r = e + 1
    np.reciprocal(r, out=r)
    np.multiply(e, r, out=e)                # e * r: sigmoid(z) for z < 0
    s = np.where(z >= 0, r, e)
    np.multiply(e, r, out=e)                # e * r * r: sigmoid'(z)
    return s, e


def _elu(z):
    """Return (elu(z), elu'(z)): max(z, 0) + expm1(min(z, 0)) and exp(min(z, 0)), exact at 0."""
    m = np.minimum(z, 0)
    d = np.exp(m)
    np.expm1(m, out=m)
    m += np.maximum(z, 0)
    return m, d


def forward(input, weights, bias, old_h, old_cell):
    batch, _ = input.shape
    state = old_h.shape[1]
    X = np.concatenate((old_h, input), axis=1)
    gates = np.matmul(X, weights.T)
    gates += bias.reshape(-1)

    z_io = gates[:, : 2 * state]
    e = np.abs(z_io)
    np.negative(e, out=e)
    np.exp(e, out=e)
    r = e + 1
    np.divide(e, r, out=e)                  # sigmoid(z) for z < 0
    np.reciprocal(r, out=r)                 # sigmoid(z) for z >= 0
    np.copyto(e, r, where=z_io >= 0)
    input_gate = e[:, :state]
    output_gate = e[:, state:]

    z_c = gates[:, 2 * state:]
    candidate_cell = np.minimum(z_c, 0)
    np.expm1(candidate_cell, out=candidate_cell)
    candidate_cell += np.maximum(z_c, 0)

    new_cell = np.multiply(candidate_cell, input_gate, out=candidate_cell)
    new_cell += old_cell
    new_h = np.tanh(new_cell)
    new_h *= output_gate
    saved = LLTMSaved("numpy", X, gates, new_cell, weights, tuple(bias.shape))
    return new_h, new_cell, saved


def backward(grad_h, grad_cell, saved, needed=(True,) * 5):
    gates, new_cell, X, weights = saved.gates, saved.new_cell, saved.X, saved.weights
    batch, state = new_cell.shape
    dtype = new_cell.dtype
    if grad_h is None:
        grad_h = np.zeros((batch, state), dtype)
    if grad_cell is None:
        grad_cell = np.zeros((batch, state), dtype)

    sig, d_sig = _sigmoid(gates[:, : 2 * state])
    candidate_cell, d_elu = _elu(gates[:, 2 * state:])

    # tanh'(c) = 4 e / (1 + e)^2 with e = exp(-2|c|): no cancellation once tanh saturates.
    e = np.abs(new_cell)
    e *= -2
    np.exp(e, out=e)
    den = e + 1
    np.square(den, out=den)
    e *= 4
    d_tanh = np.divide(e, den, out=e)

    d_gates = np.empty((batch, 3 * state), dtype)
    d_i, d_o, d_c = d_gates[:, :state], d_gates[:, state: 2 * state], d_gates[:, 2 * state:]

    # d_new_cell = tanh'(c) * output_gate * grad_h + grad_cell
    d_new_cell = np.multiply(d_tanh, sig[:, state:], out=d_tanh)
    d_new_cell *= grad_h
    d_new_cell += grad_cell
    # d_output_gate = tanh(c) * grad_h, times sigmoid'(z_o)
    np.tanh(new_cell, out=d_o)
    d_o *= grad_h
    d_o *= d_sig[:, state:]
    # d_input_gate = candidate_cell * d_new_cell, times sigmoid'(z_i)
    np.multiply(candidate_cell, d_new_cell, out=d_i)
    d_i *= d_sig[:, :state]
    # d_candidate_cell = input_gate * d_new_cell, times elu'(z_c)
    np.multiply(sig[:, :state], d_new_cell, out=d_c)
    d_c *= d_elu

    need_h, need_x, need_w, need_b, need_c = needed
    return LLTMGrads(
        np.matmul(d_gates, weights[:, :state]) if need_h else None,
        np.matmul(d_gates, weights[:, state:]) if need_x else None,
        np.matmul(d_gates.T, X) if need_w else None,
        d_gates.sum(axis=0).reshape(saved.bias_shape) if need_b else None,
        d_new_cell if need_c else None,
    )
