"""The fused whole-sequence kernels (cuda_src/lltm_fused.cu, lltm_cupy/_cuda/fused.py), without a
GPU: the CUDA source built as host C++ with real block semantics (tests/host_shim/shim.h:
a context per thread, __syncthreads() a barrier, per-block shared memory) and launched from the
GPU backend on the emulated CuPy; against the stepped path and the float64 reference, forward
and every gradient. Also: a missing __syncthreads() is caught, NVRTC compiles the kernels for
every architecture and dtype, ptxas reports no spill, and the shared-memory bound per
architecture. The last test runs the fused path on a real GPU where there is one.

Runs everywhere (g++, the NVRTC wheel and nvcc, no GPU); only the GPU test may skip.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from lltm_cupy import _packing
from lltm_cupy._cuda import fused as _fused, fused_kernels as _fused_kernels, kernels as _kernels
from lltm_cupy._cuda import group_kernels as _group_kernels
from conftest import (TOLERANCE, assert_engines_agree, gpu_unavailable_reason, max_error,
                      to_numpy)
from helpers import cubin as _cubin, host_fused, mutants
from test_array_lengths import _reference

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install .[test])")

BF16 = _kernels.BFLOAT16
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32),
          "float64": np.dtype(np.float64)}
#: the emulated device's opt-in shared memory per block: an H100/H200's (sm_90)
LIMIT = _fused.ARCH_SHARED_MEMORY[90]
#: fused vs stepped (they differ in the order of the recurrent product's sums, then in what the
#: roundings of a 16-bit type make of that), per dtype
AGREE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2,
         BF16: 2e-2}
OUT = ("outputs", "h_n", "c_n", "d_inputs", "d_weights", "d_bias", "d_h0", "d_c0")


@pytest.fixture(scope="session")
def fused_lib(tmp_path_factory):
    return host_fused.build(tmp_path_factory.mktemp("fused_host"))


@pytest.fixture
def fused_cupy(emulated_cupy, monkeypatch, fused_lib):
    """The emulated CuPy with the fused kernels' host build, on a device of LIMIT bytes of shared
    memory per block and one SM (``monkeypatch`` _kernels._sm_count for more); the FMA kernels of
    lltm_fused.cu in every dtype (tests/kernels/test_fused_mma.py runs the 16-bit kernels on tensor
    cores)."""
    monkeypatch.setattr(_fused_kernels, "get_kernels",
                        host_fused.host_get_fused_kernels(fused_lib, LIMIT))
    monkeypatch.setattr(_group_kernels, "get_kernels", _group_kernels_not_built)
    monkeypatch.setattr(_fused.fused_mma, "usable", lambda state, dtype, backward=False: False)
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    host_fused.set_schedule(fused_lib, "ascending")
    yield emulated_cupy
    host_fused.set_schedule(fused_lib, "ascending")


def _group_kernels_not_built(dtype, size):
    """get_group_kernels where its host build is not loaded (tests/kernels/test_fused_group.py runs
    it): records the module's compile, as warmup on the emulated sm_80 device asks for it; a
    launch is an error."""
    from helpers import emulated_cupy as emu

    def launch(*args, **kwargs):
        raise AssertionError("a group kernel launched without its host build")

    emu._state.compile("lltm_fused_cluster.cu", "group", np.dtype(dtype).str)
    return _kernels.FusedKernels(launch, launch)


def to_bits(a):
    return np.ascontiguousarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
                                .view(np.uint16))


def values(a):
    """float64 values of an array of the backend (bfloat16 as its bits)."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return a.view(ml_dtypes.bfloat16).astype(np.float64)
    return a.astype(np.float64)


def make(T, B, F, S, dtype, seed):
    """(storage arrays for the backend, the same values in float64)."""
    rng = np.random.default_rng(seed)
    k = S + F
    case = dict(inputs=rng.standard_normal((T, B, F)),
                weights=rng.uniform(-1, 1, (3 * S, k)) / np.sqrt(k),
                bias=rng.uniform(-1, 1, 3 * S), h0=rng.uniform(-1, 1, (B, S)),
                c0=rng.standard_normal((B, S)), grad_outputs=rng.standard_normal((T, B, S)),
                grad_h_n=rng.standard_normal((B, S)), grad_c_n=rng.standard_normal((B, S)))
    stored = {n: to_bits(v) if dtype == BF16 else v.astype(dtype) for n, v in case.items()}
    return stored, {n: values(v) for n, v in stored.items()}


def run(xp, stored, lengths, reverse, fused, grads=("grad_outputs", "grad_h_n", "grad_c_n"),
        ran=None):
    """The GPU backend's forward_sequence and backward_sequence: the 8 results as NumPy arrays.
    The forward must have run fused as asked, unless ``ran`` (a list) is given: then whether it
    did is appended to it."""
    from lltm_cupy import _cuda

    T, B = stored["inputs"].shape[:2]
    plan = (None if lengths is None and not reverse else _packing.plan(
        np.full(B, T, np.int64) if lengths is None else np.asarray(lengths, np.int64), T,
        reverse))
    a = {k: xp.asarray(v) for k, v in stored.items()}
    outputs, h_n, c_n, saved = _cuda.forward_sequence(
        *(a[n] for n in ("inputs", "weights", "bias", "h0", "c0")), plan=plan, fused=fused)
    if ran is None:
        assert saved.fused == fused
    else:
        ran.append(saved.fused)
    g = _cuda.backward_sequence(*(a[n] if n else None for n in grads), saved)
    return [to_numpy(v) for v in (outputs, h_n, c_n, *g)]


