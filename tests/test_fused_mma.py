"""The host shim's warp-level mma.sync.m16n8k16 (tests/host_shim/shim.h), which the fused
forward on tensor cores (cuda_src/lltm_fused_mma.cu) runs on, without a GPU.

Runs everywhere (g++ and the NVRTC wheel, no GPU).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from helpers import host_fused

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install .[test])")

#: the 16-bit types of the product: NumPy dtype of the values, and the bits' view
TYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def fused_lib(tmp_path_factory):
    return host_fused.build(tmp_path_factory.mktemp("mma_host"))


# ------------------------------------------------------------------ the shim's warp-level product

def fragments(a, b, c):
    """Each lane's registers for mma.m16n8k16 (A 16x16 row-major, B 16x8 col-major, C 16x8 f32),
    by the PTX ISA's "Matrix Fragments for mma.m16n8k16 with floating point type": groupID =
    lane >> 2, tig = lane % 4; A's a_i (register i // 2, low half first) at row groupID for
    i in {0, 1, 4, 5} else groupID + 8, col 2 tig + (i & 1) (+ 8 for i >= 4); B's b_i at row
    2 tig + (i & 1) (+ 8 for i >= 2), col groupID; C's c_i at row groupID (+ 8 for i >= 2), col
    2 tig + (i & 1). Returns (a (32, 4) uint32, b (32, 2) uint32, c (32, 4) float32)."""
    bits_a, bits_b = a.view(np.uint16).astype(np.uint32), b.view(np.uint16).astype(np.uint32)
    fa, fb, fc = (np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32),
                  np.zeros((32, 4), np.float32))
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        for i in range(8):
            row = g if i in (0, 1, 4, 5) else g + 8
            col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
            fa[lane, i // 2] |= bits_a[row, col] << (16 * (i & 1))
        for i in range(4):
            fb[lane, i // 2] |= bits_b[2 * t + (i & 1) + (8 if i >= 2 else 0), g] << (16 * (i & 1))
        for i in range(4):
            fc[lane, i] = c[g + (8 if i >= 2 else 0), 2 * t + (i & 1)]
    return fa, fb, fc


def result_matrix(d):
    """D (16, 8) from the lanes' result registers (32, 4), by the C/D layout above."""
    out = np.full((16, 8), np.nan, np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        for i in range(4):
            out[g + (8 if i >= 2 else 0), 2 * t + (i & 1)] = d[lane, i]
    return out


def shim_order(a, b, c):
    """The shim's documented float32 arithmetic: exact products, a pairwise tree over k, then C."""
    p = a.astype(np.float32)[:, :, None] * b.astype(np.float32)[None, :, :]     # (16, 16, 8)
    while p.shape[1] > 1:
        p = p[:, 0::2] + p[:, 1::2]
    return c + p[:, 0]


def run_mma(lib, kind, mats, skip=-1, barrier_lane=-1):
    """One block of len(mats) warps, warp w computing mats[w] = (a, b, c); D per warp."""
    frags = [fragments(*m) for m in mats]
    fa, fb, fc = (np.ascontiguousarray(np.stack([f[i] for f in frags])) for i in range(3))
    d = np.full((len(mats), 32, 4), np.nan, np.float32)
    lib.lltm_host_mma_selftest(ctypes.c_uint(len(mats)), ctypes.c_int(kind == "bfloat16"),
                               host_fused.ptr(fa), host_fused.ptr(fb), host_fused.ptr(fc),
                               host_fused.ptr(d), ctypes.c_int(skip), ctypes.c_int(barrier_lane))
    error = lib.lltm_host_last_error()
    return [result_matrix(x) for x in d], None if error is None else error.decode()


def random_case(rng, dtype, scale=1.0):
    a = (rng.standard_normal((16, 16)) * scale).astype(dtype)
    b = (rng.standard_normal((16, 8)) * scale).astype(dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    return a, b, c


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("seed", range(4))
def test_shim_mma_equals_numpy(fused_lib, kind, seed):
    """Two warps, each one 16x8x16 product of random 16-bit A, B and float32 C: D equals the
    shim's documented float32 order bit for bit, and the float64 product within float32
    rounding."""
    rng = np.random.default_rng(seed)
    mats = [random_case(rng, TYPES[kind]), random_case(rng, TYPES[kind], scale=3.0)]
    for order in host_fused.SCHEDULES:
        host_fused.set_schedule(fused_lib, order, seed=seed)
        got, error = run_mma(fused_lib, kind, mats)
        assert error is None, error
        for (a, b, c), d in zip(mats, got):
            np.testing.assert_array_equal(d, shim_order(a, b, c))
            exact = a.astype(np.float64) @ b.astype(np.float64) + c
            bound = 18 * np.finfo(np.float32).eps * (np.abs(a.astype(np.float64))
                                                     @ np.abs(b.astype(np.float64)) + np.abs(c))
            assert (np.abs(d - exact) <= bound).all(), order
    host_fused.set_schedule(fused_lib, "ascending")


def test_shim_mma_reads_each_fragment_where_the_ptx_layout_puts_it(fused_lib):
    """One-hot operands: A = e_(m, k), B = e_(k, n) gives D = e_(m, n) and nothing elsewhere, for
    every (m, k) and a spread of (k, n): a lane or register swapped anywhere shows."""
    for m in range(16):
        for k in range(16):
            a = np.zeros((16, 16), np.float16)
            b = np.zeros((16, 8), np.float16)
            a[m, k] = 1
            n = (m + k) % 8
            b[k, n] = 2
            got, error = run_mma(fused_lib, "float16", [(a, b, np.zeros((16, 8), np.float32))])
            assert error is None, error
            want = np.zeros((16, 8), np.float32)
            want[m, n] = 2
            np.testing.assert_array_equal(got[0], want, err_msg=f"m={m} k={k} n={n}")


@pytest.mark.parametrize("case", ["returns", "waits at __syncthreads"])
def test_a_lane_missing_from_the_warp_product_is_an_error(fused_lib, case):
    rng = np.random.default_rng(0)
    mats = [random_case(rng, np.float16), random_case(rng, np.float16)]
    kw = {"skip": 37} if case == "returns" else {"barrier_lane": 5}
    _, error = run_mma(fused_lib, "float16", mats, **kw)
    assert error is not None and "warp-level product" in error, error
    _, error = run_mma(fused_lib, "float16", mats)        # the same launch with every lane
    assert error is None
