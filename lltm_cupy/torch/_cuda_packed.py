"""The CUDA path's variable-length sequences in the torch layer, stepped (a packing plan of
``lltm_cupy._packing``: ``lengths=`` and ``PackedSequence`` data): the CUDA backend's loops on
pointers (``lltm_cupy._cuda.packed.forward_rows`` / ``backward_rows``) over ``torch.empty``
buffers, torch's GEMMs, the gathers and scatters torch's indexing by the plan's index arrays on
the device (``_interop.plan_arrays``). The same device work, in the same order, as the CuPy
backend's ``forward_packed`` / ``backward_packed`` (``_cuda_sequence`` adds the bias gradient,
torch's reduction). Called by ``_cuda_sequence`` inside ``_interop.launching``, on the packed
rows and the sorted states.
"""
from __future__ import annotations

import torch

from .._cuda import packed as _packed, sequence as _sequence
from .._cuda.elementwise import launch
from .._packing import incoming_cell_grad, pack_rows, step_blocks, unpack_rows
from . import _interop, _torch_gemm
from ._interop import rows as _rows

__all__ = ["forward", "backward"]


def forward(x, weights, bias, h0s, c0s, plan, d, xp, keep):
    """(outputs, out, gates, cells, h_sorted, c_sorted): the outputs in the caller's layout;
    every packed row's hidden state, gate pre-activations and cell (rows, ...), what the
    backward reads (None forward only); each sorted sequence's final state. x: the packed
    inputs (rows, F), contiguous; h0s, c0s: the sorted initial state, contiguous; d: the plan's
    device arrays; xp: ``_interop.TorchArrays`` of the device."""
    state = h0s.shape[1]
    batch, rows, offsets = len(plan.perm), plan.rows, plan.offsets
    blocks = step_blocks(offsets, _sequence._BLOCK_ROWS)
    new = x.new_empty
    w_x_t, w_h_t = weights[:, state:].t(), weights[:, :state].t()
    mm, addmm_ = _torch_gemm._mm, _torch_gemm._addmm_
    if keep:
        hs = new((rows, state))
        gates, cells = new((rows, 3 * state)), new((rows, state))
        extra = ()
    else:
        outputs, hs, h_rows, scatter, after = _packed.forward_only_outputs(xp, plan, d, state,
                                                                           x.dtype)
        h_sorted, c_sorted = h0s.clone(), c0s.clone()
        if not rows:
            return outputs, None, None, None, h_sorted, c_sorted
        gates = new((max(offsets[b] - offsets[a] for a, b in blocks), 3 * state))
        cells = new((2, batch, state))
        extra = (h_rows, (h_sorted.data_ptr(), c_sorted.data_ptr()), after, scatter)

    def project(r0, r1):        # a block's input projection (forward only: from row 0)
        mm(x[r0:r1], w_x_t, out=gates[r0:r1] if keep else gates[: r1 - r0])

    def first(n):
        addmm_(gates[:n], h0s[:n], w_h_t)

    def recurrent(i, j, n):
        addmm_(gates.narrow(0, j, n), hs.narrow(0, i, n), w_h_t)

    b = bias.contiguous()
    _packed.forward_rows(plan, blocks, project, first, recurrent, _rows(gates), _rows(hs),
                         cells.data_ptr(), b.data_ptr(), c0s.data_ptr(),
                         _interop.KERNEL_DTYPE[x.dtype], state, *extra)
    if not keep:
        return outputs, None, None, None, h_sorted, c_sorted
    outputs = unpack_rows(hs, plan, xp, d.t_index, d.b_index, d.data_index)
    return (outputs, hs, gates, cells,
            *_packed.final_states(plan, d, hs, cells, h0s, c0s, torch.Tensor.clone))


def backward(grad_outputs, grad_h_n, grad_c_n, out, gates, cells, weights, plan, d, xp):
    """(d_gates (rows, 3S), d_h0, d_c0), the latter two in the sorted order, from the packed
    rows' hidden states ``out``, ``gates`` and ``cells`` that :func:`forward` kept; grad_h_n,
    grad_c_n: the final state's gradients in the sorted order (None: zero)."""
    rows, state = out.shape
    batch = len(plan.perm)
    dtype = _interop.KERNEL_DTYPE[out.dtype]
    new = out.new_empty
    if grad_outputs is None:
        grad_h = out.new_zeros((rows, state))
    else:   # written below: a copy, also where the packed rows are grad_outputs itself
        grad_h = pack_rows(grad_outputs, plan, d.t_index, d.b_index, d.data_index)
        grad_h = (grad_h.clone(memory_format=torch.contiguous_format) if grad_h is grad_outputs
                  else grad_h.contiguous())
    ended = plan.ended
    if grad_h_n is not None and ended and rows:
        # the add kernel (as the backend's: it adds bfloat16 bits as numbers)
        part, more = grad_h[d.last], grad_h_n[:ended].contiguous()
        run = launch(dtype, part.numel(), state)
        run.kernels.add(run.grid, run.block, (part.data_ptr(), more.data_ptr(), run.n))
        grad_h[d.last] = part
    d_gates = new((rows, 3 * state))
    d_h0 = (out.new_zeros((batch, state)) if grad_h_n is None
            else grad_h_n.clone(memory_format=torch.contiguous_format))
    d_c0 = (out.new_zeros((batch, state)) if grad_c_n is None
            else grad_c_n.clone(memory_format=torch.contiguous_format))
    sizes = plan.batch_sizes
    if sizes:
        w_h = weights[:, :state]
        buffers = new((2, batch, state))
        addmm_ = _torch_gemm._addmm_

        def incoming(last, n, nxt):
            held = incoming_cell_grad(xp, None if last is None else buffers[last, :nxt],
                                      grad_c_n, n, nxt, state, out.dtype)
            return None if held is None else (held.data_ptr(), held)

        def recurrent(i, j, n):
            addmm_(grad_h.narrow(0, j, n), d_gates.narrow(0, i, n), w_h)

        last = _packed.backward_rows(plan, recurrent, incoming, _rows(grad_h), cells.data_ptr(),
                                     _rows(gates), d_gates.data_ptr(), buffers.data_ptr(), dtype,
                                     state)
        n = sizes[0]
        d_h0[:n] = _torch_gemm._mm(d_gates[:n], w_h, out=new((n, state)))
        d_c0[:n] = buffers[last, :n]
    return d_gates, d_h0, d_c0