def compare(fused, stepped, want, dtype, label):
    """fused equals stepped within AGREE, and is as close to the float64 reference as stepped is
    (within the dtype's tolerance, 10x for the sequences' accumulation in float32 / float64)."""
    for name, f, s, w in zip(OUT, fused, stepped, want):
        assert f.shape == w.shape and f.dtype == s.dtype, f"{label} {name}: shape/dtype"
        assert not np.isnan(values(f)).any(), f"{label} {name}: NaN"
        err = max_error(values(f), values(s))
        assert err <= AGREE[dtype], f"{label} {name}: fused vs stepped {err:.2e}"
        ref_f, ref_s = max_error(values(f), w), max_error(values(s), w)
        bound = (10 * TOLERANCE[dtype] if dtype in (np.float32, np.float64)
                 else 2 * ref_s + AGREE[dtype] / 4)
        assert ref_f <= bound, f"{label} {name}: fused vs reference {ref_f:.2e} > {bound:.1e}" \
                               f" (stepped: {ref_s:.2e})"


LENGTHS = {"full": None, "zeros and ties": [3, 0, 5, 1, 5, 0, 2], "all zero": [0] * 7}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_equals_stepped_and_reference(fused_cupy, monkeypatch, dtype, lengths, reverse):
    """7 rows over 3 "SMs": tiles of 3 rows, the last block with 1 (a tile that does not divide
    the batch); lengths with zeros, both directions, all dtypes."""
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 3)
    stored, case = make(5, 7, 4, 6, dtype, seed=3 + reverse)
    fused = run(fused_cupy, stored, lengths, reverse, True)
    stepped = run(fused_cupy, stored, lengths, reverse, False)
    full = [5] * 7 if lengths is None else lengths
    want = _reference(case, full, reverse, (case["grad_outputs"], case["grad_h_n"],
                                            case["grad_c_n"]))
    compare(fused, stepped, want, dtype, f"{np.dtype(dtype)}")


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_with_several_elements_per_thread(fused_cupy, monkeypatch, dtype, reverse):
    """Blocks of 16 threads over one tile of 7 rows x 6 states (2 or 3 elements per thread, on
    different rows and states): the walk over a thread's elements, and the loads of each element
    issued while the one before it computes (the next one of the step, else the first of the
    next step), with rows that end at different steps."""
    monkeypatch.setattr(_fused, "THREADS", 16)
    stored, case = make(5, 7, 4, 6, dtype, seed=11 + reverse)
    lengths = LENGTHS["zeros and ties"]
    emu = fused_cupy.emulator
    emu.reset()
    fused = run(fused_cupy, stored, lengths, reverse, True)
    assert emu.log.count("kernel:seq_fwd") == 1 and emu.log.count("kernel:seq_bwd") == 1
    stepped = run(fused_cupy, stored, lengths, reverse, False)
    want = _reference(case, lengths, reverse, (case["grad_outputs"], case["grad_h_n"],
                                               case["grad_c_n"]))
    compare(fused, stepped, want, dtype, f"{np.dtype(dtype)}")


def _bound_sizes():
    return [pytest.param(dtype, state, id=f"{name}-S{state}") for name, dtype in DTYPES.items()
            for top in [_fused.max_state(LIMIT, dtype)] for state in (top - 1, top)]


@pytest.mark.parametrize("dtype,state", _bound_sizes())
def test_fused_at_the_shared_memory_bound(fused_cupy, dtype, state):
    """The largest state sizes the bound accepts on sm_90 (one-row tiles, full shared memory)."""
    stored, case = make(3, 2, 3, state, dtype, seed=state)
    emu = fused_cupy.emulator
    emu.reset()
    fused = run(fused_cupy, stored, None, False, True)
    assert emu.log.count("kernel:seq_fwd") == 1 and emu.log.count("kernel:seq_bwd") == 1
    stepped = run(fused_cupy, stored, None, False, False)
    want = _reference(case, [3, 3], False, (case["grad_outputs"], case["grad_h_n"],
                                            case["grad_c_n"]))
    compare(fused, stepped, want, dtype, f"S={state}")


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_above_the_bound_runs_the_stepped_path(fused_cupy, monkeypatch, dtype, arch):
    """Past an 8-block group's bound on a device without clusters (sm_80 to sm_89), past a
    16-block cluster's on sm_90 (tests/kernels/test_fused_group.py and
    tests/kernels/test_fused_cluster.py run the sizes between)."""
    from lltm_cupy import _cuda
    from lltm_cupy._cuda import fused_cluster

    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: arch)
    state = (fused_cluster.max_state(LIMIT, dtype, 8, group=True) if arch < 90
             else fused_cluster.max_state(LIMIT, dtype, 16)) + 1
    stored, _ = make(2, 1, 2, state, dtype, seed=1)
    emu = fused_cupy.emulator
    a = {k: fused_cupy.asarray(v) for k, v in stored.items()}
    emu.reset()
    *_, saved = _cuda.forward_sequence(*(a[n] for n in ("inputs", "weights", "bias", "h0", "c0")),
                                       fused=True)
    assert not saved.fused and "kernel:seq_fwd" not in emu.log
    assert emu.log.count("kernel:fwd") == 2


