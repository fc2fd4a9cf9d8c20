"""The CPU backend's step: one LLTM step each way, and the element-wise forms every loop runs.

- :func:`forward` / :func:`backward`: one step into buffers the caller gives (the torch layer's
  tensors, or the array API's arrays), with one GEMM forward and one per needed gradient;
- :func:`cell_forward` / :func:`cell_backward`: the element-wise cell alone;
- the element-wise forward (:func:`_forward_step`, :func:`_step_factors`) and backward
  (:func:`_backward_step`; :func:`_d_gates` for one step), which the sequence loops
  (``sequence``, ``packed``) run step after step on views made once per buffer.

The gate values live gate-major, as (3, batch, state), so that every element-wise call runs on
contiguous memory (a NumPy ufunc on a column slice of a (batch, 3 * state) array costs 2-3 us
more per call at the tutorial's size): one step's layout change is folded into the bias add
(forward) and into one copy of the gate gradients back to (batch, 3 * state) for the GEMMs
(backward). The forward computes what the backward multiplies by and keeps those four products
(4, batch, state) instead of the activations, so the backward is four multiplications and an
addition per element.

Every entry point runs with NumPy's floating-point errors ignored (:func:`quiet`): infinities
and NaN in the arguments give IEEE results (the reference's), and the library, not NumPy,
decides what is an error.
"""
from __future__ import annotations

import numpy as np

from .._types import LLTMCellGrads, LLTMCellSaved, LLTMGrads
from .gemm import NUMPY_GEMM
from .memory import _local, loud, quiet, scratch, zeros

__all__ = ["forward", "backward", "cell_forward", "cell_backward", "cell_forward_into",
           "cell_backward_into", "cell_rows"]


def _project(x, w, bias, mm, steps, batch, out=None, product=None):
    """Gate pre-activations ``x @ w.T + bias`` of ``steps * batch`` rows, as a C-ordered
    gate-major array (steps, 3, batch, state) (``out``, or a new one); the bias add writes the
    layout.

    For up to 128 rows the product is taken as ``w @ x.T`` (OpenBLAS runs it up to 2x faster than
    ``x @ w.T`` at small batch) and the bias add transposes it; for more rows ``x @ w.T``, whose
    (batch, 3, state) rows the bias add moves whole (transposing a large product costs more than
    the GEMM: 43 ms against 20 ms at 4096 x 1536). ``product``: a scratch for the GEMM's result
    (3 * state * steps * batch elements; the engine's ``into`` writes it), or None.
    """
    state = w.shape[0] // 3
    out = np.empty((steps, 3, batch, state), x.dtype) if out is None else out
    into = None if product is None else getattr(mm, "into", None)
    if x.shape[0] <= 128:
        if into is None:
            product = mm(w, x.T)
        else:
            product = into(w, x.T, product.reshape(3 * state, steps * batch))
        product = product.reshape(3, state, steps, batch).transpose(2, 0, 3, 1)
    else:
        if into is None:
            product = mm(x, w.T)
        else:
            product = into(x, w.T, product.reshape(steps * batch, 3 * state))
        product = product.reshape(steps, batch, 3, state).transpose(0, 2, 1, 3)
    np.add(product, bias.reshape(3, 1, state), out=out)
    return out


