"""The fused sequence kernels in every variant, each case written once with a ``variant``
parameter (tests/helpers/fused_devices.py): ``single`` (one block per tile, cuda_src/lltm_fused.cu),
``clusterP`` (P = 1 to 16 blocks of an sm_90 cluster, lltm_fused_cluster.cu), ``groupP`` (P = 1
to 8 blocks of a cooperative launch on sm_80 to sm_89, the same source's group kernels), ``mma``
(one block on tensor cores, lltm_fused_mma.cu); ``cluster`` and ``group`` alone: the launcher's
own choice of P. Without a GPU the CUDA source runs as host C++ with block, cluster or group
semantics (tests/host_shim/shim.h), launched from the GPU backend on the emulated CuPy.

Each variant against the stepped path and the float64 reference (lltm_cupy/reference.py through
tests/helpers/lengths_reference.py), forward and every gradient, and it must have launched its
own kernels (``Variant.assert_ran``): the thread order changes no bit, forward-only blocks of
steps give the one launch's bits, warmup leaves nothing to compile, the kernel-time script times
it, the torch layer runs it; on a real GPU the same against the stepped path. What only one
variant has is in its own module: tests/kernels/test_fused_one_block.py, test_fused_cluster_*.py,
test_fused_group_exchange.py, test_fused_mma_geometry.py; barriers in test_fused_barriers.py,
compilers in test_fused_compilers.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from lltm_cupy._cuda import cluster_kernels as _cluster_kernels, fused as _fused
from lltm_cupy._cuda import fused_cluster as _cluster, fused_kernels as _fused_kernels
from lltm_cupy._cuda import fused_mma as _mma, group_kernels as _group_kernels
from lltm_cupy._cuda import kernels as _kernels
from conftest import gpu_unavailable_reason, max_error
from helpers import host_cluster, host_fused
from helpers.fused_cases import (DTYPES, DTYPES16, LIMIT, LIMIT80, OUT, check_fused, make,
                                 run, torch_case, torch_run)
from helpers.fused_devices import (CLUSTER, CLUSTERS, GROUP, GROUPS, MMA, SINGLE,
                                   group_kernels_not_built)

pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install .[test])")

LENGTHS = {"full": None, "zeros and ties": [3, 0, 5, 1, 5, 0, 2], "all zero": [0] * 7}
DIRECTIONS = {"forward": False, "reverse": True}


def _case(variant, state, dtype, *rest, label=None):
    name = next(k for k, v in DTYPES.items() if v == dtype)
    parts = [variant.name, f"S{state}", name] + [str(r) for r in rest]
    return pytest.param(variant, state, dtype, *rest, id="-".join(parts if label is None
                                                                    else parts + [label]))


def _stepped_cases():
    """7 rows over 3 tiles (of 3, 3 and 1 rows: a tile that does not divide the batch), lengths
    with zeros, both directions: the one-block kernels at S = 6 in every dtype (also every row
    of length 0); every cluster and group size forced at S = 13 (blocks of 1 to 13 states,
    unequal where P does not divide S; S = 19 for 16 blocks, of 1 or 2 states: past the portable
    size, which the emulated device holds); the tensor-core kernels at S = 8 and 20 (padded to
    whole k-tiles of 16) and 64 (four s-tiles, four warps)."""
    cases = []
    for variant, states, dtypes, lengths in (
            [(SINGLE, (6,), DTYPES, LENGTHS)]
            + [(v, (13 if p <= 13 else 19,), DTYPES, list(LENGTHS)[:2])
               for p, v in CLUSTERS.items()]
            + [(v, (13,), DTYPES, list(LENGTHS)[:2]) for v in GROUPS.values()]
            + [(MMA, (8, 20, 64), DTYPES16, list(LENGTHS)[:2])]):
        for state in states:
            for dtype in dtypes.values():
                for length in lengths:
                    for direction in DIRECTIONS:
                        cases.append(_case(variant, state, dtype, length, direction))
    return cases


@pytest.mark.parametrize("variant,state,dtype,lengths,direction", _stepped_cases())
def test_fused_equals_stepped_and_reference(request, monkeypatch, variant, state, dtype, lengths,
                                            direction):
    """Forward and every gradient against the stepped path and the float64 reference (module
    docstring; the cases: _stepped_cases); one launch each way of the variant's own kernels."""
    reverse = DIRECTIONS[direction]
    xp = variant.device(request, monkeypatch, sm_count=3 * variant.blocks(state, dtype))
    seed = (state if variant is MMA else 3) + reverse
    stored, case = make(5, 7, 4, state, dtype, seed=seed)
    emu = xp.emulator
    emu.reset()
    forwards = 0 if lengths == "all zero" else 1      # no step to run forward
    check_fused(xp, stored, case, LENGTHS[lengths], reverse, dtype, variant.name,
                ran=lambda: variant.assert_ran(emu, state, dtype, forwards=forwards))