@pytest.mark.parametrize("grads", [("grad_outputs", None, None), (None, "grad_h_n", None),
                                   (None, None, "grad_c_n"), (None, None, None)],
                         ids=["outputs", "h_n", "c_n", "none"])
@pytest.mark.parametrize("lengths", [None, [2, 0, 4]], ids=["full", "ragged"])
def test_fused_with_missing_gradients(fused_cupy, grads, lengths):
    stored, _ = make(4, 3, 2, 5, np.dtype(np.float64), seed=9)
    fused = run(fused_cupy, stored, lengths, False, True, grads)
    stepped = run(fused_cupy, stored, lengths, False, False, grads)
    for name, f, s in zip(OUT, fused, stepped):
        assert max_error(f, s) <= 1e-13, name


@pytest.mark.parametrize("shape", [(0, 3), (4, 0), (0, 0)], ids=["T=0", "B=0", "T=B=0"])
def test_fused_with_no_step_or_no_row(fused_cupy, shape):
    T, B = shape
    stored, _ = make(T, B, 2, 5, np.dtype(np.float32), seed=1)
    fused = run(fused_cupy, stored, None, False, True)
    stepped = run(fused_cupy, stored, None, False, False)
    for name, f, s in zip(OUT, fused, stepped):
        assert f.shape == s.shape and np.array_equal(f, s), name


def test_fused_results_do_not_depend_on_the_thread_order(fused_cupy, fused_lib, monkeypatch):
    """A kernel free of data races gives bit-identical results whatever order the threads of a
    block run in between barriers; the shim runs them ascending, descending and shuffled."""
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 2)
    stored, _ = make(6, 5, 3, 9, np.dtype(np.float32), seed=5)
    results = {}
    for order in host_fused.SCHEDULES:
        host_fused.set_schedule(fused_lib, order, seed=7)
        results[order] = run(fused_cupy, stored, [6, 2, 0, 6, 3], True, True)
    for order, got in results.items():
        for name, a, b in zip(OUT, got, results["ascending"]):
            assert np.array_equal(a, b), f"{name} differs between ascending and {order} order"


@pytest.mark.parametrize("steps", [1, 4, 9])
def test_launches_per_sequence_do_not_depend_on_the_length(fused_cupy, steps):
    """One fused kernel per call each way plus the batched GEMMs: nothing per step."""
    emu = fused_cupy.emulator
    stored, _ = make(steps, 3, 2, 4, np.dtype(np.float32), seed=steps)
    a = {k: fused_cupy.asarray(v) for k, v in stored.items()}
    from lltm_cupy import _cuda

    emu.reset()
    *_, saved = _cuda.forward_sequence(*(a[n] for n in ("inputs", "weights", "bias", "h0", "c0")),
                                       fused=True)
    forward = [e for e in emu.log if e.startswith(("kernel", "gemm"))]
    assert forward == ["gemm", "kernel:seq_fwd"]
    emu.reset()
    _cuda.backward_sequence(a["grad_outputs"], a["grad_h_n"], a["grad_c_n"], saved)
    backward = [e for e in emu.log if e.startswith(("kernel", "gemm"))]
    assert backward == ["kernel:seq_bwd", "gemm", "gemm", "gemm"]   # d_W (2 halves), d_inputs
    assert emu.log.count("reduce") == 1                               # d_bias


def test_public_api_selects_the_fused_path(fused_cupy):
    import lltm_cupy

    stored, _ = make(3, 2, 2, 4, np.dtype(np.float32), seed=2)
    a = {k: fused_cupy.asarray(v) for k, v in stored.items()}
    args = [a[n] for n in ("inputs", "weights", "bias", "h0", "c0")]
    assert not lltm_cupy.forward_sequence(*args)[3].fused, "the default stays the stepped path"
    for kw in ({}, {"lengths": [3, 1]}, {"reverse": True}):
        *_, saved = lltm_cupy.forward_sequence(*args, fused=True, **kw)
        assert saved.fused
        lltm_cupy.backward_sequence(a["grad_outputs"], None, None, saved)
    # the CPU backend has one path and ignores the flag
    host = [np.asarray(x) for x in args]
    out_f = lltm_cupy.forward_sequence(*host, fused=True)[0]
    np.testing.assert_array_equal(out_f, lltm_cupy.forward_sequence(*host)[0])


@pytest.mark.parametrize("lengths", [None, [9, 0, 4]], ids=["full", "ragged"])
def test_forward_only_runs_blocks_of_steps_with_the_same_bits(fused_cupy, monkeypatch, lengths):
    """return_saved=False: the fused forward in blocks of steps (one GEMM and one launch each,
    the final state of one block the initial state of the next) gives the bits of the one
    launch that keeps everything."""
    import lltm_cupy
    from lltm_cupy._cuda import sequence as _sequence

    monkeypatch.setattr(_sequence, "_BLOCK_ROWS", 6)        # 2 steps of 3 rows per block
    emu = fused_cupy.emulator
    stored, _ = make(9, 3, 2, 5, np.dtype(np.float32), seed=4)
    a = {k: fused_cupy.asarray(v) for k, v in stored.items()}
    args = [a[n] for n in ("inputs", "weights", "bias", "h0", "c0")]
    kept = lltm_cupy.forward_sequence(*args, lengths=lengths, fused=True)
    emu.reset()
    only = lltm_cupy.forward_sequence(*args, lengths=lengths, fused=True, return_saved=False)
    assert only[3] is None
    assert emu.log.count("kernel:seq_fwd") == 5 and emu.log.count("gemm") == 5   # 9 steps / 2
    for name, x, y in zip(OUT, only[:3], kept[:3]):
        assert np.array_equal(np.asarray(x), np.asarray(y)), name