def _forward_step(z, scratch, zero, derivatives):
    """The element-wise forward of one step as a function ``step(old_cell, new_h, new_cell)``
    of its state, on the buffers given here, whose views it makes once: the sequence loops make
    one per buffer and call it step after step (a dozen views cost about 2 us, a step at
    B * S = 2k about 20), with no array, view or Python object made per step.

    z (3, B, S): the gate pre-activations, used as scratch (z[1:] holds p + q below afterwards;
    the caller writes the next step's z into it). ``zero``: zeros shaped like z (read-only).
    The step writes new_h, new_cell (B, S) (``new_cell`` may be ``old_cell`` itself: updated
    in place), and leaves in ``scratch`` (6, B, S) [q_i, q_o, input_gate, output_gate, p_c,
    candidate_cell * input_gate] what :func:`_step_factors` computes the backward's factors
    from (p_c only with ``derivatives``; without, the outputs are the same bits).

    Forms that keep relative accuracy for every finite input, on both sides, and never overflow,
    from p = exp(min(z, 0)) and q = exp(-max(z, 0)) (both in (0, 1], one of them exactly 1):

        sigmoid(z) = p / (p + q)           sigmoid(-z) = q / (p + q)
        sigmoid'(z) = sigmoid(z) * sigmoid(-z)
        elu(z) = max(expm1(min(z, 0)), z)  elu'(z) = p  (expm1(z) > z for z < 0)
        tanh'(c) = (1 / cosh(c))^2

    (the tutorial's (1 + tanh(z / 2)) / 2, s (1 - s) and 1 - tanh^2 are accurate only to about
    one unit in the last place of 1, which is no relative accuracy at all once a gate saturates).
    Twelve NumPy calls: values multiplied by the same factor sit side by side, so that one call
    does two gates; min / max against a zeros array (NumPy's loop for a scalar operand is not
    vectorised); outputs passed positionally (0.3 us less per call than ``out=``), except to
    minimum/maximum, where NumPy deprecates that.
    """
    minimum, maximum, negative, expm1, exp, add, divide, multiply, tanh = (
        np.minimum, np.maximum, np.negative, np.expm1, np.exp, np.add, np.divide, np.multiply,
        np.tanh)
    qp = scratch[:5]
    q, p = qp[:2], qp[2:]
    io = p[:2]
    p_c, a = p[2], scratch[5]
    e = qp if derivatives else qp[:4]
    # z_i's row takes the candidate cell, z_o's and z_c's p + q, once no longer needed
    z_io, g, z_c, total = z[:2], z[0], z[2], z[1:]
    input_gate, output_gate = io
    zero_io = zero[:2]

    def step(old_cell, new_h, new_cell):
        minimum(z, zero, out=p)
        maximum(z_io, zero_io, out=q)
        negative(q, q)                      # -max(z, 0) (min(z, 0) - z is NaN at z = -inf)
        expm1(p_c, g)
        maximum(g, z_c, out=g)              # candidate_cell = elu(z_c) (expm1(z) > z for z < 0)
        # q = exp(-max(z, 0)), p = exp(min(z, 0)); p_c = elu'(z_c) only for the backward
        exp(e, e)
        add(io, q, total)                   # p + q
        divide(io, total, io)               # [input_gate, output_gate]
        multiply(g, input_gate, a)          # candidate_cell * input_gate
        add(a, old_cell, new_cell)
        tanh(new_cell, new_h)
        multiply(new_h, output_gate, new_h)  # new_h = tanh(new_cell) * output_gate
    return step


def _scratch_step(batch: int, state: int, dtype, derivatives: bool):
    """``[rows, step, made]``: this thread's :func:`cell_rows` (9, batch, state), into whose
    first three rows the caller writes the gate pre-activations, the :func:`_forward_step` over
    them (the rest of the rows its scratch), and what :func:`gate_rows` makes of them, made
    once per scratch buffer, shape and mode and kept (its dozen
    views and closure cost about 3 us, a whole step at (16, 128) about 20). Kept under the
    scratch buffer's id: the kept rows and step are views of that buffer (their base), so no
    other buffer takes its id while they are kept, and the buffer never shrinks."""
    made = getattr(_local, "steps", None)
    if made is None:
        made = _local.steps = {}
    buffer = getattr(_local, "buffers", {}).get(dtype)
    found = made.get((id(buffer), batch, state, derivatives))
    if found is None:
        if len(made) >= 8:                      # shapes come and go: keep a few
            made.clear()
        rows = cell_rows(batch, state, dtype)   # grows the buffer where it is too small
        z = rows[:3]
        step = _forward_step(z, rows[3:], zeros(z.size, z.dtype).reshape(z.shape), derivatives)
        found = made[(id(rows.base), batch, state, derivatives)] = [rows, step, None]
    return found


