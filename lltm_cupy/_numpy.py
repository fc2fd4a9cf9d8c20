"""CPU backend: the LLTM cell in vectorised NumPy.

The arithmetic runs in the input dtype (float32 stays float32). Arguments were checked by
``lltm_cupy._checks``. At the sizes recurrent cells run at, the cost on the CPU is the number of
NumPy calls rather than arithmetic, so this backend is written for few, cheap passes:

- the gate values live gate-major, as (3, batch, state), so that every element-wise call runs
  on contiguous memory: a NumPy ufunc on a column slice of a (batch, 3 * state) array costs
  2-3 us more per call at the tutorial's size; one step's layout change is folded into the
  bias add (forward; the sequence loops need none, their GEMMs write gate-major) and into one
  copy of the gate gradients back to (batch, 3 * state) for the GEMMs (backward);
- every activation and derivative is evaluated in a form that keeps relative accuracy for every
  finite input on both sides, never overflows and needs no branch (``_step`` lists them);
  the tutorial's sigmoid = (1 + tanh(z / 2)) / 2, s (1 - s) and 1 - tanh^2 are accurate only to
  about one unit in the last place of 1, i.e. not at all relative to a saturated gate's tiny
  value or derivative;
- the forward computes what the backward multiplies by and saves those four products
  (4, batch, state) instead of the activations, so the backward is five multiplications and an
  addition: X plus 5 * B * S values are kept (new_cell among them, the output itself);
- the forward's scratch is small (six rows of (batch, state) plus the pre-activations' own rows,
  which are a temporary of the step), so that a step's working set stays in cache next to the
  weights (two rows less measured about 1 % of the step).

The GEMMs go through ``mm``, an object with the interface of :mod:`lltm_cupy._cpu_gemm`
(default: NumPy's BLAS): the torch layer passes torch's (one BLAS thread pool per process, not
two that fight over the cores). The sequence loops run them gate-major, so that the products
land in the element-wise step's layout with the bias already added: no pass transposes them.
"""
from __future__ import annotations

import numpy as np

from . import _packing
from ._cpu_gemm import NUMPY_GEMM, gate_weights
from ._types import (LLTMCellGrads, LLTMCellSaved, LLTMGrads, LLTMSaved, LLTMSequenceGrads,
                     LLTMSequenceSaved)

__all__ = ["forward", "backward", "forward_sequence", "backward_sequence"]


def _project(x, w, bias, mm, steps, batch, out=None):
    """Gate pre-activations ``x @ w.T + bias`` of ``steps * batch`` rows, as a C-ordered
    gate-major array (steps, 3, batch, state) (``out``, or a new one); the bias add writes the
    layout.

    For up to 128 rows the product is taken as ``w @ x.T``: OpenBLAS runs it up to 2x faster than
    ``x @ w.T`` at small batch, and the bias add transposes it anyway. For more rows, ``x @ w.T``,
    whose (batch, 3, state) rows the bias add moves whole (transposing a large product costs more
    than the GEMM: 43 ms against 20 ms at 4096 x 1536).
    """
    state = w.shape[0] // 3
    out = np.empty((steps, 3, batch, state), x.dtype) if out is None else out
    if x.shape[0] <= 128:
        product = mm(w, x.T).reshape(3, state, steps, batch).transpose(2, 0, 3, 1)
    else:
        product = mm(x, w.T).reshape(steps, batch, 3, state).transpose(0, 2, 1, 3)
    np.add(product, bias.reshape(3, 1, state), out=out)
    return out


def _d_tanh(c, out):
    """tanh'(c) = (1 / cosh(c))^2 into ``out``: relatively accurate where 1 - tanh(c)^2 cancels
    (|tanh c| near 1). cosh overflows to inf for |c| > ~710 (float64) / ~89 (float32), where the
    exact value underflows to 0 anyway (1 / inf = 0). The square comes after the reciprocal, so
    it can only underflow."""
    np.cosh(c, out)
    np.reciprocal(out, out)
    np.square(out, out)


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

