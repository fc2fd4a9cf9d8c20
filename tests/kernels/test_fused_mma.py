"""The fused kernels on tensor cores (cuda_src/lltm_fused_mma.cu) without a GPU: first the host
shim's warp-level mma.sync.m16n8k16 itself (tests/host_shim/shim.h), then the kernels built as
host C++ against the stepped path and the float64 reference, a missing barrier caught, NVRTC
builds, register pins and ptxas.

Runs everywhere (g++ and the NVRTC wheel, no GPU).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from helpers import host_fused, mutants
from helpers.host_kernels import ptr

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


# ------------------------------------------------------------------ the kernels on tensor cores

from lltm_cupy._cuda import fused_kernels as _fused_kernels, fused_mma as _mma  # noqa: E402
from lltm_cupy._cuda import group_kernels as _group_kernels, kernels as _kernels  # noqa: E402
from conftest import max_error  # noqa: E402
from test_fused_sequence import (  # noqa: E402
    LIMIT, OUT, _group_kernels_not_built, _reference, compare, make, run)

DTYPES16 = {"float16": np.dtype(np.float16), "bfloat16": _kernels.BFLOAT16}


@pytest.fixture
def mma_cupy(emulated_cupy, monkeypatch, fused_lib):
    """The emulated CuPy on an sm_90 device (LIMIT bytes of shared memory per block, one SM
    unless a test patches _kernels._sm_count): the 16-bit kernels run the host build of
    lltm_fused_mma.cu where it applies, else lltm_fused.cu's."""
    monkeypatch.setattr(_fused_kernels, "get_kernels",
                        host_fused.host_get_fused_kernels(fused_lib, LIMIT))
    monkeypatch.setattr(_mma, "get_kernels", host_fused.host_get_mma_kernels(fused_lib, LIMIT))
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 90)
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    host_fused.set_schedule(fused_lib, "ascending")
    yield emulated_cupy
    host_fused.set_schedule(fused_lib, "ascending")


def check(xp, T, B, F, S, dtype, lengths, reverse, seed):
    """The fused path against the stepped path and the float64 reference
    (test_fused_sequence.compare: the suite's 16-bit tolerances), forward and every gradient; the
    forward ran on tensor cores, and the backward too where its shared memory fits."""
    stored, case = make(T, B, F, S, dtype, seed=seed)
    emu = xp.emulator
    emu.reset()
    fused = run(xp, stored, lengths, reverse, True)
    assert emu.log.count("kernel:seq_fwd") == 1 and emu.log.count("kernel:seq_bwd") == 1
    assert emu.log.count("variant:mma") == 1 + _mma.usable(S, dtype, backward=True)
    stepped = run(xp, stored, lengths, reverse, False)
    full = [T] * B if lengths is None else lengths
    want = _reference(case, full, reverse, (case["grad_outputs"], case["grad_h_n"],
                                            case["grad_c_n"]))
    compare(fused, stepped, want, dtype, f"{np.dtype(dtype)} S={S}")
    return fused


LENGTHS = {"full": None, "zeros and ties": [3, 0, 5, 1, 5, 0, 2]}


@pytest.mark.parametrize("state", [8, 20, 64])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
def test_mma_kernels_equal_stepped_and_reference(mma_cupy, monkeypatch, dtype, lengths, reverse,
                                                  state):
    """7 rows over 3 "SMs": tiles of 3 rows, the last block with 1 (a tile that does not divide
    the batch), lengths with zeros, both directions; S = 8 and 20 padded to whole k-tiles of 16,
    S = 64 four s-tiles (four warps)."""
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 3)
    check(mma_cupy, 5, 7, 4, state, dtype, lengths, reverse, seed=state + reverse)


@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
def test_mma_kernels_at_128_and_the_largest_states(mma_cupy, dtype):
    """S = 128 (eight warps, one per s-tile) and the largest S each kernel takes in one block on
    sm_90: 176 backward (11 s-tiles over eight warps), 192 forward (with the FMA backward)."""
    top = max(s for s in range(1, 400) if _mma.shared_bytes(s, 1) <= LIMIT)
    top_bwd = max(s for s in range(1, 400) if _mma.shared_bytes(s, 1, True) <= LIMIT)
    assert (top, top_bwd) == (192, 176)
    assert _mma.usable(top, dtype) and not _mma.usable(top + 1, dtype)
    assert _mma.usable(top_bwd, dtype, True) and not _mma.usable(top_bwd + 1, dtype, True)
    for state in (128, top_bwd, top):
        check(mma_cupy, 3, 2, 3, state, dtype, [3, 2], False, seed=state)


