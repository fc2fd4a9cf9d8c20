"""GPU backend, variable-length sequences (``forward_sequence`` / ``backward_sequence`` with a
packing plan of :mod:`lltm_cupy._packing`).

Per step the rows still running are a prefix of the sorted batch and a contiguous block of the
packed arrays, so every GEMM and kernel launch is the fixed-length one on fewer rows: the CUDA
kernels need nothing new. The gathers and scatters are CuPy's advanced indexing with the plan's
index arrays on the device (uploaded once per plan and device, :meth:`Plan.device_arrays`): in
steady state a call copies nothing between host and device and never waits for the device.
Every step runs on pointers at its row offset into the packed buffers (as the fixed-length loop
of :mod:`.sequence`): one GEMM and one launch, no view or allocation. Where sequences end, the
backward makes the incoming cell gradient there (an array), and the forward only copies their
final h and c by two device-to-device copies on pointers (no object).

Forward only (``keep=False``), no array grows with the packed rows but the outputs and the packed
copy of the inputs: each step's hidden state is written where the outputs want it, straight into
them where its rows are contiguous there, else into a buffer of a few steps' rows that one
scatter puts into the outputs when it is full.

The caller (:mod:`.sequence`) passes the CuPy module, the GEMM and its block size.
"""
from __future__ import annotations

from .elementwise import FLAG, launch
from .gemm import d_bias as bias_gradient, row_steps
from .kernels import on_device
from .._packing import incoming_cell_grad, pack_rows, unpack_rows
from .._types import LLTMSequenceGrads, LLTMSequenceSaved


def _index(cupy, plan, device_id):
    """The plan's index arrays on ``device_id``; refused while a graph is being captured unless
    they are there already (before any work of the call is queued)."""
    capturing = cupy.cuda.get_current_stream().is_capturing()
    return plan.device_arrays(cupy, device_id, capturing)


def hidden_inputs(cupy, plan, d, h0s, out):
    """The hidden state each packed row read (rows, state): ``h0s`` (the sorted initial state)
    for step 0's rows, then the packed outputs ``out`` of the previous step, in one gather by
    ``d.prev`` (not a concatenation of the steps, which CuPy does above 8 parts with an upload
    of their pointers: refused under CUDA-graph capture). ``d``: the plan's device arrays."""
    sizes = plan.batch_sizes
    h_in = cupy.empty((plan.rows, out.shape[1]), out.dtype)
    if sizes:
        h_in[: sizes[0]] = h0s[: sizes[0]]
    if d.prev is not None:
        h_in[sizes[0]:] = out[d.prev]
    return h_in


def _permuted(a, perm):
    return a if perm is None or a is None else a[perm]


#: Forward only, where the outputs need a scatter: the hidden states of this many steps of the
#: whole batch (rows) are gathered before one scatter puts them into the outputs
SCATTER_STEPS = 4


def _forward_only_outputs(cupy, plan, d, state, dtype):
    """Forward only: (outputs, hs, h_rows, scatter, after). The forward kernel writes step
    tau's hidden state into rows ``h_rows[tau]`` onwards of ``hs``, a C-contiguous (rows, state)
    array (step tau + 1's recurrent GEMM reads it there); after a step tau in ``after``,
    ``scatter(*after[tau])`` puts the packed rows r0:r1, then in ``hs[:r1 - r0]``, into
    ``outputs``.

    Straight into the outputs where step tau's rows are contiguous there: a PackedSequence's data
    in the forward direction (the packed rows themselves), and the padded (T, B, S) outputs when
    the sort order is the caller's and the direction forward (``outputs[tau, :n]``). Otherwise
    the packed rows of :data:`SCATTER_STEPS` steps (of the whole batch; more steps as sequences
    end) one after the other in ``hs``, then scattered into the outputs in one go by the plan's
    index arrays (slices of the device copies: no upload), and the next steps written from row
    0 again: the first of them reads the previous step's rows by its GEMM before its kernel
    writes (stream order)."""
    sizes, offsets, batch = plan.batch_sizes, plan.offsets, len(plan.perm)
    if plan.packed_io:
        outputs = cupy.empty((plan.rows, state), dtype)   # every row is written
        if d.data_index is None:
            return outputs, outputs, offsets, None, {}
    else:
        outputs = cupy.zeros((plan.steps, batch, state), dtype)     # zeros at padded positions
        if d.perm is None and not plan.reverse:
            return (outputs, outputs.reshape(plan.steps * batch, state),
                    range(0, len(sizes) * batch, batch), None, {})
    hs = cupy.empty((min(SCATTER_STEPS * batch, plan.rows), state), dtype)

    def scatter(r0, r1):
        if plan.packed_io:
            outputs[d.data_index[r0:r1]] = hs[: r1 - r0]
        else:
            outputs[d.t_index[r0:r1], d.b_index[r0:r1]] = hs[: r1 - r0]

    h_rows, after, row, first = [], {}, 0, 0
    for tau, n in enumerate(sizes):
        if row + n > len(hs):               # hs is full: scatter, then start from row 0
            after[tau - 1] = (first, offsets[tau])
            row, first = 0, offsets[tau]
        h_rows.append(row)
        row += n
    if sizes:
        after[len(sizes) - 1] = (first, plan.rows)
    return outputs, hs, h_rows, scatter, after