def _largest_cases():
    """The launcher's own choice at the largest sizes: the one-block kernels at the two largest
    S the bound accepts on sm_90 (one-row tiles, full shared memory); past that bound (S = 138
    float32, 195 16-bit, 97 float64) the smallest cluster that holds W_h, up to what 8 blocks
    hold (544, 388, 272), then 16 blocks (the emulated device holds such clusters) up to 768,
    544, 384; on sm_80 past its bound (117, 165, 82) the smallest group, up to what 8 blocks
    hold (464, 328, 232); the tensor-core kernels at S = 128 (eight warps, one per s-tile), 176
    (the largest backward: 11 s-tiles over eight warps) and 192 (the largest forward, with the
    FMA backward). (T, B, F), lengths and SMs per variant: the clusters and groups in tiles that
    do not divide the rows."""
    cases = []
    for name, dtype in DTYPES.items():
        top = _fused.max_state(LIMIT, dtype)
        cases += [_case(SINGLE, s, dtype) for s in (top - 1, top)]
    for name, dtype in DTYPES.items():
        top, top8 = _fused.max_state(LIMIT, dtype), _cluster.max_state(LIMIT, dtype, 8)
        states = {"float16": (top + 1, 512, top8 + 1), "bfloat16": (300, 512, 768),
                  "float32": (top + 1, 388, top8 + 1, 512),
                  "float64": (top + 1, 272, top8 + 1, 384)}[name]
        cases += [_case(CLUSTER, s, dtype) for s in states]
    for name, dtype in DTYPES.items():
        top = _fused.max_state(LIMIT80, dtype)
        states = {"float16": (top + 1, 464), "bfloat16": (300,), "float32": (top + 1, 328),
                  "float64": (top + 1, 232)}[name]
        cases += [_case(GROUP, s, dtype) for s in states]
    top = max(s for s in range(1, 400) if _mma.shared_bytes(s, 1) <= LIMIT)
    top_bwd = max(s for s in range(1, 400) if _mma.shared_bytes(s, 1, True) <= LIMIT)
    for dtype in DTYPES16.values():
        cases += [_case(MMA, s, dtype) for s in (128, top_bwd, top)]
    return cases


#: (T, B, F), lengths and SMs of the largest sizes' runs per variant kind
_LARGEST = {"single": ((3, 2, 3), None, None), "cluster": ((3, 3, 3), [3, 1, 2], 16),
            "group": ((3, 3, 3), [3, 1, 2], 108), "mma": ((3, 2, 3), [3, 2], None)}


@pytest.mark.parametrize("variant,state,dtype", _largest_cases())
def test_fused_at_the_largest_state_sizes(request, monkeypatch, variant, state, dtype):
    """The largest state sizes each variant takes, chosen by the launcher (_largest_cases)."""
    (T, B, F), lengths, sms = _LARGEST[variant.kind]
    xp = variant.device(request, monkeypatch, sm_count=sms)
    assert _fused.usable(state, dtype)
    if variant.kind in ("cluster", "group"):
        assert variant.blocks(state, dtype) > 1
    stored, case = make(T, B, F, state, dtype, seed=state)
    emu = xp.emulator
    emu.reset()
    check_fused(xp, stored, case, lengths, False, dtype, f"{variant.name} S={state}",
                ran=lambda: variant.assert_ran(emu, state, dtype))


#: SMs, S and dtype of the thread-order runs per variant
_ORDER = {"single": (2, 9, np.float32), "cluster4": (8, 11, np.float32),
          "mma": (2, 40, np.float16)}