@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
def test_mma_kernels_with_tiles_of_several_n_tiles_and_warps_with_several_jobs(
        mma_cupy, monkeypatch, dtype):
    """20 rows on one SM: one tile of 20 rows, three n-tiles of 8 (the last with 4), rows ending
    at different steps in every n-tile; two warps for 2 s-tiles x 3 n-tiles of jobs."""
    monkeypatch.setattr(_mma, "WARPS", 2)
    lengths = [(7 * b) % 6 for b in range(20)]
    check(mma_cupy, 5, 20, 3, 24, dtype, lengths, True, seed=2)


def test_mma_kernels_do_not_depend_on_the_thread_order(mma_cupy, fused_lib, monkeypatch):
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 2)
    stored, _ = make(6, 5, 3, 40, np.dtype(np.float16), seed=5)
    results = {}
    for order in host_fused.SCHEDULES:
        host_fused.set_schedule(fused_lib, order, seed=7)
        results[order] = run(mma_cupy, stored, [6, 2, 0, 6, 3], True, True)
    for order, got in results.items():
        for name, a, b in zip(OUT, got, results["ascending"]):
            assert np.array_equal(a, b), f"{name} differs between ascending and {order} order"


@pytest.mark.parametrize("lengths", [None, [9, 0, 4]], ids=["full", "ragged"])
def test_mma_forward_only_in_blocks_of_steps_gives_the_same_bits(mma_cupy, monkeypatch, lengths):
    import lltm_cupy
    from lltm_cupy._cuda import sequence as _sequence

    monkeypatch.setattr(_sequence, "_BLOCK_ROWS", 6)        # 2 steps of 3 rows per block
    emu = mma_cupy.emulator
    stored, _ = make(9, 3, 2, 18, np.dtype(np.float16), seed=4)
    a = {k: mma_cupy.asarray(v) for k, v in stored.items()}
    args = [a[n] for n in ("inputs", "weights", "bias", "h0", "c0")]
    kept = lltm_cupy.forward_sequence(*args, lengths=lengths, fused=True)
    emu.reset()
    only = lltm_cupy.forward_sequence(*args, lengths=lengths, fused=True, return_saved=False)
    assert only[3] is None
    assert emu.log.count("variant:mma") == 5 and emu.log.count("kernel:seq_fwd") == 5
    for name, x, y in zip(OUT, only[:3], kept[:3]):
        assert np.array_equal(np.asarray(x), np.asarray(y)), name


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


def test_launcher_shared_memory_is_the_kernels(fused_lib):
    """fused_mma.shared_bytes is the kernels' own lltm_mma_fwd_bytes / lltm_mma_bwd_bytes."""
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


# ------------------------------------------------------------------------ a missing barrier

_MMA_TEXT = _kernels.source_path(_mma.SOURCE_NAME).read_text()


@pytest.mark.parametrize("which", range(len(mutants.statements("mma"))))
@pytest.mark.slow
def test_deleting_a_barrier_is_caught(which, tmp_path, emulated_cupy, monkeypatch):
    """Each __syncthreads() of lltm_fused_mma.cu deleted in turn (all of them in one build:
    tests/helpers/mutants.py): the host run gives results off the reference (the control:
    test_mma_kernels_equal_stepped_and_reference, and below on the mutants' build)."""
    assert len(mutants.statements("mma")) == _MMA_TEXT.count("__syncthreads();") == 5
    lib = host_fused.build(tmp_path, sources=mutants.sources("harness_fused.cpp"))
    mutants.delete(lib, "mma", which)
    monkeypatch.setattr(_fused_kernels, "get_kernels", host_fused.host_get_fused_kernels(lib, LIMIT))
    monkeypatch.setattr(_mma, "get_kernels", host_fused.host_get_mma_kernels(lib, LIMIT))
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 90)
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    stored, case = make(4, 3, 3, 40, np.dtype(np.float16), seed=1)
    want = _reference(case, [4, 4, 4], False, (case["grad_outputs"], case["grad_h_n"],
                                               case["grad_c_n"]))
    try:
        got = run(emulated_cupy, stored, None, False, True)
    except AssertionError as exc:       # the shim's report
        assert "warp-level product" in str(exc) or "__syncthreads" in str(exc)
        return
    errors = {name: max_error(g, w) for name, g, w in zip(OUT, got, want)}
    assert max(e if np.isfinite(e) else np.inf for e in errors.values()) > 0.1, \
        f"barrier {which} deleted, yet every result is near the reference: {errors}"


