"""The CUDA path's sequences of one length in the torch layer: the buffers ``torch.empty``
tensors, the GEMMs torch's, and the CUDA backend's launches on the buffers' device pointers, on
torch's current stream: the per-step loops (``lltm_cupy._cuda.sequence.forward_steps`` /
``backward_steps``) or, with ``fused``, the fused sequence kernels
(``lltm_cupy._cuda.fused.launch_forward`` / ``launch_backward``). No CuPy array, DLPack import or
allocator callback per call: what the sequence Function runs on CUDA for sequences of one length
each way (variable lengths, and the fused kernels' group variant on sm_80 to sm_89, go through
the CuPy backend's arrays, ``_interop.cuda_call``).

The same device work, in the same order, as the CuPy backend's ``forward_sequence`` /
``backward_sequence`` with torch's GEMM engine (so the same bits), except the final state's
gradient on the stepped path, added by torch instead of the backend's add kernel, and the bias
gradient, torch's reduction. Where the driver refuses a fused launch (a 16-block cluster), the
call runs on the stepped path, as the backend's does.
"""
from __future__ import annotations

import numpy as np
import torch

from .._cuda import cluster_kernels, fused as _fused, fused_cluster, kernels, sequence as _sequence
from .._cuda.elementwise import launch
from .._packing import block_steps
from . import _interop, _torch_gemm

__all__ = ["forward", "backward", "route"]


def _pointer_step(t):
    """(device pointer, stride of the first dimension in bytes) of a contiguous tensor."""
    return t.data_ptr(), t.stride(0) * t.element_size()


#: what :func:`forward` returns where ``fused=True`` would run the fused kernels' group variant
GROUP = None


def forward(inputs, weights, bias, h0, c0, keep=True, fused=False):
    """``(hs, h_n, c_n, gates, cells, fused_ran)``: hs (steps + 1, B, S) = [h0, outputs...];
    gates (steps, B, 3S) and cells (steps, B, S) with ``keep`` (what the backward reads), else
    None; ``fused_ran``: whether the fused kernels ran (then so does the backward). ``fused``:
    the fused kernels where they fit, else the stepped path; :data:`GROUP` where they run as
    their group variant (sm_80 to sm_89, W_h over several blocks), whose exchange buffers the
    CuPy backend allocates: the caller runs such a call through the backend's arrays."""
    with _interop.launching(inputs.device):
        if fused:
            found = _fused_forward(inputs, weights, bias, h0, c0, keep)
            if found is GROUP:
                return GROUP
            if found is not False:
                return (*found, True)
        return (*_stepped_forward(inputs, weights, bias, h0, c0, keep), False)


def route(like, state: int, fused: bool) -> tuple:
    """``(fused_ran, native)`` of a sequence of one length asked with ``fused`` on tensors like
    ``like``, as :func:`forward` decides it (a launch the driver refused is not planned again,
    so that a later decision agrees): whether the fused kernels run, and whether on torch's
    buffers (not the group variant's backend arrays)."""
    if not fused:
        return False, True
    with _interop.launching(like.device):
        kind = _fused_runs(state, _interop.KERNEL_DTYPE[like.dtype])
    return kind is not False, kind is not GROUP


def _stepped_forward(inputs, weights, bias, h0, c0, keep):
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

        _sequence.forward_steps(
            launch(_interop.KERNEL_DTYPE[inputs.dtype], n, state), steps, block, keep, project,
            recurrent, _pointer_step(gates), _pointer_step(hs), _pointer_step(cells),
            b.data_ptr(), c.data_ptr())
    h_n = hs[steps].clone()
    c_n = c0.clone() if not steps else cells[(steps - 1) if keep else (steps - 1) % 2].clone()
    return (hs, h_n, c_n, gates, cells) if keep else (hs, h_n, c_n, None, None)


def _fused_runs(state: int, dtype):
    """Whether the fused kernels run ``state`` in ``dtype`` on the current device now, on
    torch's buffers (True), in their group variant (:data:`GROUP`), or not at all (False)."""
    if not _fused.usable(state, dtype):
        return False
    if _fused.cluster_size(state, dtype) is not None and \
            not fused_cluster.uses_clusters(kernels.current_device()):
        return GROUP
    return True


