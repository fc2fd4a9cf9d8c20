"""GPU backend: cuBLAS GEMMs through CuPy plus the fused kernels of ``cuda_src/lltm.cu``.

Launchers only allocate, size the grid and launch; arguments were checked by
``lltm_cupy._checks``. Everything runs on CuPy's current stream, on the arrays' device, with no
host synchronisation. CuPy is imported on first call, never at package import.
"""
from __future__ import annotations

import numpy as np

from ._kernels import get_kernels, launch_config
from ._types import LLTMGrads, LLTMSaved

__all__ = ["forward", "backward"]

_gpu_checked = False


def _cupy():
    """Import CuPy and make sure a GPU is usable (checked once per process)."""
    global _gpu_checked
    import cupy

    if not _gpu_checked:
        if not cupy.cuda.is_available():
            raise RuntimeError("lltm_cupy: CuPy arrays were given but CuPy finds no usable GPU "
                               "(no device, or no CUDA driver)")
        _gpu_checked = True
    return cupy


def forward(input, weights, bias, old_h, old_cell):
    cupy = _cupy()
    dtype = input.dtype
    batch = input.shape[0]
    state = old_h.shape[1]
    with cupy.cuda.Device(input.device.id):
        X = cupy.concatenate((old_h, input), axis=1)
        gates = cupy.empty((batch, 3 * state), dtype)
        cupy.matmul(X, weights.T, out=gates)
        new_h = cupy.empty((batch, state), dtype)
        new_cell = cupy.empty((batch, state), dtype)
        n = batch * state
        if n:
            fwd, _ = get_kernels(dtype)
            bias_c = cupy.ascontiguousarray(bias.reshape(-1))
            old_cell_c = cupy.ascontiguousarray(old_cell)
            grid, block = launch_config(n)
            fwd(grid, block, (gates, bias_c, old_cell_c, new_h, new_cell,
                              np.int64(n), np.int32(state)))
    return new_h, new_cell, LLTMSaved("cupy", X, gates, new_cell, weights, tuple(bias.shape))


def backward(grad_h, grad_cell, saved, needed=(True,) * 5):
    cupy = _cupy()
    gates, new_cell, X, weights = saved.gates, saved.new_cell, saved.X, saved.weights
    batch, state = new_cell.shape
    dtype = new_cell.dtype
    with cupy.cuda.Device(new_cell.device.id):
        d_gates = cupy.empty((batch, 3 * state), dtype)
        d_old_cell = cupy.empty((batch, state), dtype)
        n = batch * state
        if n:
            _, bwd = get_kernels(dtype)
            # A missing gradient is zero: the kernel is told so and reads another valid pointer.
            gh = new_cell if grad_h is None else cupy.ascontiguousarray(grad_h)
            gc = new_cell if grad_cell is None else cupy.ascontiguousarray(grad_cell)
            grid, block = launch_config(n)
            bwd(grid, block, (gh, gc, gates, new_cell, d_gates, d_old_cell,
                              np.int32(grad_h is not None), np.int32(grad_cell is not None),
                              np.int64(n), np.int32(state)))
        need_h, need_x, need_w, need_b, need_c = needed
        d_old_h = cupy.matmul(d_gates, weights[:, :state]) if need_h else None
        d_input = cupy.matmul(d_gates, weights[:, state:]) if need_x else None
        d_weights = d_bias = None
        if need_w:
            d_weights = cupy.matmul(d_gates.T, X) if batch else cupy.zeros(weights.shape, dtype)
        if need_b:
            if dtype == np.float16:  # accumulate in float32
                d_bias = d_gates.sum(axis=0, dtype=np.float32).astype(dtype)
            else:
                d_bias = d_gates.sum(axis=0)
            d_bias = d_bias.reshape(saved.bias_shape)
    return LLTMGrads(d_old_h, d_input, d_weights, d_bias, d_old_cell if need_c else None)