@pytest.mark.slow
def test_the_mutants_build_with_none_deleted_gives_the_sources_bits(tmp_path, emulated_cupy,
                                                                   fused_lib, monkeypatch):
    """The control of the test above on its build (every barrier of lltm_fused_mma.cu and
    lltm_fused.cu behind the mutants' switch, none deleted): the run it makes gives the bits of
    the build of the source as it is."""
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 90)
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    stored, _ = make(4, 3, 3, 40, np.dtype(np.float16), seed=1)
    gated = host_fused.build(tmp_path, sources=mutants.sources("harness_fused.cpp"))
    mutants.delete(gated, None)
    results = []
    for lib in (fused_lib, gated):
        with monkeypatch.context() as m:
            m.setattr(_fused_kernels, "get_kernels", host_fused.host_get_fused_kernels(lib, LIMIT))
            m.setattr(_mma, "get_kernels", host_fused.host_get_mma_kernels(lib, LIMIT))
            results.append(run(emulated_cupy, stored, None, False, True))
    for name, a, b in zip(OUT, *results):
        assert np.array_equal(a, b), name


# -------------------------------------------------------------------------------- compilers

#: Registers per thread of the mma kernels as NVRTC 13.x compiles them (no local memory in any;
#: 48 of them hold the W_h fragments kept in registers, LLTM_MMA_KEPT):
#:                 float16  bfloat16
#:   sm_80  fwd      128      127
#:          bwd      116      114
#:   sm_90  fwd      160      160
#:          bwd      124      120
#:   sm_100 fwd      126      127
#:          bwd      119      120
MMA_REGISTERS = {(80, "fwd"): (128, 127), (80, "bwd"): (116, 114), (90, "fwd"): (160, 160),
                 (90, "bwd"): (124, 120), (100, "fwd"): (126, 127), (100, "bwd"): (119, 120)}
ARCHS = (80, 90, 100)


def _ceiling(arch, name, compiler="nvrtc"):
    from helpers import cubin as _cubin

    kernel = "fwd" if "lltm_seq_fwd_mma_kernel" in name else "bwd"
    assert f"lltm_seq_{kernel}_mma_kernel" in name, name
    return _cubin.register_ceiling(MMA_REGISTERS[arch, kernel][0 if "lltm_half" in name else 1],
                                   compiler)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
@pytest.mark.slow
def test_nvrtc_compiles_the_mma_kernels(dtype, arch):
    """NVRTC builds both kernels for sm_80, sm_90 and sm_100 with the tensor-core instruction of
    the dtype in the PTX (header-free inline PTX), no local memory, registers within the pins."""
    from helpers import cubin as _cubin

    kind = "f16" if dtype == np.float16 else "bf16"
    ptx = _mma.compile_offline(dtype, arch, output="ptx").decode()
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32" in ptx
    assert "trap;" not in ptx
    cubin = _mma.compile_offline(dtype, arch, output="cubin")
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return an ELF cubin"
    resources = _cubin.kernel_resources(cubin)
    assert len(resources) == 2, sorted(resources)
    for name, r in resources.items():
        assert r.get("frame") == 0 and r.get("stack") == 0, f"sm_{arch} {name}: local memory {r}"
        ceiling = _ceiling(arch, name)
        assert 0 < r["registers"] <= ceiling, f"sm_{arch} {name}: {r['registers']} > {ceiling}"
        assert r["registers"] * 32 * _mma.WARPS <= 65536


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow
def test_ptxas_reports_no_spill_for_the_mma_kernels(arch):
    """ptxas -v (nvcc) on both kernels in both dtypes: no spill or stack frame, the registers NVRTC's
    cubin records (the pins above), no static shared memory."""
    import shutil
    from helpers import cubin as _cubin
    from test_fused_sequence import _run_ptxas

    nvcc = shutil.which("nvcc")
    assert nvcc, "nvcc (CUDA toolkit) is required for the ptxas check"
    report, cubin = _run_ptxas(nvcc, arch, _mma.source(),
                               [_mma.name_expression(k, d) for d in DTYPES16.values()
                                for k in _mma.KERNEL_NAMES])
    assert len(report) == 4, sorted(report)
    read = _cubin.kernel_resources(cubin)
    for name, r in report.items():
        assert r["spills"] == (0, 0) and r["frame"] == 0, f"sm_{arch} {name}: spills {r}"
        assert r["registers"] == read[name]["registers"], (r, read[name])
        assert r["registers"] <= _ceiling(arch, name, "ptxas"), f"sm_{arch} {name}: {r}"
        assert r["smem"] == 0, f"sm_{arch} {name}: static shared memory {r['smem']}"