_ZERO = {np.dtype(t): t(0) for t in (np.float32, np.float64)}   # typed: 0.5 us less than int 0


def _activate(z, old_cell, new_h, new_cell, factors=None) -> None:
    """Element-wise forward of one step: :func:`_step` and, unless ``factors`` is None,
    :func:`_step_factors` (for callers with one step; the sequence loops call the two apart)."""
    scratch = np.empty((6,) + new_cell.shape, z.dtype)
    _step(z, old_cell, new_h, new_cell, scratch, factors is not None)
    if factors is not None:
        _step_factors(z[1:], scratch, new_h, new_cell, factors)


def _step(z, old_cell, new_h, new_cell, scratch, derivatives) -> None:
    """Element-wise forward of one step. z (3, B, S): the gate pre-activations, used as scratch
    (the callers' own temporary; z[1:] holds p + q below afterwards). Writes new_h, new_cell
    (B, S) (``new_cell`` may be ``old_cell`` itself: updated in place), and leaves in
    ``scratch`` (6, B, S) [q_i, q_o, input_gate, output_gate, p_c, candidate_cell * input_gate]
    what :func:`_step_factors` computes the backward's factors from (p_c only with
    ``derivatives``; without, the outputs are the same bits).

    Forms that keep relative accuracy for every finite input, on both sides, and never overflow,
    from p = exp(min(z, 0)) and q = exp(-max(z, 0)) (both in (0, 1], one of them exactly 1):

        sigmoid(z) = p / (p + q)           sigmoid(-z) = q / (p + q)
        sigmoid'(z) = sigmoid(z) * sigmoid(-z)
        elu(z) = max(expm1(min(z, 0)), z)  elu'(z) = p  (expm1(z) > z for z < 0)
        tanh'(c) = (1 / cosh(c))^2

    (the tutorial's (1 + tanh(z / 2)) / 2, s (1 - s) and 1 - tanh^2 are accurate only to about
    one unit in the last place of 1, which is no relative accuracy at all once a gate saturates).
    Values multiplied by the same factor sit side by side, so that one NumPy call does two
    gates; outputs are passed positionally (0.3 us less per call than ``out=``), except to
    minimum/maximum, where NumPy deprecates that.
    """
    _step_on(_step_views(z, scratch, derivatives), old_cell, new_h, new_cell)


def _step_views(z, scratch, derivatives) -> tuple:
    """The views :func:`_step_on` works on, of a step's z (3, B, S) and scratch (6, B, S): made
    once per buffer by the sequence loops, which reuse their buffers step after step (a dozen
    views cost about 2 us, a step at B * S = 2k about 20)."""
    qp = scratch[:5]
    q, p = qp[:2], qp[2:]
    io = p[:2]
    zero = _ZERO[z.dtype]
    # z_i's row takes the candidate cell, z_o's and z_c's p + q, once no longer needed
    return (z, zero, p, z[:2], q, p[2], z[0], z[2], qp if derivatives else qp[:4], z[1:], io,
            scratch[5], io[0], io[1])


def _step_on(views, old_cell, new_h, new_cell) -> None:
    """:func:`_step` on views made by :func:`_step_views`."""
    z, zero, p, z_io, q, p_c, g, z_c, e, total, io, a, input_gate, output_gate = views
    np.minimum(z, zero, out=p)
    np.maximum(z_io, zero, out=q)
    np.negative(q, q)                       # -max(z, 0) (min(z, 0) - z is NaN at z = -inf)
    np.expm1(p_c, g)
    np.maximum(g, z_c, out=g)               # candidate_cell = elu(z_c) (expm1(z) > z for z < 0)
    # q = exp(-max(z, 0)), p = exp(min(z, 0)); p_c = elu'(z_c) only for the backward
    np.exp(e, e)
    np.add(io, q, total)                    # p + q
    np.divide(io, total, io)                # [input_gate, output_gate]
    np.multiply(g, input_gate, a)           # candidate_cell * input_gate
    np.add(a, old_cell, new_cell)
    np.tanh(new_cell, new_h)
    np.multiply(new_h, output_gate, new_h)  # new_h = tanh(new_cell) * output_gate