def gate_rows(batch: int, state: int, dtype, derivatives: bool, operand):
    """``(z, run)``: this thread's gate pre-activations (3, batch, state) as ``operand`` makes
    them (a GEMM engine's operand over the first three rows of :func:`cell_rows`), into which the
    caller writes them gate-major, bias included; and ``run(old_cell, new_h, new_cell,
    factors=None)``, the element-wise forward on them (as :func:`cell_forward_into`: writes
    new_h, new_cell (batch, state) and, with ``derivatives``, ``factors`` (4, batch, state)).
    Made once per scratch buffer, shape and mode with the step they run, and kept."""
    found = _scratch_step(batch, state, dtype, derivatives)
    if found[2] is None:
        rows, step = found[0], found[1]
        total, rest = rows[1:3], rows[3:]

        def run(old_cell, new_h, new_cell, factors=None):
            token = quiet()
            try:
                step(old_cell, new_h, new_cell)
                if factors is not None:
                    _step_factors(total, rest, new_h, new_cell, factors)
            finally:
                loud(token)
        found[2] = (operand(rows[:3]), run)
    return found[2]


def forget_workspaces() -> None:
    """Drop the steps :func:`_scratch_step` keeps for this thread (made again when next
    needed; they bind NumPy's functions when made)."""
    _local.steps = {}


def _step_factors(total, scratch, new_h, new_cell, factors) -> None:
    """What the backward multiplies by, from what a :func:`_forward_step` left (``total`` = its
    z[1:], ``scratch``, its outputs), for one step or, with a leading steps axis on every
    argument, for K steps in one call each (fewer calls: at small sizes a call costs more than
    its arithmetic):

        factors = [candidate_cell * sigmoid'(z_i),  tanh(c) * sigmoid'(z_o),
                   input_gate * elu'(z_c),          output_gate * tanh'(c)]

    The first two reuse the outputs' products: candidate_cell * input_gate * sigmoid(-z_i) and
    new_h * sigmoid(-z_o). tanh'(c) = (1 / cosh(c))^2: relatively accurate where
    1 - tanh(c)^2 cancels (|tanh c| near 1); cosh overflows to inf for |c| > ~710 (float64) /
    ~89 (float32), where the exact value underflows to 0 anyway (1 / inf = 0), and the square
    comes after the reciprocal, so it can only underflow. Overwrites ``scratch``."""
    q = scratch[..., :2, :, :]              # (row i of (..., rows, B, S): [..., i, :, :])
    np.divide(q, total, q)                  # sigmoid(-z) of both
    np.multiply(scratch[..., 5, :, :], scratch[..., 0, :, :], factors[..., 0, :, :])
    np.multiply(new_h, scratch[..., 1, :, :], factors[..., 1, :, :])
    d_tanh = scratch[..., 5, :, :]              # tanh'(c), next to p_c = elu'(z_c)
    np.cosh(new_cell, d_tanh)
    np.reciprocal(d_tanh, d_tanh)
    np.square(d_tanh, d_tanh)
    np.multiply(scratch[..., 2:4, :, :], scratch[..., 4:6, :, :], factors[..., 2:4, :, :])


def _backward_step(d):
    """The element-wise backward of one step as a function ``step(grad_h, f_io, f_oc,
    d_cell, d_gates)``, on the scratch ``d`` (5, B, S) whose views it makes once (the sequence
    loops make one per shape and call it step after step: four NumPy calls a step).

    grad_h (B, S); f_io = factors[0::2] and f_oc = factors[1::2] of the forward's factors
    (4, B, S) (see :func:`_step_factors`); ``d_cell`` (B, S): the cell gradient arriving from
    the next step (grad_cell), replaced by d_new_cell (= d_old_cell); ``d_gates`` (3, B, S),
    any strides (a gate-major view of the GEMMs' (B, 3S) rows): receives [d_z_i, d_z_o, d_z_c].

        d_new_cell = output_gate * tanh'(c) * grad_h + grad_cell
        d_z_i = candidate_cell * sigmoid'(z_i) * d_new_cell
        d_z_o = tanh(c) * sigmoid'(z_o) * grad_h
        d_z_c = input_gate * elu'(z_c) * d_new_cell

    ``d``'s rows are [d_z_i, (unused), d_z_o, o * tanh'(c) * grad_h, d_z_c]: the two products
    by grad_h land side by side (one call), the two by d_new_cell at rows 0 and 4 (one call),
    and the three gradients at rows 0, 2, 4, whence one copy moves them."""
    multiply, add, copyto = np.multiply, np.add, np.copyto
    by_grad_h, part, by_cell, gates = d[2:4], d[3], d[0::4], d[0::2]

    def step(grad_h, f_io, f_oc, d_cell, d_gates):
        multiply(f_oc, grad_h, by_grad_h)   # [d_z_o, output_gate * tanh'(c) * grad_h]
        add(part, d_cell, d_cell)           # d_new_cell
        multiply(f_io, d_cell, by_cell)     # [d_z_i, d_z_c]
        copyto(d_gates, gates)
    return step


