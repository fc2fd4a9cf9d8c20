"""The CUDA backend, one step each way: the element-wise launches of ``cuda_src/lltm.cu`` around
cuBLAS GEMMs (``forward``, ``backward``) and the fused cell alone (``cell_forward``,
``cell_backward``).

Launchers only allocate, size the grid and launch; arguments were checked by
``lltm_cupy._checks``. Everything runs on CuPy's current stream, on the arrays' device, with no
host synchronisation and no allocation outside CuPy's current allocator (so a caller can route
every byte through its own allocator with ``cupy.cuda.using_allocator``).

Device work per call (the launch budget ``tests/test_launch_budget.py`` enforces):

- forward: one concatenation kernel (X = [old_h, input]), one GEMM, the fused kernel;
- backward: the fused kernel, one GEMM per needed gradient of old_h, input and the weights, one
  reduction for the bias (in bfloat16, which CuPy cannot add, a GEMM against ones).

bfloat16 has no CuPy dtype: it arrives as uint16 arrays of its bits (``kernels.BFLOAT16``),
which the kernels, ``gemm`` and the bias gradient read as bfloat16.

Every GEMM goes through ``gemm``: by default :func:`lltm_cupy._cuda.gemm.gemm` (cuBLAS
``gemmEx`` through CuPy's binding, on any row-major view, without copies); the torch layer
passes torch's GEMM while a CUDA graph is being captured, where CuPy refuses to call cuBLAS.
"""
from __future__ import annotations

import numpy as np

from . import kernels
from .gemm import d_bias as _d_bias, gemm
from .kernels import cupy_module, launch_config
from .._types import LLTMCellGrads, LLTMCellSaved, LLTMGrads, LLTMSaved

__all__ = ["forward", "backward", "cell_forward", "cell_backward", "step_backward"]


def forward(input, weights, bias, old_h, old_cell, gemm=gemm, keep=True):
    cupy = cupy_module()
    dtype = input.dtype
    batch, features = input.shape
    state = old_h.shape[1]
    with cupy.cuda.Device(input.device.id):
        X = cupy.empty((batch, state + features), dtype)
        gates = cupy.empty((batch, 3 * state), dtype)
        new_h = cupy.empty((batch, state), dtype)
        new_cell = cupy.empty((batch, state), dtype)
        if batch:  # state >= 1, so nothing to launch exactly when batch == 0
            grid, block, wide = launch_config(X.size)
            kernels.get_kernels(dtype, wide).concat(grid, block, (
                cupy.ascontiguousarray(old_h), cupy.ascontiguousarray(input), X,
                np.int64(X.size), np.int32(state), np.int32(features)))
            gemm(X, weights.T, gates)
            n = batch * state
            grid, block, wide = launch_config(n)
            kernels.get_kernels(dtype, wide).fwd(grid, block, (
                gates, cupy.ascontiguousarray(bias.reshape(-1)), cupy.ascontiguousarray(old_cell),
                new_h, new_cell, np.int64(n), np.int32(state)))
    if not keep:
        return new_h, new_cell, None
    return new_h, new_cell, LLTMSaved("cupy", X, gates, new_cell, weights, tuple(bias.shape))


def backward(grad_h, grad_cell, saved, needed=(True,) * 5, gemm=gemm):
    cupy = cupy_module()
    gates, new_cell, X, weights = saved.gates, saved.new_cell, saved.X, saved.weights
    batch, state = new_cell.shape
    dtype = new_cell.dtype
    need_h, need_x, need_w, need_b, need_c = needed
    with cupy.cuda.Device(new_cell.device.id):
        d_gates, d_old_cell = step_backward(cupy, grad_h, grad_cell, gates, new_cell)
        d_old_h = d_input = d_weights = d_bias = None
        if need_h:
            d_old_h = gemm(d_gates, weights[:, :state], cupy.empty((batch, state), dtype))
        if need_x:
            d_input = gemm(d_gates, weights[:, state:],
                           cupy.empty((batch, X.shape[1] - state), dtype))
        if need_w:
            d_weights = gemm(d_gates.T, X, cupy.empty(weights.shape, dtype))
        if need_b:
            d_bias = _d_bias(cupy, d_gates, saved.bias_shape, gemm)
    return LLTMGrads(d_old_h, d_input, d_weights, d_bias, d_old_cell if need_c else None)


# ------------------------------------------------------------------------- the fused cell alone

def cell_forward(gates, old_cell):
    """The fused forward kernel alone on gate pre-activations (batch, 3 * state) the caller
    computed (a zero bias: adding 0 leaves every value, rounding included, as it was)."""
    cupy = cupy_module()
    batch, state = old_cell.shape
    dtype = gates.dtype
    with cupy.cuda.Device(gates.device.id):
        z = cupy.array(gates, dtype=dtype, order="C")      # the kernel writes z + bias back
        new_h = cupy.empty((batch, state), dtype)
        new_cell = cupy.empty((batch, state), dtype)
        n = batch * state
        if n:
            grid, block, wide = launch_config(n)
            kernels.get_kernels(dtype, wide).fwd(grid, block, (
                z, cupy.zeros(3 * state, dtype), cupy.ascontiguousarray(old_cell), new_h,
                new_cell, np.int64(n), np.int32(state)))
    return new_h, new_cell, LLTMCellSaved("cupy", z, new_cell)


def cell_backward(grad_h, grad_cell, saved):
    cupy = cupy_module()
    with cupy.cuda.Device(saved.new_cell.device.id):
        return LLTMCellGrads(*step_backward(cupy, grad_h, grad_cell, saved.gates,
                                             saved.new_cell))


def step_backward(cupy, grad_h, grad_cell, gates, new_cell):
    """The element-wise backward kernel of one step, inside the arrays' device: (d_gates,
    d_old_cell). A missing gradient is zero: the kernel is told so and reads another valid
    pointer."""
    batch, state = new_cell.shape
    dtype = new_cell.dtype
    d_gates = cupy.empty((batch, 3 * state), dtype)
    d_old_cell = cupy.empty((batch, state), dtype)
    n = batch * state
    if n:
        grid, block, wide = launch_config(n)
        gh = new_cell if grad_h is None else cupy.ascontiguousarray(grad_h)
        gc = new_cell if grad_cell is None else cupy.ascontiguousarray(grad_cell)
        kernels.get_kernels(dtype, wide).bwd(grid, block, (
            gh, gc, gates, new_cell, d_gates, d_old_cell, np.int32(grad_h is not None),
            np.int32(grad_cell is not None), np.int64(n), np.int32(state)))
    return d_gates, d_old_cell
