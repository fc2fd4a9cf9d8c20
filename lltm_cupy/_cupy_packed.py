"""GPU backend, variable-length sequences (``forward_sequence`` / ``backward_sequence`` with a
packing plan of :mod:`lltm_cupy._packing`).

Per step the rows still running are a prefix of the sorted batch and a contiguous block of the
packed arrays, so every GEMM and kernel launch is the fixed-length one on fewer rows: the CUDA
kernels need nothing new. The gathers and scatters are CuPy's advanced indexing with the plan's
index arrays copied to the device. Kernels, the GPU check and the bias gradient are looked up
on :mod:`lltm_cupy._cupy` at call time (one place to replace them, as the tests' host-compiled
kernels do).
"""
from __future__ import annotations

import numpy as np

from . import _cupy as base
from ._packing import pack_rows, unpack_rows
from ._types import LLTMSequenceGrads, LLTMSequenceSaved


def _index(cupy, plan):
    """The plan's index arrays on the current device: ((t_index, b_index, data_index), perm)."""
    data_index = None if plan.data_index is None else cupy.asarray(plan.data_index)
    return ((cupy.asarray(plan.t_index), cupy.asarray(plan.b_index), data_index),
            cupy.asarray(plan.perm))


def forward_packed(inputs, weights, bias, h0, c0, gemm, plan, keep=True):
    from ._packing import step_blocks

    cupy = base._cupy()
    state = h0.shape[1]
    dtype = inputs.dtype
    rows = plan.rows
    batch = len(plan.perm)
    with cupy.cuda.Device(inputs.device.id):
        index, perm = _index(cupy, plan)
        x = cupy.ascontiguousarray(pack_rows(inputs, plan, *index))      # (N, F)
        blocks = step_blocks(plan.offsets, base._BLOCK_ROWS)
        # keep: every packed row's gate pre-activations and cell (the backward reads them);
        # forward only: one block's gates, and two (batch, state) cell buffers taken in turn
        # (the kernel's old_cell and new_cell may not alias)
        widest = max((plan.offsets[b] - plan.offsets[a] for a, b in blocks), default=0)
        gates = cupy.empty((rows if keep else widest, 3 * state), dtype)
        h0s, c0s = h0[perm], c0[perm]
        out = cupy.empty((rows, state), dtype)
        cells = cupy.empty((rows, state) if keep else (2, batch, state), dtype)
        c_sorted = None if keep else c0s.copy()     # each sequence's cell after its last step
        w_x_t, w_h_t = weights[:, state:].T, weights[:, :state].T
        bias_c = cupy.ascontiguousarray(bias.reshape(-1))
        sizes = plan.batch_sizes
        for tau0, tau1 in blocks:
            start = plan.offsets[tau0] if keep else 0
            base_row = plan.offsets[tau0]
            # the input projection of a block of steps in one GEMM
            g = gates[start: start + plan.offsets[tau1] - base_row]
            gemm(x[base_row: plan.offsets[tau1]], w_x_t, g)
            for tau in range(tau0, tau1):
                n = sizes[tau]
                rows_t = plan.step(tau)
                g_t = g[rows_t.start - base_row: rows_t.stop - base_row]
                if tau:
                    prev = plan.offsets[tau - 1]
                    h_in = out[prev: prev + n]
                    c_in = cells[prev: prev + n] if keep else cells[(tau - 1) % 2, :n]
                else:
                    h_in, c_in = h0s[:n], c0s[:n]
                c_out = cells[rows_t] if keep else cells[tau % 2, :n]
                gemm(h_in, w_h_t, g_t, accumulate=True)
                grid, block, wide = base.launch_config(n * state)
                base.get_kernels(dtype, wide).fwd(grid, block, (
                    g_t, bias_c, c_in, out[rows_t], c_out, np.int64(n * state),
                    np.int32(state)))
                nxt = sizes[tau + 1] if tau + 1 < len(sizes) else 0
                if not keep and nxt < n:                    # sequences ending at this step
                    c_sorted[nxt:n] = c_out[nxt:n]
        outputs = unpack_rows(out, plan, cupy, *index)
        h_sorted = h0s.copy()
        ended = np.flatnonzero(plan.last_row >= 0)
        if rows:
            last = cupy.asarray(plan.last_row[ended])
            ended_d = cupy.asarray(ended)
            h_sorted[ended_d] = out[last]
            if keep:
                c_sorted = c0s.copy()
                c_sorted[ended_d] = cells[last]
        elif keep:
            c_sorted = c0s.copy()
        h_n, c_n = cupy.empty_like(h_sorted), cupy.empty_like(c_sorted)
        h_n[perm] = h_sorted
        c_n[perm] = c_sorted
    if not keep:
        return outputs, h_n, c_n, None
    saved = LLTMSequenceSaved("cupy", x, out, gates, cells, weights, tuple(bias.shape),
                              plan=plan, h0=h0s)
    return outputs, h_n, c_n, saved


