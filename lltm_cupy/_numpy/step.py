"""The CPU backend's step: one LLTM step each way.

- :func:`forward` / :func:`backward`: one step into buffers the caller gives (the array API's
  arrays), with one GEMM forward and one per needed gradient;
- :func:`gate_rows` / :func:`cell_backward_into`: the element-wise step each way around a
  caller's GEMMs (the torch layer's), into buffers it gives;
- :func:`cell_forward` / :func:`cell_backward`: the element-wise cell alone.

The element-wise forms are :mod:`.elementwise`'s, run on this thread's workspace
(``memory.workspace``). One step's layout change is folded into the bias add (forward: the
gate pre-activations gate-major, (3, batch, state)) and into one copy of the gate gradients
back to (batch, 3 * state) for the GEMMs (backward).

Every entry point runs with NumPy's floating-point errors ignored (:func:`quiet`): infinities
and NaN in the arguments give IEEE results (the reference's), and the library, not NumPy,
decides what is an error.
"""
from __future__ import annotations

import numpy as np

from .._types import LLTMCellGrads, LLTMCellSaved, LLTMGrads
from .gemm import NUMPY_GEMM
from .elementwise import step_factors
from .memory import loud, quiet, scratch, workspace

__all__ = ["forward", "backward", "gate_rows", "cell_forward", "cell_backward",
           "cell_forward_into", "cell_backward_into"]


def _project(x, w, bias, mm, steps, batch, out=None, product=None):
    """Gate pre-activations ``x @ w.T + bias`` of ``steps * batch`` rows, as a C-ordered
    gate-major array (steps, 3, batch, state) (``out``, or a new one); the bias add writes the
    layout.

    For up to 128 rows the product is taken as ``w @ x.T`` (OpenBLAS's faster orientation at
    small batch) and the bias add transposes it; for more rows ``x @ w.T``, whose
    (batch, 3, state) rows the bias add moves whole (transposing a large product costs more than
    the GEMM): docs/performance.md, "GEMM orientation". ``product``: a scratch for the GEMM's
    result (3 * state * steps * batch elements; the engine's ``into`` writes it), or None.
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


def gate_rows(batch: int, state: int, dtype, derivatives: bool, operand):
    """``(z, run)``: this thread's gate pre-activations (3, batch, state) as ``operand`` makes
    them (a GEMM engine's operand), into which the caller writes them gate-major, bias included;
    and ``run(old_cell, new_h, new_cell, factors=None)``, the element-wise forward on them:
    writes new_h, new_cell (batch, state) and, with ``derivatives``, ``factors`` (4, batch,
    state). Made once per workspace, mode and operand (``memory.Workspace.gate_rows``)."""
    space = workspace(batch, state, dtype)
    found = space.made.get((derivatives, operand))
    return found if found is not None else space.gate_rows(derivatives, operand)


def _d_gates(grad_h, grad_cell, factors, d_gates, d_new_cell=None):
    """Element-wise backward of one step from the forward's ``factors`` (4, B, S): writes
    d_gates (3, B, S) (any strides) and returns d_new_cell (B, S), written into ``d_new_cell``
    (None: a new array); grad_h / grad_cell may be None (zero). The formulas:
    ``elementwise.backward_step`` (which the sequence loops run on a workspace's buffers); here
    four or five NumPy calls on the caller's arrays, no view made but the factors' rows."""
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
        dtype = old_h.dtype
        if X is None:       # (a temporary in this thread's scratch)
            width = state + input.shape[1]
            X = scratch(batch * width, dtype).reshape(batch, width)
        np.concatenate((old_h, input), axis=1, out=X)
        # z and the step's scratch, and the GEMM's product: this thread's workspace's
        space = workspace(batch, state, dtype)
        z, step, total, rest = space.cells[factors is not None]
        _project(X, weights, bias, mm, 1, batch, z[None], space.product)
        step(old_cell, new_h, new_cell)
        if factors is not None:
            step_factors(total, rest, new_h, new_cell, factors)
    finally:
        loud(token)


def backward(grad_h, grad_cell, factors, weights, bias_shape, X, needed=(True,) * 5,
             mm=NUMPY_GEMM) -> LLTMGrads:
    """The gradients of one step (:class:`LLTMGrads`, None where ``needed`` says so) from the
    forward's ``factors`` and ``X`` = [old_h, input]; grad_h / grad_cell (batch, state), either
    None (zero)."""
    token = quiet()
    try:
        _, batch, state = factors.shape
        n = batch * state
        need_h, need_x, need_w, need_b, need_c = needed
        # d_gates gate-major and as the GEMMs' rows
        buffer = scratch(6 * n, factors.dtype)
        d_acts = buffer[:3 * n].reshape(3, batch, state)
        d_new_cell = _d_gates(grad_h, grad_cell, factors, d_acts)
        d_gates = buffer[3 * n:].reshape(batch, 3 * state)
        _gate_major_to_rows(d_acts, d_gates)
        return LLTMGrads(
            mm(d_gates, weights[:, :state]) if need_h else None,
            mm(d_gates, weights[:, state:]) if need_x else None,
            mm(d_gates.T, X) if need_w else None,
            d_gates.sum(axis=0).reshape(bias_shape) if need_b else None,
            d_new_cell if need_c else None)
    finally:
        loud(token)


# -------------------------------------------- the element-wise cell alone (GEMMs elsewhere)

def cell_forward_into(gates, old_cell, new_h, new_cell, factors=None) -> None:
    """The element-wise forward of one step on the gate pre-activations ``gates`` (batch,
    3 * state) the caller computed (bias included); writes new_h, new_cell (batch, state) and,
    for a backward, ``factors`` (4, batch, state) (None: forward only, the same outputs)."""
    token = quiet()
    try:
        batch, state = old_cell.shape
        z, step, total, rest = workspace(batch, state, gates.dtype).cells[factors is not None]
        np.copyto(z, gates.reshape(batch, 3, state).transpose(1, 0, 2))
        step(old_cell, new_h, new_cell)
        if factors is not None:
            step_factors(total, rest, new_h, new_cell, factors)
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
    ``saved`` holds the four products the backward multiplies by (``elementwise.step_factors``)."""
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