def _forward_only_steps(cupy, plan, d, blocks, x, w_x_t, w_h_t, bias, h0s, c0s, gemm):
    """The steps of a packed forward only, on pointers: (outputs, h_sorted, c_sorted), the
    latter two each sorted sequence's state after its last step (h0s, c0s for length 0).

    Each step's rows of one block's gate pre-activations, of the hidden states (written where
    :func:`_forward_only_outputs` says) and of two (batch, state) cell buffers taken in turn (the
    kernel's old_cell and new_cell may not alias) at their offsets: one GEMM and one launch, no
    view or allocation; where sequences end, their rows of h and c go into h_sorted, c_sorted
    by two device-to-device copies on pointers (no object either). Per block of steps: its
    input projection in one GEMM. Where the outputs need a scatter, one every
    :data:`SCATTER_STEPS` steps or more."""
    sizes, offsets = plan.batch_sizes, plan.offsets
    batch, state = len(plan.perm), h0s.shape[1]
    dtype = x.dtype
    outputs, hs, h_rows, scatter, after = _forward_only_outputs(cupy, plan, d, state, dtype)
    h_sorted, c_sorted = h0s.copy(), c0s.copy()
    if not plan.rows:
        return outputs, h_sorted, c_sorted
    widest = max(offsets[b] - offsets[a] for a, b in blocks)
    gates = cupy.empty((widest, 3 * state), dtype)
    cells = cupy.empty((2, batch, state), dtype)
    c0_c = cupy.ascontiguousarray(c0s)
    g_at, h_at, c_at, b_ptr = (a.data.ptr for a in (gates, hs, cells, bias))
    hn_at, cn_at = h_sorted.data.ptr, c_sorted.data.ptr
    row, g_row, c_step = hs.strides[0], gates.strides[0], cells.strides[0]    # bytes
    copy, d2d = cupy.cuda.runtime.memcpyAsync, cupy.cuda.runtime.memcpyDeviceToDevice
    stream = cupy.cuda.get_current_stream().ptr
    taus, c_in = len(sizes), c0_c.data.ptr
    with row_steps(gemm, hs, w_h_t, gates, accumulate=True) as recurrent:
        for tau0, tau1 in blocks:
            r0, r1 = offsets[tau0], offsets[tau1]
            gemm(x[r0:r1], w_x_t, gates[: r1 - r0])     # the block's input projection
            for tau in range(tau0, tau1):
                n, j = sizes[tau], offsets[tau] - r0    # j: the step's first row of gates
                if tau:
                    recurrent(h_rows[tau - 1], j, n)    # gates[j:] += h of the previous step
                else:
                    gemm(h0s[:n], w_h_t, gates[:n], accumulate=True)
                h_out, c_out = h_at + h_rows[tau] * row, c_at + (tau & 1) * c_step
                run = launch(dtype, n * state, state)
                run.kernels.fwd(run.grid, run.block, (
                    g_at + j * g_row, b_ptr, c_in, h_out, c_out, run.n, run.state))
                c_in = c_out
                nxt = sizes[tau + 1] if tau + 1 < taus else 0
                if nxt < n:                    # sequences ending at this step
                    copy(hn_at + nxt * row, h_out + nxt * row, (n - nxt) * row, d2d, stream)
                    copy(cn_at + nxt * row, c_out + nxt * row, (n - nxt) * row, d2d, stream)
                if tau in after:               # where the outputs need a scatter
                    scatter(*after[tau])
    return outputs, h_sorted, c_sorted


