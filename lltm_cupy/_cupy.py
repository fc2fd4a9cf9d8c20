"""GPU backend: cuBLAS GEMMs through CuPy plus the fused kernels of ``cuda_src/lltm.cu``.

Launchers only allocate, size the grid and launch; arguments were checked by
``lltm_cupy._checks``. Everything runs on CuPy's current stream, on the arrays' device, with no
host synchronisation. CuPy is imported on first call, never at package import.
"""
from __future__ import annotations

import numpy as np

from ._kernels import get_kernels, launch_config
from ._types import LLTMGrads, LLTMSaved, LLTMSequenceGrads, LLTMSequenceSaved

__all__ = ["forward", "backward", "forward_sequence", "backward_sequence"]

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


def _d_bias(d_gates, bias_shape):
    """Sum of d_gates (rows, 3S) over its rows, shaped like the bias; float16 sums in float32."""
    if d_gates.dtype == np.float16:
        return d_gates.sum(axis=0, dtype=np.float32).astype(np.float16).reshape(bias_shape)
    return d_gates.sum(axis=0).reshape(bias_shape)


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
            grid, block, wide = launch_config(n)
            fwd, _ = get_kernels(dtype, wide)
            bias_c = cupy.ascontiguousarray(bias.reshape(-1))
            old_cell_c = cupy.ascontiguousarray(old_cell)
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
            grid, block, wide = launch_config(n)
            _, bwd = get_kernels(dtype, wide)
            # A missing gradient is zero: the kernel is told so and reads another valid pointer.
            gh = new_cell if grad_h is None else cupy.ascontiguousarray(grad_h)
            gc = new_cell if grad_cell is None else cupy.ascontiguousarray(grad_cell)
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
            d_bias = _d_bias(d_gates, saved.bias_shape)
    return LLTMGrads(d_old_h, d_input, d_weights, d_bias, d_old_cell if need_c else None)


def _gemm_accumulate(cupy, a, b_t, out):
    """out += a @ b_t.T without a temporary (cuBLAS, beta = 1) for float32/float64."""
    if out.dtype == np.float16:  # cublas.gemm has no half path; CuPy's matmul accumulates in fp32
        out += cupy.matmul(a, b_t.T)
    else:
        from cupy import cublas

        cublas.gemm("N", "T", a, b_t, out=out, alpha=1.0, beta=1.0)


def forward_sequence(inputs, weights, bias, h0, c0):
    cupy = _cupy()
    steps, batch, features = inputs.shape
    state = h0.shape[1]
    dtype = inputs.dtype
    with cupy.cuda.Device(inputs.device.id):
        x = cupy.ascontiguousarray(inputs).reshape(steps * batch, features)
        gates = cupy.empty((steps, batch, 3 * state), dtype)
        flat = gates.reshape(steps * batch, 3 * state)
        if steps * batch:
            cupy.matmul(x, weights[:, state:].T, out=flat)  # every step's input projection
        hs = cupy.empty((steps + 1, batch, state), dtype)
        hs[0] = h0
        cells = cupy.empty((steps, batch, state), dtype)
        n = batch * state
        if steps and n:
            w_h = cupy.ascontiguousarray(weights[:, :state])
            bias_c = cupy.ascontiguousarray(bias.reshape(-1))
            c = cupy.ascontiguousarray(c0)
            grid, block, wide = launch_config(n)
            fwd, _ = get_kernels(dtype, wide)
            for t in range(steps):
                _gemm_accumulate(cupy, hs[t], w_h, gates[t])
                fwd(grid, block, (gates[t], bias_c, c, hs[t + 1], cells[t],
                                  np.int64(n), np.int32(state)))
                c = cells[t]
        h_n = hs[steps].copy() if steps else cupy.array(h0, dtype=dtype)
        c_n = cells[steps - 1].copy() if steps else cupy.array(c0, dtype=dtype)
    saved = LLTMSequenceSaved("cupy", x, hs, gates, cells, weights, tuple(bias.shape))
    return hs[1:], h_n, c_n, saved


def backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, needed=(True,) * 5):
    cupy = _cupy()
    x, hs, gates, cells, weights = saved.inputs, saved.hs, saved.gates, saved.cells, saved.weights
    steps, batch, state = cells.shape
    features = x.shape[1]
    dtype = cells.dtype
    with cupy.cuda.Device(cells.device.id):
        # grad_h of every step; the recurrent GEMM of step t accumulates into step t - 1's.
        grad_h = (cupy.zeros((steps, batch, state), dtype) if grad_outputs is None
                  else cupy.array(grad_outputs, dtype=dtype, order="C"))
        if steps and grad_h_n is not None:
            grad_h[steps - 1] += grad_h_n
        d_gates = cupy.empty((steps, batch, 3 * state), dtype)
        n = batch * state
        d_c = None if grad_c_n is None else cupy.ascontiguousarray(grad_c_n)
        if steps and n:
            w_h = cupy.ascontiguousarray(weights[:, :state])
            grid, block, wide = launch_config(n)
            _, bwd = get_kernels(dtype, wide)
            buffers = (cupy.empty((batch, state), dtype), cupy.empty((batch, state), dtype))
            for i, t in enumerate(range(steps - 1, -1, -1)):
                out_c = buffers[i % 2]      # never the buffer read as grad_cell (restrict)
                bwd(grid, block, (grad_h[t], cells[t] if d_c is None else d_c, gates[t], cells[t],
                                  d_gates[t], out_c, np.int32(1), np.int32(d_c is not None),
                                  np.int64(n), np.int32(state)))
                d_c = out_c
                if t:
                    _gemm_accumulate(cupy, d_gates[t], w_h.T, grad_h[t - 1])
            d_h0 = cupy.matmul(d_gates[0], w_h)
            d_c0 = d_c.copy()
        elif steps:
            d_h0 = cupy.zeros((batch, state), dtype)
            d_c0 = cupy.zeros((batch, state), dtype)
        else:
            d_h0 = cupy.zeros((batch, state), dtype) if grad_h_n is None else cupy.array(grad_h_n)
            d_c0 = cupy.zeros((batch, state), dtype) if grad_c_n is None else cupy.array(grad_c_n)
        need_x, need_w, need_b, need_h0, need_c0 = needed
        flat = d_gates.reshape(steps * batch, 3 * state)
        d_weights = d_bias = d_inputs = None
        if need_w:
            d_weights = cupy.zeros(weights.shape, dtype)
            if steps * batch:
                d_weights[:, :state] = cupy.matmul(flat.T, hs[:-1].reshape(steps * batch, state))
                d_weights[:, state:] = cupy.matmul(flat.T, x)
        if need_b:
            d_bias = _d_bias(flat, saved.bias_shape)
        if need_x:
            d_inputs = cupy.matmul(flat, weights[:, state:]).reshape(steps, batch, features)
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0 if need_h0 else None,
                             d_c0 if need_c0 else None)