def _d_gates(grad_h, grad_cell, factors, d_gates, d_new_cell=None):
    """Element-wise backward of one step from the forward's ``factors`` (4, B, S): writes
    d_gates (3, B, S) (any strides) and returns d_new_cell (B, S), written into ``d_new_cell``
    (None: a new array); grad_h / grad_cell may be None (zero). The formulas:
    :func:`_backward_step` (which the sequence loops run on buffers of their own); here four or
    five NumPy calls on the caller's arrays, no view made but the factors' rows."""
    if grad_h is not None:
        d_new_cell = np.multiply(factors[3], grad_h, d_new_cell)
        if grad_cell is not None:
            np.add(d_new_cell, grad_cell, d_new_cell)
        np.multiply(factors[1], grad_h, d_gates[1])
    else:
        if d_new_cell is None:
            d_new_cell = np.empty_like(factors[3])
        if grad_cell is None:
            d_new_cell[...] = 0
        else:
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


# ------------------------------------------------------------------------------- one step

def forward(input, weights, bias, old_h, old_cell, new_h, new_cell, factors=None, X=None,
            mm=NUMPY_GEMM) -> None:
    """One step into the caller's buffers: new_h, new_cell (batch, state) and, for a backward,
    ``factors`` (4, batch, state) (None: forward only, the outputs the same bits). ``X``
    (batch, state + features) receives [old_h, input], the GEMM's operand (None: a temporary).

    input (batch, features), weights (3 * state, state + features), bias (3 * state,) or
    (1, 3 * state), old_h and old_cell (batch, state): one dtype, checked by the caller;
    ``new_cell`` may be ``old_cell`` itself (updated in place) where no backward follows."""
    token = quiet()
    try:
        batch, state = old_h.shape
        n, width = batch * state, state + input.shape[1]
        # the step's temporaries in this thread's scratch: z and the element-wise scratch
        # (9 rows of (batch, state)), the GEMM's product (3), and X unless it is kept
        buffer = scratch(12 * n + (0 if X is not None else batch * width), old_h.dtype)
        if X is None:
            X = buffer[12 * n:].reshape(batch, width)
        np.concatenate((old_h, input), axis=1, out=X)
        rows, step, _ = _scratch_step(batch, state, old_h.dtype, factors is not None)
        z = _project(X, weights, bias, mm, 1, batch, rows[None, :3], buffer[9 * n: 12 * n])[0]
        step(old_cell, new_h, new_cell)
        if factors is not None:
            _step_factors(z[1:], rows[3:], new_h, new_cell, factors)
    finally:
        loud(token)


def backward(grad_h, grad_cell, factors, weights, bias_shape, X=None, old_h=None, input=None,
             needed=(True,) * 5, mm=NUMPY_GEMM) -> LLTMGrads:
    """The gradients of one step (:class:`LLTMGrads`, None where ``needed`` says so) from the
    forward's ``factors`` and [old_h, input]: ``X`` as the forward wrote it, or (X None) the
    two arrays, concatenated here only if the weights' gradient is needed. grad_h / grad_cell
    (batch, state), either None (zero)."""
    token = quiet()
    try:
        _, batch, state = factors.shape
        n = batch * state
        need_h, need_x, need_w, need_b, need_c = needed
        width = state + input.shape[1] if need_w and X is None else 0
        # d_gates gate-major and as the GEMMs' rows, and X where it is concatenated again
        buffer = scratch(6 * n + batch * width, factors.dtype)
        d_acts = buffer[:3 * n].reshape(3, batch, state)
        d_new_cell = _d_gates(grad_h, grad_cell, factors, d_acts)
        d_gates = buffer[3 * n: 6 * n].reshape(batch, 3 * state)
        _gate_major_to_rows(d_acts, d_gates)
        if width:
            X = buffer[6 * n:].reshape(batch, width)
            np.concatenate((old_h, input), axis=1, out=X)
        return LLTMGrads(
            mm(d_gates, weights[:, :state]) if need_h else None,
            mm(d_gates, weights[:, state:]) if need_x else None,
            mm(d_gates.T, X) if need_w else None,
            d_gates.sum(axis=0).reshape(bias_shape) if need_b else None,
            d_new_cell if need_c else None)
    finally:
        loud(token)