def _step_factors(total, scratch, new_h, new_cell, factors) -> None:
    """What the backward multiplies by, from what :func:`_step` left (``total`` = its z[1:],
    ``scratch``, its outputs), for one step or, with a leading steps axis on every argument,
    for K steps in one call each (fewer calls: at small sizes a call costs more than its
    arithmetic):

        factors = [candidate_cell * sigmoid'(z_i),  tanh(c) * sigmoid'(z_o),
                   input_gate * elu'(z_c),          output_gate * tanh'(c)]

    The first two reuse the outputs' products: candidate_cell * input_gate * sigmoid(-z_i) and
    new_h * sigmoid(-z_o). Overwrites ``scratch``."""
    gate = lambda a, i: a[..., i, :, :]     # noqa: E731 -- row i of (..., rows, B, S)
    q = scratch[..., :2, :, :]
    np.divide(q, total, q)                  # sigmoid(-z) of both
    np.multiply(gate(scratch, 5), gate(scratch, 0), gate(factors, 0))
    np.multiply(new_h, gate(scratch, 1), gate(factors, 1))
    _d_tanh(new_cell, gate(scratch, 5))     # next to p_c = elu'(z_c)
    np.multiply(scratch[..., 2:4, :, :], scratch[..., 4:6, :, :], factors[..., 2:4, :, :])


def _d_gates(grad_h, grad_cell, factors, d_gates, d_new_cell=None):
    """Element-wise backward of one step from the forward's ``factors`` (4, B, S): writes
    d_gates (3, B, S) (any strides) and returns d_new_cell (B, S), written into
    ``d_new_cell`` when given (it may be ``grad_cell`` itself); grad_h / grad_cell may be None
    (zero).

        d_new_cell = output_gate * tanh'(c) * grad_h + grad_cell     (= d_old_cell)
        d_z_i = candidate_cell * sigmoid'(z_i) * d_new_cell
        d_z_o = tanh(c) * sigmoid'(z_o) * grad_h
        d_z_c = input_gate * elu'(z_c) * d_new_cell
    """
    if grad_h is not None:
        if grad_cell is None:
            d_new_cell = np.multiply(factors[3], grad_h, d_new_cell)
        elif d_new_cell is grad_cell:       # in place; d_z_i's row as the product's scratch
            np.add(d_new_cell, np.multiply(factors[3], grad_h, d_gates[0]), d_new_cell)
        else:
            d_new_cell = np.multiply(factors[3], grad_h, d_new_cell)
            np.add(d_new_cell, grad_cell, d_new_cell)
        np.multiply(factors[1], grad_h, d_gates[1])
    else:
        if d_new_cell is None:
            d_new_cell = np.empty_like(factors[3])
        if grad_cell is None:
            d_new_cell[...] = 0
        elif d_new_cell is not grad_cell:
            np.copyto(d_new_cell, grad_cell)
        d_gates[1] = 0
    np.multiply(factors[0::2], d_new_cell, d_gates[0::2])   # d_z_i and d_z_c: one call
    return d_new_cell


def _gate_major_to_rows(d_gates, out) -> None:
    """Copy gate-major (3, B, S) values into ``out`` (B, 3 * S), the GEMMs' layout."""
    batch, state = d_gates.shape[1:]
    np.copyto(out.reshape(batch, 3, state), d_gates.transpose(1, 0, 2))


# Every entry point runs under np.errstate(all="ignore"): infinities and NaN in the arguments
# give IEEE results (the reference's), and the library, not NumPy, decides what is an error.

def forward(input, weights, bias, old_h, old_cell, mm=NUMPY_GEMM, keep=True):
    with np.errstate(all="ignore"):
        return _forward(input, weights, bias, old_h, old_cell, mm, keep)


def backward(grad_h, grad_cell, saved, needed=(True,) * 5, mm=NUMPY_GEMM):
    with np.errstate(all="ignore"):
        return _backward(grad_h, grad_cell, saved, needed, mm)