# ------------------------------------------------------------------------ a missing barrier

_FUSED_TEXT = _kernels.source_path(_fused_kernels.SOURCE_NAME).read_text()


def test_the_kernels_have_the_barriers_the_mutation_test_deletes():
    """The mutation test below deletes every __syncthreads() of lltm_fused.cu: four."""
    assert len(mutants.statements("fused")) == _FUSED_TEXT.count("__syncthreads();") == 4


@pytest.mark.parametrize("which", range(len(mutants.statements("fused"))))
@pytest.mark.slow
def test_deleting_a_barrier_is_caught(which, tmp_path, emulated_cupy, monkeypatch):
    """Each __syncthreads() of lltm_fused.cu deleted in turn (a mutation of the source, all of
    them in one build: tests/helpers/mutants.py): the host run with block semantics gives wrong
    numbers (or reports a divergent barrier)."""
    lib = host_fused.build(tmp_path, sources=mutants.sources("harness_fused.cpp"))
    mutants.delete(lib, "fused", which)
    monkeypatch.setattr(_fused_kernels, "get_kernels", host_fused.host_get_fused_kernels(lib, LIMIT))
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    stored, case = make(4, 3, 3, 8, np.dtype(np.float64), seed=1)
    want = _reference(case, [4, 4, 4], False, (case["grad_outputs"], case["grad_h_n"],
                                               case["grad_c_n"]))
    try:
        got = run(emulated_cupy, stored, None, False, True)
    except AssertionError as exc:       # the shim's divergence report
        assert "__syncthreads" in str(exc)
        return
    errors = {name: max_error(g, w) for name, g, w in zip(OUT, got, want)}
    assert max(e if np.isfinite(e) else np.inf for e in errors.values()) > 1e-6, \
        f"barrier {which} deleted, yet every result matches the reference: {errors}"


@pytest.mark.parametrize("build", [
    "source", pytest.param("mutants-none-deleted", marks=pytest.mark.slow)])
def test_unmutated_source_passes_the_mutation_check(emulated_cupy, fused_lib, monkeypatch, build,
                                                    tmp_path):
    """The control of the test above: the same run with every barrier in place is exact, in the
    build of the source as it is and in the mutants' build with none deleted."""
    lib = fused_lib
    if build != "source":
        lib = host_fused.build(tmp_path, sources=mutants.sources("harness_fused.cpp"))
        mutants.delete(lib, None)
    monkeypatch.setattr(_fused_kernels, "get_kernels", host_fused.host_get_fused_kernels(lib, LIMIT))
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    stored, case = make(4, 3, 3, 8, np.dtype(np.float64), seed=1)
    want = _reference(case, [4, 4, 4], False, (case["grad_outputs"], case["grad_h_n"],
                                               case["grad_c_n"]))
    got = run(emulated_cupy, stored, None, False, True)
    for name, g, w in zip(OUT, got, want):
        assert max_error(g, w) <= 1e-12, name


@pytest.mark.slow
def test_a_divergent_barrier_is_reported(tmp_path, emulated_cupy, monkeypatch):
    """A __syncthreads() that only some threads reach stops the host launch with an error."""
    text = _FUSED_TEXT.replace("      if (r >= active) {             // finished:",
                               "      if (r >= active) { __syncthreads();  //", 1)
    assert text != _FUSED_TEXT
    (tmp_path / _fused_kernels.SOURCE_NAME).write_text(text)
    lib = host_fused.build(tmp_path, source_dir=tmp_path)
    monkeypatch.setattr(_fused_kernels, "get_kernels", host_fused.host_get_fused_kernels(lib, LIMIT))
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    stored, _ = make(3, 2, 2, 4, np.dtype(np.float64), seed=1)
    with pytest.raises(AssertionError, match="divergent __syncthreads"):
        run(emulated_cupy, stored, [3, 1], False, True)


# -------------------------------------------------------------- compilers and the bound

ARCHS = (80, 90, 100)

#: Registers per thread of each kernel variant as compiled today: the larger of NVRTC 13.5's
#: (the runtime compiler: the nvidia-cuda-nvrtc wheel) and ptxas 13.0's (nvcc) figure, which
#: differ by a few on sm_100. No variant uses local memory (no spill). Static shared memory is
#: 0 bytes in every variant (all of it is the launch's dynamic shared memory, sized by
#: lltm_cupy/_cuda/fused.shared_bytes).
#:                 float16  bfloat16  float32  float64
#:   sm_80  fwd       64       63        55       96
#:          bwd       54       54        56       80
#:   sm_90  fwd       79       72        71      128
#:          bwd       56       54        56       96
#:   sm_100 fwd       72       80        72      126
#:          bwd       63       63        60       78
REGISTERS = {
    (80, "fwd"): (64, 63, 55, 96), (80, "bwd"): (54, 54, 56, 80),
    (90, "fwd"): (79, 72, 71, 128), (90, "bwd"): (56, 54, 56, 96),
    (100, "fwd"): (72, 80, 72, 126), (100, "bwd"): (63, 63, 60, 78),
}
#: What a variant may use beyond its figure: helpers/cubin.register_ceiling (one allocation
#: unit with the compilers the figures come from, more with other versions).
#: the kernels' template arguments as the Itanium ABI mangles them
_MANGLED = {"9lltm_half": "float16", "9lltm_bf16": "bfloat16", "f": "float32", "d": "float64"}


