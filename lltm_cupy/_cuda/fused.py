"""GPU backend, fused sequences: one launch of ``cuda_src/lltm_fused.cu`` per layer and direction
runs every step, with the recurrent weights W_h in each block's shared memory for all steps.

Chosen by :func:`lltm_cupy._cuda.sequence.forward_sequence` when the caller asks for it
(``fused=True``) and :func:`usable` says the state size fits; the backward of a sequence whose
forward was fused is fused too. Device work per call:

- forward: the input projection of every step (one GEMM, as on the stepped path), then one fused
  kernel; with variable lengths also the gathers and scatters of the packed layout (by the
  plan's index arrays and step offsets on the device, uploaded once per plan: in steady state,
  and under CUDA-graph capture after an eager call with the same lengths, nothing is copied
  from the host);
- backward: one fused kernel (the reverse recurrence, writing every step's d_gates), then the
  weight, bias and input gradients as one GEMM (or reduction) each over all steps.

Results are the stepped path's up to the order of the recurrent product's sums (float32
accumulation for the 16-bit types, as cuBLAS; the same rounding points).

Shared memory per block (bytes; T the storage type, A the arithmetic type: float32 for the 16-bit
types): W_h, 3 S^2 sizeof(T) (backward) or S rows of ``fused_kernels.wt_stride`` elements
(forward, at most 3 S^2 + 3 S: rows padded against bank conflicts at the load), rounded up to
16, plus per batch row of the block's tile 3 S sizeof(A) (forward) or 5 S sizeof(A)
(backward). A state size is accepted when the backward of a one-row tile fits the device's
opt-in limit per block (``MaxSharedMemoryPerBlockOptin``); the tile is the batch spread over the
SMs, as many rows as fit. Largest accepted S (:func:`max_state`):

    architecture        opt-in bytes per block   float16 / bfloat16   float32   float64
    sm_80  (A100)              166,912                  165            117        82
    sm_90  (H100, H200)        232,448                  195            138        97
    sm_100 (B200)              232,448                  195            138        97

In float16 and bfloat16 on sm_80 and newer, the calls within that bound launch the tensor-core
kernels of :mod:`.fused_mma` instead where their shared memory fits (each way on its own).
Above that bound, on sm_90 and newer, the same calls launch the cluster variant instead
(``cuda_src/lltm_fused_cluster.cu``, sized by :mod:`.fused_cluster`: W_h split over the blocks
of a thread-block cluster), with the same arguments; on sm_80 to sm_89 its group variant (the
same kernels' bodies, the blocks of a tile exchanging through global memory in a cooperative
launch).
"""
from __future__ import annotations

import functools

import numpy as np

from . import cluster_kernels, fused_cluster, fused_kernels, fused_mma, group_kernels, kernels
from .fused_kernels import THREADS, acc_size, wt_stride
from .gemm import gemm, parameter_grads
from .kernels import cupy_module, on_device
from .packed import _index, hidden_inputs, unpermuted
from .._packing import block_steps, pack_rows, unpack_rows
from .._types import LLTMSequenceGrads, LLTMSequenceSaved

__all__ = ["ARCH_SHARED_MEMORY", "shared_bytes", "max_state", "usable", "forward_fused",
           "backward_fused", "launch_forward", "launch_backward", "variant"]

#: Opt-in shared memory per block (bytes) of the architectures the tests check the bound for
#: (CUDA C++ Programming Guide, "Compute Capabilities", maximum shared memory per thread block).
ARCH_SHARED_MEMORY = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}


