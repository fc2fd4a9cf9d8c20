"""The CUDA backend's sequences: the per-step loop of fixed-length sequences each way, and the
choice of the variable-length (:mod:`.packed`) and fused (:mod:`.fused`) paths.

Device work per call (the launch budget ``tests/budgets/test_launch_budget.py`` enforces): one GEMM
for every step's input projection (one per block of steps), then per step one GEMM plus the fused
kernel each way (and the add kernel once for a final-state gradient); the backward's weight,
bias and input gradients as one GEMM (or reduction) each over all steps.
"""
from __future__ import annotations

import dataclasses

from . import fused as _fused, packed as _packed
from .cluster_kernels import LaunchRefused
from .elementwise import FLAG, launch
from .gemm import gemm, parameter_grads, steps as gemm_steps
from .kernels import cupy_module, on_device
from .._packing import block_steps
from .._types import LLTMSequenceGrads, LLTMSequenceSaved

__all__ = ["forward_sequence", "backward_sequence", "forward_steps", "backward_steps"]


#: Rows of one block of a sequence's input projection (one GEMM per block of steps; the same
#: blocks with and without keep, so both give the same bits). Forward only, the gate
#: pre-activations live in one such block: 2048 * 3S values (25 MB at S = 1024 in float32).
#: Chosen, not measured on a GPU: a GEMM of 2048 rows fills a GPU of today, and one GEMM launch
#: per block of steps beside the per-step GEMM and kernel is a small share.
#: ``scripts/block_rows.py`` times it (and the peak memory) against other block sizes on a GPU.
_BLOCK_ROWS = 2048


def _fused_usable(device_id: int, state: int, dtype) -> bool:
    """Whether the fused kernels run ``state`` in ``dtype`` on device ``device_id`` (the arrays'
    device, which need not be the current one)."""
    with on_device(device_id):
        return _fused.usable(state, dtype)


def forward_sequence(inputs, weights, bias, h0, c0, plan=None, keep=True, fused=False):
    if fused and _fused_usable(inputs.data.device_id, h0.shape[1], inputs.dtype):
        try:
            return _fused.forward_fused(inputs, weights, bias, h0, c0, plan, keep,
                                        _BLOCK_ROWS)
        except LaunchRefused:   # recorded, the size not planned again: this call runs stepped
            pass
    cupy = cupy_module()
    if plan is not None:
        return _packed.forward_packed(cupy, inputs, weights, bias, h0, c0, plan, keep,
                                      _BLOCK_ROWS)
    steps, batch, features = inputs.shape
    state = h0.shape[1]
    dtype = inputs.dtype
    with on_device(inputs.data.device_id):
        x = cupy.ascontiguousarray(inputs).reshape(steps * batch, features)
        block = block_steps(batch, _BLOCK_ROWS)
        # keep: every step's gate pre-activations (the backward reads them); forward only: one
        # block's, reused block after block
        gates = cupy.empty((steps if keep else min(block, steps), batch, 3 * state), dtype)
        hs = cupy.empty((steps + 1, batch, state), dtype)   # [h0, h_1, ..., h_T]
        hs[0] = h0
        # keep: every step's cell; forward only: two (batch, state) buffers taken in turn (the
        # kernel's old_cell and new_cell may not alias)
        cells = cupy.empty((steps if keep else min(2, steps), batch, state), dtype)
        n = batch * state
        w_x_t = weights[:, state:].T
        if steps and n:
            bias_c, c0_c = cupy.ascontiguousarray(bias), cupy.ascontiguousarray(c0)

            def project(t0, k, j0):     # the input projection of a block of steps, one GEMM
                gemm(x[t0 * batch: (t0 + k) * batch], w_x_t,
                     gates[j0: j0 + k].reshape(k * batch, 3 * state))

            with gemm_steps(hs, weights[:, :state].T, gates, accumulate=True) as recurrent:
                forward_steps(launch(dtype, n, state), steps, block, keep, project, recurrent,
                              (gates.data.ptr, gates.strides[0]), (hs.data.ptr, hs.strides[0]),
                              (cells.data.ptr, cells.strides[0]), bias_c.data.ptr,
                              c0_c.data.ptr)
        h_n = hs[steps].copy() if steps else cupy.array(h0, dtype=dtype)
        if not steps:
            c_n = cupy.array(c0, dtype=dtype)
        else:
            c_n = cells[(steps - 1) if keep else (steps - 1) % 2].copy()
    if not keep:
        return hs[1:], h_n, c_n, None
    saved = LLTMSequenceSaved("cupy", x, hs, gates, cells, weights, tuple(bias.shape))
    return hs[1:], h_n, c_n, saved


def backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, needed=(True,) * 5):
    if saved.fused:
        # as the forward: fused only where the fused kernels run the state size now (a cluster
        # size refused since the forward, a failed occupancy query: the stepped path)
        if _fused_usable(saved.hs.data.device_id, saved.weights.shape[0] // 3, saved.hs.dtype):
            try:
                return _fused.backward_fused(grad_outputs, grad_h_n, grad_c_n, saved, needed)
            except LaunchRefused:   # the fused forward saved what the stepped backward reads
                pass
        saved = dataclasses.replace(saved, fused=False)
    cupy = cupy_module()
    if saved.plan is not None:
        return _packed.backward_packed(cupy, grad_outputs, grad_h_n, grad_c_n, saved, needed)
    x, hs, gates, cells, weights = saved.inputs, saved.hs, saved.gates, saved.cells, saved.weights
    steps, batch, state = cells.shape
    features = x.shape[1]
    dtype = cells.dtype
    with on_device(cells.data.device_id):
        # grad_h of every step; the recurrent GEMM of step t accumulates into step t - 1's.
        grad_h = (cupy.zeros((steps, batch, state), dtype) if grad_outputs is None
                  else cupy.array(grad_outputs, dtype=dtype, order="C"))
        if steps and grad_h_n is not None and batch:
            # the add kernel rather than CuPy's +=: it adds bfloat16 bits as numbers
            ghn = cupy.ascontiguousarray(grad_h_n)
            run = launch(dtype, batch * state, state)
            run.kernels.add(run.grid, run.block, (
                grad_h.data.ptr + (steps - 1) * grad_h.strides[0], ghn.data.ptr, run.n))
        d_gates = cupy.empty((steps, batch, 3 * state), dtype)
        n = batch * state
        d_c = None if grad_c_n is None else cupy.ascontiguousarray(grad_c_n)
        w_h = weights[:, :state]
        if steps and n:
            # the cell gradient of each step, two (batch, state) buffers taken in turn: never
            # the one read as grad_cell (restrict)
            buffers = cupy.empty((2, batch, state), dtype)
            with gemm_steps(d_gates, w_h, grad_h, accumulate=True) as recurrent:
                backward_steps(launch(dtype, n, state), steps, recurrent,
                               (grad_h.data.ptr, grad_h.strides[0]),
                               (cells.data.ptr, cells.strides[0]),
                               (gates.data.ptr, gates.strides[0]),
                               (d_gates.data.ptr, d_gates.strides[0]),
                               (buffers.data.ptr, buffers.strides[0]),
                               None if d_c is None else d_c.data.ptr)
            d_h0 = gemm(d_gates[0], w_h, cupy.empty((batch, state), dtype))
            d_c0 = buffers[(steps - 1) % 2].copy()
        elif steps:
            d_h0 = cupy.zeros((batch, state), dtype)
            d_c0 = cupy.zeros((batch, state), dtype)
        else:
            d_h0 = cupy.zeros((batch, state), dtype) if grad_h_n is None else cupy.array(grad_h_n)
            d_c0 = cupy.zeros((batch, state), dtype) if grad_c_n is None else cupy.array(grad_c_n)
        need_x, need_w, need_b, need_h0, need_c0 = needed
        d_inputs, d_weights, d_bias = parameter_grads(
            cupy, d_gates.reshape(steps * batch, 3 * state),
            hs[:-1].reshape(steps * batch, state), x, weights, saved.bias_shape, needed)
        if need_x:
            d_inputs = d_inputs.reshape(steps, batch, features)
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0 if need_h0 else None,
                             d_c0 if need_c0 else None)


