"""The element-wise LLTM cell every step of the CPU backend runs: the forward
(:func:`forward_step`, :func:`step_factors`) and the backward (:func:`backward_step`), each a
function made once over the buffers it runs on (:class:`lltm_cupy._numpy.memory.Workspace`
makes and keeps them), so that a step makes no array, view or Python object.

The gate values live gate-major, as (3, batch, state), so that every element-wise call runs on
contiguous memory (a NumPy ufunc on a column slice of a (batch, 3 * state) array costs more per
call). The forward computes what the backward multiplies by and keeps those four products
(4, batch, state) instead of the activations, so the backward is four multiplications and an
addition per element. The callers run these with NumPy's floating-point errors ignored
(``memory.quiet``): infinities and NaN give IEEE results (the reference's).
"""
from __future__ import annotations

import numpy as np

__all__ = ["forward_step", "step_factors", "backward_step"]


def forward_step(z, scratch, zero, derivatives):
    """The element-wise forward of one step as a function ``step(old_cell, new_h, new_cell)``
    of its state, on the buffers given here, whose views it makes once (docs/performance.md,
    "How the sequence loops are laid out"): no array, view or Python object made per step.

    z (3, B, S): the gate pre-activations, used as scratch (z[1:] holds p + q below afterwards;
    the caller writes the next step's z into it). ``zero``: zeros shaped like z (read-only).
    The step writes new_h, new_cell (B, S) (``new_cell`` may be ``old_cell`` itself: updated
    in place), and leaves in ``scratch`` (6, B, S) [q_i, q_o, input_gate, output_gate, p_c,
    candidate_cell * input_gate] what :func:`step_factors` computes the backward's factors
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
    vectorised); outputs passed positionally (cheaper than ``out=``: docs/performance.md, "The
    accurate forms' cost"), except to minimum/maximum, where NumPy deprecates that.
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


def step_factors(total, scratch, new_h, new_cell, factors) -> None:
    """What the backward multiplies by, from what a :func:`forward_step` left (``total`` = its
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


def backward_step(d):
    """The element-wise backward of one step as a function ``step(grad_h, f_io, f_oc,
    d_cell, d_gates)``, on the scratch ``d`` (5, B, S) whose views it makes once (four NumPy
    calls a step).

    grad_h (B, S); f_io = factors[0::2] and f_oc = factors[1::2] of the forward's factors
    (4, B, S) (see :func:`step_factors`); ``d_cell`` (B, S): the cell gradient arriving from
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
