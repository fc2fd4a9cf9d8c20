"""GPU backend: cuBLAS GEMMs through CuPy plus the fused kernels of ``cuda_src/lltm.cu``.

Launchers only allocate, size the grid and launch; arguments were checked by
``lltm_cupy._checks``. Everything runs on CuPy's current stream, on the arrays' device, with no
host synchronisation and no allocation outside CuPy's current allocator (so a caller can route
every byte through its own allocator with ``cupy.cuda.using_allocator``). CuPy is imported on
first call, never at package import.

Device work per call (the launch budget ``tests/test_launch_budget.py`` enforces):

- forward: one concatenation kernel (X = [old_h, input]), one GEMM, the fused kernel;
- backward: the fused kernel, one GEMM per needed gradient of old_h, input and the weights, one
  reduction for the bias (in bfloat16, which CuPy cannot add, a GEMM against ones);
- sequences: one GEMM for every step's input projection, then per step one GEMM plus the fused
  kernel each way (and the add kernel once for a final-state gradient).

bfloat16 has no CuPy dtype: it arrives as uint16 arrays of its bits (``_kernels.BFLOAT16``),
which the kernels, ``gemm`` and the bias gradient read as bfloat16.

Every GEMM goes through ``gemm``: by default :func:`lltm_cupy._gemm.gemm` (cuBLAS ``gemmEx``
through CuPy's binding, on any row-major view, without copies); the torch layer passes torch's GEMM while a
CUDA graph is being captured, where CuPy refuses to call cuBLAS.
"""
from __future__ import annotations

import numpy as np

from . import _cupy_packed
from ._gemm import d_bias as _d_bias, gemm
from ._kernels import BFLOAT16, get_kernels, launch_config
from ._types import (LLTMCellGrads, LLTMCellSaved, LLTMGrads, LLTMSaved, LLTMSequenceGrads,
                     LLTMSequenceSaved)

__all__ = ["forward", "backward", "forward_sequence", "backward_sequence", "gemm", "warmup"]

_gpu_checked = None   # the cupy module whose GPU was found usable


def _cupy():
    """Import CuPy and make sure a GPU is usable (checked once per process)."""
    global _gpu_checked
    import cupy

    if _gpu_checked is not cupy:
        if not cupy.cuda.is_available():
            raise RuntimeError("lltm_cupy: the GPU backend needs a GPU, and CuPy finds no "
                               "usable GPU (no device, or no CUDA driver)")
        _gpu_checked = cupy
    return cupy


def forward(input, weights, bias, old_h, old_cell, gemm=gemm, keep=True):
    cupy = _cupy()
    dtype = input.dtype
    batch, features = input.shape
    state = old_h.shape[1]
    with cupy.cuda.Device(input.device.id):
        X = cupy.empty((batch, state + features), dtype)
        gates = cupy.empty((batch, 3 * state), dtype)
        new_h = cupy.empty((batch, state), dtype)
        new_cell = cupy.empty((batch, state), dtype)
        if batch:  # state >= 1, so nothing to launch exactly when batch == 0
            grid, block, wide = launch_config(X.size)
            get_kernels(dtype, wide).concat(grid, block, (
                cupy.ascontiguousarray(old_h), cupy.ascontiguousarray(input), X,
                np.int64(X.size), np.int32(state), np.int32(features)))
            gemm(X, weights.T, gates)
            n = batch * state
            grid, block, wide = launch_config(n)
            get_kernels(dtype, wide).fwd(grid, block, (
                gates, cupy.ascontiguousarray(bias.reshape(-1)), cupy.ascontiguousarray(old_cell),
                new_h, new_cell, np.int64(n), np.int32(state)))
    if not keep:
        return new_h, new_cell, None
    return new_h, new_cell, LLTMSaved("cupy", X, gates, new_cell, weights, tuple(bias.shape))