@pytest.mark.parametrize("variant", [SINGLE, CLUSTERS[4], MMA], ids=lambda v: v.name)
def test_results_do_not_depend_on_the_thread_order(request, monkeypatch, variant):
    """A kernel free of data races (between threads, or between a cluster's blocks) gives
    bit-identical results whatever order the threads run in between barriers: the shim runs
    them ascending, descending and in two random orders; 5 rows with a length of 0, reverse."""
    sms, state, dtype = _ORDER[variant.name]
    xp = variant.device(request, monkeypatch, sm_count=sms)
    host = host_fused if variant.kind in ("single", "mma") else host_cluster
    lib = request.getfixturevalue("fused_lib" if host is host_fused else "cluster_lib")
    stored, _ = make(6, 5, 3, state, np.dtype(dtype), seed=5)
    results = {}
    emu = xp.emulator
    for order, seed in (("ascending", 1), ("descending", 1), ("random", 7), ("random", 8)):
        host.set_schedule(lib, order, seed=seed)
        emu.reset()
        results[order, seed] = run(xp, stored, [6, 2, 0, 6, 3], True, True)
        variant.assert_ran(emu, state, np.dtype(dtype))
    for key, got in results.items():
        for name, a, b in zip(OUT, got, results["ascending", 1]):
            assert np.array_equal(a, b), f"{variant.name} {name}: ascending != {key}"


@pytest.mark.parametrize("lengths", [None, [9, 0, 4]], ids=["full", "ragged"])
@pytest.mark.parametrize("variant,state,dtype", [
    _case(SINGLE, 5, np.dtype(np.float32)), _case(MMA, 18, np.dtype(np.float16))])
def test_forward_only_runs_blocks_of_steps_with_the_same_bits(request, monkeypatch, variant,
                                                              state, dtype, lengths):
    """return_saved=False: the fused forward in blocks of steps (one GEMM and one launch each,
    the final state of one block the initial state of the next) gives the bits of the one
    launch that keeps everything."""
    import lltm_cupy
    from lltm_cupy._cuda import sequence as _sequence

    xp = variant.device(request, monkeypatch)
    monkeypatch.setattr(_sequence, "_BLOCK_ROWS", 6)        # 2 steps of 3 rows per block
    emu = xp.emulator
    stored, _ = make(9, 3, 2, state, dtype, seed=4)
    a = {k: xp.asarray(v) for k, v in stored.items()}
    args = [a[n] for n in ("inputs", "weights", "bias", "h0", "c0")]
    kept = lltm_cupy.forward_sequence(*args, lengths=lengths, fused=True)
    emu.reset()
    only = lltm_cupy.forward_sequence(*args, lengths=lengths, fused=True, return_saved=False)
    assert only[3] is None
    variant.assert_ran(emu, state, dtype, forwards=5, backwards=0)     # 9 steps / 2
    assert emu.log.count("gemm") == 5
    for name, x, y in zip(OUT, only[:3], kept[:3]):
        assert np.array_equal(np.asarray(x), np.asarray(y)), name


def _fused_call(xp, stored, lengths, reverse, keep):
    """A fused forward (the backward too if ``keep``) through the array API; in bfloat16, which
    the array API does not take (its arrays hold the bits), through the GPU backend."""
    import lltm_cupy
    from lltm_cupy import _cuda, _packing

    a = {k: xp.asarray(v) for k, v in stored.items()}
    args = [a[n] for n in ("inputs", "weights", "bias", "h0", "c0")]
    grads = (a["grad_outputs"], a["grad_h_n"], a["grad_c_n"])
    if stored["inputs"].dtype != np.uint16:
        saved = lltm_cupy.forward_sequence(*args, lengths=lengths, reverse=reverse, fused=True,
                                           return_saved=keep)[3]
        return lltm_cupy.backward_sequence(*grads, saved) if keep else None
    T, B = stored["inputs"].shape[:2]
    plan = _packing.plan(np.asarray([T] * B if lengths is None else lengths, np.int64), T,
                         reverse)
    saved = _cuda.forward_sequence(*args, plan=plan, keep=keep, fused=True)[3]
    return _cuda.backward_sequence(*grads, saved) if keep else None


#: the dtypes warmup is asked for, and the emulator's record of a variant's module compile
_WARMUP = {"single": (["float32"], lambda d: ("lltm_fused.cu", d.str)),
           "cluster": (["float32"], lambda d: ("lltm_fused_cluster.cu", d.str)),
           "group": (["float32"], lambda d: ("lltm_fused_cluster.cu", "group", d.str)),
           "mma": (["float16", "bfloat16"], lambda d: ("lltm_fused_mma.cu", d.str))}


