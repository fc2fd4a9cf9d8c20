"""CPU backend: the LLTM cell in vectorised NumPy, with the array API's entry points.

The arithmetic runs in the input dtype (float32 stays float32). Arguments were checked by
``lltm_cupy._checks``. At the sizes recurrent cells run at, the cost on the CPU is the number of
NumPy calls rather than arithmetic, so this backend is written for few, cheap passes on
contiguous memory, in forms that keep relative accuracy for every finite input
(``elementwise``).

One file per job, importing one way (``__init__`` -> ``packed`` -> ``sequence`` -> ``step`` ->
``gemm`` -> ``memory`` -> ``elementwise``):

- ``step``: one step each way into buffers the caller gives (what the torch layer calls), and
  the element-wise cell alone;
- ``sequence``: the fixed-length sequence loops; ``packed``: variable lengths;
- ``gemm``: the GEMMs, by NumPy's BLAS or (passed as ``mm``) another engine's;
- ``memory``: everything the backend keeps per thread (its workspaces, with the element-wise
  steps over them; scratch; recycled arrays), the fork rule, NumPy's floating-point error state;
- ``elementwise``: the element-wise forms every step runs.

The GEMMs go through ``mm``, an object with the interface of :mod:`lltm_cupy._numpy.gemm`
(default: NumPy's BLAS): the torch layer passes torch's (one BLAS thread pool per process, not
two that fight over the cores).
"""
from __future__ import annotations

import numpy as np

from .._types import LLTMSaved
from . import step
from .gemm import NUMPY_GEMM
from .packed import backward_packed, forward_packed
from .sequence import backward_sequence as _backward_sequence, forward_sequence as _forward_sequence
from .memory import loud, quiet
from .step import cell_backward, cell_forward

__all__ = ["forward", "backward", "forward_sequence", "backward_sequence", "cell_forward",
           "cell_backward"]


def forward(input, weights, bias, old_h, old_cell, mm=NUMPY_GEMM, keep=True):
    batch, state = old_h.shape
    dtype = old_h.dtype
    new_h = np.empty((batch, state), dtype)
    new_cell = np.empty((batch, state), dtype)
    if not keep:
        step.forward(input, weights, bias, old_h, old_cell, new_h, new_cell, mm=mm)
        return new_h, new_cell, None
    X = np.empty((batch, state + input.shape[1]), dtype)
    factors = np.empty((4, batch, state), dtype)
    step.forward(input, weights, bias, old_h, old_cell, new_h, new_cell, factors, X, mm)
    return new_h, new_cell, LLTMSaved("numpy", X, factors, new_cell, weights, tuple(bias.shape))


def backward(grad_h, grad_cell, saved, needed=(True,) * 5, mm=NUMPY_GEMM):
    return step.backward(grad_h, grad_cell, saved.gates, saved.weights, saved.bias_shape,
                         X=saved.X, needed=needed, mm=mm)


def forward_sequence(inputs, weights, bias, h0, c0, mm=NUMPY_GEMM, plan=None, keep=True):
    token = quiet()
    try:
        if plan is not None:
            return forward_packed(inputs, weights, bias, h0, c0, mm, plan, keep)
        return _forward_sequence(inputs, weights, bias, h0, c0, mm, keep)
    finally:
        loud(token)


def backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, needed=(True,) * 5, mm=NUMPY_GEMM):
    token = quiet()
    try:
        if saved.plan is not None:
            return backward_packed(grad_outputs, grad_h_n, grad_c_n, saved, needed, mm)
        return _backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, needed, mm)
    finally:
        loud(token)
