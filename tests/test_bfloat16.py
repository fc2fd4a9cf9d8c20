"""bfloat16: the conversions of cuda_src/lltm.cu (exhaustively, against ml_dtypes), the kernels in
bfloat16 through their host build against the float64 reference, and the GPU backend's bfloat16
path (raw bits in uint16 arrays, cuBLAS gemmEx with CUDA_R_16BF) on the emulated CuPy.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install .[test])")

from lltm_cupy import _kernels  # noqa: E402
from conftest import make_case, reference_results  # noqa: E402
from helpers.host_kernels import ptr  # noqa: E402

BF16 = ml_dtypes.bfloat16
BITS = _kernels.BFLOAT16   # uint16: the backend's bfloat16 storage


def to_bits(a) -> np.ndarray:
    """float values rounded to bfloat16 (ml_dtypes: round to nearest even), as raw bits."""
    return np.ascontiguousarray(np.asarray(a, np.float32).astype(BF16).view(np.uint16))


def from_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(BF16).astype(np.float64)


def _conversions(lib):
    """(widen, narrow) of lltm.cu, bits in and out: uint16 -> float32 bits, float32 bits ->
    uint16."""
    widen = lib.lltm_bf16_to_float32_bits
    widen.restype, widen.argtypes = ctypes.c_uint, [ctypes.c_ushort]
    narrow = lib.lltm_float32_bits_to_bf16
    narrow.restype, narrow.argtypes = ctypes.c_ushort, [ctypes.c_uint]
    return widen, narrow


def test_every_bfloat16_bit_pattern_widens_exactly(host_lib):
    widen, _ = _conversions(host_lib)
    bits = np.arange(2**16, dtype=np.uint16)
    got = np.array([widen(int(b)) for b in bits], np.uint32).view(np.float32)
    want = bits.view(BF16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0 too
    # NaN keeps its sign and payload bits: widening is a plain shift
    assert np.array_equal(got[nan].view(np.uint32), bits[nan].astype(np.uint32) << 16)


def _float32_sweep() -> np.ndarray:
    rng = np.random.default_rng(0)
    info = np.finfo(np.float32)
    bf_max = float(np.finfo(BF16).max)
    # every bfloat16 value and the float32 values just around it, ties exactly between two
    # neighbours (to even), subnormals, the extremes, +-inf and NaNs
    base = np.arange(2**16, dtype=np.uint32) << 16
    near = np.concatenate([base, base + 0x8000, base + 0x7fff, base + 0x8001, base + 1,
                           base + 0xffff])
    special = np.array([0.0, -0.0, info.smallest_subnormal, -info.smallest_subnormal, info.tiny,
                        info.max, -info.max, np.inf, -np.inf, bf_max, -bf_max,
                        np.nextafter(np.float32(bf_max), np.float32(np.inf)), 1.0, -1.0, 1e-40],
                       np.float32)
    return np.concatenate([near.view(np.float32), special,
                           rng.standard_normal(20000).astype(np.float32) * 100,
                           rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
                           .view(np.float32)])


def test_float32_rounds_to_bfloat16_as_ml_dtypes_does(host_lib):
    _, narrow = _conversions(host_lib)
    values = _float32_sweep()
    got = np.array([narrow(int(u)) for u in values.view(np.uint32)], np.uint16)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow casts are the point
        want = values.astype(BF16).view(np.uint16)
    nan = np.isnan(values)
    assert np.isnan(got[nan].view(BF16).astype(np.float32)).all(), "NaN must stay NaN"
    assert np.array_equal(got[nan] & 0x8000, want[nan] & 0x8000), "NaN keeps its sign"
    mismatch = np.flatnonzero(got[~nan] != want[~nan])
    assert mismatch.size == 0, (f"{mismatch.size} of {(~nan).sum()} values round differently, "
                                f"e.g. {values[~nan][mismatch[:5]]}")


# Pre-activations, states and gradients are stored in bfloat16 (8 significant bits, unit
# roundoff u = 2^-9 ~ 2e-3), with float32 arithmetic in between: each stored input carries up to
# u relative error, each output one more rounding, and the backward's products compound three or
# four of them (|relative error| <~ 6u ~ 1.2e-2 in the worst element). As a normalised error
# (max |ours - ref| / max(1, max |ref|)) against the float64 reference on the same rounded
# inputs, 2e-2 leaves room for that and catches any formula or indexing bug (those give O(1)).
BF16_TOLERANCE = 2e-2


def _normalised(actual, expected):
    expected = np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(1.0, np.abs(expected).max()))


@pytest.mark.parametrize("batch,features,state", [(1, 1, 1), (3, 17, 5), (16, 32, 128)])
def test_host_kernels_in_bfloat16_match_the_reference(host_lib, batch, features, state):
    case64 = make_case(batch, features, state, np.float64, seed=batch + state)
    bits = {k: to_bits(v) for k, v in case64.items()}
    case = {k: from_bits(v) for k, v in bits.items()}       # the rounded values, in float64
    ref_h, ref_c, _ = reference_results(case)
    x = np.concatenate([case["old_h"], case["input"]], axis=1)
    gates = to_bits(x @ case["weights"].T)                    # the GEMM's bfloat16 output
    bias = np.ascontiguousarray(bits["bias"].reshape(-1))
    new_h = np.zeros((batch, state), np.uint16)
    new_cell = np.zeros((batch, state), np.uint16)
    host_lib.lltm_fwd_bf16(ctypes.c_uint(3), ctypes.c_uint(32), ptr(gates), ptr(bias),
                           ptr(bits["old_cell"]), ptr(new_h), ptr(new_cell),
                           ctypes.c_longlong(batch * state), ctypes.c_int(state))
    assert _normalised(from_bits(new_h), ref_h) <= BF16_TOLERANCE
    assert _normalised(from_bits(new_cell), ref_c) <= BF16_TOLERANCE
    # backward from the kernel's own saved pre-activations and new_cell
    from lltm_cupy import reference

    z = from_bits(gates).reshape(batch, 3 * state)
    i, o = (1 / (1 + np.exp(-z[:, k * state:(k + 1) * state])) for k in (0, 1))
    zc = z[:, 2 * state:]
    g = np.where(zc > 0, zc, np.expm1(np.minimum(zc, 0)))
    ref_d_gates, ref_d_nc = reference.lltm_backward_gates(
        case["grad_h"], case["grad_cell"], from_bits(new_cell), i, o, g, z)
    d_gates = np.zeros((batch, 3 * state), np.uint16)
    d_old_cell = np.zeros((batch, state), np.uint16)
    host_lib.lltm_bwd_bf16(ctypes.c_uint(2), ctypes.c_uint(64), ptr(bits["grad_h"]),
                           ptr(bits["grad_cell"]), ptr(gates), ptr(new_cell), ptr(d_gates),
                           ptr(d_old_cell), ctypes.c_int(1), ctypes.c_int(1),
                           ctypes.c_longlong(batch * state), ctypes.c_int(state))
    assert _normalised(from_bits(d_gates), ref_d_gates) <= BF16_TOLERANCE
    assert _normalised(from_bits(d_old_cell), ref_d_nc) <= BF16_TOLERANCE


def test_host_add_kernel_in_bfloat16(host_lib):
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal(1000) for _ in range(2))
    xb, yb = to_bits(x), to_bits(y)
    host_lib.lltm_add_bf16(ctypes.c_uint(2), ctypes.c_uint(64), ptr(xb), ptr(yb),
                           ctypes.c_longlong(1000))
    want = to_bits(from_bits(to_bits(x)).astype(np.float32) + from_bits(yb).astype(np.float32))
    assert np.array_equal(xb, want)  # float32 sum of the two, rounded once
