"""The CUDA backend, one step each way: the element-wise launches of ``cuda_src/lltm.cu`` around
cuBLAS GEMMs (``forward``, ``backward``) and the fused cell alone (``cell_forward``,
``cell_backward``).

Launchers only allocate, size the grid and launch; arguments were checked by
``lltm_cupy._checks``. Everything runs on CuPy's current stream, on the arrays' device, with no
host synchronisation and no allocation outside CuPy's current allocator (so a caller can route
every byte through its own allocator with ``cupy.cuda.using_allocator``).

Device work per call (the launch budget ``tests/budgets/test_launch_budget.py`` enforces):

- forward: one concatenation kernel (X = [old_h, input]), one GEMM, the fused kernel;
- backward: the fused kernel, one GEMM per needed gradient of old_h, input and the weights, one
  reduction for the bias (in bfloat16, which CuPy cannot add, a GEMM against ones).

bfloat16 has no CuPy dtype: it arrives as uint16 arrays of its bits (``kernels.BFLOAT16``),
which the kernels, ``gemm`` and the bias gradient read as bfloat16.

Every GEMM is :func:`lltm_cupy._cuda.gemm.gemm`. The torch layer launches the kernels here
(``launch_concat``, ``launch_forward``, ``launch_backward``) on its tensors' pointers.
"""
from __future__ import annotations

import numpy as np

from .elementwise import FLAG, launch
from .gemm import d_bias as _d_bias, gemm
from .kernels import cupy_module, on_device
from .._types import LLTMCellGrads, LLTMCellSaved, LLTMGrads, LLTMSaved

__all__ = ["forward", "backward", "cell_forward", "cell_backward", "step_backward",
           "launch_concat", "launch_forward", "launch_backward"]


def forward(input, weights, bias, old_h, old_cell, keep=True):
    cupy = cupy_module()
    dtype = input.dtype
    batch, features = input.shape
    state = old_h.shape[1]
    with on_device(input.data.device_id):
        X = cupy.empty((batch, state + features), dtype)
        gates = cupy.empty((batch, 3 * state), dtype)
        new_h = cupy.empty((batch, state), dtype)
        new_cell = cupy.empty((batch, state), dtype)
        if batch:  # state >= 1, so nothing to launch exactly when batch == 0
            # (contiguous copies, where made, held until the launches are queued)
            h, x = cupy.ascontiguousarray(old_h), cupy.ascontiguousarray(input)
            run = launch(dtype, X.size, state)
            run.kernels.concat(run.grid, run.block, (
                h.data.ptr, x.data.ptr, X.data.ptr, run.n, run.state, np.int32(features)))
            gemm(X, weights.T, gates)
            b, c = cupy.ascontiguousarray(bias), cupy.ascontiguousarray(old_cell)
            run = launch(dtype, batch * state, state)
            run.kernels.fwd(run.grid, run.block, (
                gates.data.ptr, b.data.ptr, c.data.ptr, new_h.data.ptr, new_cell.data.ptr,
                run.n, run.state))
    if not keep:
        return new_h, new_cell, None
    return new_h, new_cell, LLTMSaved("cupy", X, gates, new_cell, weights, tuple(bias.shape))


def backward(grad_h, grad_cell, saved, needed=(True,) * 5):
    cupy = cupy_module()
    gates, new_cell, X, weights = saved.gates, saved.new_cell, saved.X, saved.weights
    batch, state = new_cell.shape
    dtype = new_cell.dtype
    need_h, need_x, need_w, need_b, need_c = needed
    with on_device(new_cell.data.device_id):
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
            d_bias = _d_bias(cupy, d_gates, saved.bias_shape)
    return LLTMGrads(d_old_h, d_input, d_weights, d_bias, d_old_cell if need_c else None)


# ------------------------------------------------------------------------- the fused cell alone

def cell_forward(gates, old_cell):
    """The fused forward kernel alone on gate pre-activations (batch, 3 * state) the caller
    computed (a zero bias: adding 0 leaves every value, rounding included, as it was)."""
    cupy = cupy_module()
    batch, state = old_cell.shape
    dtype = gates.dtype
    with on_device(gates.data.device_id):
        z = cupy.array(gates, dtype=dtype, order="C")      # the kernel writes z + bias back
        new_h = cupy.empty((batch, state), dtype)
        new_cell = cupy.empty((batch, state), dtype)
        if batch:
            zero_bias, c = cupy.zeros(3 * state, dtype), cupy.ascontiguousarray(old_cell)
            run = launch(dtype, batch * state, state)
            run.kernels.fwd(run.grid, run.block, (
                z.data.ptr, zero_bias.data.ptr, c.data.ptr, new_h.data.ptr, new_cell.data.ptr,
                run.n, run.state))
    return new_h, new_cell, LLTMCellSaved("cupy", z, new_cell)


def cell_backward(grad_h, grad_cell, saved):
    cupy = cupy_module()
    with on_device(saved.new_cell.data.device_id):
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
    if batch:
        run = launch(dtype, batch * state, state)
        gh = new_cell if grad_h is None else cupy.ascontiguousarray(grad_h)
        gc = new_cell if grad_cell is None else cupy.ascontiguousarray(grad_cell)
        run.kernels.bwd(run.grid, run.block, (
            gh.data.ptr, gc.data.ptr, gates.data.ptr, new_cell.data.ptr, d_gates.data.ptr,
            d_old_cell.data.ptr,
            FLAG[grad_h is not None], FLAG[grad_cell is not None], run.n, run.state))
    return d_gates, d_old_cell


# ---------------- on device pointers (ints) of C-contiguous buffers, batch > 0, the current
# ---------------- device and CuPy's current stream (the torch layer's launches)

def launch_concat(dtype, batch, features, state, old_h, input, X) -> None:
    """X = [old_h, input] (batch, state + features)."""
    run = launch(dtype, batch * (state + features), state)
    run.kernels.concat(run.grid, run.block, (old_h, input, X, run.n, run.state,
                                             np.int32(features)))


def launch_forward(dtype, batch, state, gates, bias, old_cell, new_h, new_cell) -> None:
    """The fused forward kernel: new_h and new_cell (batch, state) from the gate
    pre-activations X @ W.T (batch, 3 * state), the bias (3 * state) and old_cell."""
    run = launch(dtype, batch * state, state)
    run.kernels.fwd(run.grid, run.block, (gates, bias, old_cell, new_h, new_cell, run.n,
                                          run.state))


def launch_backward(dtype, batch, state, grad_h, grad_cell, gates, new_cell, d_gates,
                    d_old_cell) -> None:
    """The element-wise backward kernel: d_gates (batch, 3 * state) and d_old_cell (batch,
    state) from grad_h, grad_cell (None: zero), the forward's gates and new_cell."""
    run = launch(dtype, batch * state, state)
    run.kernels.bwd(run.grid, run.block, (
        new_cell if grad_h is None else grad_h, new_cell if grad_cell is None else grad_cell,
        gates, new_cell, d_gates, d_old_cell, FLAG[grad_h is not None],
        FLAG[grad_cell is not None], run.n, run.state))
