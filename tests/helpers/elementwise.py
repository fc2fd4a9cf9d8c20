"""Each backend's element-wise code on flat inputs (no GEMM: the pre-activations are given),
for the accuracy tests against lltm_cupy.exact."""
from __future__ import annotations

import ctypes

import numpy as np

from .host_kernels import SUFFIX, ptr


def _flat_inputs(inputs, dtype):
    return {k: np.ascontiguousarray(np.asarray(v, dtype).reshape(-1)) for k, v in inputs.items()}


def run_numpy(inputs, dtype) -> dict:
    """lltm_cupy._numpy's element-wise forward and backward of one step."""
    from lltm_cupy import _numpy

    a = _flat_inputs(inputs, dtype)
    n = a["z_i"].size
    gates = np.concatenate([a["z_i"], a["z_o"], a["z_c"]]).reshape(1, 3 * n)
    new_h, new_cell = np.empty((1, n), dtype), np.empty((1, n), dtype)
    factors = np.empty((4, 1, n), dtype)
    d = np.empty((3, 1, n), dtype)
    _numpy.step.cell_forward_into(gates, a["old_cell"].reshape(1, n), new_h, new_cell, factors)
    with np.errstate(all="ignore"):     # as the backend's entry points run them
        d_new_cell = _numpy.step._d_gates(a["grad_h"].reshape(1, n), a["grad_cell"].reshape(1, n),
                                     factors, d)
    return _named(new_h, new_cell, d_new_cell, d[0], d[1], d[2])


def run_kernels(lib, inputs, dtype, grid=3, block=7) -> dict:
    """cuda_src/lltm.cu's fused kernels, built as host C++ (tests/helpers/host_kernels.py), on
    one row of n = len(inputs) elements: gates = [z_i | z_o | z_c], a zero bias."""
    a = _flat_inputs(inputs, dtype)
    n = a["z_i"].size
    gates = np.concatenate([a["z_i"], a["z_o"], a["z_c"]]).reshape(1, 3 * n)
    bias = np.zeros(3 * n, dtype)
    new_h, new_cell = _unwritten((1, n), dtype), _unwritten((1, n), dtype)
    suffix = SUFFIX[np.dtype(dtype)]
    getattr(lib, f"lltm_fwd_{suffix}")(
        ctypes.c_uint(grid), ctypes.c_uint(block), ptr(gates), ptr(bias),
        ptr(a["old_cell"].reshape(1, n)), ptr(new_h), ptr(new_cell), ctypes.c_longlong(n),
        ctypes.c_int(n))
    d_gates = _unwritten((1, 3 * n), dtype)
    d_old_cell = _unwritten((1, n), dtype)
    getattr(lib, f"lltm_bwd_{suffix}")(
        ctypes.c_uint(grid), ctypes.c_uint(block), ptr(a["grad_h"].reshape(1, n)),
        ptr(a["grad_cell"].reshape(1, n)), ptr(gates), ptr(new_cell), ptr(d_gates),
        ptr(d_old_cell), ctypes.c_int(1), ctypes.c_int(1), ctypes.c_longlong(n), ctypes.c_int(n))
    d = d_gates.reshape(3, n)
    return _named(new_h, new_cell, d_old_cell, d[0], d[1], d[2])


def _unwritten(shape, dtype):
    """An output buffer filled with NaN (for bfloat16 bits, a NaN's bit pattern), so that an
    element the kernel does not write cannot pass as a result."""
    if np.dtype(dtype).kind == "u":
        return np.full(shape, 0x7FC1, dtype)
    return np.full(shape, np.nan, dtype)


def _named(new_h, new_cell, d_old_cell, d_i, d_o, d_c) -> dict:
    return {name: np.asarray(v).reshape(-1) for name, v in zip(
        ("new_h", "new_cell", "d_old_cell", "d_input_gate", "d_output_gate", "d_candidate"),
        (new_h, new_cell, d_old_cell, d_i, d_o, d_c))}


def special_values(dtype) -> np.ndarray:
    """Exactly 0 (both signs), +-1e4, the smallest subnormal and normal, tiny and 1-ish values."""
    info = np.finfo(dtype)
    sub = float(info.smallest_subnormal)
    tiny = float(info.tiny)
    vals = [0.0, -0.0, sub, -sub, 7 * sub, tiny, -tiny, 1e-30, -1e-30, 1e-7, -1e-7, 0.5, -0.5,
            1.0, -1.0, 3.0, -3.0, 20.0, -20.0, 1e4, -1e4]
    return np.array([v for v in vals if abs(v) <= info.max], dtype=dtype)