def forward_sequence(inputs, weights, bias, h0, c0, mm=NUMPY_GEMM, plan=None, keep=True):
    with np.errstate(all="ignore"):
        if plan is not None:
            return _forward_packed(inputs, weights, bias, h0, c0, mm, plan, keep)
        return _forward_sequence(inputs, weights, bias, h0, c0, mm, keep)


def backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, needed=(True,) * 5, mm=NUMPY_GEMM):
    with np.errstate(all="ignore"):
        if saved.plan is not None:
            return _backward_packed(grad_outputs, grad_h_n, grad_c_n, saved, needed, mm)
        return _backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, needed, mm)


def _forward(input, weights, bias, old_h, old_cell, mm, keep):
    batch, state = old_h.shape
    X = np.concatenate((old_h, input), axis=1)
    z = _project(X, weights, bias, mm, 1, batch)[0]
    new_h = np.empty((batch, state), z.dtype)
    new_cell = np.empty((batch, state), z.dtype)
    factors = np.empty((4, batch, state), z.dtype) if keep else None
    _activate(z, old_cell, new_h, new_cell, factors)
    if not keep:
        return new_h, new_cell, None
    return new_h, new_cell, LLTMSaved("numpy", X, factors, new_cell, weights, tuple(bias.shape))


def _backward(grad_h, grad_cell, saved, needed, mm):
    factors, new_cell, X, weights = saved.gates, saved.new_cell, saved.X, saved.weights
    batch, state = new_cell.shape
    dtype = new_cell.dtype
    d_acts = np.empty((3, batch, state), dtype)
    d_new_cell = _d_gates(grad_h, grad_cell, factors, d_acts)
    d_gates = np.empty((batch, 3 * state), dtype)
    _gate_major_to_rows(d_acts, d_gates)
    need_h, need_x, need_w, need_b, need_c = needed
    return LLTMGrads(
        mm(d_gates, weights[:, :state]) if need_h else None,
        mm(d_gates, weights[:, state:]) if need_x else None,
        mm(d_gates.T, X) if need_w else None,
        d_gates.sum(axis=0).reshape(saved.bias_shape) if need_b else None,
        d_new_cell if need_c else None,
    )


def _forward_sequence(inputs, weights, bias, h0, c0, mm, keep):
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
    # Gate-major GEMMs (lltm_cupy._cpu_gemm): the input projection of a block of steps in one
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
    group = 1 if not keep else min(block, max(
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


def _backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, needed, mm):
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


# ------------------------------------------------------------------ variable-length sequences

def _forward_packed(inputs, weights, bias, h0, c0, mm, plan, keep):
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
    for tau0, tau1 in _packing.step_blocks(plan.offsets, _BLOCK_ROWS):
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


def _backward_packed(grad_outputs, grad_h_n, grad_c_n, saved, needed, mm):
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

def cell_forward(gates, old_cell):
    """The element-wise step on gate pre-activations (batch, 3 * state) the caller computed;
    ``saved`` holds the four products the backward multiplies by (``_activate``)."""
    with np.errstate(all="ignore"):
        batch, state = old_cell.shape
        z = np.empty((3, batch, state), gates.dtype)       # _activate's scratch: a copy
        np.copyto(z, gates.reshape(batch, 3, state).transpose(1, 0, 2))
        new_h = np.empty((batch, state), z.dtype)
        new_cell = np.empty((batch, state), z.dtype)
        factors = np.empty((4, batch, state), z.dtype)
        _activate(z, old_cell, new_h, new_cell, factors)
    return new_h, new_cell, LLTMCellSaved("numpy", factors, new_cell)


def cell_backward(grad_h, grad_cell, saved):
    with np.errstate(all="ignore"):
        batch, state = saved.new_cell.shape
        d_acts = np.empty((3, batch, state), saved.new_cell.dtype)
        d_old_cell = _d_gates(grad_h, grad_cell, saved.gates, d_acts)
        d_gates = np.empty((batch, 3 * state), d_acts.dtype)
        _gate_major_to_rows(d_acts, d_gates)
    return LLTMCellGrads(d_gates, d_old_cell)
