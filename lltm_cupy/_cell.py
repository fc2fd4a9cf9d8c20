"""The fused cell alone: the element-wise forward and backward of one step on gate
pre-activations the caller computed (what the GPU kernels do between the GEMMs), for gates
built another way: another projection, attention, a GEMM of the caller's own."""
from __future__ import annotations

from ._dispatch import _backend
from ._aliasing import private_cell
from ._checks import check_cell_backward, check_cell_forward

__all__ = ["cell_forward", "cell_backward"]


def cell_forward(gates, old_cell):
    """The LLTM's element-wise step. Returns ``(new_h, new_cell, saved)``.

    gates: (batch, 3 * state) pre-activations, bias included: [input | output | candidate]
        (the layout of ``X @ weights.T + bias`` in :func:`forward`)
    old_cell: (batch, state)

    new_cell = old_cell + elu(z_c) * sigmoid(z_i); new_h = tanh(new_cell) * sigmoid(z_o).
    All NumPy (float32, float64) or all CuPy (float16, float32, float64), one dtype; the same
    evaluation, and accuracy, as :func:`forward` (on the GPU the same kernel). No argument is
    modified, and the backward reads no array returned or passed in. ``saved`` (an
    ``LLTMCellSaved``) goes to :func:`cell_backward`.
    """
    backend = check_cell_forward(gates, old_cell)
    new_h, new_cell, saved = _backend(backend).cell_forward(gates, old_cell)
    return new_h, private_cell(new_cell, saved), saved


def cell_backward(grad_h, grad_cell, saved):
    """Gradients of :func:`cell_forward`. Returns ``LLTMCellGrads(d_gates, d_old_cell)``.

    grad_h, grad_cell: (batch, state) gradients w.r.t. new_h and new_cell, or None for zero
    saved: what :func:`cell_forward` returned (usable for several backward calls)

    ``d_gates`` (batch, 3 * state) is the gradient w.r.t. the pre-activations (for the bias,
    sum it over the batch; for a projection, multiply it back through), ``d_old_cell``
    (batch, state).
    """
    backend = check_cell_backward(grad_h, grad_cell, saved)
    return _backend(backend).cell_backward(grad_h, grad_cell, saved)
