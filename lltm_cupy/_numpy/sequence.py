"""The CPU backend's fixed-length sequence loops: every step's recurrent GEMM and element-wise
step on buffers made once per call (``forward_sequence``, ``backward_sequence``).

The GEMMs go through ``mm``, an object with the interface of :mod:`lltm_cupy._numpy.gemm`
(default: NumPy's BLAS); they run gate-major, so that the products land in the element-wise
step's layout with the bias already added: no pass transposes them.
"""
from __future__ import annotations

import numpy as np

from .. import _packing
from .._types import LLTMSequenceGrads, LLTMSequenceSaved
from .gemm import gate_weights
from .step import _d_gates, _step_factors, _step_on, _step_views

__all__ = ["forward_sequence", "backward_sequence"]

#: Rows of one block of the sequences' input projection: one GEMM per block of steps into a
#: buffer reused block after block. At 256-2048 rows torch's and NumPy's single-threaded GEMMs
#: run at their best rows per second (measured at F, S = (16, 512), (32, 128), (128, 256),
#: (256, 512), (512, 1024)); at 4096-8192 rows the product leaves the caches and a row costs
#: 1.2-7x more.
_BLOCK_ROWS = 512

#: keep: a group of steps' factors in one _step_factors call each, as many steps as keep its
#: arguments (_GROUP_ROWS rows of (B, S): scratch, z[1:], new_h, new_cell, factors) within
#: _GROUP_BYTES, next to the weights in a core's L2 cache; at least one step.
_GROUP_BYTES = 1 << 20
_GROUP_ROWS = 14


