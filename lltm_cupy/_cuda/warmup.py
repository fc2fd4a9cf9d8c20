"""``lltm_cupy.warmup`` for the CUDA backend: every kernel a call can launch, compiled and loaded
by running every code path once on tiny arrays."""
from __future__ import annotations

import numpy as np

from . import cluster_kernels, elementwise, fused as _fused, fused_cluster, group_kernels, kernels
from .fused_cluster import GROUP_MIN_ARCH, MIN_ARCH
from .kernels import BFLOAT16, cupy_module
from .sequence import backward_sequence, forward_sequence
from .step import backward, cell_backward, cell_forward, forward

__all__ = ["warmup_dtype", "warmup"]

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
    """Compile and load, on one device, every kernel this backend's calls launch for each dtype
    (ours and CuPy's own: copies, fills, reductions, casts) by running every code path of the
    four calls once on tiny arrays, then synchronise. ``fused``: the fused calls too, with the
    tensor-core module (16-bit types, sm_80+), the cluster (sm_90+) or group (sm_80 to sm_89)
    module of every size; on sm_90+ it also launches each non-portable cluster size the device
    holds once each way, so that a driver refusal happens here, outside any capture (the size
    is then recorded as refused and its calls run on the stepped path).
    """
    cupy = cupy_module()
    with cupy.cuda.Device(device_id):
        for dtype in dtypes:
            elementwise.get_kernels(dtype, False)       # one NVRTC module holds both index widths
            elementwise.get_kernels(dtype, True)
            for batch in (2, 1):
                _exercise(cupy, dtype, batch, features=3, state=4)
                if fused:
                    _exercise_sequences(cupy, dtype, batch, features=3, state=4, fused=True)
            arch = kernels.compute_capability(cupy.cuda.Device().id)
            if fused and arch >= MIN_ARCH:
                cluster_kernels.get_kernels(dtype, 1)   # one module holds every cluster size
                _launch_non_portable(cupy, dtype)
            elif fused and arch >= GROUP_MIN_ARCH:
                group_kernels.get_kernels(dtype, 1)     # and one every group size
        cupy.cuda.Device().synchronize()


def _launch_non_portable(cupy, dtype):
    """One forward and backward launch (one row, one step, as many states as blocks) of each
    non-portable cluster size the occupancy query holds; a refusal is recorded, not raised."""
    for size in cluster_kernels.SIZES:
        if size <= cluster_kernels.PORTABLE_SIZE or not fused_cluster.held(size, dtype, size):
            continue
        weights = cupy.zeros((3 * size, size + 1), dtype)
        h, c = cupy.zeros((1, size), dtype), cupy.zeros((1, size), dtype)
        try:
            *_, saved = _fused.forward_fused(cupy.zeros((1, 1, 1), dtype), weights,
                                             cupy.zeros(3 * size, dtype), h, c, None, size=size)
            _fused.backward_fused(None, h, c, saved, (True,) * 5, size=size)
        except cluster_kernels.LaunchRefused:
            pass            # kernels.cluster_failures says why; the size is not planned again


def _exercise_sequences(cupy, dtype, batch, features, state, fused):
    """The sequence calls on variable lengths and packed data, both directions (with ``fused``
    fixed lengths too), with and without a backward's saved values, each gradient given and
    None. Plans of their own, cached by none: a cached plan would keep its index arrays, in
    CuPy's pool, for the calls that meet the same lengths later, the torch layer's among them,
    whose bytes are torch's."""
    from .. import _packing

    weights, bias = cupy.zeros((3 * state, state + features), dtype), cupy.zeros(3 * state, dtype)
    h, c = cupy.zeros((batch, state), dtype), cupy.zeros((batch, state), dtype)
    lengths = np.arange(batch, dtype=np.int64) % 3
    cases = [(None, (2, batch)), (None, (0, batch))] if fused else []
    for reverse in (False, True):
        cases += [(_packing.plan(lengths, 2, reverse), (2, batch)),
                  (_packing.packed_layout((batch, 1), reverse), (batch + 1,))]
    for plan, lead in cases:
        x = cupy.zeros(lead + (features,), dtype)
        forward_sequence(x, weights, bias, h, c, plan=plan, keep=False, fused=fused)
        *_, saved = forward_sequence(x, weights, bias, h, c, plan=plan, fused=fused)
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
    _exercise_sequences(cupy, dtype, batch, features, state, fused=False)
