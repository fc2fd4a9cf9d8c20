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

The caller (:mod:`.sequence`) passes the CuPy module and its block size. The loops on
pointers (:func:`forward_rows`, :func:`backward_rows`), and the helpers that only allocate and
index (``xp``: anything with CuPy's ``empty(shape, dtype)`` and ``zeros(shape, dtype)``), serve
the torch layer too (torch tensors, torch's GEMMs: ``lltm_cupy.torch._cuda_packed``).
"""
from __future__ import annotations

from .elementwise import FLAG, launch
from .gemm import gemm, parameter_grads, row_steps
from .kernels import cupy_module, on_device
from .._packing import incoming_cell_grad, pack_rows, unpack_rows
from .._types import LLTMSequenceGrads, LLTMSequenceSaved


def _index(cupy, plan, device_id):
    """The plan's index arrays on ``device_id``; refused while a graph is being captured unless
    they are there already (before any work of the call is queued)."""
    stream = cupy.cuda.get_current_stream()
    return plan.device_arrays(cupy.asarray, device_id, stream.ptr, stream.is_capturing())


def hidden_inputs(xp, plan, d, h0s, out):
    """The hidden state each packed row read (rows, state): ``h0s`` (the sorted initial state)
    for step 0's rows, then the packed outputs ``out`` of the previous step, in one gather by
    ``d.prev`` (not a concatenation of the steps, which CuPy does above 8 parts with an upload
    of their pointers: refused under CUDA-graph capture). ``d``: the plan's device arrays."""
    sizes = plan.batch_sizes
    h_in = xp.empty((plan.rows, out.shape[1]), out.dtype)
    if sizes:
        h_in[: sizes[0]] = h0s[: sizes[0]]
    if d.prev is not None:
        h_in[sizes[0]:] = out[d.prev]
    return h_in


def final_states(plan, d, out, cells, h0s, c0s, copy):
    """Each sorted sequence's final (h, c), from every packed row's hidden state ``out`` and
    cell ``cells`` (rows, S): the rows of its last step (one gather each), or for length 0 the
    sorted initial state ``h0s``, ``c0s`` (``copy``: the arrays' copy function)."""
    ended = plan.ended      # the sequences with a last step: a prefix of the sorted order
    if plan.rows and ended == len(plan.perm):
        return out[d.last], cells[d.last]
    h_sorted, c_sorted = copy(h0s), copy(c0s)
    if plan.rows:
        h_sorted[:ended] = out[d.last]
        c_sorted[:ended] = cells[d.last]
    return h_sorted, c_sorted


def _permuted(a, perm):
    return a if perm is None or a is None else a[perm]


def unpermuted(xp, a, perm):
    """``a`` (batch, ...) in a plan's sorted order, back in the caller's order: a new array
    (``xp.empty_like``), or ``a`` itself where ``perm`` is None (the identity)."""
    if perm is None:
        return a
    out = xp.empty_like(a)
    out[perm] = a
    return out


#: Forward only, where the outputs need a scatter: the hidden states of this many steps of the
#: whole batch (rows) are gathered before one scatter puts them into the outputs
SCATTER_STEPS = 4


def forward_only_outputs(xp, plan, d, state, dtype):
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
        outputs = xp.empty((plan.rows, state), dtype)   # every row is written
        if d.data_index is None:
            return outputs, outputs, offsets, None, {}
    else:
        outputs = xp.zeros((plan.steps, batch, state), dtype)     # zeros at padded positions
        if d.perm is None and not plan.reverse:
            return (outputs, outputs.reshape(plan.steps * batch, state),
                    range(0, len(sizes) * batch, batch), None, {})
    hs = xp.empty((min(SCATTER_STEPS * batch, plan.rows), state), dtype)

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


def _first(h0s, w_h_t, gates):
    """Step 0's recurrent GEMM, ``first(n)``: gates[:n] += h0s[:n] @ W_h.T."""
    return lambda n: gemm(h0s[:n], w_h_t, gates[:n], accumulate=True)


def forward_packed(cupy, inputs, weights, bias, h0, c0, plan, keep=True, block_rows=2048):
    from .._packing import step_blocks

    state = h0.shape[1]
    dtype = inputs.dtype
    rows, offsets = plan.rows, plan.offsets
    with on_device(inputs.data.device_id):
        d = _index(cupy, plan, inputs.device.id)
        index = (d.t_index, d.b_index, d.data_index)
        x = cupy.ascontiguousarray(pack_rows(inputs, plan, *index))      # (N, F)
        blocks = step_blocks(offsets, block_rows)
        h0s, c0s = _permuted(h0, d.perm), _permuted(c0, d.perm)
        w_x_t, w_h_t = weights[:, state:].T, weights[:, :state].T
        bias_c = cupy.ascontiguousarray(bias.reshape(-1))
        if keep:    # every packed row's gate pre-activations, hidden state and cell (kept)
            out, cells, gate_rows, extra = (cupy.empty((rows, state), dtype),
                                            cupy.empty((rows, state), dtype), rows, ())
        else:       # one block's gates, two (batch, state) cells in turn, h where the outputs say
            outputs, out, h_rows, scatter, after = forward_only_outputs(cupy, plan, d, state,
                                                                        dtype)
            h_sorted, c_sorted = h0s.copy(), c0s.copy()
            cells = cupy.empty((2, len(plan.perm), state), dtype)
            gate_rows = max((offsets[b] - offsets[a] for a, b in blocks), default=0)
            extra = (h_rows, (h_sorted.data.ptr, c_sorted.data.ptr), after, scatter)
        gates = cupy.empty((gate_rows, 3 * state), dtype)

        def project(r0, r1):    # a block's input projection (forward only: from row 0)
            gemm(x[r0:r1], w_x_t, gates[r0:r1] if keep else gates[: r1 - r0])

        if rows:
            c0_c = cupy.ascontiguousarray(c0s)
            with row_steps(out, w_h_t, gates, accumulate=True) as recurrent:
                forward_rows(plan, blocks, project, _first(h0s, w_h_t, gates), recurrent,
                             (gates.data.ptr, gates.strides[0]), (out.data.ptr, out.strides[0]),
                             cells.data.ptr, bias_c.data.ptr, c0_c.data.ptr, dtype, state,
                             *extra)
        if keep:
            outputs = unpack_rows(out, plan, cupy, *index)
            h_sorted, c_sorted = final_states(plan, d, out, cells, h0s, c0s, cupy.ndarray.copy)
        h_n, c_n = unpermuted(cupy, h_sorted, d.perm), unpermuted(cupy, c_sorted, d.perm)
    if not keep:
        return outputs, h_n, c_n, None
    saved = LLTMSequenceSaved("cupy", x, out, gates, cells, weights, tuple(bias.shape),
                              plan=plan, h0=h0s)
    return outputs, h_n, c_n, saved


def backward_packed(cupy, grad_outputs, grad_h_n, grad_c_n, saved, needed):
    plan, x, gates, cells, out, weights = (saved.plan, saved.inputs, saved.gates, saved.cells,
                                           saved.hs, saved.weights)
    rows, state = out.shape
    batch = len(plan.perm)
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
            # the cell gradient each step passes back: two (batch, state) buffers taken in turn
            buffers = cupy.empty((2, batch, state), dtype)

            def incoming(last, n, nxt):
                held = incoming_cell_grad(cupy, None if last is None else buffers[last, :nxt],
                                          gcn, n, nxt, state, dtype)
                return None if held is None else (held.data.ptr, held)

            with row_steps(flat, w_h, grad_h, accumulate=True) as recurrent:
                last = backward_rows(plan, recurrent, incoming,
                                     (grad_h.data.ptr, grad_h.strides[0]), cells.data.ptr,
                                     (gates.data.ptr, gates.strides[0]), flat.data.ptr,
                                     buffers.data.ptr, dtype, state)
            n = sizes[0]
            d_c = buffers[last, :n]
            d_h_first = gemm(flat[:n], w_h, cupy.empty((n, state), dtype))
        d_h0s = cupy.zeros((batch, state), dtype) if ghn is None else cupy.array(ghn)
        d_c0s = cupy.zeros((batch, state), dtype) if gcn is None else cupy.array(gcn)
        if sizes:
            d_h0s[: sizes[0]] = d_h_first
            d_c0s[: sizes[0]] = d_c
        d_h0, d_c0 = unpermuted(cupy, d_h0s, perm), unpermuted(cupy, d_c0s, perm)
        need_x, need_w, need_b, need_h0, need_c0 = needed
        h_in = hidden_inputs(cupy, plan, d, saved.h0, out) if need_w else None
        d_inputs, d_weights, d_bias = parameter_grads(cupy, flat, h_in, x, weights,
                                                      saved.bias_shape, needed)
        if need_x:
            d_inputs = unpack_rows(d_inputs, plan, cupy, *index)
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0 if need_h0 else None,
                             d_c0 if need_c0 else None)


# ------------------------------------------------- the loops, on pointers (any engine)
# (on the current device and CuPy's current stream; the array API's and the torch layer's)

def forward_rows(plan, blocks, project, first, recurrent, gates, hs, cells, bias, c0, dtype,
                 state, h_rows=None, finals=None, after=(), scatter=None) -> None:
    """The steps of a packed forward: each step's rows of the buffers at their offsets, one GEMM
    and one launch, no view or allocation. Per block (tau0, tau1) of ``blocks``:
    ``project(r0, r1)``, the input projection of its packed rows into ``gates``; per step
    ``recurrent(i, j, n)`` (gates[j:j + n] += hs[i:i + n] @ W_h.T: the previous step's hidden
    state), or for step 0 ``first(n)`` (gates[:n] += h0s[:n] @ W_h.T), then the forward kernel
    from the previous step's cell (``c0`` first).

    ``gates``, ``hs``: (device pointer, bytes a row), ``cells``, ``bias``, ``c0``: pointers.
    Every packed row kept (``h_rows`` None): ``gates``, ``hs``, ``cells`` (rows, ...) at the
    packed row. Forward only: ``gates`` one block's rows from its first; step tau's hidden state
    at row ``h_rows[tau]`` of ``hs``; its cell in two (batch, state) buffers at ``cells`` taken
    in turn; where sequences end, their rows of h and c copied device to device to the (h, c)
    pointers ``finals`` (each sorted sequence's final state); after a step tau in ``after``,
    ``scatter(*after[tau])``."""
    sizes, offsets = plan.batch_sizes, plan.offsets
    batch, taus, keep = len(plan.perm), len(sizes), h_rows is None
    g_at, g_row = gates
    h_at, row = hs
    h_rows = offsets if keep else h_rows
    if finals is not None:
        cupy = cupy_module()
        copy, d2d = cupy.cuda.runtime.memcpyAsync, cupy.cuda.runtime.memcpyDeviceToDevice
        stream = cupy.cuda.get_current_stream().ptr
    c_in = c0
    for tau0, tau1 in blocks:
        r0 = offsets[tau0]
        project(r0, offsets[tau1])
        for tau in range(tau0, tau1):
            n, r = sizes[tau], offsets[tau]
            j = r if keep else r - r0           # the step's first row of gates
            if tau:
                recurrent(h_rows[tau - 1], j, n)
            else:
                first(n)
            h_out = h_at + h_rows[tau] * row
            c_out = cells + (r if keep else (tau & 1) * batch) * row
            run = launch(dtype, n * state, state)
            run.kernels.fwd(run.grid, run.block, (
                g_at + j * g_row, bias, c_in, h_out, c_out, run.n, run.state))
            c_in = c_out
            if finals is not None:
                nxt = sizes[tau + 1] if tau + 1 < taus else 0
                if nxt < n:                    # sequences ending at this step
                    hn_at, cn_at = finals
                    copy(hn_at + nxt * row, h_out + nxt * row, (n - nxt) * row, d2d, stream)
                    copy(cn_at + nxt * row, c_out + nxt * row, (n - nxt) * row, d2d, stream)
            if tau in after:                   # where the outputs need a scatter
                scatter(*after[tau])


def backward_rows(plan, recurrent, incoming, grad_h, cells, gates, d_gates, buffers, dtype,
                  state):
    """The recurrence of a packed backward, last step first: each step's rows of the packed
    buffers at their offsets, one launch and (but for step 0) ``recurrent(i, j, n)``
    (grad_h[j:j + n] += d_gates[i:i + n] @ W_h: into the previous step's rows), no view or
    allocation but where sequences end: ``incoming(last, n, nxt)``, the cell gradient entering
    such a step's ``n`` rows, of which the first ``nxt`` run on (``last``: which of ``buffers``
    holds what the step after passed back, None before the first), as (pointer, its owner) or
    None (zero).

    ``grad_h`` (rows, S), the outputs' gradient (accumulated into), ``gates`` (rows, 3S) and
    ``d_gates`` (rows, 3S), written: (pointer, bytes a row) (``d_gates`` rows as ``gates``');
    ``cells`` (rows, S) and ``buffers`` (2, batch, S), the cell gradient each step passes back
    (never the one read as grad_cell: restrict): pointers. Returns which buffer holds step 0's
    cell gradient."""
    sizes, offsets = plan.batch_sizes, plan.offsets
    gh_at, row = grad_h
    g_at, g_row = gates
    passed = (buffers, buffers + len(plan.perm) * row)
    last = None
    for i, tau in enumerate(range(len(sizes) - 1, -1, -1)):
        n, nxt = sizes[tau], sizes[tau + 1] if tau + 1 < len(sizes) else 0
        r0 = offsets[tau]
        if last is not None and nxt == n:   # no sequence ends at this step
            held, dc_in = None, passed[last]
        else:
            held = incoming(last, n, nxt)
            dc_in = None if held is None else held[0]
        cell_t = cells + r0 * row
        run = launch(dtype, n * state, state)
        run.kernels.bwd(run.grid, run.block, (
            gh_at + r0 * row, cell_t if dc_in is None else dc_in, g_at + r0 * g_row, cell_t,
            d_gates + r0 * g_row, passed[i % 2], FLAG[1], FLAG[dc_in is not None], run.n,
            run.state))
        last = i % 2
        if tau:
            recurrent(r0, offsets[tau - 1], n)
    return last