def _variant(symbol: str) -> tuple:
    """("fwd" | "bwd", dtype name) of a fused kernel's mangled name."""
    m = re.match(r"_Z19lltm_seq_(fwd|bwd)_kernelI(\w+?)Ev", symbol)
    assert m and m.group(2) in _MANGLED, f"not a fused kernel: {symbol}"
    return m.group(1), _MANGLED[m.group(2)]


def _register_ceiling(arch: int, symbol: str, compiler: str = "nvrtc") -> int:
    kernel, dtype = _variant(symbol)
    return _cubin.register_ceiling(REGISTERS[arch, kernel][list(DTYPES).index(dtype)], compiler)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.slow
def test_nvrtc_compiles_the_fused_kernels(dtype, arch):
    """NVRTC (what CuPy compiles with at run time) builds both kernels of the dtype for the
    architecture; the cubin records no local memory (no spill) and registers within the pins."""
    cubin = _fused_kernels.compile_offline(dtype, arch, output="cubin")
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return an ELF cubin"
    resources = _cubin.kernel_resources(cubin)
    assert sorted(_variant(k)[0] for k in resources) == ["bwd", "fwd"], sorted(resources)
    for name, r in resources.items():
        assert _variant(name)[1] == [k for k, v in DTYPES.items() if v == dtype][0], name
        assert r.get("frame") == 0 and r.get("stack") == 0, f"sm_{arch} {name}: local memory {r}"
        assert 0 < r["registers"] <= _register_ceiling(arch, name), \
            f"sm_{arch} {name}: {r['registers']} registers > {_register_ceiling(arch, name)}"


