"""What only the tensor-core variant of the fused kernels has (cuda_src/lltm_fused_mma.cu,
lltm_cupy/_cuda/fused_mma.py): first the host shim's warp-level mma.sync.m16n8k16 itself
(tests/host_shim/shim.h) against NumPy and a second reading of the PTX fragment layout
(CUTLASS's), then the kernels' geometry: tiles of several n-tiles and warps with several jobs,
the dtypes and architectures that keep the FMA kernels, the shared-memory layout and bounds,
the fragments kept in registers; and on a real GPU the instruction against the shim's layout.
The cases every variant shares: test_fused_variants.py (``mma``).

Runs everywhere (g++, no GPU) but the GPU tests.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from lltm_cupy._cuda import fused_mma as _mma, kernels as _kernels
from conftest import gpu_unavailable_reason
from helpers import host_fused
from helpers.fused_cases import DTYPES16, LIMIT, OUT, check_fused, make, run
from helpers.fused_devices import MMA
from helpers.host_kernels import ptr

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install .[test])")


#: the 16-bit types of the product: NumPy dtype of the values, and the bits' view
TYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


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
                               ptr(fa), ptr(fb), ptr(fc),
                               ptr(d), ctypes.c_int(skip), ctypes.c_int(barrier_lane))
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


def _cute_coordinates(shape, stride, lanes_values, rows):
    """(row, col) of every (lane, value) of a CuTe layout ``((4, 8), values):((s0, s1), strides)``
    over a column-major (rows, cols) matrix."""
    (t_shape, v_shape), (t_stride, v_stride) = shape, stride
    coords = {}
    for lane in range(32):
        t0, t1 = lane % t_shape[0], lane // t_shape[0]
        for v in range(lanes_values):
            offset, rest = t0 * t_stride[0] + t1 * t_stride[1], v
            for n, step in zip(v_shape, v_stride):
                offset, rest = offset + (rest % n) * step, rest // n
            coords[lane, v] = (offset % rows, offset // rows)
    return coords


def test_fragment_layouts_equal_cutlass_layouts():
    """The fragments the tests (and so the shim's checks) build, against a second reading of
    NVIDIA's layout: CUTLASS's cute/atom/mma_traits_sm80.hpp, SM80_16x8x16_F32F16F16F32_TN,
    ALayout ((4,8),(2,2,2)):((32,1),(16,8,128)) over A (M 16, K 16), BLayout
    ((4,8),(2,2)):((16,1),(8,64)) over B^T (N 8, K 16), CLayout SM80_16x8_Row
    ((4,8),(2,2)):((32,1),(16,8)) over C (M 16, N 8); value v of a register pair is the pair's
    low half when v is even."""
    a_at = _cute_coordinates(((4, 8), (2, 2, 2)), ((32, 1), (16, 8, 128)), 8, 16)   # (m, k)
    b_at = _cute_coordinates(((4, 8), (2, 2)), ((16, 1), (8, 64)), 4, 8)           # (n, k)
    c_at = _cute_coordinates(((4, 8), (2, 2)), ((32, 1), (16, 8)), 4, 16)          # (m, n)
    # matrices whose every element is its own index, as 16-bit patterns
    a = np.arange(256, dtype=np.uint16).reshape(16, 16).view(np.float16)
    b = np.arange(128, dtype=np.uint16).reshape(16, 8).view(np.float16)
    c = np.arange(128, dtype=np.float32).reshape(16, 8)
    fa, fb, fc = fragments(a, b, c)
    for lane in range(32):
        for v in range(8):
            m, k = a_at[lane, v]
            assert (int(fa[lane, v // 2]) >> (16 * (v & 1))) & 0xFFFF == 16 * m + k, (lane, v)
        for v in range(4):
            n, k = b_at[lane, v]
            assert (int(fb[lane, v // 2]) >> (16 * (v & 1))) & 0xFFFF == 8 * k + n, (lane, v)
            m, n = c_at[lane, v]
            assert fc[lane, v] == 8 * m + n, (lane, v)
    d = np.zeros((32, 4), np.float32)
    for (lane, v), (m, n) in c_at.items():
        d[lane, v] = 8 * m + n
    assert np.array_equal(result_matrix(d), c)


@pytest.mark.parametrize("case", ["returns", "waits at __syncthreads"])
def test_a_lane_missing_from_the_warp_product_is_an_error(fused_lib, case):
    rng = np.random.default_rng(0)
    mats = [random_case(rng, np.float16), random_case(rng, np.float16)]
    kw = {"skip": 37} if case == "returns" else {"barrier_lane": 5}
    _, error = run_mma(fused_lib, "float16", mats, **kw)
    assert error is not None and "warp-level product" in error, error
    _, error = run_mma(fused_lib, "float16", mats)        # the same launch with every lane
    assert error is None


# ------------------------------------------------------------------ the kernels' geometry


@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
def test_mma_kernels_with_tiles_of_several_n_tiles_and_warps_with_several_jobs(
        mma_cupy, monkeypatch, dtype):
    """20 rows on one SM: one tile of 20 rows, three n-tiles of 8 (the last with 4), rows ending
    at different steps in every n-tile; two warps for 2 s-tiles x 3 n-tiles of jobs."""
    monkeypatch.setattr(_mma, "WARPS", 2)
    lengths = [(7 * b) % 6 for b in range(20)]
    stored, case = make(5, 20, 3, 24, dtype, seed=2)
    emu = mma_cupy.emulator
    emu.reset()
    check_fused(mma_cupy, stored, case, lengths, True, dtype, "several n-tiles",
                ran=lambda: MMA.assert_ran(emu, 24, dtype))


def test_float32_float64_and_old_architectures_keep_the_fma_kernels(mma_cupy, monkeypatch):
    for dtype in (np.float32, np.float64):
        assert not _mma.usable(16, dtype) and not _mma.usable(16, dtype, True)
    assert _mma.usable(16, np.float16) and _mma.usable(16, np.float16, True)
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 75)
    assert not _mma.usable(16, np.float16)
    emu = mma_cupy.emulator
    stored, _ = make(3, 2, 2, 8, np.dtype(np.float16), seed=1)
    emu.reset()
    run(mma_cupy, stored, None, False, True)
    assert "variant:mma" not in emu.log and emu.log.count("kernel:seq_fwd") == 1
    assert emu.log.count("kernel:seq_bwd") == 1


def test_launcher_shared_memory_is_the_kernels(mma_cupy, fused_lib):
    """fused_mma.shared_bytes is the kernels' own lltm_mma_fwd_bytes / lltm_mma_bwd_bytes; the
    largest S each kernel takes in one block on sm_90: 192 forward, 176 backward
    (test_fused_variants.py runs both)."""
    top = max(s for s in range(1, 400) if _mma.shared_bytes(s, 1) <= LIMIT)
    top_bwd = max(s for s in range(1, 400) if _mma.shared_bytes(s, 1, True) <= LIMIT)
    assert (top, top_bwd) == (192, 176)
    for dtype in DTYPES16.values():
        assert _mma.usable(top, dtype) and not _mma.usable(top + 1, dtype)
        assert _mma.usable(top_bwd, dtype, True) and not _mma.usable(top_bwd + 1, dtype, True)
    fused_lib.lltm_host_mma_fwd_bytes.restype = ctypes.c_longlong
    fused_lib.lltm_host_mma_bwd_bytes.restype = ctypes.c_longlong
    for state in (1, 8, 15, 16, 17, 100, 128, 192):
        for tile in (1, 3, 8, 9, 20):
            assert fused_lib.lltm_host_mma_fwd_bytes(state, tile) == _mma.shared_bytes(state, tile)
            assert fused_lib.lltm_host_mma_bwd_bytes(state, tile) == \
                _mma.shared_bytes(state, tile, True)


@pytest.mark.slow
def test_the_fragments_kept_in_registers_change_no_bit(mma_cupy, monkeypatch, tmp_path):
    """S = 128 on one row per block (eight jobs, eight warps: each warp keeps its first
    k-tiles' fragments in registers) gives the bits of the same source with nothing kept in
    registers (every fragment read from shared memory), both ways; S = 192 (twelve jobs over
    eight warps) keeps none."""
    text = _kernels.source_path(_mma.SOURCE_NAME).read_text()
    none = text.replace("const int kept = jobs <= warps ? min(KT, LLTM_MMA_KEPT) : 0;",
                        "const int kept = 0;").replace(
        "const int kept = jobs <= warps ? min(3 * KT, 3 * LLTM_MMA_KEPT) : 0;",
        "const int kept = 0;")
    assert none.count("const int kept = 0;") == 2
    (tmp_path / _mma.SOURCE_NAME).write_text(none)
    lib = host_fused.build(tmp_path, source_dir=tmp_path)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 2)
    for dtype in DTYPES16.values():
        stored, _ = make(4, 2, 3, 128, dtype, seed=8)
        kept = run(mma_cupy, stored, [4, 3], True, True)
        with monkeypatch.context() as m:
            m.setattr(_mma, "get_kernels", host_fused.host_get_mma_kernels(lib, LIMIT))
            shared = run(mma_cupy, stored, [4, 3], True, True)
        for name, a, b in zip(OUT, kept, shared):
            assert np.array_equal(a, b), name


# ---------------------------------------------------------------------------------- on a GPU


_GPU_REASON = gpu_unavailable_reason()


#: a kernel of one block of 32 * warps threads handing each lane's registers to the wrappers of
#: lltm_fused_mma.cu (as lltm_host_mma_selftest does in the host build)
_MMA_SELFTEST = r'''
extern "C" __global__ void lltm_mma_selftest(int bf16, const unsigned* a, const unsigned* b,
                                             const float* c, float* d) {
  const unsigned t = threadIdx.x;
  float out[4];
  if (bf16) {
    lltm_mma_16816_bf16(out, a + 4 * t, b + 2 * t, c + 4 * t);
  } else {
    lltm_mma_16816_f16(out, a + 4 * t, b + 2 * t, c + 4 * t);
  }
  for (int i = 0; i < 4; ++i) d[4 * t + i] = out[i];
}
'''


def _sm80_or_skip(cupy):
    arch = _kernels.compute_capability(cupy.cuda.Device().id)
    if arch < _mma.MIN_ARCH:
        pytest.skip(f"GPU test: sm_{arch} has no mma.sync.m16n8k16 (sm_80 and newer)")


@pytest.mark.gpu
@pytest.mark.skipif(_GPU_REASON is not None, reason=f"GPU test: {_GPU_REASON}")
@pytest.mark.parametrize("kind", TYPES)
def test_gpu_mma_instruction_matches_the_shim_layout(kind):
    """The tensor cores' product of the fragments the shim's layout (fragments() above) builds
    is the NumPy product, within float32 rounding (the hardware's order of the sums is its own):
    the PTX layout the shim emulates is the GPU's."""
    import cupy

    _sm80_or_skip(cupy)
    rng = np.random.default_rng(3)
    mats = [random_case(rng, TYPES[kind]) for _ in range(2)]
    frags = [fragments(*m) for m in mats]
    fa, fb, fc = (cupy.asarray(np.stack([f[i] for f in frags])) for i in range(3))
    d = cupy.full((2, 32, 4), np.nan, np.float32)
    module = cupy.RawModule(code=_mma.source() + _MMA_SELFTEST, options=("-ftz=true",))
    module.get_function("lltm_mma_selftest")((1,), (64,), (np.int32(kind == "bfloat16"), fa, fb,
                                                          fc, d))
    for (a, b, c), got in zip(mats, cupy.asnumpy(d)):
        exact = a.astype(np.float64) @ b.astype(np.float64) + c
        bound = 18 * np.finfo(np.float32).eps * (np.abs(a.astype(np.float64))
                                                 @ np.abs(b.astype(np.float64)) + np.abs(c))
        assert (np.abs(result_matrix(got) - exact) <= bound).all()
