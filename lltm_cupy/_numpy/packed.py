"""The CPU backend's variable lengths: sequences of different lengths run packed, per step only
the sequences still running (a prefix of the batch sorted by length), as
:mod:`lltm_cupy._packing` plans them (``lengths=``, a ``PackedSequence``'s rows), through the
same loops as fixed lengths (:mod:`lltm_cupy._numpy.sequence`); here the gathers into the
packed rows and back, and the final states."""
from __future__ import annotations

import numpy as np

from .. import _packing
from .._types import LLTMSequenceGrads, LLTMSequenceSaved
from . import sequence
from .sequence import _backward_loop, _forward_loop, bias_grad
from .memory import recycled, scratch

__all__ = ["forward_packed", "backward_packed"]


def forward_packed(inputs, weights, bias, h0, c0, mm, plan, keep):
    """forward_sequence over the packed rows of ``plan`` (lltm_cupy._packing): per step only
    the sequences still running, a prefix of the sorted batch."""
    batch = len(plan.perm)
    state = h0.shape[1]
    dtype = inputs.dtype
    rows = plan.rows
    t_index, b_index, data_index = _indices(plan)
    x = _packing.pack_rows(inputs, plan, t_index, b_index, data_index)     # (N, F), one gather
    sizes, offsets, ended = plan.batch_sizes, plan.offsets, plan.ended
    c0s = c0[plan.perm]
    direct = plan.packed_io and data_index is None   # the packed rows are the outputs' rows
    cells = factors = None
    if keep or direct:
        # the hidden states (h0 sorted, then every step's rows: the outputs, packed) in the
        # engine's memory (mm.empty: the torch layer's, or NumPy's), and what the backward keeps
        # in memory of earlier calls' no longer referred to (memory.recycled)
        h = mm.empty((batch + rows, state), dtype)
        if keep:
            cells, factors = recycled(dtype, (rows, state), (rows * 4 * state,))
        emit = None
    else:
        # forward only, the outputs elsewhere: one block's rows at a time, scattered into
        # them after each block
        h = np.empty((batch + (sequence.block_rows(sizes, offsets) if rows else 0), state), dtype)
        if plan.packed_io:
            outputs = mm.empty((rows, state), dtype)

            def emit(block, a, b):
                outputs[data_index[offsets[a]: offsets[b]]] = block
        else:
            outputs = mm.zeros((plan.steps, batch, state), dtype)

            def emit(block, a, b):
                at = slice(offsets[a], offsets[b])
                outputs[t_index[at], b_index[at]] = block
    np.take(h0, plan.perm, axis=0, out=h[:batch])
    h0s = h[:batch].copy() if emit is not None else h[:batch]
    # forward only: the sorted cell state c0s, rows [0, n) updated in place at each step
    _forward_loop(x, weights, bias, mm, sizes, offsets, h, batch, cells, c0s, factors, emit)
    # each sequence's state after its last step (h0, c0 for length 0); the sequences that ran
    # are a prefix of the sorted order
    last = plan.last_row[:ended]
    h_sorted = h0s.copy()
    if emit is None:
        h_sorted[:ended] = h[batch + last]
        out = h[batch:]
        outputs = _packing.unpack_rows(out, plan, mm, t_index, b_index, data_index)
    elif plan.packed_io:
        h_sorted[:ended] = outputs[data_index[last]]
    else:
        h_sorted[:ended] = outputs[t_index[last], b_index[last]]
    if keep:
        c_sorted = c0s.copy()
        c_sorted[:ended] = cells[last]
    else:
        c_sorted = c0s
    h_n, c_n = mm.empty(h_sorted.shape, dtype), mm.empty(c_sorted.shape, dtype)
    h_n[plan.perm], c_n[plan.perm] = h_sorted, c_sorted
    if not keep:
        return outputs, h_n, c_n, None
    saved = LLTMSequenceSaved("numpy", x, out, factors, cells, weights, tuple(bias.shape),
                              plan=plan, h0=h0s)
    return outputs, h_n, c_n, saved


def _indices(plan):
    return plan.t_index, plan.b_index, plan.data_index


def backward_packed(grad_outputs, grad_h_n, grad_c_n, saved, needed, mm):
    plan, x, factors, weights = saved.plan, saved.inputs, saved.gates, saved.weights
    rows, state = saved.hs.shape
    batch = len(plan.perm)
    dtype = saved.hs.dtype
    sizes = plan.batch_sizes
    first = sizes[0] if sizes else 0       # the sequences of length > 0 (a prefix, sorted)
    ghn = None if grad_h_n is None else grad_h_n[plan.perm]
    gcn = None if grad_c_n is None else grad_c_n[plan.perm]
    # this thread's scratch: every step's d_gates in the GEMMs' layout (N, 3S), and the hidden
    # state's gradient of every packed row: the outputs' gradient, the final state's at each
    # sequence's last step, and (in the loop) what flows back from the next step; afterwards
    # the hidden state each row's step read
    buffer = scratch(4 * rows * state, dtype)
    flat = buffer[: 3 * rows * state].reshape(rows, 3 * state)
    grad_h = buffer[3 * rows * state:].reshape(rows, state)
    if grad_outputs is None:
        grad_h[...] = 0
    elif not plan.packed_io:
        steps = grad_outputs.shape[0]
        np.take(grad_outputs.reshape(steps * batch, state),
                plan.t_index * batch + plan.b_index, axis=0, out=grad_h)
    elif plan.data_index is None:
        np.copyto(grad_h, grad_outputs)
    else:
        np.take(grad_outputs, plan.data_index, axis=0, out=grad_h)
    if ghn is not None and first:
        grad_h[plan.last_row[:plan.ended]] += ghn[:plan.ended]
    d_c = None
    if rows:
        d_c = _backward_loop(grad_h, None if gcn is None else gcn[:first], factors, flat,
                             weights[:, :state], mm, sizes, plan.offsets)
    need_x, need_w, need_b, need_h0, need_c0 = needed
    d_h0 = d_c0 = None
    if need_h0:
        d_h0s = np.zeros((batch, state), dtype) if ghn is None else ghn.copy()
        if first:
            d_h0s[:first] = mm(flat[:first], weights[:, :state])
        d_h0 = mm.empty(d_h0s.shape, dtype)
        d_h0[plan.perm] = d_h0s
    if need_c0:
        d_c0s = np.zeros((batch, state), dtype) if gcn is None else gcn.copy()
        if first:
            d_c0s[:first] = d_c
        d_c0 = mm.empty(d_c0s.shape, dtype)
        d_c0[plan.perm] = d_c0s
    d_weights = d_bias = d_inputs = None
    if need_w:
        d_weights = mm.empty(weights.shape, dtype)
        h_in = grad_h       # the hidden state each row's step read: h0, or the previous step's
        h_in[:first] = saved.h0[:first]
        np.take(saved.hs, plan.prev_row, axis=0, out=h_in[first:])
        mm.into(flat.T, h_in, d_weights[:, :state])
        mm.into(flat.T, x, d_weights[:, state:])
    if need_b:
        d_bias = bias_grad(flat, saved.bias_shape, mm)
    if need_x:
        d_inputs = _packing.unpack_rows(mm(flat, weights[:, state:]), plan, mm, *_indices(plan))
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0, d_c0)