def shared_bytes(state: int, dtype, tile: int, backward: bool) -> int:
    """Dynamic shared memory of one block of the fused kernels (see the module docstring)."""
    item = np.dtype(dtype).itemsize
    elements = 3 * state * state if backward else state * wt_stride(state, item)
    weights = -(-elements * item // 16) * 16
    return weights + tile * (5 if backward else 3) * state * acc_size(dtype)


@functools.lru_cache(maxsize=None)
def max_state(limit: int, dtype) -> int:
    """The largest state size whose backward (the larger kernel) fits ``limit`` bytes per block
    with a one-row tile (worked out once per limit and dtype: a search over the sizes, which
    every fused call asks for)."""
    state = 0
    while shared_bytes(state + 1, dtype, 1, True) <= limit:
        state += 1
    return state


def usable(state: int, dtype) -> bool:
    """True when the fused kernels run this state size in this dtype on the current device: in
    one block per tile, or (sm_80 and newer) split over several blocks per tile, in a cluster
    from sm_90, in a group of a cooperative launch before (:mod:`.fused_cluster`)."""
    return (0 < state <= max_state(kernels.shared_memory_limit(kernels.current_device()), dtype)
            or fused_cluster.usable(state, dtype))


def cluster_size(state: int, dtype):
    """None where the one-block kernels run ``state`` (and no cluster size is forced), else the
    blocks per tile of the cluster (or group) kernels."""
    if fused_cluster.FORCED_SIZE is None and \
            state <= max_state(kernels.shared_memory_limit(kernels.current_device()), dtype):
        return None
    return fused_cluster.chosen_size(state, dtype)


def variant(batch: int, state: int, dtype, backward: bool, size=None, buffers=None):
    """(kernel, blocks, threads, tile, shared bytes) of the variant that runs ``state``
    (``size``: blocks per tile instead of the launcher's choice; ``buffers``: as
    ``group_kernels.group_launch``'s).
    cluster_kernels.LaunchRefused where no variant runs ``state`` now (past one block's shared
    memory with no cluster or group size chosen: one was refused, or a query fails), and from a
    non-portable cluster launch the driver refuses."""
    size = cluster_size(state, dtype) if size is None else size
    if size is None and fused_mma.usable(state, dtype, backward):          # tensor cores
        fns = fused_mma.get_kernels(dtype)
        return (fns.bwd if backward else fns.fwd, *fused_mma.geometry(batch, state, backward))
    if size is None:
        device = kernels.current_device()
        if state > max_state(kernels.shared_memory_limit(device), dtype):
            raise cluster_kernels.LaunchRefused(
                f"lltm_cupy: no fused variant runs state size {state} in "
                f"{np.dtype(dtype).name} on device {device} now (one block's shared memory "
                f"holds up to {max_state(kernels.shared_memory_limit(device), dtype)}, and no "
                f"cluster or group size is chosen: one was refused, or an occupancy query "
                f"failed; kernels.cluster_failures says why): the call runs on the stepped path")
        fns = fused_kernels.get_kernels(dtype)
        geometry = _geometry(None, batch, state, dtype, backward)
    elif fused_cluster.uses_clusters(kernels.current_device()):
        fns = cluster_kernels.get_kernels(dtype, size)
        kernel = fns.bwd if backward else fns.fwd
        shape = fused_cluster.geometry(batch, state, dtype, backward, size, kernel)
        if size > cluster_kernels.PORTABLE_SIZE:
            kernel = cluster_kernels.guarded(kernel, size)
        return (kernel, *shape)
    else:                                       # sm_80 to sm_89: groups, a cooperative launch
        fns = group_kernels.get_kernels(dtype, size)
        fn = fns.bwd if backward else fns.fwd
        shape = fused_cluster.geometry(batch, state, dtype, backward, size)
        group_kernels.resident_blocks(fn, shape[1], shape[3])   # asked now, not at the launch
        return (group_kernels.group_launch(fn, size, dtype, state, backward, buffers),
                *shape)
    return (fns.bwd if backward else fns.fwd, *geometry)


def _geometry(cupy, batch: int, state: int, dtype, backward: bool):
    """(blocks, threads, tile, shared bytes): the batch spread over the SMs, one tile per block,
    as many rows per tile as shared memory holds."""
    device = kernels.current_device()
    limit = kernels.shared_memory_limit(device)
    base = shared_bytes(state, dtype, 0, backward)                # W_h
    per_row = (5 if backward else 3) * state * acc_size(dtype)   # a batch row of the tile
    tile = max(1, min(-(-batch // kernels._sm_count(device)), (limit - base) // per_row))
    threads = min(THREADS, -(-tile * state // 32) * 32)
    return -(-batch // tile), threads, tile, base + tile * per_row


def forward_fused(inputs, weights, bias, h0, c0, plan, keep=True, block_rows=2048, size=None):
    """The fused forward of one layer and direction: one input-projection GEMM and one launch;
    forward only (``keep=False``) one of each per block of the stepped path's steps, into one
    reused block, so that memory beyond the outputs does not grow with the steps. ``size``: the
    blocks per tile instead of the launcher's choice (warmup). The launch is planned before any
    work is queued; cluster_kernels.LaunchRefused (the caller then runs the stepped path)."""
    cupy = cupy_module()
    dtype = inputs.dtype
    state = h0.shape[1]
    with on_device(inputs.data.device_id):
        batch = inputs.shape[1] if plan is None else len(plan.perm)
        launched = variant(batch, state, dtype, False, size) if batch and (
            inputs.shape[0] if plan is None else plan.batch_sizes) else None
        if plan is None:
            steps, batch, features = inputs.shape
            x = cupy.ascontiguousarray(inputs).reshape(steps * batch, features)
            hs = cupy.empty((steps + 1, batch, state), dtype)     # [h0, h_1, ..., h_T]
            hs[0] = h0
            out = hs[1:].reshape(steps * batch, state)
            starts = [t * batch for t in range(steps + 1)]
            h_prev, c_prev = hs[0], cupy.ascontiguousarray(c0)
            offsets, packed = cupy.zeros(1, np.int64), np.int32(0)   # not read
        else:
            d = _index(cupy, plan, inputs.data.device_id)
            index, perm = (d.t_index, d.b_index, d.data_index), d.order
            steps, batch = len(plan.batch_sizes), len(plan.perm)
            x = cupy.ascontiguousarray(pack_rows(inputs, plan, *index))
            out = cupy.empty((plan.rows, state), dtype)
            starts = plan.offsets
            h_prev, c_prev = h0[perm], c0[perm]
            offsets, packed = d.offsets, np.int32(1)
        h0s = h_prev
        block = steps if keep else min(steps, block_steps(batch, block_rows))
        spans = [(t0, min(t0 + block, steps)) for t0 in range(0, steps, max(block, 1))]
        rows = max([starts[t1] - starts[t0] for t0, t1 in spans], default=0)
        gates = cupy.empty((rows, 3 * state), dtype)
        cells = cupy.empty((rows, state), dtype)
        finals = [(cupy.empty((batch, state), dtype), cupy.empty((batch, state), dtype))
                  for _ in range(min(len(spans), 2))]
        w_x_t = weights[:, state:].T

        def project(r0, r1):    # the input projection of a span's steps, one GEMM
            gemm(x[r0:r1], w_x_t, gates[: r1 - r0])

        if batch and spans:
            h_prev, c_prev = cupy.ascontiguousarray(h_prev), cupy.ascontiguousarray(c_prev)
            w = cupy.ascontiguousarray(weights)
            bias_c = cupy.ascontiguousarray(bias.reshape(-1))
            last = launch_forward(
                launched, spans, starts, project,
                w.data.ptr, weights.shape[1], bias_c.data.ptr, gates.data.ptr, h_prev.data.ptr,
                c_prev.data.ptr, out.data.ptr, out.strides[0], cells.data.ptr,
                [(h.data.ptr, c.data.ptr) for h, c in finals], offsets.data.ptr, packed, batch,
                state)
            h_prev, c_prev = finals[(len(spans) - 1) % 2]
            assert last == (h_prev.data.ptr, c_prev.data.ptr)
        elif spans:                      # no batch: nothing to launch, the input projections
            for t0, t1 in spans:
                project(starts[t0], starts[t1])
            h_prev, c_prev = finals[(len(spans) - 1) % 2]
        else:                            # no step: the final state is the initial one
            h_prev, c_prev = cupy.array(h_prev), cupy.array(c_prev)
        if plan is None:
            outputs, h_n, c_n = hs[1:], h_prev, c_prev
            saved = LLTMSequenceSaved("cupy", x, hs, gates.reshape(steps, batch, 3 * state),
                                      cells.reshape(steps, batch, state), weights,
                                      tuple(bias.shape), fused=True) if keep else None
        else:
            outputs = unpack_rows(out, plan, cupy, *index)
            h_n, c_n = unpermuted(cupy, h_prev, perm), unpermuted(cupy, c_prev, perm)
            saved = LLTMSequenceSaved("cupy", x, out, gates, cells, weights, tuple(bias.shape),
                                      plan=plan, h0=h0s, fused=True) if keep else None
    return outputs, h_n, c_n, saved


def backward_fused(grad_outputs, grad_h_n, grad_c_n, saved, needed, size=None):
    """The fused backward of one layer and direction, as :func:`forward_fused` (the saved values
    are the stepped path's: on LaunchRefused the caller runs the stepped backward on them)."""
    cupy = cupy_module()
    plan, x, hs, weights = saved.plan, saved.inputs, saved.hs, saved.weights
    state = weights.shape[0] // 3
    dtype = hs.dtype
    with on_device(hs.data.device_id):
        batch = saved.cells.shape[1] if plan is None else len(plan.perm)
        launched = variant(batch, state, dtype, True, size) if batch else None   # (first)
        if plan is None:
            steps, batch = saved.cells.shape[:2]
            grad_out = None if grad_outputs is None else cupy.ascontiguousarray(grad_outputs)
            ghn, gcn = grad_h_n, grad_c_n
        else:
            d = _index(cupy, plan, hs.data.device_id)
            index, perm = (d.t_index, d.b_index, d.data_index), d.order
            steps, batch = len(plan.batch_sizes), len(plan.perm)
            grad_out = (None if grad_outputs is None
                        else cupy.ascontiguousarray(pack_rows(grad_outputs, plan, *index)))
            ghn = None if grad_h_n is None else grad_h_n[perm]
            gcn = None if grad_c_n is None else grad_c_n[perm]
        rows = x.shape[0]
        d_gates = cupy.empty((rows, 3 * state), dtype)
        d_h0, d_c0 = cupy.empty((batch, state), dtype), cupy.empty((batch, state), dtype)
        if batch:
            offsets, packed = ((cupy.zeros(1, np.int64), np.int32(0)) if plan is None else
                               (d.offsets, np.int32(1)))
            gates = cupy.ascontiguousarray(saved.gates.reshape(rows, 3 * state))
            cells = cupy.ascontiguousarray(saved.cells.reshape(rows, state))
            ghn = None if ghn is None else cupy.ascontiguousarray(ghn)
            gcn = None if gcn is None else cupy.ascontiguousarray(gcn)
            w = cupy.ascontiguousarray(weights)
            launch_backward(
                launched, w.data.ptr,
                weights.shape[1], gates.data.ptr, cells.data.ptr,
                *(None if a is None else a.data.ptr for a in (grad_out, ghn, gcn)),
                d_gates.data.ptr, d_h0.data.ptr, d_c0.data.ptr, offsets.data.ptr, packed, steps,
                batch, state)
        if plan is None:
            h_in = hs[:-1].reshape(rows, state)
        else:
            h_in = hidden_inputs(cupy, plan, d, saved.h0, hs)
            d_h0, d_c0 = unpermuted(cupy, d_h0, perm), unpermuted(cupy, d_c0, perm)
        need_x, need_w, need_b, need_h0, need_c0 = needed
        d_inputs, d_weights, d_bias = parameter_grads(cupy, d_gates, h_in, x, weights,
                                                      saved.bias_shape, needed)
        if need_x:
            d_inputs = (d_inputs.reshape(steps, batch, x.shape[1]) if plan is None
                        else unpack_rows(d_inputs, plan, cupy, *index))
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0 if need_h0 else None,
                             d_c0 if need_c0 else None)


# ------------------------------------------------------ the launches, on pointers (any engine)

def launch_forward(variant, spans, starts, project, w, features_and_state, bias, gates, h0, c0,
                   out, out_row, cells, finals, offsets, packed, batch, state):
    """The fused forward's launches on device pointers (ints) of C-contiguous buffers, current
    device and CuPy's current stream, for the array API and the torch layer alike: per span
    (t0, t1) of steps, ``project(r0, r1)`` (its rows' input projection into ``gates``), then
    one launch of ``variant`` (:func:`variant`'s tuple) from the previous span's final (h, c)
    into its rows of ``out`` (``out_row`` bytes a row), ``cells`` and ``finals``' pair taken in
    turn; returns the last (h, c). ``offsets``: the plan's step offsets where ``packed``."""
    kernel, blocks, threads, tile, smem = variant
    columns, b32, s32, t32 = np.int64(features_and_state), np.int32(batch), np.int32(state), \
        np.int32(tile)
    h_prev, c_prev = h0, c0
    for i, (t0, t1) in enumerate(spans):
        r0, r1 = starts[t0], starts[t1]
        project(r0, r1)
        h_last, c_last = finals[i % 2]
        kernel((blocks,), (threads,), (
            w, columns, bias, gates, h_prev, c_prev, out + r0 * out_row, cells, h_last, c_last,
            offsets + 8 * t0 if packed else offsets, packed, np.int32(t1 - t0), b32, s32, t32),
            shared_mem=smem)
        h_prev, c_prev = h_last, c_last
    return h_prev, c_prev


def launch_backward(variant, w, features_and_state, gates, cells, grad_out, grad_h_n, grad_c_n,
                    d_gates, d_h0, d_c0, offsets, packed, steps, batch, state) -> None:
    """The fused backward's launch, as :func:`launch_forward`: d_gates (rows, 3S), d_h0, d_c0
    (B, S) from the forward's gates and cells and the gradients (None: zero)."""
    kernel, blocks, threads, tile, smem = variant
    present = [a for a in (grad_out, grad_h_n, grad_c_n) if a is not None]
    placeholder = cells if not present else present[0]      # read only where flagged
    kernel((blocks,), (threads,), (
        w, np.int64(features_and_state), gates, cells,
        placeholder if grad_out is None else grad_out,
        placeholder if grad_h_n is None else grad_h_n,
        placeholder if grad_c_n is None else grad_c_n, d_gates, d_h0, d_c0, offsets, packed,
        np.int32(grad_out is not None), np.int32(grad_h_n is not None),
        np.int32(grad_c_n is not None), np.int32(steps), np.int32(batch), np.int32(state),
        np.int32(tile)), shared_mem=smem)