@pytest.mark.parametrize("variant", [SINGLE, CLUSTERS[2], GROUPS[2], MMA], ids=lambda v: v.name)
def test_warmup_with_fused_leaves_nothing_to_compile(request, monkeypatch, variant):
    """lltm_cupy.warmup(..., fused=True) compiles the variant's module (on sm_90 the cluster one,
    on sm_80 the group one, in 16-bit dtypes the tensor-core one) and every CuPy kernel the
    fused calls use, so that they can be captured in a CUDA graph; without fused=True it
    compiles no fused module. Then fused calls (lengths or not, reverse, with the backward or
    forward only) launch the variant's kernels and compile nothing."""
    import lltm_cupy

    xp = variant.device(request, monkeypatch)
    if variant is MMA:      # an sm_80 device, as fused_cupy's, whose group module is not built
        monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 80)
        monkeypatch.setattr(_group_kernels, "get_kernels", group_kernels_not_built)
    names, module = _WARMUP[variant.kind]
    dtypes = [DTYPES[n] for n in names]
    emu = xp.emulator
    lltm_cupy.warmup(names)
    assert not [module(d) for d in dtypes if module(d) in emu.compiles], emu.compiles
    lltm_cupy.warmup(names, fused=True)
    for dtype in dtypes:
        assert module(dtype) in emu.compiles, emu.compiles
    emu.reset()
    for dtype in dtypes:
        stored, _ = make(3, 4, 2, 5, dtype, seed=0)
        for lengths, reverse in ((None, False), ([3, 0, 2, 1], False), ([3, 0, 2, 1], True)):
            for keep in (True, False):
                _fused_call(xp, stored, lengths, reverse, keep)
    assert emu.compiles == [], f"compiled after warmup: {emu.compiles}"
    variant.assert_ran(emu, 5, dtypes[0], forwards=6 * len(dtypes), backwards=3 * len(dtypes))


#: the script's sizes and dtype, and the SMs of the device, per variant
_SCRIPT = {"cluster": ("3x2x2x150,3x2x2x5", "float32", None),
           "group": ("3x2x2x150,3x2x2x5", "float32", 108), "mma": ("5x3x2x20", "bfloat16", None)}


