"""The CPU backend's sequence loops: every step's recurrent GEMM and element-wise step on
buffers made once per call (``forward_sequence``, ``backward_sequence`` for fixed lengths; the
same loops run variable lengths for ``packed``).

A step costs its arithmetic: its GEMM (through ``mm``, an object with the interface of
:mod:`lltm_cupy._numpy.gemm`) and the fewest element-wise NumPy calls that keep the relatively
accurate forms (``elementwise``: twelve forward, four backward), with no array, view or Python
object made per step. Everything a step reads or writes is a view made once per call (as lists, one
call each where the engine allows), the element-wise steps' own views once per thread and shape
(``memory.Workspace``, with their buffers, reused call after call), and the backward's factors
for a group of steps in one call each. The GEMMs run gate-major, so that the products land in
the element-wise step's layout: no pass transposes them (the step's input projection, bias
included, is added to its recurrent product by one NumPy call).

The loops work on packed rows (``lltm_cupy._packing``): step t runs ``sizes[t]`` rows, a prefix
of the rows of step t - 1, at rows ``offsets[t]:offsets[t] + sizes[t]``; a fixed-length
sequence is the case where every step runs the whole batch.
"""
from __future__ import annotations

from itertools import chain
from operator import getitem

import numpy as np

from .. import _packing
from .._types import LLTMSequenceGrads, LLTMSequenceSaved
from .gemm import copy
from .elementwise import step_factors
from .memory import recycled, scratch, workspace

__all__ = ["forward_sequence", "backward_sequence"]

#: Rows of one block of the sequences' input projection: one GEMM per block of steps into a
#: buffer reused block after block, in the range of rows where torch's and NumPy's
#: single-threaded GEMMs run at their best rows per second (past it the product leaves the
#: caches: docs/performance.md, "How the sequence loops are laid out").
_BLOCK_ROWS = 512