def forward_packed(cupy, inputs, weights, bias, h0, c0, gemm, plan, keep=True,
                   block_rows=2048):
    from .._packing import step_blocks

    state = h0.shape[1]
    dtype = inputs.dtype
    rows = plan.rows
    batch = len(plan.perm)
    with on_device(inputs.data.device_id):
        d = _index(cupy, plan, inputs.device.id)
        index = (d.t_index, d.b_index, d.data_index)
        x = cupy.ascontiguousarray(pack_rows(inputs, plan, *index))      # (N, F)
        blocks = step_blocks(plan.offsets, block_rows)
        h0s, c0s = _permuted(h0, d.perm), _permuted(c0, d.perm)
        w_x_t, w_h_t = weights[:, state:].T, weights[:, :state].T
        bias_c = cupy.ascontiguousarray(bias.reshape(-1))
        if not keep:
            outputs, h_sorted, c_sorted = _forward_only_steps(
                cupy, plan, d, blocks, x, w_x_t, w_h_t, bias_c, h0s, c0s, gemm)
        else:
            # every packed row's gate pre-activations, hidden state and cell (the backward reads
            # them)
            gates = cupy.empty((rows, 3 * state), dtype)
            out = cupy.empty((rows, state), dtype)
            cells = cupy.empty((rows, state), dtype)
            _forward_steps(cupy, plan, blocks, x, w_x_t, w_h_t, bias_c, h0s, c0s, gates, out,
                           cells, gemm)
            outputs = unpack_rows(out, plan, cupy, *index)
            ended = plan.ended  # the sequences with a last step: a prefix of the sorted order
            if rows and ended == batch:
                h_sorted, c_sorted = out[d.last], cells[d.last]
            else:
                h_sorted, c_sorted = h0s.copy(), c0s.copy()
                if rows:
                    h_sorted[:ended] = out[d.last]
                    c_sorted[:ended] = cells[d.last]
        if d.perm is None:
            h_n, c_n = h_sorted, c_sorted
        else:
            h_n, c_n = cupy.empty_like(h_sorted), cupy.empty_like(c_sorted)
            h_n[d.perm] = h_sorted
            c_n[d.perm] = c_sorted
    if not keep:
        return outputs, h_n, c_n, None
    saved = LLTMSequenceSaved("cupy", x, out, gates, cells, weights, tuple(bias.shape),
                              plan=plan, h0=h0s)
    return outputs, h_n, c_n, saved


def backward_packed(cupy, grad_outputs, grad_h_n, grad_c_n, saved, needed, gemm):
    plan, x, gates, cells, out, weights = (saved.plan, saved.inputs, saved.gates, saved.cells,
                                           saved.hs, saved.weights)
    rows, state = out.shape
    batch, features = len(plan.perm), x.shape[1]
    dtype = out.dtype
    with on_device(out.data.device_id):
        d = _index(cupy, plan, out.device.id)
        index, perm = (d.t_index, d.b_index, d.data_index), d.perm
        if grad_outputs is None:
            grad_h = cupy.zeros((rows, state), dtype)
        else:   # written below: a copy, also where the packed rows are grad_outputs itself
            grad_h = pack_rows(grad_outputs, plan, *index)
            grad_h = (cupy.array(grad_h, order="C") if grad_h is grad_outputs
                      else cupy.ascontiguousarray(grad_h))
        ended = plan.ended
        ghn, gcn = _permuted(grad_h_n, perm), _permuted(grad_c_n, perm)
        if ghn is not None and ended and rows:
            part = grad_h[d.last]
            run = launch(dtype, part.size, state)
            run.kernels.add(run.grid, run.block, (
                part, cupy.ascontiguousarray(ghn[:ended]), run.n))
            grad_h[d.last] = part
        flat = cupy.empty((rows, 3 * state), dtype)
        w_h = weights[:, :state]
        sizes = plan.batch_sizes
        d_c = d_h_first = None
        if sizes:
            d_c, d_h_first = _backward_steps(cupy, plan, grad_h, gates, cells, flat, w_h, gcn,
                                             gemm)
        d_h0s = cupy.zeros((batch, state), dtype) if ghn is None else cupy.array(ghn)
        d_c0s = cupy.zeros((batch, state), dtype) if gcn is None else cupy.array(gcn)
        if sizes:
            d_h0s[: sizes[0]] = d_h_first
            d_c0s[: sizes[0]] = d_c
        if perm is None:
            d_h0, d_c0 = d_h0s, d_c0s
        else:
            d_h0, d_c0 = cupy.empty_like(d_h0s), cupy.empty_like(d_c0s)
            d_h0[perm] = d_h0s
            d_c0[perm] = d_c0s
        need_x, need_w, need_b, need_h0, need_c0 = needed
        d_weights = d_bias = d_inputs = None
        if need_w:
            h_in = hidden_inputs(cupy, plan, d, saved.h0, out)
            d_weights = cupy.empty(weights.shape, dtype)
            gemm(flat.T, h_in, d_weights[:, :state])
            gemm(flat.T, x, d_weights[:, state:])
        if need_b:
            d_bias = bias_gradient(cupy, flat, saved.bias_shape, gemm)
        if need_x:
            d_inputs = unpack_rows(gemm(flat, weights[:, state:],
                                        cupy.empty((rows, features), dtype)), plan, cupy, *index)
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0 if need_h0 else None,
                             d_c0 if need_c0 else None)