@pytest.mark.parametrize("variant", [CLUSTER, GROUP, MMA], ids=lambda v: v.name)
def test_the_kernel_time_script_times_the_variant(request, monkeypatch, capsys, variant):
    """scripts/fused_kernel_time.py on the variant's device: past one block's bound (S = 150) it
    checks and times the cluster or group kernels (their launches alone) and says how many
    blocks ran; in bfloat16 the tensor-core kernels (the calls run them); the kernels' getters
    are restored after. (The one-block kernels: tests/scripts/test_fused_kernel_time_script.py.)"""
    from helpers import gpu_scripts

    sizes, dtype, sms = _SCRIPT[variant.kind]
    xp = variant.device(request, monkeypatch, sm_count=sms)
    script = gpu_scripts.load("fused_kernel_time")
    getters = (_fused_kernels.get_kernels, _cluster_kernels.get_kernels,
               _group_kernels.get_kernels, _mma.get_kernels)
    emu = xp.emulator
    emu.reset()
    status = script.main(["--sizes", sizes, "--dtypes", dtype, "--runs", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert (_fused_kernels.get_kernels, _cluster_kernels.get_kernels,
            _group_kernels.get_kernels, _mma.get_kernels) == getters
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == [sizes.split("x")[0]]]
    want = [(size.split("x")[3], str(variant.blocks(int(size.split("x")[3]), DTYPES[dtype])))
            for size in sizes.split(",")]
    assert [(r[3], r[-1]) for r in rows] == want, out
    fwd = variant.kernels(int(want[0][0]), DTYPES[dtype])[0]
    assert emu.log.count(fwd) >= 3, emu.log         # the check, then each timed run
    if variant is MMA:
        assert emu.log.count("variant:mma") >= 6      # both ways
    for r in rows:
        fwd_time, bwd_time, whole = map(float, r[5:8])
        assert 0 < fwd_time and 0 < bwd_time and fwd_time + bwd_time <= whole, r


@pytest.mark.parametrize("lengths", [None, [5, 2, 1, 4]], ids=["padded", "packed"])
@pytest.mark.parametrize("variant,dtype", [
    pytest.param(SINGLE, "float32", id="single-float32"),
    pytest.param(SINGLE, "bfloat16", id="single-bfloat16"),
    pytest.param(MMA, "bfloat16", id="mma-bfloat16")])
def test_torch_lltm_fused_equals_the_default(request, monkeypatch, emulated_cuda_torch, variant,
                                             dtype, lengths):
    """LLTM(..., fused=True), 2 layers, bidirectional, on the emulated CUDA path: one launch of
    the variant's kernels per layer and direction each way, results within the dtype's
    tolerance of the default path's."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt

    xp = variant.device(request, monkeypatch)
    dtype_t = getattr(torch, dtype)
    xs, hx = torch_case(torch, dtype_t)
    torch.manual_seed(1)
    default = lt.LLTM(3, 6, num_layers=2, bidirectional=True, dtype=dtype_t)
    fused = lt.LLTM(3, 6, num_layers=2, bidirectional=True, dtype=dtype_t, fused=True)
    fused.load_state_dict(default.state_dict())
    assert "fused=True" in repr(fused) and fused.fused and not default.fused
    emu = xp.emulator
    want = torch_run(torch, default, xs, hx, lengths)
    assert "kernel:seq_fwd" not in emu.log
    emu.reset()
    got = torch_run(torch, fused, xs, hx, lengths)
    variant.assert_ran(emu, 6, DTYPES[dtype], forwards=4, backwards=4)
    assert "kernel:fwd" not in emu.log and "kernel:bwd" not in emu.log
    tol = 1e-5 if dtype == "float32" else 2e-2
    for i, (g, w) in enumerate(zip(got, want)):
        assert max_error(g, w) <= tol, f"result {i}: {max_error(g, w):.2e}"


# ---------------------------------------------------------------------------- on a GPU

_GPU_REASON = gpu_unavailable_reason()


def _gpu_cases():
    """The one-block path (the launcher's choice: on sm_80 and newer the tensor-core kernels
    where they apply) in every dtype at S = 5 and a large S (128, or the largest the device
    takes in one block), padded and ragged, both directions; clusters forced to 2 and 8 blocks
    at S = 13 and the launcher's own choice past one block's bound (float32 S = 256: 4 blocks;
    bfloat16 S = 512: 8 blocks of about 200 KB of shared memory each), packed lengths; the
    tensor-core kernels at S = 40 and 128, padded forward and ragged reverse."""
    cases = [_case(SINGLE, state, dtype, lengths, direction)
             for dtype in DTYPES.values() for state in ("small", "large")
             for lengths in ("full", "ragged") for direction in DIRECTIONS]
    cases += [_case(v, s, DTYPES[d], "ragged", "forward")
              for v, s, d in ((CLUSTERS[2], 13, "float32"), (CLUSTERS[8], 13, "float32"),
                              (CLUSTER, 256, "float32"), (CLUSTER, 512, "bfloat16"))]
    cases += [_case(MMA, s, dtype, lengths, "forward" if lengths == "full" else "reverse")
              for dtype in DTYPES16.values() for lengths in ("full", "ragged") for s in (40, 128)]
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(_GPU_REASON is not None, reason=f"GPU test: {_GPU_REASON}")
@pytest.mark.parametrize("variant,state,dtype,lengths,direction", _gpu_cases())
def test_gpu_fused_equals_the_stepped_path(monkeypatch, variant, state, dtype, lengths,
                                           direction):
    """The variants on a real GPU (NVRTC; dynamic shared memory above 48 KB at the large sizes;
    clusters: __cluster_dims__ and distributed shared memory on sm_90 and newer; the tensor
    cores: mma.sync on sm_80 and newer) against the stepped path and the float64 reference,
    forward and every gradient (the cases: _gpu_cases)."""
    import cupy

    device = cupy.cuda.Device().id
    arch = _kernels.compute_capability(device)
    if variant.kind == "cluster":
        if arch < _cluster.MIN_ARCH:
            pytest.skip("GPU test: the cluster kernels need sm_90 or newer")
        monkeypatch.setattr(_cluster, "FORCED_SIZE", variant.size)
        if variant.size is None:
            assert _fused.cluster_size(state, dtype) is not None, "the one-block kernels would run"
    if variant is MMA:
        if arch < _mma.MIN_ARCH:
            pytest.skip(f"GPU test: sm_{arch} has no mma.sync.m16n8k16 (sm_80 and newer)")
        assert _mma.usable(state, dtype) and _mma.usable(state, dtype, True)
    if state == "small":
        state = 5
    elif state == "large":
        state = min(128, _fused.max_state(_kernels.shared_memory_limit(device), dtype))
    stored, case = make(7, 5, 6, state, dtype, seed=state)
    lengths = None if lengths == "full" else [7, 0, 3, 7, 1]
    check_fused(cupy, stored, case, lengths, DIRECTIONS[direction], dtype, f"gpu {variant.name}")
    if variant is MMA:
        assert ("fused_mma", device, np.dtype(dtype).str) in _kernels._cache   # they ran

