"""The CUDA path's sequences in the torch layer: the buffers ``torch.empty`` tensors, the GEMMs
torch's, and the CUDA backend's launches on the buffers' device pointers, on torch's current
stream: the per-step loops (``lltm_cupy._cuda.sequence.forward_steps`` / ``backward_steps``;
with a packing plan of variable lengths, ``_cuda_packed``) or, with ``fused``, the fused
sequence kernels in whichever variant runs the state size (``lltm_cupy._cuda.fused.variant``:
one block, tensor cores, a cluster, or a cooperative group whose exchange buffer and counters
are torch tensors too), launched by ``lltm_cupy._cuda.fused.launch_forward`` /
``launch_backward``. A plan's index arrays are torch tensors on the device
(``_interop.plan_arrays``), its gathers and scatters torch's indexing. No CuPy array, DLPack
import or allocator callback per call.

The same device work, in the same order, as the CuPy backend's ``forward_sequence`` /
``backward_sequence`` with torch's GEMM engine (so the same bits), except the final state's
gradient on the stepped path of one length, added by torch instead of the backend's add
kernel, and the bias gradient, torch's reduction. Where the driver refuses a fused launch (a
16-block cluster), the call runs on the stepped path, as the backend's does.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .._cuda import cluster_kernels, fused as _fused, sequence as _sequence
from .._cuda.elementwise import launch
from .._cuda.packed import hidden_inputs, unpermuted
from .._packing import block_steps, pack_rows, unpack_rows
from . import _cuda_packed, _interop, _torch_gemm
from ._interop import rows as _rows

__all__ = ["forward", "backward", "fused_runs"]


def _permuted(t, perm):
    """``t`` (batch, ...) in the sorted order of a plan (``perm``: its device ``perm``, None for
    the identity), contiguous; None stays None."""
    if t is None:
        return None
    return t.contiguous() if perm is None else t[perm]


def forward(inputs, weights, bias, h0, c0, plan=None, keep=True, fused=False):
    """``(outputs, h_n, c_n, fused_ran, *kept)`` of a sequence, ``kept`` what the backward
    reads besides the arguments (the Function's layout, ``_sequence_function``): the hidden
    states (for a plan the packed rows (rows, S), left out where they are the outputs
    themselves), the gate pre-activations, the cells, the inputs as the backward reads them
    where they are not the argument (a contiguous copy, the gathered packed rows) and, with a
    plan, the sorted initial state; ``fused_ran``: whether the fused kernels ran (then so does
    the backward). With ``keep`` False (no backward to follow) ``(outputs, h_n, c_n)``, the
    same bits. ``fused``: the fused kernels where they run the state size, else the stepped
    path."""
    d = xp = None
    h0s, c0s = h0, c0           # (with a plan: in the sorted order)
    with _interop.launching(inputs.device):
        if plan is None:
            x = inputs.contiguous()
        else:
            d = _interop.plan_arrays(plan, inputs)
            xp = _interop.TorchArrays(inputs.device)
            x = pack_rows(inputs, plan, d.t_index, d.b_index, d.data_index).contiguous()
            h0s, c0s = _permuted(h0, d.perm), _permuted(c0, d.perm)
        found = fused and _fused_forward(x, weights, bias, h0s, c0s, keep, plan, d, xp)
        ran = found is not False
        if not ran:
            found = (_stepped_forward(x, weights, bias, h0, c0, keep) if plan is None else
                     _cuda_packed.forward(x, weights, bias, h0s, c0s, plan, d, xp, keep))
    outputs, hs, gates, cells, h_n, c_n = found
    if plan is not None:
        h_n, c_n = unpermuted(torch, h_n, d.perm), unpermuted(torch, c_n, d.perm)
    if not keep:
        return outputs, h_n, c_n
    kept = [] if outputs is hs else [hs]
    kept += [gates, cells]
    if x is not inputs:
        kept.append(x)
    if plan is not None:        # (a view where it is the argument: autograd saves no input
        kept.append(h0s.view_as(h0s) if h0s is h0 else h0s)    # returned as it is)
    return (outputs, h_n, c_n, ran, *kept)


def fused_runs(like, state: int, fused: bool) -> bool:
    """Whether a sequence asked with ``fused`` on tensors like ``like`` runs the fused kernels,
    as :func:`forward` decides it (a launch the driver refused is not planned again, so that a
    later decision agrees)."""
    if not fused:
        return False
    with _interop.launching(like.device):
        return _fused.usable(state, _interop.KERNEL_DTYPE[like.dtype])


def _stepped_forward(inputs, weights, bias, h0, c0, keep):
    steps, batch, features = inputs.shape
    state = h0.shape[1]
    new = h0.new_empty
    x = inputs.view(steps * batch, features)
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

        _sequence.forward_steps(
            launch(_interop.KERNEL_DTYPE[inputs.dtype], n, state), steps, block, keep, project,
            recurrent, _rows(gates), _rows(hs), _rows(cells),
            b.data_ptr(), c.data_ptr())
    h_n = hs[steps].clone()
    c_n = c0.clone() if not steps else cells[(steps - 1) if keep else (steps - 1) % 2].clone()
    return (hs[1:], hs, gates, cells, h_n, c_n) if keep else (hs[1:], hs, None, None, h_n, c_n)


def _fused_forward(x, weights, bias, h0, c0, keep, plan, d, xp):
    """The fused forward (``_fused.forward_fused``'s on torch's buffers): (outputs, hidden
    states, gates, cells, h_n, c_n) (with a plan the packed rows, h_n and c_n in the sorted
    order); False where the state size does not fit or the driver refuses the launch (the
    stepped path runs). x: the inputs (steps, B, F) or the packed rows (rows, F), contiguous;
    h0, c0: (with a plan sorted) the initial state."""
    state = h0.shape[1]
    dtype = _interop.KERNEL_DTYPE[x.dtype]
    if not _fused.usable(state, dtype):
        return False
    if plan is None:
        steps, batch, features = x.shape
        x = x.view(steps * batch, features)
    else:
        steps, batch = len(plan.batch_sizes), len(plan.perm)
    try:        # planned first, before any work is queued (see _fused.forward_fused)
        launched = _fused.variant(batch, state, dtype, False, buffers=functools.partial(
            _interop.group_buffers, h0)) if batch and steps else None
    except cluster_kernels.LaunchRefused:       # no variant runs it now: the stepped path
        return False
    new = h0.new_empty
    row = state * h0.element_size()
    if plan is None:
        hs = new((steps + 1, batch, state))
        hs[0] = h0
        out_at = hs.data_ptr() + batch * row
        starts = range(0, (steps + 1) * batch, batch) if batch else [0] * (steps + 1)
        offsets, packed = hs.data_ptr(), np.int32(0)        # (offsets: not read)
    else:
        hs = new((plan.rows, state))
        out_at, starts = hs.data_ptr(), plan.offsets
        offsets, packed = d.offsets.data_ptr(), np.int32(1)
    # spans of steps, one launch each: every step at once, or (forward only) the stepped
    # path's blocks of steps
    block = steps if keep else min(steps, block_steps(batch, _sequence._BLOCK_ROWS))
    spans = [(t0, min(t0 + block, steps)) for t0 in range(0, steps, max(block, 1))]
    rows = max([starts[t1] - starts[t0] for t0, t1 in spans], default=0)
    gates, cells = new((rows, 3 * state)), new((rows, state))
    finals = ((new((batch, state)), new((batch, state))),
              (new((batch, state)), new((batch, state))))[: min(len(spans), 2)]
    w_x_t = weights[:, state:].t()
    mm = _torch_gemm._mm

    def project(r0, r1):    # the input projection of a span's steps, one GEMM
        mm(x[r0:r1], w_x_t, out=gates[: r1 - r0])

    if batch and spans:
        w, b, h, c = weights.contiguous(), bias.contiguous(), h0.contiguous(), c0.contiguous()
        try:
            _fused.launch_forward(
                launched, spans, starts, project, w.data_ptr(), weights.shape[1], b.data_ptr(),
                gates.data_ptr(), h.data_ptr(), c.data_ptr(), out_at, row, cells.data_ptr(),
                [(hn.data_ptr(), cn.data_ptr()) for hn, cn in finals], offsets, packed, batch,
                state)
        except cluster_kernels.LaunchRefused:   # recorded, not planned again: the stepped path
            return False
    elif spans:                                 # no batch: the input projections only
        for t0, t1 in spans:
            project(starts[t0], starts[t1])
    if spans:
        h_n, c_n = finals[(len(spans) - 1) % 2]
    else:                                       # no step: the final state is the initial one
        h_n, c_n = (hs[0] if plan is None else h0).clone(), c0.clone()
    if plan is None:
        outputs = hs[1:]
        if keep:
            gates, cells = gates.view(steps, batch, 3 * state), cells.view(steps, batch, state)
    else:
        outputs = unpack_rows(hs, plan, xp, d.t_index, d.b_index, d.data_index)
    return (outputs, hs, gates, cells, h_n, c_n) if keep else (outputs, hs, None, None, h_n, c_n)


def backward(grad_outputs, grad_h_n, grad_c_n, x, hs, gates, cells, weights, bias_shape,
             needed, fused=False, plan=None, h0s=None):
    """``(d_inputs, d_weights, d_bias, d_h0, d_c0)`` (None where ``needed`` says so) of a
    sequence from what :func:`forward` kept (``fused``: its fused kernels ran); x: the inputs
    as the backward reads them ((steps, batch, features), or the packed rows); with a plan,
    ``h0s``: the sorted initial state."""
    need_x, need_w, need_b, need_h0, need_c0 = needed
    d = xp = None
    with _interop.launching(cells.device):
        ghn, gcn = grad_h_n, grad_c_n
        if plan is not None:
            d = _interop.plan_arrays(plan, cells)
            xp = _interop.TorchArrays(cells.device)
            ghn, gcn = _permuted(grad_h_n, d.perm), _permuted(grad_c_n, d.perm)
        found = None
        if fused:
            go = grad_outputs
            if plan is not None and go is not None:
                go = pack_rows(go, plan, d.t_index, d.b_index, d.data_index)
            found = _fused_backward(go, ghn, gcn, gates, cells, weights, plan, d)
        if found is None:
            found = (_stepped_backward(grad_outputs, ghn, gcn, gates, cells, weights)
                     if plan is None else _cuda_packed.backward(
                         grad_outputs, ghn, gcn, hs, gates, cells, weights, plan, d, xp))
        d_gates, d_h0, d_c0 = found
        state = weights.shape[0] // 3
        flat = d_gates.view(-1, 3 * state)
        x2 = x.view(-1, x.shape[-1])
        if need_w:
            h_in = (hs[:-1].reshape(-1, state) if plan is None
                    else hidden_inputs(xp, plan, d, h0s, hs))
    new, mm = cells.new_empty, _torch_gemm._mm
    d_weights = d_bias = d_inputs = None
    if need_w:
        d_weights = new(weights.shape)
        mm(flat.t(), h_in, out=d_weights[:, :state])
        mm(flat.t(), x2, out=d_weights[:, state:])
    if need_b:
        d_bias = flat.sum(0).reshape(bias_shape)
    if need_x:
        d_inputs = mm(flat, weights[:, state:], out=new((flat.shape[0], x2.shape[1])))
        d_inputs = (d_inputs.view(x.shape) if plan is None else
                    unpack_rows(d_inputs, plan, xp, d.t_index, d.b_index, d.data_index))
    if plan is not None:
        d_h0, d_c0 = unpermuted(torch, d_h0, d.perm), unpermuted(torch, d_c0, d.perm)
    return d_inputs, d_weights, d_bias, d_h0 if need_h0 else None, d_c0 if need_c0 else None


def _stepped_backward(grad_outputs, grad_h_n, grad_c_n, gates, cells, weights):
    """(d_gates (steps, B, 3S), d_h0, d_c0) by the per-step loop."""
    steps, batch, state = cells.shape
    new = cells.new_empty
    # grad_h of every step, accumulated into: the outputs' gradient, the final state's
    grad_h = (cells.new_zeros((steps, batch, state)) if grad_outputs is None
              else grad_outputs.clone(memory_format=torch.contiguous_format))
    if steps and grad_h_n is not None:
        grad_h[steps - 1] += grad_h_n
    d_gates = new((steps, batch, 3 * state))
    w_h = weights[:, :state]
    if steps and batch:
        buffers = new((2, batch, state))
        gc = None if grad_c_n is None else grad_c_n.contiguous()
        addmm_ = _torch_gemm._addmm_

        def recurrent(t, j):
            addmm_(grad_h[j], d_gates[t], w_h)

        _sequence.backward_steps(
            launch(_interop.KERNEL_DTYPE[cells.dtype], batch * state, state), steps, recurrent,
            _rows(grad_h), _rows(cells), _rows(gates),
            _rows(d_gates), _rows(buffers), None if gc is None else gc.data_ptr())
        return (d_gates, _torch_gemm._mm(d_gates[0], w_h, out=new((batch, state))),
                buffers[(steps - 1) % 2].clone())
    if steps:                   # no batch
        return d_gates, new((batch, state)), new((batch, state))
    # no step: the final state is the initial one
    return (d_gates, cells.new_zeros((batch, state)) if grad_h_n is None else grad_h_n.clone(),
            cells.new_zeros((batch, state)) if grad_c_n is None else grad_c_n.clone())


def _fused_backward(grad_out, grad_h_n, grad_c_n, gates, cells, weights, plan, d):
    """(d_gates, d_h0, d_c0) by the fused backward kernel (with a plan: ``grad_out`` the packed
    rows, the final state's gradients and the results in the sorted order), or None where the
    fused kernels do not run the state size now (checked as the forward checks it: a cluster
    size refused since the forward, a failed occupancy query) or the driver refuses its launch
    (the forward's saved values are the stepped path's: the caller runs that)."""
    state = weights.shape[0] // 3
    if plan is None:
        steps, batch = cells.shape[:2]
    else:
        steps, batch = len(plan.batch_sizes), len(plan.perm)
    dtype = _interop.KERNEL_DTYPE[cells.dtype]
    if not _fused.usable(state, dtype):
        return None
    try:        # planned first, before any work is queued (see _fused.forward_fused)
        launched = _fused.variant(batch, state, dtype, True, buffers=functools.partial(
            _interop.group_buffers, cells)) if batch else None
    except cluster_kernels.LaunchRefused:       # no variant runs it now
        return None
    new = cells.new_empty
    d_gates = new(gates.shape)
    d_h0, d_c0 = new((batch, state)), new((batch, state))
    if batch:
        go, ghn, gcn = (None if g is None else g.contiguous()
                        for g in (grad_out, grad_h_n, grad_c_n))
        w = weights.contiguous()
        offsets, packed = ((cells.data_ptr(), np.int32(0)) if plan is None else   # (not read)
                           (d.offsets.data_ptr(), np.int32(1)))
        try:
            _fused.launch_backward(
                launched, w.data_ptr(), weights.shape[1], gates.data_ptr(), cells.data_ptr(),
                None if go is None else go.data_ptr(), None if ghn is None else ghn.data_ptr(),
                None if gcn is None else gcn.data_ptr(), d_gates.data_ptr(), d_h0.data_ptr(),
                d_c0.data_ptr(), offsets, packed, steps, batch, state)
        except cluster_kernels.LaunchRefused:   # the driver refused the launch
            return None
    return d_gates, d_h0, d_c0
