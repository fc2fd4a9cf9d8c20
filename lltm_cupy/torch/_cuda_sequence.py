"""The CUDA path's fixed-length sequences in the torch layer: the buffers ``torch.empty``
tensors, the GEMMs torch's, and the CUDA backend's per-step loops
(``lltm_cupy._cuda.sequence.forward_steps`` / ``backward_steps``) launching the kernels on
the buffers' device pointers, on torch's current stream. No CuPy array, DLPack import or
allocator callback per call: what the sequence Function runs on CUDA for sequences of one
length each way (variable lengths and the fused kernels go through the CuPy backend's arrays,
``_interop.backend_call``).

The same device work, in the same order, as the CuPy backend's ``forward_sequence`` /
``backward_sequence`` with torch's GEMM engine (so the same bits), except the final state's
gradient, added by torch instead of the backend's add kernel, and the bias gradient, torch's
reduction.
"""
from __future__ import annotations

import torch

from .._cuda import sequence as _sequence
from .._cuda.elementwise import launch
from .._packing import block_steps
from . import _interop, _torch_gemm

__all__ = ["forward", "backward"]


def forward(inputs, weights, bias, h0, c0, keep=True):
    """``(hs, h_n, c_n, gates, cells)``: hs (steps + 1, B, S) = [h0, outputs...]; gates and
    cells (steps, ...) with ``keep`` (what the backward reads), else None."""
    steps, batch, features = inputs.shape
    state = h0.shape[1]
    new = h0.new_empty
    x = inputs.contiguous().view(steps * batch, features)
    block = block_steps(batch, _sequence._BLOCK_ROWS)
    gates = new((steps if keep else min(block, steps), batch, 3 * state))
    hs = new((steps + 1, batch, state))
    hs[0] = h0
    cells = new((steps if keep else min(2, steps), batch, state))
    n = batch * state
    if steps and n:
        w_x_t, w_h_t = weights[:, state:].t(), weights[:, :state].t()
        b, c = bias.contiguous(), c0.contiguous()
        mm, addmm_ = _torch_gemm._mm, _torch_gemm._addmm_

        def project(t0, k, j0):
            mm(x[t0 * batch: (t0 + k) * batch], w_x_t,
               out=gates[j0: j0 + k].view(k * batch, 3 * state))

        def recurrent(t, j):
            addmm_(gates[j], hs[t], w_h_t)

        with _interop.launching(inputs.device):
            _sequence.forward_steps(
                launch(_interop.KERNEL_DTYPE[inputs.dtype], n, state), steps, block, keep,
                project, recurrent, (gates.data_ptr(), gates.stride(0) * gates.element_size()),
                (hs.data_ptr(), hs.stride(0) * hs.element_size()),
                (cells.data_ptr(), cells.stride(0) * cells.element_size()), b.data_ptr(),
                c.data_ptr())
    h_n = hs[steps].clone()
    c_n = c0.clone() if not steps else cells[(steps - 1) if keep else (steps - 1) % 2].clone()
    return (hs, h_n, c_n, gates, cells) if keep else (hs, h_n, c_n, None, None)


def backward(grad_outputs, grad_h_n, grad_c_n, x, hs, gates, cells, weights, bias_shape,
             needed):
    """``(d_inputs, d_weights, d_bias, d_h0, d_c0)`` (None where ``needed`` says so) of a
    fixed-length sequence from what :func:`forward` kept; x: the inputs (steps * batch,
    features)."""
    steps, batch, state = cells.shape
    new = cells.new_empty
    # grad_h of every step, accumulated into: the outputs' gradient, the final state's
    grad_h = (cells.new_zeros((steps, batch, state)) if grad_outputs is None
              else grad_outputs.clone(memory_format=torch.contiguous_format))
    if steps and grad_h_n is not None:
        grad_h[steps - 1] += grad_h_n
    d_gates = new((steps, batch, 3 * state))
    w_h = weights[:, :state]
    mm, addmm_ = _torch_gemm._mm, _torch_gemm._addmm_
    need_x, need_w, need_b, need_h0, need_c0 = needed
    if steps and batch:
        buffers = new((2, batch, state))
        gc = None if grad_c_n is None else grad_c_n.contiguous()

        def recurrent(t, j):
            addmm_(grad_h[j], d_gates[t], w_h)

        size = cells.element_size()
        with _interop.launching(cells.device):
            _sequence.backward_steps(
                launch(_interop.KERNEL_DTYPE[cells.dtype], batch * state, state), steps,
                recurrent, (grad_h.data_ptr(), grad_h.stride(0) * size),
                (cells.data_ptr(), cells.stride(0) * size),
                (gates.data_ptr(), gates.stride(0) * gates.element_size()),
                (d_gates.data_ptr(), d_gates.stride(0) * d_gates.element_size()),
                (buffers.data_ptr(), buffers.stride(0) * size),
                None if gc is None else gc.data_ptr())
        d_h0 = mm(d_gates[0], w_h, out=new((batch, state)))
        d_c0 = buffers[(steps - 1) % 2].clone()
    elif steps:                 # no batch
        d_h0, d_c0 = new((batch, state)), new((batch, state))
    else:                       # no step: the final state is the initial one
        d_h0 = cells.new_zeros((batch, state)) if grad_h_n is None else grad_h_n.clone()
        d_c0 = cells.new_zeros((batch, state)) if grad_c_n is None else grad_c_n.clone()
    flat = d_gates.view(steps * batch, 3 * state)
    d_weights = d_bias = d_inputs = None
    if need_w:
        d_weights = new(weights.shape)
        mm(flat.t(), hs[:-1].reshape(steps * batch, state), out=d_weights[:, :state])
        mm(flat.t(), x, out=d_weights[:, state:])
    if need_b:
        d_bias = flat.sum(0).reshape(bias_shape)
    if need_x:
        d_inputs = mm(flat, weights[:, state:], out=new((steps * batch, x.shape[1]))).view(
            steps, batch, x.shape[1])
    return d_inputs, d_weights, d_bias, d_h0 if need_h0 else None, d_c0 if need_c0 else None