# ---------------------------------------------- the per-step loops, on pointers (any engine)
# (on the current device and CuPy's current stream; the array API's and the torch layer's)

def forward_steps(run, steps, block, keep, project, recurrent, gates, hs, cells, bias,
                  c0) -> None:
    """The fixed-length forward's loop: per block of ``block`` steps ``project(t0, k, j0)`` (the
    input projection of steps t0 .. t0 + k into the gate rows j0 .., bias not included), then
    per step ``recurrent(t, j)`` (gates[j] += hs[t] @ W_h.T) and the fused kernel of ``run``
    (an ``elementwise.Launch``). ``gates``, ``hs``, ``cells``: (device pointer, stride in
    bytes) of the (steps or a block, B, 3S) pre-activations, the (steps + 1, B, S) hidden
    states [h0, h_1, ...] and the (steps or 2, B, S) cells; ``keep``: every step's gates and
    cell kept (else one block's gates, two cells in turn); ``bias``, ``c0``: pointers."""
    fwd, grid, block_dim, n64, s32 = run.kernels.fwd, run.grid, run.block, run.n, run.state
    g_at, g_step = gates
    h_at, h_step = hs
    c_at, c_step = cells
    c_in = c0
    for t0 in range(0, steps, block):
        k = min(block, steps - t0)
        project(t0, k, t0 if keep else 0)
        for t in range(t0, t0 + k):
            j = t if keep else t - t0          # this step's gates
            c_out = c_at + (t if keep else t % 2) * c_step
            recurrent(t, j)                    # gates[j] += hs[t] @ W_h.T
            fwd(grid, block_dim, (g_at + j * g_step, bias, c_in, h_at + (t + 1) * h_step, c_out,
                                  n64, s32))
            c_in = c_out


def backward_steps(run, steps, recurrent, grad_h, cells, gates, d_gates, buffers,
                   grad_c) -> None:
    """The fixed-length backward's loop: per step, last first, the backward kernel of ``run`` and
    (but for step 0) ``recurrent(t, t - 1)`` (grad_h[t - 1] += d_gates[t] @ W_h). (pointer,
    stride) pairs: ``grad_h`` (steps, B, S), the outputs' gradient with the final state's added
    (accumulated into), ``cells``, ``gates`` (steps, B, 3S), ``d_gates`` (steps, B, 3S),
    written, ``buffers`` (2, B, S), the cell gradient of each step in turn (the last step 0's);
    ``grad_c``: the pointer of the final cell state's gradient, or None (zero)."""
    bwd, grid, block, n64, s32 = run.kernels.bwd, run.grid, run.block, run.n, run.state
    gh_at, gh_step = grad_h
    cell_at, cell_step = cells
    g_at, g_step = gates
    dg_at, dg_step = d_gates
    out_c = (buffers[0], buffers[0] + buffers[1])
    dc_in = grad_c
    for i, t in enumerate(range(steps - 1, -1, -1)):
        cell_t = cell_at + t * cell_step
        bwd(grid, block, (gh_at + t * gh_step, cell_t if dc_in is None else dc_in,
                          g_at + t * g_step, cell_t, dg_at + t * dg_step, out_c[i % 2],
                          FLAG[1], FLAG[dc_in is not None], n64, s32))
        dc_in = out_c[i % 2]
        if t:
            recurrent(t, t - 1)        # grad_h[t - 1] += d_gates[t] @ W_h
