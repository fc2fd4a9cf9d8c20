"""The CPU backend's variable-length loops: sequences of different lengths run packed, per step
only the sequences still running (a prefix of the batch sorted by length), as
:mod:`lltm_cupy._packing` plans them (``lengths=``, a ``PackedSequence``'s rows)."""
from __future__ import annotations

import numpy as np

from .. import _packing
from .._types import LLTMSequenceGrads, LLTMSequenceSaved
from . import sequence
from .step import _activate, _d_gates, _gate_major_to_rows

__all__ = ["forward_packed", "backward_packed"]


def forward_packed(inputs, weights, bias, h0, c0, mm, plan, keep):
    """forward_sequence over the packed rows of ``plan`` (lltm_cupy._packing): per step only
    the sequences still running, a prefix of the sorted batch."""
    batch = len(plan.perm)
    state = h0.shape[1]
    dtype = inputs.dtype
    rows = plan.rows
    x = _packing.pack_rows(inputs, plan, *_indices(plan))     # (N, F), one gather
    w_x_t = np.ascontiguousarray(weights[:, state:].T)
    w_h_t = np.ascontiguousarray(weights[:, :state].T)
    h0s, c0s = h0[plan.perm], c0[plan.perm]
    t_index, b_index, data_index = _indices(plan)
    direct = plan.packed_io and data_index is None    # the packed rows are the output's rows
    if keep or direct:
        out = np.empty((rows, state), dtype)
    if keep:
        cells = np.empty((rows, state), dtype)
        factors = np.empty(rows * 4 * state, dtype)
    else:
        # forward only: the sorted state, rows [:n] updated in place at each step, and each
        # step's hidden state written straight to its place in the output
        c_state = np.array(c0s, dtype, order="C")
        h_state = np.array(h0s, dtype, order="C")
        if plan.packed_io and not direct:
            outputs = np.empty((rows, state), dtype)
        elif not direct:
            outputs = np.zeros((plan.steps, batch, state), dtype)
    scratch = np.empty(3 * batch * state, dtype)
    # the input projection of a block of steps in one GEMM, bias added, in the GEMMs' row
    # layout (the same blocks with and without keep)
    for tau0, tau1 in _packing.step_blocks(plan.offsets, sequence._BLOCK_ROWS):
        start = plan.offsets[tau0]
        projection = mm(x[start: plan.offsets[tau1]], w_x_t)
        projection += bias.reshape(1, -1)
        for tau in range(tau0, tau1):
            n = plan.batch_sizes[tau]
            rows_t = plan.step(tau)
            prev = plan.offsets[tau - 1] if tau else None
            if keep or direct:
                h_in = h0s[:n] if not tau else out[prev: prev + n]
            else:
                h_in = h_state[:n]
            z = scratch[: 3 * n * state].reshape(3, n, state)
            np.add(projection[rows_t.start - start: rows_t.stop - start]
                   .reshape(n, 3, state).transpose(1, 0, 2),
                   mm(h_in, w_h_t).reshape(n, 3, state).transpose(1, 0, 2), z)
            if keep:
                c_in = c0s[:n] if not tau else cells[prev: prev + n]
                f = factors[4 * state * rows_t.start: 4 * state * rows_t.stop].reshape(4, n, state)
                _activate(z, c_in, out[rows_t], cells[rows_t], f)
            elif direct:
                _activate(z, c_state[:n], out[rows_t], c_state[:n])
                h_state[:n] = out[rows_t]
            else:
                _activate(z, c_state[:n], h_state[:n], c_state[:n])
                if plan.packed_io:
                    outputs[data_index[rows_t]] = h_state[:n]
                else:
                    outputs[t_index[rows_t], b_index[rows_t]] = h_state[:n]
    h_n, c_n = np.empty_like(h0s), np.empty_like(c0s)
    if not keep:
        if direct:
            outputs = out
        # each sequence's state after its last step (h0, c0 for length 0)
        h_n[plan.perm], c_n[plan.perm] = h_state, c_state
        return outputs, h_n, c_n, None
    outputs = _packing.unpack_rows(out, plan, np, t_index, b_index, data_index)
    ended = plan.last_row >= 0
    h_sorted = np.where(ended[:, None], out[np.maximum(plan.last_row, 0)] if rows else h0s, h0s)
    c_sorted = np.where(ended[:, None], cells[np.maximum(plan.last_row, 0)] if rows else c0s, c0s)
    h_n[plan.perm], c_n[plan.perm] = h_sorted, c_sorted
    saved = LLTMSequenceSaved("numpy", x, out, factors, cells, weights, tuple(bias.shape),
                              plan=plan, h0=h0s)
    return outputs, h_n, c_n, saved