def _blocks(sizes, offsets):
    """The input projection's blocks of steps, ``(a, b)`` for steps a to b - 1, as
    ``lltm_cupy._packing.step_blocks`` makes them: each block's rows at most
    :data:`_BLOCK_ROWS`, or one step's. ``sizes``: per step, or one size for every step."""
    if isinstance(sizes, int):
        steps = len(offsets) - 1
        k = max(1, _BLOCK_ROWS // max(sizes, 1))
        return zip(range(0, steps, k), chain(range(k, steps, k), (steps,)))   # (lazily)
    return _packing.step_blocks(offsets, _BLOCK_ROWS)


def block_rows(sizes, offsets) -> int:
    """The rows of the largest block of the input projection (see :func:`_blocks`)."""
    return max(offsets[b] - offsets[a] for a, b in _blocks(sizes, offsets))


def _runs(sizes, a: int, b: int) -> list:
    """Steps a to b - 1 as runs of steps of the same rows: ``[(t0, t1, n), ...]`` (``sizes``:
    per step, or an int, every step's)."""
    if isinstance(sizes, int):
        return [(a, b, sizes)]
    runs, t0 = [], a
    for t in range(a + 1, b + 1):
        if t == b or sizes[t] != sizes[t0]:
            runs.append((t0, t, sizes[t0]))
            t0 = t
    return runs


# --------------------------------------------------------------------------------- forward

def forward_sequence(inputs, weights, bias, h0, c0, mm, keep):
    steps, batch, features = inputs.shape
    state = h0.shape[1]
    dtype = inputs.dtype
    x = inputs.reshape(steps * batch, features)
    # the hidden states [h0, h_1, ..., h_T] in the engine's memory (the outputs are a view of
    # them: the torch layer's, or NumPy's; large ones reused, see memory.recycled) and, for a
    # backward, the cells and factors in memory of earlier calls' no longer referred to
    hs = mm.empty((steps + 1, batch, state), dtype)
    if keep:
        cells, factors = recycled(dtype, (steps, batch, state), (steps, 4, batch, state))
    hs[0] = h0
    offsets = range(0, (steps + 1) * batch, batch) if batch else [0] * (steps + 1)
    h = hs.reshape((steps + 1) * batch, state)
    if keep:    # what the backward keeps
        _forward_loop(x, weights, bias, mm, batch, offsets, h, batch,
                      cells.reshape(steps * batch, state), c0, factors.reshape(-1))
        c_n = copy(mm, cells[-1] if steps else c0)
        saved = LLTMSequenceSaved("numpy", x, hs, factors, cells, weights, tuple(bias.shape))
        return hs[1:], copy(mm, hs[steps]), c_n, saved
    c = copy(mm, c0)        # forward only: one cell state, updated in place
    _forward_loop(x, weights, bias, mm, batch, offsets, h, batch, None, c, None)
    return hs[1:], copy(mm, hs[steps]), c, None


def _forward_loop(x, weights, bias, mm, sizes, offsets, h, first, cells, c0, factors,
                  emit=None) -> None:
    """The forward over packed rows: step t runs ``sizes[t]`` rows of ``x`` (N, F) at
    ``offsets[t]`` (``sizes``: per step, or an int, every step's: a fixed-length sequence) and
    writes its hidden state into ``h`` (first + N, S) at rows ``first + offsets[t]``;
    ``h[:first]`` holds h0 (sorted: step 0 reads its first sizes[0] rows, step t the first
    sizes[t] of step t - 1's). ``cells`` (N, S), ``factors`` (N * 4 * S,), each step's
    (4, n, S) at 4 * S * offsets[t]: what a backward keeps, with ``c0`` (the first step's old
    cell, read); or both None (forward only), with ``c0`` the cell state (batch, S), updated in
    place (its rows [0, n) at each step).

    The input projection of a block of steps (:data:`_BLOCK_ROWS` rows) is one GEMM, bias added,
    into one gate-major buffer reused block after block (the same blocks with and without a
    backward, so that both give the same bits); each step's z is its (3, n, S) view of that plus
    the recurrent product, written by one GEMM into the step's slot of the workspace; with a
    backward, the factors of up to ``group`` consecutive steps of the same rows in one call each
    from what their steps left in their slots.

    ``emit``: forward only, the hidden states in a buffer of one block's rows instead: ``h``
    (first + the largest block's rows, S) holds the rows the block's first step reads (h0, then
    the previous block's last step's), then the block's rows, and ``emit(rows, a, b)`` receives
    them (steps a to b - 1, packed) after each block."""
    steps = len(offsets) - 1
    if not steps:
        return
    if not isinstance(sizes, int) and sizes.count(sizes[0]) == steps:
        sizes = sizes[0]
    one = isinstance(sizes, int)        # every step `sizes` rows
    if one and not sizes:               # (an empty batch: nothing to compute)
        return
    state = h.shape[1]
    dtype = h.dtype
    keep = cells is not None
    space = workspace(sizes if one else max(sizes), state, dtype)
    # the GEMMs' weights gate-major, (3, K, S) (a copy each: see lltm_cupy._numpy.gemm)
    w_x = mm.gate_weights(weights[:, state:])
    w_h = mm.gate_weights(weights[:, :state])
    # with a backward: up to `group` consecutive steps of the same rows take slots 0, 1, ...
    # of the workspace and share a factor call, after their last step
    slots, after = None, {}
    if keep:
        slots, t0, group = [0] * steps, 0, space.group
        for t in range(1, steps + 1):
            if t == steps or t - t0 == group or not one and sizes[t] != sizes[t0]:
                n = sizes if one else sizes[t0]
                slots[t0:t] = range(t - t0)
                total, rest = space.group_views(t - t0, n)
                a, b = offsets[t0], offsets[t0] + (t - t0) * n
                k = t - t0
                after[t - 1] = (total, rest, h[first + a: first + b].reshape(k, n, state),
                                cells[a:b].reshape(k, n, state),
                                factors[4 * state * a: 4 * state * b].reshape(k, 4, n, state))
                t0 = t
    cell_rows = {} if keep else {n: c0[:n] for n in ((sizes,) if one else set(sizes))}
    h_op = mm.operand(h)
    # the input projection: one GEMM per block, into a buffer of this thread's scratch; the
    # block's per-step operands made in one call each (not one per step, and not for the whole
    # sequence: what a forward-only call holds stays the same for any length)
    blocks = _blocks(sizes, offsets)
    rows = block_rows(sizes, offsets) if not one else min(
        steps, max(1, _BLOCK_ROWS // max(sizes, 1))) * sizes
    projection = scratch(3 * rows * state, dtype).reshape(3, rows, state)
    projection_op = mm.operand(projection)
    project, bmm, add, factor_step = mm.project_gates, mm.bmm, np.add, step_factors
    made = space.made
    for a, b in blocks:
        k = offsets[b] - offsets[a]
        project(mm.operand(x[offsets[a]: offsets[b]]), w_x, bias, projection_op[:, :k])
        n_t = (sizes,) * (b - a) if one else sizes[a:b]
        if emit is None:
            base, read = first, first + offsets[a - 1] if a else 0
        else:       # the rows step a reads at the front, the block's after them
            base, read = (n_t[0] if not a else sizes if one else sizes[a - 1]) - offsets[a], 0
        # the per-step views of each run of steps of the same rows: one reshape each
        starts, h_out, p_in, c_out = [], [], [], []
        for r0, r1, n in [(a, b, sizes)] if one else _runs(sizes, a, b):
            at, rows = offsets[r0], (r1 - r0) * n
            starts += range(base + at, base + at + rows, n)
            h_out.extend(h[base + at: base + at + rows].reshape(r1 - r0, n, state))
            at -= offsets[a]
            p_in.extend(
                projection[:, at: at + rows].reshape(3, r1 - r0, n, state).swapaxes(0, 1))
            if keep:
                c_out.extend(cells[offsets[r0]: offsets[r0] + rows].reshape(r1 - r0, n, state))
        h_in = mm.gate_inputs(h_op, [read, *starts[:-1]], n_t)
        if keep:
            keys = [*zip(slots[a:b], n_t)]
            c_in = [c0[: n_t[0]] if not a else cells[offsets[a - 1]: offsets[a - 1] + n_t[0]]]
            c_in += c_out[:-1] if one else map(getitem, c_out[:-1], map(slice, n_t[1:]))
            done = [*map(after.get, range(a, b))]
        else:
            keys = [(0, sizes)] * (b - a) if one else [*zip([0] * (b - a), n_t)]
            c_in = c_out = [*map(cell_rows.__getitem__, n_t)]
            done = [None] * (b - a)
        steppers = [*map(made.get, zip(keys, [(keep, mm)] * (b - a)))]
        if None in steppers:        # (first use of a slot and row count on this thread)
            steppers = [space.forward(i, n, keep, mm) for i, n in keys]
        for (step, z_op, z), p, h_t, old, new_h, new_cell, group in zip(
                steppers, p_in, h_in, c_in, h_out, c_out, done):
            bmm(h_t, w_h, out=z_op)         # z = h @ W_h + the step's projection
            add(z, p, z)
            step(old, new_h, new_cell)
            if group is not None:
                factor_step(*group)
        if emit is not None:
            emit(h[starts[0]: starts[-1] + n_t[-1]], a, b)
            if b < steps:       # the block's last step's rows, to the front
                h[: n_t[-1]] = h[starts[-1]: starts[-1] + n_t[-1]]


# -------------------------------------------------------------------------------- backward

def backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, needed, mm):
    x, hs, factors, cells, weights = (saved.inputs, saved.hs, saved.gates, saved.cells,
                                      saved.weights)
    steps, batch, state = cells.shape
    features = x.shape[1]
    dtype = cells.dtype
    need_x, need_w, need_b, need_h0, need_c0 = needed
    if not steps:
        d_h0 = mm.zeros((batch, state), dtype) if grad_h_n is None else copy(mm, grad_h_n)
        d_c = mm.zeros((batch, state), dtype) if grad_c_n is None else copy(mm, grad_c_n)
        return LLTMSequenceGrads(mm.zeros((0, batch, features), dtype) if need_x else None,
                                 mm.zeros(weights.shape, dtype) if need_w else None,
                                 mm.zeros(saved.bias_shape, dtype) if need_b else None,
                                 d_h0 if need_h0 else None, d_c if need_c0 else None)
    rows = steps * batch
    # this thread's scratch: every step's d_gates in the GEMMs' layout (T * B, 3S), and the
    # hidden state's gradient of every step, to which step t + 1 adds what flows back
    buffer = scratch(4 * rows * state, dtype)
    flat = buffer[: 3 * rows * state].reshape(rows, 3 * state)
    grad_h = buffer[3 * rows * state:].reshape(steps, batch, state)
    if grad_outputs is None:
        grad_h[...] = 0
    else:
        np.copyto(grad_h, grad_outputs)
    if grad_h_n is not None:
        grad_h[-1] += grad_h_n
    d_c = _backward_loop(grad_h.reshape(rows, state), grad_c_n, factors.reshape(-1), flat,
                         weights[:, :state], mm, batch,
                         range(0, rows + batch, batch) if batch else [0] * (steps + 1))
    d_h0 = mm(flat[:batch], weights[:, :state]) if need_h0 else None
    d_weights = d_bias = d_inputs = None
    if need_w:
        d_weights = mm.empty(weights.shape, dtype)
        mm.into(flat.T, hs[:-1].reshape(rows, state), d_weights[:, :state])
        mm.into(flat.T, x, d_weights[:, state:])
    if need_b:
        d_bias = bias_grad(flat, saved.bias_shape, mm)
    if need_x:
        d_inputs = mm(flat, weights[:, state:]).reshape(steps, batch, features)
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0,
                             copy(mm, d_c) if need_c0 else None)


def bias_grad(flat, bias_shape, mm):
    """The bias gradient: ``flat`` (rows, 3S) summed over its rows, in ``mm``'s memory."""
    out = mm.empty((flat.shape[1],), flat.dtype)
    np.add.reduce(flat, 0, out=out)
    return out.reshape(bias_shape)


def _backward_loop(grad_h, grad_c, factors, flat, w_h, mm, sizes, offsets):
    """Backpropagation through time over packed rows (as :func:`_forward_loop`'s; ``sizes``
    per step, or an int: every step's): writes every step's d_gates into ``flat`` (N, 3S) and
    adds each step's recurrent gradient, ``d_gates @ W_h``, into the previous step's rows of
    ``grad_h`` (N, S), which holds the outputs' gradient (and the final state's at each
    sequence's last step). ``grad_c``: the final cell state's gradient (batch, S), sorted, or
    None (zero). Returns the cell gradient (batch, S), sorted: d_c0 (this thread's workspace:
    valid until its next call on this thread)."""
    steps = len(offsets) - 1
    if not isinstance(sizes, int) and sizes.count(sizes[0]) == steps:
        sizes = sizes[0]
    one = isinstance(sizes, int)
    batch, state = sizes if one else sizes[0], grad_h.shape[1]
    space = workspace(batch, state, grad_h.dtype)
    d_c = space.d_c
    if grad_c is None:
        d_c[...] = 0
    else:
        np.copyto(d_c, grad_c)
    if not batch:                       # (an empty batch: nothing to compute)
        return d_c
    # the cell gradient of a step's rows is d_c's first rows: rows past the next step's are
    # those whose sequences end here, which still hold grad_c (no later step touches them).
    # The per-step views of each run of steps of the same rows: one reshape each
    n_t = (batch,) * steps if one else sizes
    g_rows, f_io, f_oc, d_rows, made = [], [], [], [], []
    for t0, t1, n in [(0, steps, sizes)] if one else _runs(sizes, 0, steps):
        k, at = t1 - t0, offsets[t0]
        g_rows.extend(grad_h[at: at + k * n].reshape(k, n, state))
        f = factors[4 * state * at: 4 * state * (at + k * n)].reshape(k, 4, n, state)
        f_io.extend(f[:, 0::2])
        f_oc.extend(f[:, 1::2])
        d_rows.extend(flat[at: at + k * n].reshape(k, n, 3, state).transpose(0, 2, 1, 3))
        made += [space.backward(n)] * k
    d_ops = mm.steps_of(mm.operand(flat), n_t)
    # step t > 0 adds into the first sizes[t] rows of step t - 1's
    g_ops = [None, *mm.row_blocks(mm.operand(grad_h), offsets[:steps - 1], n_t[1:])]
    w_h_op = mm.recurrent(w_h)
    addmm_ = mm.addmm_
    for (step, cell), g, a, b, d, g_prev, d_op in zip(
            reversed(made), reversed(g_rows), reversed(f_io), reversed(f_oc), reversed(d_rows),
            reversed(g_ops), reversed(d_ops)):
        step(g, a, b, cell, d)
        if g_prev is not None:          # grad_h[t - 1][:n] += d_gates(t) @ W_h
            addmm_(g_prev, d_op, w_h_op)
    return d_c