def _store_conflicts(state: int, itemsize: int, stride: int) -> int:
    """The worst bank conflict (distinct 4-byte words in one bank, in one memory transaction) of
    the forward kernel's load of W_h: thread i of a warp stores element (g, k) = divmod(i, S) at
    k * stride + g. A 64-bit access is served per half-warp; two threads writing the halves of
    one word (16-bit types) do not conflict."""
    lanes = 16 if itemsize == 8 else 32
    worst = 0
    for start in range(0, 3 * state * state, lanes):
        banks = {}
        for i in range(start, min(start + lanes, 3 * state * state)):
            g, k = divmod(i, state)
            byte = (k * stride + g) * itemsize
            for word in range(byte // 4, (byte + itemsize - 1) // 4 + 1):
                banks.setdefault(word % 32, set()).add(word)
        worst = max(worst, max(len(words) for words in banks.values()))
    return worst


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.slow
def test_forward_weights_load_meets_no_bank_conflict(itemsize):
    """The forward kernel's transposed W_h rows are padded (lltm_cupy/_cuda/fused.wt_stride) so
    that its load's stores meet no bank conflict where a warp stores into one gate's column (S a
    multiple of 32: every warp), at most 2-way where a warp straddles two (S >= 32), at most
    4-way for S < 32 (a warp over several columns); the unpadded stride 3S has a 32-way (16-way
    for 8-byte types) conflict at S = 128."""
    for state in range(1, 200):
        stride = _fused_kernels.wt_stride(state, itemsize)
        assert 3 * state <= stride <= 3 * state + 3
        worst = 1 if state % 32 == 0 else 2 if state >= 32 else 4
        assert _store_conflicts(state, itemsize, stride) <= worst, (state, stride)
    assert _store_conflicts(128, itemsize, 3 * 128) == (16 if itemsize == 8 else 32)


def test_launcher_sizes_shared_memory_as_the_kernels_lay_it_out(fused_lib):
    """fused.shared_bytes and the kernels' own layout functions (built on the host) agree."""
    import ctypes

    fused_lib.lltm_host_w_bytes.restype = ctypes.c_longlong
    for state in range(1, 200):
        for dtype in DTYPES.values():
            item = dtype.itemsize
            assert fused_lib.lltm_host_wt_stride(state, item) == _fused_kernels.wt_stride(state, item)
            for backward in (False, True):
                weights = fused_lib.lltm_host_w_bytes(state, item, int(backward))
                assert weights == _fused.shared_bytes(state, dtype, 0, backward), (state, dtype)


def test_a_launch_with_too_little_shared_memory_is_reported(fused_cupy, monkeypatch):
    """The host build checks the launch's shared memory against the kernels' layout: a launcher
    that asks for less (the forward's padding forgotten) fails instead of writing past it."""
    real = _fused.shared_bytes

    def unpadded(state, dtype, tile, backward):
        return real(state, dtype, tile, True) - 2 * tile * state * _fused_kernels.acc_size(dtype) \
            if not backward else real(state, dtype, tile, backward)

    monkeypatch.setattr(_fused, "shared_bytes", unpadded)
    stored, _ = make(3, 2, 2, 6, np.dtype(np.float32), seed=3)
    with pytest.raises(AssertionError, match="more dynamic shared memory than the launch"):
        run(fused_cupy, stored, None, False, True)


def test_shared_memory_bound_table():
    """The bound documented in lltm_cupy/_cuda/fused.py and the public docstring."""
    table = {arch: tuple(_fused.max_state(limit, d) for d in DTYPES.values())
             for arch, limit in _fused.ARCH_SHARED_MEMORY.items()}
    assert table == {80: (165, 165, 117, 82), 90: (195, 195, 138, 97), 100: (195, 195, 138, 97)}
    doc = _fused.__doc__
    for arch, (half, _, single, double) in table.items():
        assert re.search(rf"sm_{arch} .*\s{half}\s+{single}\s+{double}\n", doc), arch


def _ptxas_report(arch: int) -> tuple:
    """ptxas -v of every fused kernel for sm_<arch> (nvcc 13.0's, on the same source text as
    NVRTC's): ({mangled name: {"registers", "spills": (stores, loads), "frame", "smem"}}, the
    cubin)."""
    nvcc = shutil.which("nvcc")
    assert nvcc, "nvcc (CUDA toolkit) is required for the ptxas check"
    return _run_ptxas(nvcc, arch)


def _run_ptxas(nvcc, arch, source=None, names=None):
    """ptxas -v of the kernels ``names`` of ``source`` (default: every fused kernel)."""
    import tempfile
    from pathlib import Path

    names = names or [_fused_kernels.name_expression(k, d)
                      for d in DTYPES.values() for k in _fused_kernels.KERNEL_NAMES]
    keep = ", ".join(f"(void*)&{n}" for n in names)
    with tempfile.TemporaryDirectory() as folder:
        src, out = Path(folder) / "fused.cu", Path(folder) / "fused.cubin"
        src.write_text((source or _fused_kernels.source())
                       + f"\nvoid* lltm_instances[] = {{{keep}}};\n")
        proc = subprocess.run([nvcc, "--cubin", f"-arch=sm_{arch}", "-Xptxas", "-v",
                               "-ftz=true", "-std=c++17", str(src), "-o", str(out)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        cubin = out.read_bytes()
    report, name = {}, None
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m and name:
            report.setdefault(name, {})["spills"] = (int(m.group(2)), int(m.group(3)))
            report[name]["frame"] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            smem = re.search(r"(\d+) bytes smem", line)
            report[name]["registers"] = int(m.group(1))
            report[name]["smem"] = int(smem.group(1)) if smem else 0
    return report, cubin


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow
def test_ptxas_reports_no_spill_and_shared_memory_within_the_limit(arch):
    """ptxas -v (nvcc) on every variant: no spill, registers within the pins (REGISTERS) and no
    static shared memory, and every size the selection accepts within the architecture's
    shared memory. Also holds the cubin reader of the NVRTC test above to ptxas's own figures
    for the same cubin."""
    report, cubin = _ptxas_report(arch)
    assert len(report) == len(DTYPES) * len(_fused_kernels.KERNEL_NAMES), sorted(report)
    read = _cubin.kernel_resources(cubin)
    assert sorted(read) == sorted(report)
    limit = _fused.ARCH_SHARED_MEMORY[arch]
    for name, r in report.items():
        assert (read[name]["registers"], read[name]["frame"]) == (r["registers"], r["frame"]), \
            f"sm_{arch} {name}: the cubin reader says {read[name]}, ptxas -v {r}"
        assert r["spills"] == (0, 0) and r["frame"] == 0, f"sm_{arch} {name}: spills {r}"
        assert r["registers"] <= _register_ceiling(arch, name, "ptxas"), \
            f"sm_{arch} {name}: {r['registers']} registers > " \
            f"{_register_ceiling(arch, name, 'ptxas')}"
        assert r["registers"] * _fused_kernels.THREADS <= 65536, f"sm_{arch} {name}: registers"
        assert r["smem"] == 0, f"sm_{arch} {name}: {r['smem']} bytes of static shared memory"
        backward = "bwd" in name
        for dtype in DTYPES.values():
            # every size the selection accepts, with the largest tile it would choose
            top = _fused.max_state(limit, dtype)
            per_row = (_fused.shared_bytes(top, dtype, 1, backward)
                       - _fused.shared_bytes(top, dtype, 0, backward))
            worst = max(_fused.shared_bytes(s, dtype, 1, backward) for s in range(1, top + 1))
            assert r["smem"] + worst <= limit and per_row > 0, f"sm_{arch} {name} {dtype}"


# ---------------------------------------------------------------------------- on a GPU

_GPU_REASON = gpu_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_GPU_REASON is not None, reason=f"GPU test: {_GPU_REASON}")
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("lengths", [None, [7, 0, 3, 7, 1]], ids=["full", "ragged"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_gpu_fused_equals_the_stepped_path(dtype, lengths, reverse, size):
    """The fused kernels on a real GPU (NVRTC, dynamic shared memory above 48 KB for the large
    size: S = 128, or the largest the device accepts in float64) against the stepped path and
    the float64 reference, forward and every gradient."""
    import cupy

    dtype = DTYPES[dtype]
    top = _fused.max_state(_kernels.shared_memory_limit(cupy.cuda.Device().id), dtype)
    state = 5 if size == "small" else min(128, top)
    stored, case = make(7, 5, 6, state, dtype, seed=state)
    fused = run(cupy, stored, lengths, reverse, True)
    stepped = run(cupy, stored, lengths, reverse, False)
    full = [7] * 5 if lengths is None else lengths
    want = _reference(case, full, reverse, (case["grad_outputs"], case["grad_h_n"],
                                            case["grad_c_n"]))
    compare(fused, stepped, want, dtype, "gpu")


# ------------------------------------------------------------------------- the torch layer

def _torch_case(torch, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, B, F, H = 5, 4, 3, 6
    xs = torch.randn(T, B, F, generator=g).to(dtype)
    hx = tuple(torch.randn(4, B, H, generator=g).to(dtype) for _ in range(2))
    return xs, hx


def _torch_run(torch, model, xs, hx, lengths):
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    xs, hx = xs.clone().requires_grad_(), tuple(h.clone().requires_grad_() for h in hx)
    if lengths is None:
        out, (h_n, c_n) = model(xs, hx)
    else:
        packed = pack_padded_sequence(xs, torch.tensor(lengths), enforce_sorted=False)
        out, (h_n, c_n) = model(packed, hx)
        out = pad_packed_sequence(out, total_length=xs.shape[0])[0]
    (out.float().sum() + 3 * h_n.float().sum() + 2 * c_n.float().sum()).backward()
    grads = [xs.grad, hx[0].grad, hx[1].grad] + [p.grad for p in model.parameters()]
    return [t.detach().double().numpy() for t in [out, h_n, c_n, *grads]]


@pytest.mark.parametrize("lengths", [None, [5, 2, 1, 4]], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_lltm_fused_equals_the_default(fused_cupy, emulated_cuda_torch, dtype, lengths):
    """LLTM(..., fused=True), 2 layers, bidirectional, on the emulated CUDA path: one fused
    launch per layer and direction each way, results equal to the default path's."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt

    dtype = getattr(torch, dtype)
    xs, hx = _torch_case(torch, dtype)
    torch.manual_seed(1)
    default = lt.LLTM(3, 6, num_layers=2, bidirectional=True, dtype=dtype)
    fused = lt.LLTM(3, 6, num_layers=2, bidirectional=True, dtype=dtype, fused=True)
    fused.load_state_dict(default.state_dict())
    assert "fused=True" in repr(fused) and fused.fused and not default.fused
    emu = fused_cupy.emulator
    want = _torch_run(torch, default, xs, hx, lengths)
    assert "kernel:seq_fwd" not in emu.log
    emu.reset()
    got = _torch_run(torch, fused, xs, hx, lengths)
    assert emu.log.count("kernel:seq_fwd") == 4 and emu.log.count("kernel:seq_bwd") == 4
    assert "kernel:fwd" not in emu.log and "kernel:bwd" not in emu.log
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (g, w) in enumerate(zip(got, want)):
        assert max_error(g, w) <= tol, f"result {i}: {max_error(g, w):.2e}"


def test_torch_compiled_sequence_runs_fused(fused_cupy, emulated_cuda_torch):
    """Under torch.compile the sequence op carries ``fused`` to the backend, both ways."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt

    xs, hx = _torch_case(torch, torch.float32)
    w = (torch.rand(18, 9) - 0.5).requires_grad_()
    b = (torch.rand(18) - 0.5).requires_grad_()

    def loss(fused):
        fn = torch.compile(lambda *a: lt.lltm_sequence(*a, fused=fused), backend="aot_eager",
                           fullgraph=True)
        out, h_n, c_n = fn(xs, w, b, hx[0][0], hx[1][0])
        (out.sum() + h_n.sum() + c_n.sum()).backward()
        result = [out.detach(), w.grad.clone(), b.grad.clone()]
        w.grad = b.grad = None
        return result

    emu = fused_cupy.emulator
    want = loss(False)
    emu.reset()
    got = loss(True)
    assert emu.log.count("kernel:seq_fwd") == 1 and emu.log.count("kernel:seq_bwd") == 1
    for g, v in zip(got, want):
        assert max_error(g.double().numpy(), v.double().numpy()) <= 1e-5


def test_benchmark_checks_the_fused_outputs_before_timing():
    """The benchmark's check (scripts/gpu_check.sh's fused rows): equal modules pass, a module
    whose weights differ by a realistic error is refused before anything is timed."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt
    from lltm_bench.sequence import check_fused

    torch.manual_seed(0)
    default, other = lt.LLTM(3, 5), lt.LLTM(3, 5)
    other.load_state_dict(default.state_dict())
    xs, h, c = torch.randn(4, 2, 3), torch.randn(2, 5), torch.randn(2, 5)
    assert check_fused(default, other, xs, h, c, "float32") <= 1e-5
    with torch.no_grad():
        other.weights_l0[0, 0] += 1e-2
    with pytest.raises(RuntimeError, match="not timed"):
        check_fused(default, other, xs, h, c, "float32")


def test_warmup_with_fused_leaves_nothing_to_compile(fused_cupy):
    """lltm_cupy.warmup(..., fused=True) compiles the fused module and every CuPy kernel the
    fused calls use, so that they can be captured in a CUDA graph; without fused=True it does
    not compile the fused module."""
    import lltm_cupy

    emu = fused_cupy.emulator
    lltm_cupy.warmup(["float32"])
    assert ("lltm_fused.cu", "<f4") not in emu.compiles
    lltm_cupy.warmup(["float32"], fused=True)
    assert ("lltm_fused.cu", "<f4") in emu.compiles
    emu.reset()
    stored, _ = make(3, 4, 2, 5, np.dtype(np.float32), seed=0)
    for lengths, reverse in ((None, False), ([3, 0, 2, 1], False), ([3, 0, 2, 1], True)):
        for keep in (True, False):
            a = {k: fused_cupy.asarray(v) for k, v in stored.items()}
            outputs, h_n, c_n, saved = lltm_cupy.forward_sequence(
                *(a[n] for n in ("inputs", "weights", "bias", "h0", "c0")), lengths=lengths,
                reverse=reverse, fused=True, return_saved=keep)
            if keep:
                lltm_cupy.backward_sequence(a["grad_outputs"], a["grad_h_n"], a["grad_c_n"], saved)
    assert emu.compiles == [], f"compiled after warmup: {emu.compiles}"


def test_forward_layers_runs_every_layer_fused(fused_cupy):
    import lltm_cupy

    emu = fused_cupy.emulator
    rng = np.random.default_rng(0)
    params = {k: fused_cupy.asarray(v) for k, v in lltm_cupy.init_parameters(
        3, 5, 2, bidirectional=True, rng=rng).items()}
    xs = fused_cupy.asarray(rng.standard_normal((4, 2, 3)).astype(np.float32))
    emu.reset()
    fused = lltm_cupy.forward_layers(xs, params, lengths=[4, 2], fused=True)
    assert emu.log.count("kernel:seq_fwd") == 4 and "kernel:fwd" not in emu.log
    default = lltm_cupy.forward_layers(xs, params, lengths=[4, 2])
    for a, b in zip(fused[:3], default[:3]):
        assert max_error(to_numpy(a), to_numpy(b)) <= 1e-5
    g_out = fused_cupy.asarray(rng.standard_normal(fused[0].shape).astype(np.float32))
    emu.reset()
    got = lltm_cupy.backward_layers(g_out, None, None, fused[3])
    assert emu.log.count("kernel:seq_bwd") == 4 and "kernel:bwd" not in emu.log
    want = lltm_cupy.backward_layers(g_out, None, None, default[3])
    assert max_error(to_numpy(got.d_inputs), to_numpy(want.d_inputs)) <= 1e-5
    for name, g in got.d_parameters.items():
        assert max_error(to_numpy(g), to_numpy(want.d_parameters[name])) <= 1e-5, name


@pytest.mark.parametrize("lengths", [None, [5, 2, 1, 4]], ids=["padded", "packed"])
def test_torch_lltm_fused_without_grad_runs_the_fused_forward_only(fused_cupy,
                                                                    emulated_cuda_torch, lengths):
    """Under no_grad the torch layer runs the forward only; with fused=True the fused kernel."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt
    from torch.nn.utils.rnn import pack_padded_sequence

    xs, hx = _torch_case(torch, torch.float32)
    default = lt.LLTM(3, 6, num_layers=2, bidirectional=True)
    fused = lt.LLTM(3, 6, num_layers=2, bidirectional=True, fused=True)
    fused.load_state_dict(default.state_dict())
    x = xs if lengths is None else pack_padded_sequence(xs, torch.tensor(lengths),
                                                        enforce_sorted=False)
    emu = fused_cupy.emulator
    with torch.no_grad():
        want = default(x, hx)
        emu.reset()
        got = fused(x, hx)
    assert emu.log.count("kernel:seq_fwd") == 4 and "kernel:fwd" not in emu.log
    out_g, out_w = (o if lengths is None else o.data for o in (got[0], want[0]))
    for g, w in ((out_g, out_w), (got[1][0], want[1][0]), (got[1][1], want[1][1])):
        assert max_error(g.double().numpy(), w.double().numpy()) <= 1e-5


@pytest.mark.parametrize("lengths", [None, [7, 10, 1, 3]], ids=["padded", "packed"])
def test_torch_lltm_fused_under_capture_copies_nothing(fused_cupy, emulated_cuda_torch,
                                                       lengths):
    """LLTM(fused=True) captured after an eager call with the same lengths (as CUDA graphs ask):
    no host-device copy (the step offsets come from the plan's device arrays, the backward's
    hidden states from one gather, not a concatenation of more than 8 steps, which uploads
    their pointers), the fused kernels, and the eager results; training and no_grad."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt
    from torch.nn.utils.rnn import pack_padded_sequence

    g = torch.Generator().manual_seed(3)
    T, B, F, H = 10, 4, 3, 6
    xs = torch.randn(T, B, F, generator=g, dtype=torch.float64)
    hx = tuple(torch.randn(4, B, H, generator=g, dtype=torch.float64) for _ in range(2))
    torch.manual_seed(1)
    model = lt.LLTM(F, H, num_layers=2, bidirectional=True, dtype=torch.float64, fused=True)

    def step():
        for p in model.parameters():
            p.grad = None
        x = xs.clone().requires_grad_()
        inp = x if lengths is None else pack_padded_sequence(x, torch.tensor(lengths),
                                                             enforce_sorted=False)
        out, (h, c) = model(inp, hx)
        out = out if lengths is None else out.data
        (out.sum() + h.pow(2).sum() + c.sum()).backward()
        with torch.no_grad():
            out_only, (h_only, c_only) = model(inp, hx)
        out_only = out_only if lengths is None else out_only.data
        return [t.detach().clone() for t in (out, h, c, x.grad, *(p.grad for p in
                                                                   model.parameters()),
                                             out_only, h_only, c_only)]

    emu = fused_cupy.emulator
    eager = step()
    emu.reset()
    emu.capturing = True
    try:
        captured = step()
    finally:
        emu.capturing = False
    assert emu.transfers == [] and emu.syncs == 0
    assert emu.log.count("kernel:seq_fwd") == 8 and emu.log.count("kernel:seq_bwd") == 4
    for i, (a, b) in enumerate(zip(eager, captured)):
        assert_engines_agree(b, a, f"result {i}")