def backward(grad_h, grad_cell, saved, needed=(True,) * 5, gemm=gemm):
    cupy = _cupy()
    gates, new_cell, X, weights = saved.gates, saved.new_cell, saved.X, saved.weights
    batch, state = new_cell.shape
    dtype = new_cell.dtype
    need_h, need_x, need_w, need_b, need_c = needed
    with cupy.cuda.Device(new_cell.device.id):
        d_gates, d_old_cell = _step_backward(cupy, grad_h, grad_cell, gates, new_cell)
        d_old_h = d_input = d_weights = d_bias = None
        if need_h:
            d_old_h = gemm(d_gates, weights[:, :state], cupy.empty((batch, state), dtype))
        if need_x:
            d_input = gemm(d_gates, weights[:, state:],
                           cupy.empty((batch, X.shape[1] - state), dtype))
        if need_w:
            d_weights = gemm(d_gates.T, X, cupy.empty(weights.shape, dtype))
        if need_b:
            d_bias = _d_bias(cupy, d_gates, saved.bias_shape, gemm)
    return LLTMGrads(d_old_h, d_input, d_weights, d_bias, d_old_cell if need_c else None)


#: Rows of one block of a sequence's input projection (one GEMM per block of steps; the same
#: blocks with and without keep, so both give the same bits). Forward only, the gate
#: pre-activations live in one such block: 2048 * 3S values (25 MB at S = 1024 in float32).
#: Chosen, not measured on a GPU: a GEMM of 2048 rows fills a GPU of today, and one GEMM launch
#: per block of steps beside the per-step GEMM and kernel is a small share.
#: ``scripts/block_rows.py`` times it (and the peak memory) against other block sizes on a GPU.
_BLOCK_ROWS = 2048


def forward_sequence(inputs, weights, bias, h0, c0, gemm=gemm, plan=None, keep=True,
                     fused=False):
    if fused:
        from . import _cupy_fused

        if _cupy_fused.usable(h0.shape[1], inputs.dtype):
            return _cupy_fused.forward_fused(inputs, weights, bias, h0, c0, gemm, plan, keep)
    from ._packing import block_steps

    cupy = _cupy()
    if plan is not None:
        return _cupy_packed.forward_packed(cupy, get_kernels, inputs, weights, bias, h0, c0, gemm,
                                           plan, keep, _BLOCK_ROWS)
    steps, batch, features = inputs.shape
    state = h0.shape[1]
    dtype = inputs.dtype
    with cupy.cuda.Device(inputs.device.id):
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
            w_h_t = weights[:, :state].T
            bias_c = cupy.ascontiguousarray(bias.reshape(-1))
            c = cupy.ascontiguousarray(c0)
            grid, block_dim, wide = launch_config(n)
            fwd = get_kernels(dtype, wide).fwd
            for t0 in range(0, steps, block):
                k = min(block, steps - t0)
                g = gates[t0: t0 + k] if keep else gates[:k]
                # the input projection of a block of steps in one GEMM
                gemm(x[t0 * batch: (t0 + k) * batch], w_x_t, g.reshape(k * batch, 3 * state))
                for t in range(t0, t0 + k):
                    c_out = cells[t] if keep else cells[t % 2]
                    gemm(hs[t], w_h_t, g[t - t0], accumulate=True)
                    fwd(grid, block_dim, (g[t - t0], bias_c, c, hs[t + 1], c_out,
                                          np.int64(n), np.int32(state)))
                    c = c_out
        h_n = hs[steps].copy() if steps else cupy.array(h0, dtype=dtype)
        if not steps:
            c_n = cupy.array(c0, dtype=dtype)
        else:
            c_n = cells[(steps - 1) if keep else (steps - 1) % 2].copy()
    if not keep:
        return hs[1:], h_n, c_n, None
    saved = LLTMSequenceSaved("cupy", x, hs, gates, cells, weights, tuple(bias.shape))
    return hs[1:], h_n, c_n, saved


def backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, needed=(True,) * 5, gemm=gemm):
    if saved.fused:
        from ._cupy_fused import backward_fused

        return backward_fused(grad_outputs, grad_h_n, grad_c_n, saved, needed, gemm)
    cupy = _cupy()
    if saved.plan is not None:
        return _cupy_packed.backward_packed(cupy, get_kernels, grad_outputs, grad_h_n, grad_c_n,
                                            saved, needed, gemm)
    x, hs, gates, cells, weights = saved.inputs, saved.hs, saved.gates, saved.cells, saved.weights
    steps, batch, state = cells.shape
    features = x.shape[1]
    dtype = cells.dtype
    with cupy.cuda.Device(cells.device.id):
        # grad_h of every step; the recurrent GEMM of step t accumulates into step t - 1's.
        grad_h = (cupy.zeros((steps, batch, state), dtype) if grad_outputs is None
                  else cupy.array(grad_outputs, dtype=dtype, order="C"))
        if steps and grad_h_n is not None and batch:
            # the add kernel rather than CuPy's +=: it adds bfloat16 bits as numbers
            grid, block, wide = launch_config(batch * state)
            get_kernels(dtype, wide).add(grid, block, (
                grad_h[steps - 1], cupy.ascontiguousarray(grad_h_n), np.int64(batch * state)))
        d_gates = cupy.empty((steps, batch, 3 * state), dtype)
        n = batch * state
        d_c = None if grad_c_n is None else cupy.ascontiguousarray(grad_c_n)
        w_h = weights[:, :state]
        if steps and n:
            grid, block, wide = launch_config(n)
            bwd = get_kernels(dtype, wide).bwd
            buffers = (cupy.empty((batch, state), dtype), cupy.empty((batch, state), dtype))
            for i, t in enumerate(range(steps - 1, -1, -1)):
                out_c = buffers[i % 2]      # never the buffer read as grad_cell (restrict)
                bwd(grid, block, (grad_h[t], cells[t] if d_c is None else d_c, gates[t], cells[t],
                                  d_gates[t], out_c, np.int32(1), np.int32(d_c is not None),
                                  np.int64(n), np.int32(state)))
                d_c = out_c
                if t:
                    gemm(d_gates[t], w_h, grad_h[t - 1], accumulate=True)
            d_h0 = gemm(d_gates[0], w_h, cupy.empty((batch, state), dtype))
            d_c0 = d_c.copy()
        elif steps:
            d_h0 = cupy.zeros((batch, state), dtype)
            d_c0 = cupy.zeros((batch, state), dtype)
        else:
            d_h0 = cupy.zeros((batch, state), dtype) if grad_h_n is None else cupy.array(grad_h_n)
            d_c0 = cupy.zeros((batch, state), dtype) if grad_c_n is None else cupy.array(grad_c_n)
        need_x, need_w, need_b, need_h0, need_c0 = needed
        d_inputs, d_weights, d_bias = parameter_grads(
            cupy, d_gates.reshape(steps * batch, 3 * state),
            hs[:-1].reshape(steps * batch, state), x, weights, saved.bias_shape, needed, gemm)
        if need_x:
            d_inputs = d_inputs.reshape(steps, batch, features)
    return LLTMSequenceGrads(d_inputs, d_weights, d_bias, d_h0 if need_h0 else None,
                             d_c0 if need_c0 else None)



# ------------------------------------------------------------------------- the fused cell alone

def cell_forward(gates, old_cell):
    """The fused forward kernel alone on gate pre-activations (batch, 3 * state) the caller
    computed (a zero bias: adding 0 leaves every value, rounding included, as it was)."""
    cupy = _cupy()
    batch, state = old_cell.shape
    dtype = gates.dtype
    with cupy.cuda.Device(gates.device.id):
        z = cupy.array(gates, dtype=dtype, order="C")      # the kernel writes z + bias back
        new_h = cupy.empty((batch, state), dtype)
        new_cell = cupy.empty((batch, state), dtype)
        n = batch * state
        if n:
            grid, block, wide = launch_config(n)
            get_kernels(dtype, wide).fwd(grid, block, (
                z, cupy.zeros(3 * state, dtype), cupy.ascontiguousarray(old_cell), new_h,
                new_cell, np.int64(n), np.int32(state)))
    return new_h, new_cell, LLTMCellSaved("cupy", z, new_cell)