def backward_packed(grad_outputs, grad_h_n, grad_c_n, saved, needed, gemm):
    cupy = base._cupy()
    plan, x, gates, cells, out, weights = (saved.plan, saved.inputs, saved.gates, saved.cells,
                                           saved.hs, saved.weights)
    rows, state = out.shape
    batch, features = len(plan.perm), x.shape[1]
    dtype = out.dtype
    with cupy.cuda.Device(out.device.id):
        index, perm = _index(cupy, plan)
        if grad_outputs is None:
            grad_h = cupy.zeros((rows, state), dtype)
        else:   # written below: a copy, also where the packed rows are grad_outputs itself
            grad_h = pack_rows(grad_outputs, plan, *index)
            grad_h = (cupy.array(grad_h, order="C") if grad_h is grad_outputs
                      else cupy.ascontiguousarray(grad_h))
        ended = np.flatnonzero(plan.last_row >= 0)
        ghn = None if grad_h_n is None else grad_h_n[perm]
        gcn = None if grad_c_n is None else grad_c_n[perm]
        if ghn is not None and len(ended):
            last = cupy.asarray(plan.last_row[ended])
            part = grad_h[last]
            grid, block, wide = base.launch_config(part.size)
            base.get_kernels(dtype, wide).add(grid, block, (
                part, cupy.ascontiguousarray(ghn[cupy.asarray(ended)]), np.int64(part.size)))
            grad_h[last] = part
        flat = cupy.empty((rows, 3 * state), dtype)
        w_h = weights[:, :state]
        sizes = plan.batch_sizes
        d_c = d_h_first = None
        for tau in range(len(sizes) - 1, -1, -1):
            n, nxt = sizes[tau], sizes[tau + 1] if tau + 1 < len(sizes) else 0
            rows_t = plan.step(tau)
            if d_c is not None and nxt == n:
                dc_in = d_c
            elif d_c is None and gcn is None:
                dc_in = None
            else:
                dc_in = cupy.zeros((n, state), dtype)
                if d_c is not None:
                    dc_in[:nxt] = d_c
                if gcn is not None:
                    dc_in[nxt:] = gcn[nxt:n]
            d_c_out = cupy.empty((n, state), dtype)
            grid, block, wide = base.launch_config(n * state)
            base.get_kernels(dtype, wide).bwd(grid, block, (
                grad_h[rows_t], cells[rows_t] if dc_in is None else dc_in, gates[rows_t],
                cells[rows_t], flat[rows_t], d_c_out, np.int32(1), np.int32(dc_in is not None),
                np.int64(n * state), np.int32(state)))
            d_c = d_c_out
            if tau:
                prev = plan.offsets[tau - 1]
                gemm(flat[rows_t], w_h, grad_h[prev: prev + n], accumulate=True)
            else:
                d_h_first = gemm(flat[rows_t], w_h, cupy.empty((n, state), dtype))
        d_h0s = cupy.zeros((batch, state), dtype) if ghn is None else cupy.array(ghn)
        d_c0s = cupy.zeros((batch, state), dtype) if gcn is None else cupy.array(gcn)
        if sizes:
            d_h0s[: sizes[0]] = d_h_first
            d_c0s[: sizes[0]] = d_c
        d_h0, d_c0 = cupy.empty_like(d_h0s), cupy.empty_like(d_c0s)
        d_h0[perm] = d_h0s
        d_c0[perm] = d_c0s
        need_x, need_w, need_b, need_h0, need_c0 = needed
        d_weights = d_bias = d_inputs = None
        if need_w:
            parts = [saved.h0[:n] if not tau else out[plan.offsets[tau - 1]:
                                                      plan.offsets[tau - 1] + n]
                     for tau, n in enumerate(sizes)]
            h_in = cupy.concatenate(parts) if parts else out[:0]
            d_weights = cupy.empty(weights.shape, dtype)
            gemm(flat.T, h_in, d_weights[:, :state])
            gemm(flat.T, x, d_weights[:, state:])
        if need_b:
            d_bias = base._d_bias(cupy, flat, saved.bias_shape, gemm)
        if need_x:
            d_inputs = unpack_rows(gemm(flat, weights[:, state:],
                                        cupy.empty((rows, features), dtype)), plan, cupy, *index)
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0 if need_h0 else None,
                             d_c0 if need_c0 else None)