def _indices(plan):
    return plan.t_index, plan.b_index, plan.data_index


def _h_in_packed(saved):
    """The hidden state each packed row's step read, (N, S): h0 for step 0, else a prefix of
    the previous step's outputs."""
    plan, out = saved.plan, saved.hs
    parts = [saved.h0[: n] if not tau else out[plan.offsets[tau - 1]: plan.offsets[tau - 1] + n]
             for tau, n in enumerate(plan.batch_sizes)]
    return np.concatenate(parts) if parts else out[:0]


def backward_packed(grad_outputs, grad_h_n, grad_c_n, saved, needed, mm):
    plan, x, factors, weights = saved.plan, saved.inputs, saved.gates, saved.weights
    rows, state = saved.hs.shape
    batch = len(plan.perm)
    dtype = saved.hs.dtype
    zeros = np.zeros((batch, state), dtype)
    # grad_h of every packed row: the outputs' gradient, the final state's at each sequence's
    # last step, and (in the loop) what flows back from the next step
    grad_h = (np.zeros((rows, state), dtype) if grad_outputs is None
              else np.array(_packing.pack_rows(grad_outputs, plan, *_indices(plan)), dtype))
    ended = plan.last_row >= 0
    ghn = zeros if grad_h_n is None else grad_h_n[plan.perm]
    gcn = None if grad_c_n is None else grad_c_n[plan.perm]
    if grad_h_n is not None and ended.any():
        grad_h[plan.last_row[ended]] += ghn[ended]
    flat = np.empty((rows, 3 * state), dtype)
    scratch = np.empty(3 * batch * state, dtype)
    w_h = np.ascontiguousarray(weights[:, :state])
    d_c = None
    sizes = plan.batch_sizes
    d_h_first = None
    for tau in range(len(sizes) - 1, -1, -1):
        n, nxt = sizes[tau], sizes[tau + 1] if tau + 1 < len(sizes) else 0
        rows_t = plan.step(tau)
        # the cell gradient entering step tau: from step tau + 1 for the rows still running
        # there, the final state's for the rows that end here (the call only where any do)
        dc_in = (d_c if d_c is not None and nxt == n
                 else _packing.incoming_cell_grad(np, d_c, gcn, n, nxt, state, dtype))
        d_acts = scratch[: 3 * n * state].reshape(3, n, state)
        f = factors[4 * state * rows_t.start: 4 * state * rows_t.stop].reshape(4, n, state)
        d_c = _d_gates(grad_h[rows_t], dc_in, f, d_acts)
        _gate_major_to_rows(d_acts, flat[rows_t])
        if tau:
            prev = plan.offsets[tau - 1]
            grad_h[prev: prev + n] += mm(flat[rows_t], w_h)
        else:
            d_h_first = mm(flat[rows_t], w_h)
    first = sizes[0] if sizes else 0
    d_h0s, d_c0s = np.array(ghn), (zeros.copy() if gcn is None else np.array(gcn))
    if first:
        d_h0s[:first] = d_h_first
        d_c0s[:first] = d_c
    d_h0, d_c0 = np.empty_like(d_h0s), np.empty_like(d_c0s)
    d_h0[plan.perm], d_c0[plan.perm] = d_h0s, d_c0s
    need_x, need_w, need_b, need_h0, need_c0 = needed
    d_weights = d_bias = d_inputs = None
    if need_w:
        d_weights = np.empty(weights.shape, dtype)
        d_weights[:, :state] = mm(flat.T, _h_in_packed(saved))
        d_weights[:, state:] = mm(flat.T, x)
    if need_b:
        d_bias = flat.sum(axis=0).reshape(saved.bias_shape)
    if need_x:
        d_inputs = _packing.unpack_rows(mm(flat, weights[:, state:]), plan, np, *_indices(plan))
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0 if need_h0 else None,
                             d_c0 if need_c0 else None)


# ------------------------------------------------------------------ the fused cell alone