# -------------------------------------------- the element-wise cell alone (GEMMs elsewhere)

def cell_rows(batch: int, state: int, dtype) -> np.ndarray:
    """This thread's scratch for one step's element-wise forward, (9, batch, state): a caller
    that computes the gate pre-activations gate-major writes them into its first three rows and
    passes them to :func:`cell_forward_into` (``gate_major=True``)."""
    return scratch(9 * batch * state, dtype).reshape(9, batch, state)


def cell_forward_into(gates, old_cell, new_h, new_cell, factors=None,
                      gate_major=False) -> None:
    """The element-wise forward of one step on the gate pre-activations ``gates`` the caller
    computed (bias included): (batch, 3 * state), or with ``gate_major`` the first three rows
    of :func:`cell_rows` (3, batch, state), overwritten; writes new_h, new_cell (batch, state)
    and, for a backward, ``factors`` (4, batch, state) (None: forward only, the same outputs).
    What the torch layer calls around torch's GEMMs."""
    token = quiet()
    try:
        batch, state = old_cell.shape
        rows, step, _ = _scratch_step(batch, state, gates.dtype, factors is not None)
        z = rows[:3]
        if not gate_major:
            np.copyto(z, gates.reshape(batch, 3, state).transpose(1, 0, 2))
        step(old_cell, new_h, new_cell)
        if factors is not None:
            _step_factors(z[1:], rows[3:], new_h, new_cell, factors)
    finally:
        loud(token)


def cell_backward_into(grad_h, grad_cell, factors, d_gates=None, bias=False, d_old_cell=None,
                       d_bias=None):
    """The element-wise backward of one step from the forward's ``factors``: ``(d_gates,
    d_old_cell, d_bias)``, the pre-activations' gradient (batch, 3 * state), written into
    ``d_gates`` (None: into this thread's scratch, valid until the thread's next step),
    d_old_cell (batch, state), written into ``d_old_cell`` (None: a new array), and with ``bias``
    the sum of d_gates over the batch (3 * state), written into ``d_bias`` (None: a new array;
    without ``bias`` None); grad_h / grad_cell (batch, state), either None (zero)."""
    token = quiet()
    try:
        _, batch, state = factors.shape
        n = batch * state
        buffer = scratch(6 * n if d_gates is None else 3 * n, factors.dtype)
        d_acts = buffer[:3 * n].reshape(3, batch, state)
        if d_gates is None:
            d_gates = buffer[3 * n:].reshape(batch, 3 * state)
        d_old_cell = _d_gates(grad_h, grad_cell, factors, d_acts, d_old_cell)
        _gate_major_to_rows(d_acts, d_gates)
        d_bias = np.add.reduce(d_gates, 0, out=d_bias) if bias else None
    finally:
        loud(token)
    return d_gates, d_old_cell, d_bias


def cell_forward(gates, old_cell):
    """The element-wise step on gate pre-activations (batch, 3 * state) the caller computed;
    ``saved`` holds the four products the backward multiplies by (:func:`_step_factors`)."""
    batch, state = old_cell.shape
    new_h = np.empty((batch, state), gates.dtype)
    new_cell = np.empty((batch, state), gates.dtype)
    factors = np.empty((4, batch, state), gates.dtype)
    cell_forward_into(gates, old_cell, new_h, new_cell, factors)
    return new_h, new_cell, LLTMCellSaved("numpy", factors, new_cell)


def cell_backward(grad_h, grad_cell, saved):
    batch, state = saved.new_cell.shape
    d_gates = np.empty((batch, 3 * state), saved.new_cell.dtype)
    return LLTMCellGrads(*cell_backward_into(grad_h, grad_cell, saved.gates, d_gates)[:2])