def _fused_forward(inputs, weights, bias, h0, c0, keep):
    """The fused forward (``_fused.forward_fused``'s on torch's buffers); False where the state
    size does not fit or the driver refuses the launch (the stepped path runs), :data:`GROUP`
    where the group variant would run."""
    steps, batch, features = inputs.shape
    state = h0.shape[1]
    dtype = _interop.KERNEL_DTYPE[inputs.dtype]
    runs = _fused_runs(state, dtype)
    if runs is not True:
        return runs
    try:        # planned first, before any work is queued (see _fused.forward_fused)
        launched = _fused.variant(batch, state, dtype, False) if batch and steps else None
    except cluster_kernels.LaunchRefused:       # no variant runs it now: the stepped path
        return False
    new = h0.new_empty
    x = inputs.contiguous().view(steps * batch, features)
    hs = new((steps + 1, batch, state))
    hs[0] = h0
    # spans of steps, one launch each: every step at once, or (forward only) the stepped
    # path's blocks of steps; the rows of step t start at t * batch
    block = steps if keep else min(steps, block_steps(batch, _sequence._BLOCK_ROWS))
    spans = list(zip(range(0, steps, max(block, 1)),
                     [*range(block, steps, max(block, 1)), steps] if steps else ()))
    starts = range(0, (steps + 1) * batch, batch) if batch else [0] * (steps + 1)
    rows = block * batch
    gates, cells = new((rows, 3 * state)), new((rows, state))
    finals = ((new((batch, state)), new((batch, state))),
              (new((batch, state)), new((batch, state))))[: min(len(spans), 2)]
    w_x_t = weights[:, state:].t()
    mm = _torch_gemm._mm

    def project(r0, r1):    # the input projection of a span's steps, one GEMM
        mm(x[r0:r1], w_x_t, out=gates[: r1 - r0])

    if batch and spans:
        w, b, c = weights.contiguous(), bias.contiguous(), c0.contiguous()
        pointers = [(finals[0][0].data_ptr(), finals[0][1].data_ptr())]
        if len(finals) > 1:
            pointers.append((finals[1][0].data_ptr(), finals[1][1].data_ptr()))
        try:
            _fused.launch_forward(
                launched, spans, starts, project, w.data_ptr(),
                weights.shape[1], b.data_ptr(), gates.data_ptr(), hs.data_ptr(), c.data_ptr(),
                hs[1].data_ptr(), state * hs.element_size(), cells.data_ptr(), pointers,
                hs.data_ptr(), np.int32(0), batch, state)      # (offsets: not read)
        except cluster_kernels.LaunchRefused:   # recorded, not planned again: the stepped path
            return False
    elif spans:                                 # no batch: the input projections only
        for t0, t1 in spans:
            project(starts[t0], starts[t1])
    if spans:
        h_n, c_n = finals[(len(spans) - 1) % 2]
    else:                                       # no step: the final state is the initial one
        h_n, c_n = hs[0].clone(), c0.clone()
    if not keep:
        return hs, h_n, c_n, None, None
    return (hs, h_n, c_n, gates.view(steps, batch, 3 * state), cells.view(steps, batch, state))


def backward(grad_outputs, grad_h_n, grad_c_n, x, hs, gates, cells, weights, bias_shape,
             needed, fused=False):
    """``(d_inputs, d_weights, d_bias, d_h0, d_c0)`` (None where ``needed`` says so) of a
    sequence of one length from what :func:`forward` kept (``fused``: its fused kernels ran);
    x: the inputs (steps * batch, features)."""
    with _interop.launching(cells.device):
        found = None
        if fused:
            found = _fused_backward(grad_outputs, grad_h_n, grad_c_n, hs, gates, cells, weights)
        if found is None:
            found = _stepped_backward(grad_outputs, grad_h_n, grad_c_n, gates, cells, weights)
    d_gates, d_h0, d_c0 = found
    steps, batch, state = cells.shape
    need_x, need_w, need_b, need_h0, need_c0 = needed
    flat = d_gates.view(steps * batch, 3 * state)
    new, mm = cells.new_empty, _torch_gemm._mm
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
            _pointer_step(grad_h), _pointer_step(cells), _pointer_step(gates),
            _pointer_step(d_gates), _pointer_step(buffers), None if gc is None else gc.data_ptr())
        return (d_gates, _torch_gemm._mm(d_gates[0], w_h, out=new((batch, state))),
                buffers[(steps - 1) % 2].clone())
    if steps:                   # no batch
        return d_gates, new((batch, state)), new((batch, state))
    # no step: the final state is the initial one
    return (d_gates, cells.new_zeros((batch, state)) if grad_h_n is None else grad_h_n.clone(),
            cells.new_zeros((batch, state)) if grad_c_n is None else grad_c_n.clone())


def _fused_backward(grad_outputs, grad_h_n, grad_c_n, hs, gates, cells, weights):
    """(d_gates, d_h0, d_c0) by the fused backward kernel, or None where the fused kernels do not
    run the state size on torch's buffers now (checked as the forward checks it: a cluster size
    refused since the forward, a failed occupancy query) or the driver refuses its launch (the
    forward's saved values are the stepped path's: the caller runs that)."""
    steps, batch, state = cells.shape
    dtype = _interop.KERNEL_DTYPE[cells.dtype]
    if _fused_runs(state, dtype) is not True:
        return None
    try:        # planned first, before any work is queued (see _fused.forward_fused)
        launched = _fused.variant(batch, state, dtype, True) if batch else None
    except cluster_kernels.LaunchRefused:       # no variant runs it now
        return None
    new = cells.new_empty
    d_gates = new((steps, batch, 3 * state))
    d_h0, d_c0 = new((batch, state)), new((batch, state))
    if batch:
        go = None if grad_outputs is None else grad_outputs.contiguous()
        ghn = None if grad_h_n is None else grad_h_n.contiguous()
        gcn = None if grad_c_n is None else grad_c_n.contiguous()
        w = weights.contiguous()
        try:
            _fused.launch_backward(
                launched, w.data_ptr(), weights.shape[1], gates.data_ptr(), cells.data_ptr(),
                None if go is None else go.data_ptr(), None if ghn is None else ghn.data_ptr(),
                None if gcn is None else gcn.data_ptr(), d_gates.data_ptr(), d_h0.data_ptr(),
                d_c0.data_ptr(), hs.data_ptr(), np.int32(0), steps, batch, state)
        except cluster_kernels.LaunchRefused:   # the driver refused the launch
            return None
    return d_gates, d_h0, d_c0