def test_warmup_with_fused_compiles_the_mma_kernels(mma_cupy, monkeypatch):
    """lltm_cupy.warmup(..., fused=True) on an sm_80 device compiles the mma kernels of each
    16-bit dtype (its fused calls run them), so that the fused calls after it compile nothing."""
    import lltm_cupy

    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 80)   # no clusters
    emu = mma_cupy.emulator
    # on sm_80 warmup also compiles the group kernels (tests/kernels/test_fused_group.py):
    # recorded only
    monkeypatch.setattr(_group_kernels, "get_kernels", _group_kernels_not_built)
    lltm_cupy.warmup(["float16", "bfloat16"])
    assert not [c for c in emu.compiles if c[0] == "lltm_fused_mma.cu"]
    lltm_cupy.warmup(["float16", "bfloat16"], fused=True)
    for dtype in DTYPES16.values():
        assert ("lltm_fused_mma.cu", dtype.str) in emu.compiles
    emu.reset()
    for dtype in DTYPES16.values():
        stored, _ = make(3, 4, 2, 5, dtype, seed=0)
        for lengths, reverse in ((None, False), ([3, 0, 2, 1], True)):
            run(mma_cupy, stored, lengths, reverse, True)
    assert emu.log.count("variant:mma") == 8       # each call's forward and backward
    assert emu.compiles == [], f"compiled after warmup: {emu.compiles}"


def test_fused_kernel_time_script_times_the_mma_kernels(mma_cupy, capsys):
    """scripts/fused_kernel_time.py on an sm_90 device: in bfloat16 the kernels it times are the
    tensor-core ones (the calls run them)."""
    from helpers import gpu_scripts

    script = gpu_scripts.load("fused_kernel_time")
    real = _mma.get_kernels
    emu = mma_cupy.emulator
    emu.reset()
    status = script.main(["--sizes", "5x3x2x20", "--dtypes", "bfloat16", "--runs", "2",
                          "--warmup", "0"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert _mma.get_kernels is real                # restored
    assert emu.log.count("variant:mma") >= 6      # the check, then each timed run, both ways
    row = [line.split() for line in out.splitlines() if line.split()[:1] == ["5"]]
    assert len(row) == 1, out
    fwd, bwd, whole = map(float, row[0][5:8])
    assert 0 < fwd and 0 < bwd and fwd + bwd <= whole, row


# ---------------------------------------------------------------------------------- on a GPU

from conftest import gpu_unavailable_reason  # noqa: E402

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


@pytest.mark.gpu
@pytest.mark.skipif(_GPU_REASON is not None, reason=f"GPU test: {_GPU_REASON}")
@pytest.mark.parametrize("state", [40, 128])
@pytest.mark.parametrize("lengths", [None, [7, 0, 3, 7, 1]], ids=["full", "ragged"])
@pytest.mark.parametrize("dtype", DTYPES16.values(), ids=DTYPES16.keys())
def test_gpu_mma_kernels_equal_the_stepped_path(dtype, lengths, state):
    """The tensor-core kernels on a real GPU (sm_80+) against the stepped path and the float64
    reference, forward and every gradient, reverse with ragged lengths."""
    import cupy

    _sm80_or_skip(cupy)
    device = cupy.cuda.Device().id
    assert _mma.usable(state, dtype) and _mma.usable(state, dtype, True)
    stored, case = make(7, 5, 6, state, dtype, seed=state)
    reverse = lengths is not None
    fused = run(cupy, stored, lengths, reverse, True)
    assert ("fused_mma", device, np.dtype(dtype).str) in _kernels._cache   # they ran
    stepped = run(cupy, stored, lengths, reverse, False)
    full = [7] * 5 if lengths is None else lengths
    want = _reference(case, full, reverse, (case["grad_outputs"], case["grad_h_n"],
                                            case["grad_c_n"]))
    compare(fused, stepped, want, dtype, "gpu")


@pytest.mark.parametrize("lengths", [None, [5, 2, 1, 4]], ids=["padded", "packed"])
def test_torch_lltm_fused_bfloat16_runs_the_mma_kernels(mma_cupy, emulated_cuda_torch, lengths):
    """LLTM(fused=True) in bfloat16 on the emulated CUDA path of an sm_90 device: 2 layers,
    bidirectional, each layer and direction one tensor-core launch each way, results within the
    bfloat16 tolerance of the default path's."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt
    from test_fused_sequence import _torch_case, _torch_run

    xs, hx = _torch_case(torch, torch.bfloat16)
    torch.manual_seed(1)
    default = lt.LLTM(3, 6, num_layers=2, bidirectional=True, dtype=torch.bfloat16)
    fused = lt.LLTM(3, 6, num_layers=2, bidirectional=True, dtype=torch.bfloat16, fused=True)
    fused.load_state_dict(default.state_dict())
    emu = mma_cupy.emulator
    want = _torch_run(torch, default, xs, hx, lengths)
    emu.reset()
    got = _torch_run(torch, fused, xs, hx, lengths)
    assert emu.log.count("kernel:seq_fwd") == 4 and emu.log.count("kernel:seq_bwd") == 4
    assert emu.log.count("variant:mma") == 8
    for i, (g, w) in enumerate(zip(got, want)):
        assert max_error(g, w) <= 2e-2, f"result {i}: {max_error(g, w):.2e}"