def cell_backward(grad_h, grad_cell, saved):
    cupy = _cupy()
    with cupy.cuda.Device(saved.new_cell.device.id):
        return LLTMCellGrads(*_step_backward(cupy, grad_h, grad_cell, saved.gates,
                                             saved.new_cell))


def _step_backward(cupy, grad_h, grad_cell, gates, new_cell):
    """The element-wise backward kernel of one step, inside the arrays' device: (d_gates,
    d_old_cell). A missing gradient is zero: the kernel is told so and reads another valid
    pointer."""
    batch, state = new_cell.shape
    dtype = new_cell.dtype
    d_gates = cupy.empty((batch, 3 * state), dtype)
    d_old_cell = cupy.empty((batch, state), dtype)
    n = batch * state
    if n:
        grid, block, wide = launch_config(n)
        gh = new_cell if grad_h is None else cupy.ascontiguousarray(grad_h)
        gc = new_cell if grad_cell is None else cupy.ascontiguousarray(grad_cell)
        get_kernels(dtype, wide).bwd(grid, block, (
            gh, gc, gates, new_cell, d_gates, d_old_cell, np.int32(grad_h is not None),
            np.int32(grad_cell is not None), np.int64(n), np.int32(state)))
    return d_gates, d_old_cell


def parameter_grads(cupy, flat, h_in, x, weights, bias_shape, needed, gemm):
    """(d_inputs (rows, F), d_weights, d_bias) of a sequence from every step's d_gates ``flat``
    (rows, 3S), the hidden state each row read ``h_in`` (rows, S) and the inputs ``x`` (rows, F):
    one GEMM (or reduction) each over all steps; None where ``needed`` says so."""
    need_x, need_w, need_b = needed[:3]
    state = weights.shape[0] // 3
    dtype = flat.dtype
    d_weights = d_bias = d_inputs = None
    if need_w:
        # both halves written in place by their GEMMs (zeros when there are no rows)
        d_weights = cupy.empty(weights.shape, dtype)
        gemm(flat.T, h_in, d_weights[:, :state])
        gemm(flat.T, x, d_weights[:, state:])
    if need_b:
        d_bias = _d_bias(cupy, flat, bias_shape, gemm)
    if need_x:
        d_inputs = gemm(flat, weights[:, state:], cupy.empty((flat.shape[0], x.shape[1]), dtype))
    return d_inputs, d_weights, d_bias


# ---------------------------------------------------------------------------------- warmup

#: dtype names warmup accepts -> the backend's storage dtype
_WARMUP_DTYPES = {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
                  "float64": np.dtype(np.float64), "bfloat16": BFLOAT16, "uint16": BFLOAT16}


def warmup_dtype(spec) -> np.dtype:
    """The storage dtype for one of warmup's dtype specs: a NumPy dtype or type, a name
    ("float32", "bfloat16"), or a torch dtype (read by its name, torch is not imported)."""
    name = spec if isinstance(spec, str) else str(spec)
    name = name.removeprefix("torch.")
    if name not in _WARMUP_DTYPES:
        try:
            name = np.dtype(spec).name
        except TypeError:
            pass
    if name not in _WARMUP_DTYPES:
        raise TypeError(f"lltm_cupy.warmup: unsupported dtype {spec!r}; expected float16, "
                        f"bfloat16, float32 or float64")
    return _WARMUP_DTYPES[name]


def warmup(dtypes, device_id=None, fused=False) -> None:
    """Compile and load, on one device, every kernel that the calls of this backend launch for
    each dtype: the module of ``cuda_src/lltm.cu`` (both index widths) and CuPy's own kernels
    (copies, fills, the bias reduction, float16 casts, bfloat16 ones), by running every code path
    of forward, backward, forward_sequence and backward_sequence once on tiny arrays (batch 1
    and 2, steps 0, 1 and 2, each gradient given and None, fixed and variable lengths); then
    synchronises the device. ``fused``: the same calls with ``fused=True`` too (the module of
    ``cuda_src/lltm_fused.cu``).
    """
    cupy = _cupy()
    with cupy.cuda.Device(device_id):
        for dtype in dtypes:
            get_kernels(dtype, False)           # one NVRTC module holds both index widths
            get_kernels(dtype, True)
            for batch in (2, 1):
                _exercise(cupy, dtype, batch, features=3, state=4)
                if fused:
                    _exercise_fused(cupy, dtype, batch, features=3, state=4)
        cupy.cuda.Device().synchronize()