def forward_sequence(inputs, weights, bias, h0, c0, mm, keep):
    steps, batch, features = inputs.shape
    state = h0.shape[1]
    dtype = inputs.dtype
    x = inputs.reshape(steps * batch, features)
    hs = np.empty((steps + 1, batch, state), dtype)   # [h0, h_1, ..., h_T]
    hs[0] = h0
    if keep:    # what the backward keeps
        cells = np.empty((steps, batch, state), dtype)
        factors = np.empty((steps, 4, batch, state), dtype)
        c = c0
    else:       # forward only: one cell state, updated in place
        c = np.array(c0, dtype, order="C")
    # Gate-major GEMMs (lltm_cupy._numpy.gemm): the input projection of a block of steps in one
    # call, bias added, as (3, K * B, S), into one buffer reused block after block (the same
    # blocks with and without keep, so both give the same bits); each step's z = its (3, B, S)
    # view of that plus the recurrent product, written by one call into a contiguous buffer.
    w_x = mm.operand(gate_weights(weights[:, state:]))
    w_h = mm.operand(gate_weights(weights[:, :state]))
    hs_op = mm.operand(hs)
    block = _packing.block_steps(batch, _BLOCK_ROWS)
    buffer = np.empty(3 * min(block, steps) * batch * state, dtype)
    # keep: the backward's factors of a group of steps in one call each (_step_factors) from
    # what each step's _step left in its scratch and z, as many steps as keep that in cache
    group = 1 if not keep else min(block, max(steps, 1), max(
        1, _GROUP_BYTES // (_GROUP_ROWS * max(batch * state, 1) * dtype.itemsize)))
    scratch = np.empty((group, 6, batch, state), dtype)
    zs = np.empty((group, 3, batch, state), dtype)
    z_ops = mm.rows(mm.operand(zs))
    views = [_step_views(zs[i], scratch[i], keep) for i in range(group)]
    for t0 in range(0, steps, block):
        k = min(block, steps - t0)
        gates = buffer[: 3 * k * batch * state].reshape(3, k * batch, state)
        gates_op = mm.operand(gates)
        mm.project_gates(mm.operand(x[t0 * batch: (t0 + k) * batch]), w_x, bias, gates_op)
        # one block's per-step operands, made in one call each (not one per step, and not for
        # the whole sequence: what a forward-only call keeps stays the same for any length)
        p_rows = mm.rows(gates_op.reshape(3, k, batch, state).swapaxes(0, 1))   # [j]: (3, B, S)
        h_rows = mm.gate_rows(hs_op[t0: t0 + k])
        first = 0                       # keep: the first step of the group (in the block)
        for j in range(k):
            t = t0 + j
            i = j - first if keep else 0
            # z = the step's projection + h @ W_h, into a contiguous (3, B, S) buffer
            mm.add_gates(z_ops[i], p_rows[j], h_rows[j], w_h)
            if not keep:
                _step_on(views[0], c, hs[t + 1], c)
                continue
            _step_on(views[i], c, hs[t + 1], cells[t])
            c = cells[t]
            if i + 1 == group or j + 1 == k:
                a, b = t0 + first, t + 1
                _step_factors(zs[: i + 1, 1:], scratch[: i + 1],
                              hs[a + 1: b + 1], cells[a: b], factors[a: b])
                first = j + 1
    h_n = hs[steps].copy()
    if not keep:
        return hs[1:], h_n, c, None
    c_n = c.copy()
    saved = LLTMSequenceSaved("numpy", x, hs, factors, cells, weights, tuple(bias.shape))
    return hs[1:], h_n, c_n, saved


def backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, needed, mm):
    x, hs, factors, cells, weights = (saved.inputs, saved.hs, saved.gates, saved.cells,
                                      saved.weights)
    steps, batch, state = cells.shape
    features = x.shape[1]
    dtype = cells.dtype
    # grad_h of every step; step t adds the gradient flowing back from step t + 1 into it.
    grad_h = (np.zeros((steps, batch, state), dtype) if grad_outputs is None
              else np.array(grad_outputs, dtype=dtype, order="C"))
    if steps and grad_h_n is not None:
        grad_h[steps - 1] += grad_h_n
    # Every step's d_gates in the GEMMs' layout (T * B, 3S); one step's gate-major scratch
    # (written gate-major, then copied: faster than writing the strided rows directly) and one
    # cell-gradient buffer, updated in place.
    flat = np.empty((steps * batch, 3 * state), dtype)
    rows_gate_major = flat.reshape(steps, batch, 3, state).transpose(0, 2, 1, 3)
    d_acts = np.empty((3, batch, state), dtype)
    d_cell = np.empty((batch, state), dtype)
    w_h = np.ascontiguousarray(weights[:, :state])
    w_h_op = mm.operand(w_h)
    # per-step operands made once (the backward keeps O(T) anyway)
    grad_h_rows = mm.rows(mm.operand(grad_h))
    flat_rows = mm.rows(mm.operand(flat.reshape(steps, batch, 3 * state)))
    d_c = grad_c_n
    accumulate = mm.accumulate
    for t, g_h, f, rows in zip(range(steps - 1, -1, -1), grad_h[::-1], factors[::-1],
                               rows_gate_major[::-1]):
        d_c = _d_gates(g_h, d_c, f, d_acts, d_cell)
        np.copyto(rows, d_acts)
        if t:   # grad_h[t - 1] += d_gates(t) @ W_h
            accumulate(grad_h_rows[t - 1], flat_rows[t], w_h_op)
    if steps:
        d_h0 = mm(flat[:batch], w_h)
    else:
        d_h0 = np.zeros((batch, state), dtype) if grad_h_n is None else np.array(grad_h_n)
        d_c = np.zeros((batch, state), dtype) if grad_c_n is None else np.array(grad_c_n)
    need_x, need_w, need_b, need_h0, need_c0 = needed
    d_weights = d_bias = d_inputs = None
    if need_w:
        d_weights = np.empty(weights.shape, dtype)
        d_weights[:, :state] = mm(flat.T, hs[:-1].reshape(steps * batch, state))
        d_weights[:, state:] = mm(flat.T, x)
    if need_b:
        d_bias = flat.sum(axis=0).reshape(saved.bias_shape)
    if need_x:
        d_inputs = mm(flat, weights[:, state:]).reshape(steps, batch, features)
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0 if need_h0 else None,
                             d_c if need_c0 else None)