def _forward_steps(cupy, plan, blocks, x, w_x_t, w_h_t, bias, h0s, c0s, gates, out, cells,
                   gemm):
    """The steps of a packed forward that keeps everything for the backward, on pointers: each
    step's rows of the packed ``gates``, ``out`` (hidden states) and ``cells`` at its row offset,
    no view or allocation per step; one input-projection GEMM per block of steps."""
    sizes, offsets = plan.batch_sizes, plan.offsets
    state, dtype = out.shape[1], out.dtype
    c0_c = cupy.ascontiguousarray(c0s)
    g_at, h_at, c_at, b_ptr = (a.data.ptr for a in (gates, out, cells, bias))
    row, g_row = out.strides[0], gates.strides[0]      # bytes per packed row
    with row_steps(gemm, out, w_h_t, gates, accumulate=True) as recurrent:
        for tau0, tau1 in blocks:
            r0, r1 = offsets[tau0], offsets[tau1]
            gemm(x[r0:r1], w_x_t, gates[r0:r1])     # the block's input projection
            for tau in range(tau0, tau1):
                n, r = sizes[tau], offsets[tau]
                if tau:
                    prev = offsets[tau - 1]
                    recurrent(prev, r, n)          # gates[rows] += out[previous rows] @ W_h.T
                    c_in = c_at + prev * row
                else:
                    gemm(h0s[:n], w_h_t, gates[:n], accumulate=True)
                    c_in = c0_c.data.ptr
                run = launch(dtype, n * state, state)
                run.kernels.fwd(run.grid, run.block, (
                    g_at + r * g_row, b_ptr, c_in, h_at + r * row, c_at + r * row, run.n,
                    run.state))


def _backward_steps(cupy, plan, grad_h, gates, cells, flat, w_h, gcn, gemm):
    """The recurrence of a packed backward, last step first, on pointers: each step's rows of
    the packed buffers at its row offset, no view or allocation but where sequences end (the
    incoming cell gradient there). Writes every step's d_gates into ``flat`` and adds each
    step's recurrent gradient into the previous step's rows of ``grad_h``; returns (the cell
    gradient and the hidden-state gradient of step 0's rows)."""
    sizes, offsets = plan.batch_sizes, plan.offsets
    batch, state = len(plan.perm), cells.shape[1]
    dtype = cells.dtype
    # the cell gradient each step passes back: two (batch, state) buffers taken in turn, never
    # the one read as grad_cell (restrict)
    buffers = cupy.empty((2, batch, state), dtype)
    passed = (buffers.data.ptr, buffers.data.ptr + buffers.strides[0])
    gh_at, cell_at, g_at, flat_at = (a.data.ptr for a in (grad_h, cells, gates, flat))
    row, g_row = cells.strides[0], gates.strides[0]     # bytes per packed row
    last = None                 # which buffer holds the gradient the last step passed back
    with row_steps(gemm, flat, w_h, grad_h, accumulate=True) as recurrent:
        for i, tau in enumerate(range(len(sizes) - 1, -1, -1)):
            n, nxt = sizes[tau], sizes[tau + 1] if tau + 1 < len(sizes) else 0
            r0 = offsets[tau]
            if last is not None and nxt == n:   # no sequence ends at this step
                held, dc_in = None, passed[last]
            else:       # the cell gradient entering the step (an array only where sequences end)
                held = incoming_cell_grad(cupy, None if last is None else buffers[last, :nxt],
                                          gcn, n, nxt, state, dtype)
                dc_in = None if held is None else held.data.ptr
            cell_t = cell_at + r0 * row
            run = launch(dtype, n * state, state)
            run.kernels.bwd(run.grid, run.block, (
                gh_at + r0 * row, cell_t if dc_in is None else dc_in, g_at + r0 * g_row, cell_t,
                flat_at + r0 * g_row, passed[i % 2], FLAG[1], FLAG[dc_in is not None], run.n,
                run.state))
            last = i % 2
            if tau:
                recurrent(r0, offsets[tau - 1], n)   # grad_h[prev rows] += flat[rows] @ W_h
    n = sizes[0]
    d_h_first = gemm(flat[:n], w_h, cupy.empty((n, state), dtype))
    return buffers[last, :n], d_h_first