def _exercise_fused(cupy, dtype, batch, features, state):
    """The sequence calls of _exercise with fused=True: fixed and variable lengths, packed data,
    both directions, with and without a backward's saved values, each gradient given and None."""
    from . import _packing

    weights, bias = cupy.zeros((3 * state, state + features), dtype), cupy.zeros(3 * state, dtype)
    h, c = cupy.zeros((batch, state), dtype), cupy.zeros((batch, state), dtype)
    lengths = np.arange(batch, dtype=np.int64) % 3
    cases = [(None, (2, batch)), (None, (0, batch))]
    for reverse in (False, True):
        cases += [(_packing.plan(lengths, 2, reverse), (2, batch)),
                  (_packing.packed_plan((batch, 1), reverse), (batch + 1,))]
    for plan, lead in cases:
        x = cupy.zeros(lead + (features,), dtype)
        forward_sequence(x, weights, bias, h, c, plan=plan, keep=False, fused=True)
        *_, saved = forward_sequence(x, weights, bias, h, c, plan=plan, fused=True)
        for grads in ((cupy.zeros(lead + (state,), dtype), h, c), (None, None, None)):
            backward_sequence(*grads, saved)


def _exercise(cupy, dtype, batch, features, state):
    def zeros(*shape):
        return cupy.zeros(shape, dtype)

    weights, bias = zeros(3 * state, state + features), zeros(3 * state)
    h, c = zeros(batch, state), zeros(batch, state)
    forward(zeros(batch, features), weights, bias, h, c, keep=False)   # forward only
    _, _, saved = forward(zeros(batch, features), weights, bias, h, c)
    for grad_h, grad_cell in ((h, c), (h, None), (None, c), (None, None)):
        backward(grad_h, grad_cell, saved)
    backward(h, c, saved, needed=(False, False, False, True, False))
    *_, cell = cell_forward(zeros(batch, 3 * state), c)    # the fused cell alone
    for grad_h, grad_cell in ((h, c), (None, None)):
        cell_backward(grad_h, grad_cell, cell)
    for steps in (2, 1, 0):
        forward_sequence(zeros(steps, batch, features), weights, bias, h, c, keep=False)
        *_, saved = forward_sequence(zeros(steps, batch, features), weights, bias.reshape(1, -1),
                                     h, c)
        for grads in ((zeros(steps, batch, state), h, c), (None, None, None),
                      (None, h, None), (zeros(steps, batch, state), None, c)):
            backward_sequence(*grads, saved)
    from . import _packing      # variable lengths: gathers, scatters, the final-state add

    lengths = np.arange(batch, dtype=np.int64) % 3
    for reverse in (False, True):
        plan = _packing.plan(lengths, 2, reverse)
        forward_sequence(zeros(2, batch, features), weights, bias, h, c, plan=plan, keep=False)
        *_, saved = forward_sequence(zeros(2, batch, features), weights, bias, h, c, plan=plan)
        for grads in ((zeros(2, batch, state), h, c), (None, None, None)):
            backward_sequence(*grads, saved)
        # a PackedSequence's data in and out (the torch layer's packed input)
        plan = _packing.packed_plan((batch, 1), reverse)
        forward_sequence(zeros(batch + 1, features), weights, bias, h, c, plan=plan, keep=False)
        *_, saved = forward_sequence(zeros(batch + 1, features), weights, bias, h, c, plan=plan)
        for grads in ((zeros(batch + 1, state), h, c), (None, None, None)):
            backward_sequence(*grads, saved)
