"""The group variant of the cluster kernels (cuda_src/lltm_fused_cluster.cu's group kernels: the
same split of W_h over P blocks per tile, without a cluster, the blocks exchanging each step's h
and partial d_h through global memory and meeting at a barrier on a counter in global memory; a
cooperative launch), which the launcher runs on sm_80 to sm_89 past one block's bound; without a
GPU: the CUDA source built as host C++ with group semantics (tests/host_shim/shim.h's
shim_launch_group: a tile's blocks as cooperating contexts, a weak model of global memory, the
waiting loop yielding) and launched from the GPU backend on the emulated CuPy as an sm_80 device
(A100: 163 KiB of shared memory per block). Against the stepped path and the float64 reference in
every dtype at 1, 2, 4 and 8 blocks per tile, bit for bit against the cluster variant (one kernel
source), in several launches where the tiles do not fit the device at once; each barrier deleted
caught; NVRTC compiles it for sm_80 (and newer) with registers pinned, ptxas reports no spill.

Runs everywhere (g++, the NVRTC wheel and nvcc, no GPU). No GPU has run the group kernels.
"""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from lltm_cupy._cuda import cluster_kernels as _cluster_kernels, fused as _fused
from lltm_cupy._cuda import fused_cluster as _cluster, fused_kernels as _fused_kernels
from lltm_cupy._cuda import group_kernels as _group_kernels, kernels as _kernels
from helpers import cubin as _cubin, host_cluster, host_fused, mutants
from test_fused_sequence import DTYPES, OUT, _run_ptxas, compare, make, run
from test_fused_cluster import (_mutation_runs as _cluster_mutation_runs, _use as _use_cluster,
                                _want)

SIZES = _group_kernels.SIZES
#: the emulated sm_80 device's opt-in shared memory per block (A100)
LIMIT80 = _fused.ARCH_SHARED_MEMORY[80]


@pytest.fixture(scope="session")
def group_lib(tmp_path_factory):
    return host_cluster.build(tmp_path_factory.mktemp("group_host"))


@pytest.fixture(scope="session")
def one_block_lib80(tmp_path_factory):
    return host_fused.build(tmp_path_factory.mktemp("fused_host_for_groups"))


def _refuse_clusters(dtype, size):
    raise AssertionError("the cluster kernels launched on an sm_80 device")


def _use(monkeypatch, lib, one_block_lib, limit=LIMIT80):
    monkeypatch.setattr(_group_kernels, "get_kernels",
                        host_cluster.host_get_group_kernels(lib, limit))
    monkeypatch.setattr(_cluster_kernels, "get_kernels", _refuse_clusters)
    monkeypatch.setattr(_fused_kernels, "get_kernels",
                        host_fused.host_get_fused_kernels(one_block_lib, limit))
    monkeypatch.setattr(_group_kernels, "resident_blocks", host_cluster.resident_blocks)
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: limit)
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 80)
    monkeypatch.setattr(_fused.fused_mma, "usable", lambda state, dtype, backward=False: False)


@pytest.fixture
def group_cupy(emulated_cupy, monkeypatch, group_lib, one_block_lib80):
    """The emulated CuPy as an sm_80 device of LIMIT80 bytes of shared memory per block, with
    the group kernels' and the one-block kernels' host builds (the launch of a cluster kernel is
    an error); ``monkeypatch`` _cluster.FORCED_SIZE to run the group kernels where one block
    would do."""
    _use(monkeypatch, group_lib, one_block_lib80)
    host_cluster.set_schedule(group_lib, "ascending")
    yield emulated_cupy
    host_cluster.set_schedule(group_lib, "ascending")


LENGTHS = {"full": None, "zeros and ties": [3, 0, 5, 1, 5, 0, 2]}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_group_equals_stepped_and_reference(group_cupy, monkeypatch, dtype, size, lengths,
                                            reverse):
    """7 rows over 3 groups (tiles of 3, 3 and 1 rows: a tile that does not divide the batch),
    S = 13 (blocks of 1 to 13 states), lengths with zeros (tiles that stop at different steps),
    both directions, all dtypes, each group size forced; one launch each way."""
    monkeypatch.setattr(_cluster, "FORCED_SIZE", size)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 3 * size)
    emu = group_cupy.emulator
    stored, case = make(5, 7, 4, 13, dtype, seed=3 + reverse)
    emu.reset()
    fused = run(group_cupy, stored, lengths, reverse, True)
    assert emu.log.count(f"kernel:seq_fwd_group{size}") == 1
    assert emu.log.count(f"kernel:seq_bwd_group{size}") == 1
    assert "kernel:seq_fwd" not in emu.log and "kernel:seq_bwd" not in emu.log
    stepped = run(group_cupy, stored, lengths, reverse, False)
    compare(fused, stepped, _want(case, lengths, reverse, 5, 7), dtype, f"P={size}")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_group_gives_the_cluster_variants_bits(emulated_cupy, monkeypatch, group_lib,
                                               one_block_lib80, dtype):
    """One kernel source: the group kernels (sm_80) give bit for bit the cluster kernels'
    (sm_90) results, forward and every gradient, at 2, 4 and 8 blocks per tile, packed lengths
    and reverse; the same for every order of the threads."""
    stored, _ = make(4, 5, 3, 11, dtype, seed=11)
    lengths = [4, 2, 0, 4, 1]
    for size in SIZES[1:]:
        monkeypatch.setattr(_cluster, "FORCED_SIZE", size)
        monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 2 * size)
        _use_cluster(monkeypatch, group_lib, one_block_lib80)
        host_cluster.set_schedule(group_lib, "ascending")
        cluster = run(emulated_cupy, stored, lengths, True, True)
        _use(monkeypatch, group_lib, one_block_lib80, limit=_fused.ARCH_SHARED_MEMORY[90])
        for order, seed in (("ascending", 1), ("descending", 1), ("random", 5)):
            host_cluster.set_schedule(group_lib, order, seed)
            group = run(emulated_cupy, stored, lengths, True, True)
            for name, a, b in zip(OUT, group, cluster):
                assert np.array_equal(a, b), f"P={size} {order} {name}: group != cluster"
    host_cluster.set_schedule(group_lib, "ascending")


def test_more_tiles_than_the_device_holds_run_in_several_launches(group_cupy, monkeypatch):
    """A batch of more tiles than can be resident at once runs in launches of as many as can
    (here 2 of 3 tiles, then 1): every launch cooperative within the device's figure, each
    tile's counter its own, the same bits as in one launch."""
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 4)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 12)
    stored, _ = make(5, 7, 3, 13, np.dtype(np.float32), seed=8)
    emu = group_cupy.emulator
    lengths = [5, 1, 3, 5, 0, 2, 4]
    one = run(group_cupy, stored, lengths, False, True)
    monkeypatch.setattr(_group_kernels, "resident_blocks", lambda kernel, threads, shared: 8 + 3)
    emu.reset()
    waves = run(group_cupy, stored, lengths, False, True)
    assert emu.log.count("kernel:seq_fwd_group4") == 2
    assert emu.log.count("kernel:seq_bwd_group4") == 2
    for name, a, b in zip(OUT, waves, one):
        assert np.array_equal(a, b), name


def test_a_cooperative_launch_larger_than_the_device_fails(group_cupy, monkeypatch):
    """The emulated cooperative launch refuses a grid past what the device holds (CuPy would
    shrink it, and the tiles left out would be waited for forever): a launcher that trusted a
    wrong figure is caught; and where not even one tile fits, the launcher says so."""
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 2)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 4)
    stored, _ = make(2, 7, 3, 9, np.dtype(np.float32), seed=1)
    monkeypatch.setattr(_group_kernels, "resident_blocks", lambda kernel, threads, shared: 10 ** 6)
    monkeypatch.setattr(host_cluster, "SM_SHARED", 1)      # the device holds no block at all
    with pytest.raises(AssertionError, match="cooperative launch of .* more than the device"):
        run(group_cupy, stored, None, False, True)
    monkeypatch.setattr(_group_kernels, "resident_blocks", lambda kernel, threads, shared: 1)
    with pytest.raises(RuntimeError, match="cannot hold the 2 blocks of one tile"):
        run(group_cupy, stored, None, False, True)


def test_a_launch_past_the_resident_figure_is_an_error(group_cupy, monkeypatch):
    """Each cooperative launch's grid is checked against the device's resident figure right
    before the launch: a plan past it (here a figure that falls from 8 blocks at the plan and
    its waves to 2 at the launch) raises a clear error instead of launching a grid that CuPy
    would shrink, leaving tiles' blocks waiting forever; nothing is launched."""
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 2)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 4)
    stored, _ = make(2, 7, 3, 9, np.dtype(np.float32), seed=1)
    answers = iter([8, 8, 2])       # asked at the plan, for the waves, before the launch
    monkeypatch.setattr(_group_kernels, "resident_blocks",
                        lambda kernel, threads, shared: next(answers))
    emu = group_cupy.emulator
    emu.reset()
    with pytest.raises(RuntimeError, match="cooperative launch of 4 blocks .* more than the 2"):
        run(group_cupy, stored, None, False, True)
    assert not any("group" in e for e in emu.log), emu.log


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_the_group_kernels_lay_out_what_the_launcher_gives(group_cupy, monkeypatch, backward):
    """The group kernels' shared memory is their own layout (one h buffer forward, no receive
    buffers backward), exactly: tiles of 3 rows at P = 2 run with the launcher's figure, and one
    arithmetic value less in either direction is reported by the host build."""
    real = _cluster.shared_bytes
    f32 = np.dtype(np.float32)
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 2)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 6)
    stored, case = make(3, 7, 2, 9, f32, seed=3)
    assert _cluster.geometry(7, 9, f32, backward, 2)[2] == 3
    fused = run(group_cupy, stored, None, False, True)
    compare(fused, run(group_cupy, stored, None, False, False), _want(case, None, False, 3, 7),
            f32, "group layout")
    monkeypatch.setattr(_cluster, "shared_bytes",
                        lambda state, dtype, tile, b, size, group=False:
                        real(state, dtype, tile, b, size, group) - 4 * (b == backward))
    with pytest.raises(AssertionError, match="more dynamic shared memory than the launch"):
        run(group_cupy, stored, None, False, True)


def test_groups_hold_more_rows_per_tile_than_clusters():
    """The group kernels keep neither the cluster's second h buffer nor its receive buffers in
    shared memory: at float32 S = 328 in 8 blocks on an A100 (163 KiB per block) a tile holds 3
    rows forward and 6 backward, where the cluster layout holds 1 each way; the largest state
    sizes are the same (W_h's share bounds them)."""
    f32 = np.dtype(np.float32)

    def rows(backward, group):
        empty = _cluster.shared_bytes(328, f32, 0, backward, 8, group)
        return (LIMIT80 - empty) // (_cluster.shared_bytes(328, f32, 1, backward, 8, group) - empty)

    assert [rows(False, True), rows(True, True)] == [3, 6]
    assert [rows(False, False), rows(True, False)] == [1, 1]
    for dtype in DTYPES.values():
        assert _cluster.max_state(LIMIT80, dtype, 8, True) == _cluster.max_state(LIMIT80, dtype)


def _large_sizes():
    """Past the one-block bound on sm_80 (S = 117 float32, 165 16-bit, 82 float64)."""
    cases = []
    for name, dtype in DTYPES.items():
        top = _fused.max_state(LIMIT80, dtype)
        states = {"float16": (top + 1, 464), "bfloat16": (300,), "float32": (top + 1, 328),
                  "float64": (top + 1, 232)}[name]
        cases += [pytest.param(dtype, s, id=f"{name}-S{s}") for s in states]
    return cases


@pytest.mark.parametrize("dtype,state", _large_sizes())
def test_state_sizes_beyond_one_block_run_in_groups_on_sm_80(group_cupy, monkeypatch, dtype,
                                                              state):
    """The launcher's own choice on sm_80: the smallest group that holds W_h, up to the largest
    8 blocks hold (464 16-bit, 328 float32, 232 float64); packed lengths, 3 rows in tiles that do
    not divide them; an A100's 108 SMs (one launch)."""
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 108)
    size = _cluster.cluster_size(state, dtype, LIMIT80)
    assert size is not None and size > 1
    assert _fused.usable(state, dtype)
    emu = group_cupy.emulator
    stored, case = make(3, 3, 3, state, dtype, seed=state)
    lengths = [3, 1, 2]
    emu.reset()
    fused = run(group_cupy, stored, lengths, False, True)
    assert emu.log.count(f"kernel:seq_fwd_group{size}") == 1
    assert emu.log.count(f"kernel:seq_bwd_group{size}") == 1
    stepped = run(group_cupy, stored, lengths, False, False)
    compare(fused, stepped, _want(case, lengths, False, 3, 3), dtype, f"S={state} P={size}")


def test_the_split_needs_sm_80(group_cupy, monkeypatch):
    """Before sm_80 the state sizes past one block run the stepped path (and a forced size is an
    error); from sm_80 the group variant, up to what 8 blocks hold."""
    dtype = np.dtype(np.float32)
    state = _fused.max_state(LIMIT80, dtype) + 1
    assert _fused.usable(state, dtype)
    assert not _fused.usable(_cluster.max_state(LIMIT80, dtype, group=True) + 1, dtype)
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 75)
    assert not _fused.usable(state, dtype)
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 2)
    with pytest.raises(RuntimeError, match=r"only on compute capability 8\.0 and newer"):
        _cluster.chosen_size(state, dtype)


# ------------------------------------------------------------------------ a missing barrier

_TEXT = _kernels.source_path(_cluster_kernels.SOURCE_NAME).read_text()
def test_the_group_kernels_have_the_barriers_the_mutation_test_deletes():
    """The exchange's: a block barrier at the start, forward the group barrier and a block
    barrier after the copy of h, backward the group barrier; the backward body's block barrier."""
    found = [_TEXT[a:b].split("(")[0] for a, b in mutants.group_barriers(_TEXT)]
    assert found == ["__syncthreads", "lltm_group_sync", "__syncthreads", "lltm_group_sync",
                     "__syncthreads"], found


@pytest.mark.parametrize("which", range(len(mutants.statements("group"))))
@pytest.mark.slow
def test_deleting_a_barrier_of_the_group_kernels_is_caught(which, tmp_path, emulated_cupy,
                                                           monkeypatch, one_block_lib80):
    """Each barrier of the group kernels deleted in turn (a mutation of the source, all of them
    in one build: tests/helpers/mutants.py): the host run with group semantics gives wrong
    numbers or stops with an error (a deadlock, a NaN of the exchange buffer read before it was
    written), at 2 and 4 blocks per tile, in the ascending and the descending order."""
    lib = host_cluster.build(tmp_path, sources=mutants.sources("harness_cluster.cpp"))
    mutants.delete(lib, "group", which)
    _use(monkeypatch, lib, one_block_lib80)
    for label, got, errors in _mutation_runs(emulated_cupy, lib, monkeypatch):
        if got is None:
            assert "seq_" in errors, errors     # the shim's report
            continue
        assert max(e if np.isfinite(e) else np.inf for e in errors.values()) > 1e-6, \
            f"barrier {which} deleted, {label}: every result matches: {errors}"


def _mutation_runs(xp, lib, monkeypatch):
    """The cluster check's runs (test_fused_cluster), on a device of two tiles' SMs."""
    return _cluster_mutation_runs(xp, lib, monkeypatch, sm_count=lambda size: 2 * size)


@pytest.mark.parametrize("build", [
    "source", pytest.param("mutants-none-deleted", marks=pytest.mark.slow)])
def test_unmutated_source_passes_the_group_mutation_check(group_cupy, group_lib, one_block_lib80,
                                                          monkeypatch, build, tmp_path):
    """The control of the test above, in the build of the source as it is and in the mutants'
    build with no statement deleted."""
    lib = group_lib
    if build != "source":
        lib = host_cluster.build(tmp_path, sources=mutants.sources("harness_cluster.cpp"))
        mutants.delete(lib, None)
        _use(monkeypatch, lib, one_block_lib80)
    for label, got, errors in _mutation_runs(group_cupy, lib, monkeypatch):
        assert got is not None, f"{label}: {errors}"
        assert max(errors.values()) <= 1e-12, (label, errors)


# -------------------------------------------------------------- compilers and the launch

#: Registers per thread of the group kernels as NVRTC (13.x) compiles them for sm_80, the most
#: over the sizes 1, 2, 4 and 8, and no local memory in any (tested with ptxas below too).
#:                 float16  bfloat16  float32  float64
#:   sm_80  fwd       48       48        48       72
#:          bwd       48       48        48       72
GROUP_REGISTERS = {(80, "fwd"): (48, 48, 48, 72), (80, "bwd"): (48, 48, 48, 72)}


@pytest.mark.parametrize("arch", [80, 90, 100])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.slow
def test_nvrtc_compiles_the_group_kernels(dtype, arch):
    """Every group size, header-free inline PTX (fence.acq_rel.gpu, the counter's relaxed
    atomics at GPU scope, the exchange's st.cg / ld.cg), no cluster anywhere (a cooperative
    launch of an sm_80 device); the cubin records no local memory, and on sm_80 registers within
    the pins (GROUP_REGISTERS, with test_fused_sequence's margin)."""
    ptx = _group_kernels.compile_offline(dtype, arch, output="ptx").decode()
    assert ptx.count(".entry ") == 2 * len(SIZES)
    for instruction in ("fence.acq_rel.gpu", "red.relaxed.gpu.global.add.u32",
                        "ld.relaxed.gpu.global.u32", "st.global.cg.f", "ld.global.cg.f"):
        assert instruction in ptx, instruction
    for absent in ("cluster", "mapa"):
        assert absent not in ptx, absent
    cubin = _group_kernels.compile_offline(dtype, arch, output="cubin")
    resources = _cubin.kernel_resources(cubin)
    assert len(resources) == 2 * len(SIZES), sorted(resources)
    column = list(DTYPES.values()).index(dtype)
    for name, r in resources.items():
        kernel = re.match(r"_Z\d+lltm_seq_(fwd|bwd)_group_kernel", name).group(1)
        assert r.get("frame") == 0 and r.get("stack") == 0, f"sm_{arch} {name}: local memory {r}"
        assert 0 < r["registers"] * _fused_kernels.THREADS <= 65536, f"sm_{arch} {name}"
        if arch == 80:
            ceiling = _cubin.register_ceiling(GROUP_REGISTERS[arch, kernel][column])
            assert r["registers"] <= ceiling, f"sm_80 {name}: {r['registers']} > {ceiling}"


@pytest.mark.slow
def test_ptxas_reports_no_spill_for_the_group_kernels():
    """Every group kernel for sm_80: no spill or stack frame, registers for 256 threads, no
    static shared memory."""
    import shutil

    nvcc = shutil.which("nvcc")
    assert nvcc, "nvcc (CUDA toolkit) is required for the ptxas check"
    report, _ = _run_ptxas(nvcc, 80, _cluster_kernels.source(),
                           [_cluster_kernels.name_expression(k, d, p) for d in DTYPES.values()
                            for p in SIZES for k in _group_kernels.KERNEL_NAMES])
    assert len(report) == len(DTYPES) * len(SIZES) * 2, sorted(report)
    for name, r in report.items():
        assert r["spills"] == (0, 0) and r["frame"] == 0, f"{name}: spills {r}"
        assert r["registers"] * _fused_kernels.THREADS <= 65536, f"{name}: registers"
        assert r["smem"] == 0, f"{name}: static shared memory {r['smem']}"


def test_group_kernels_compile_once_per_dtype_in_a_cooperative_module(emulated_cupy,
                                                                      monkeypatch):
    """group_kernels.get_kernels on a CuPy whose RawModule records what it is asked: one module
    per device and dtype holding every group size, made with enable_cooperative_groups=True
    (CuPy then launches each of its kernels with cuLaunchCooperativeKernel), each function
    allowed the device's opt-in shared memory; the cluster module is not cooperative.
    resident_blocks asks the driver's occupancy of the kernel's function times the SMs, once per
    (kernel, threads, shared bytes)."""
    modules, asked = [], []

    class Function:
        shared_size_bytes = 0
        max_dynamic_shared_size_bytes = 0

        def __init__(self, name):
            self.name = name
            self.kernel = type("F", (), {"ptr": 1234})()

    class RawModule:
        def __init__(self, code, options, name_expressions, **kwargs):
            modules.append((code, tuple(name_expressions), kwargs))

        def get_function(self, name):
            return Function(name)

    def occupancy(ptr, threads, shared):     # a driver call: needs the thread's context
        if threading.get_ident() not in emulated_cupy.emulator.contexts:
            raise RuntimeError("CUDA_ERROR_INVALID_CONTEXT: invalid device context")
        asked.append((ptr, threads, shared))
        return 2

    emulated_cupy.emulator.contexts = set()     # none bound yet (the library binds one first)

    monkeypatch.setattr(emulated_cupy, "RawModule", RawModule, raising=False)
    monkeypatch.setattr(emulated_cupy.cuda, "driver",
                        type("D", (), {"occupancyMaxActiveBlocksPerMultiprocessor":
                                       staticmethod(occupancy)}), raising=False)
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT80)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 108)
    monkeypatch.setattr(_kernels, "_cache", {})
    monkeypatch.setattr(_group_kernels, "_resident", {})
    f32 = np.dtype(np.float32)
    got = {p: _group_kernels.get_kernels(f32, p) for p in SIZES}
    assert len(modules) == 1 and modules[0][0] == _cluster_kernels.source()
    assert modules[0][2] == {"enable_cooperative_groups": True}
    for p, fns in got.items():
        assert fns.fwd.name == f"lltm_seq_fwd_group_kernel<float, {p}>"
        assert fns.bwd.name == f"lltm_seq_bwd_group_kernel<float, {p}>"
        assert fns.bwd.max_dynamic_shared_size_bytes == LIMIT80
    _cluster_kernels.get_kernels(f32, 2)
    assert len(modules) == 2 and modules[1][2] == {}
    assert _group_kernels.resident_blocks(got[4].fwd, 256, 1000) == 216
    assert _group_kernels.resident_blocks(got[4].fwd, 256, 1000) == 216
    assert asked == [(1234, 256, 1000)]


def test_warmup_with_fused_compiles_the_group_kernels_on_sm_80(group_cupy, monkeypatch):
    """lltm_cupy.warmup(fused=True) on sm_80 compiles the group module (not the cluster one),
    after which a call that runs the group kernels compiles nothing."""
    import lltm_cupy

    emu = group_cupy.emulator
    lltm_cupy.warmup(["float32"], fused=True)
    assert ("lltm_fused_cluster.cu", "group", "<f4") in emu.compiles
    emu.reset()
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 2)
    stored, _ = make(3, 2, 2, 5, np.dtype(np.float32), seed=0)
    run(group_cupy, stored, [3, 1], False, True)
    assert emu.compiles == [], f"compiled after warmup: {emu.compiles}"


def test_group_size_table():
    """The largest state sizes on sm_80 documented in lltm_cupy/_cuda/fused_cluster.py and
    docs/api.md."""
    tops = [_cluster.max_state(LIMIT80, d, group=True) for d in DTYPES.values()]
    assert tops[0] == tops[1]
    assert re.search(rf"on sm_80 \(166,912 bytes per block\):\n\n.*\n\s+8\s+{tops[0]}\s+"
                     rf"{tops[2]}\s+{tops[3]}\n", _cluster.__doc__), tops
    from pathlib import Path

    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    assert f"| sm_80 | 8 (a group) | {tops[0]} | {tops[2]} | {tops[3]} |" in api


def test_the_kernel_time_script_times_the_group_kernels(group_cupy, monkeypatch, capsys):
    """scripts/fused_kernel_time.py on the emulated sm_80 device (108 SMs): past one block's
    bound it checks and times the group kernels (their launches alone) and says how many blocks
    ran; the kernels' getters are restored after."""
    from helpers import gpu_scripts

    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 108)
    script = gpu_scripts.load("fused_kernel_time")
    real = (_fused_kernels.get_kernels, _group_kernels.get_kernels)
    status = script.main(["--sizes", "3x2x2x150,3x2x2x5", "--dtypes", "float32", "--runs", "2",
                          "--warmup", "0"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert (_fused_kernels.get_kernels, _group_kernels.get_kernels) == real
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["3"]]
    assert [(r[3], r[-1]) for r in rows] == [("150", "2"), ("5", "1")], out
    for r in rows:
        fwd, bwd, whole = map(float, r[5:8])
        assert 0 < fwd and 0 < bwd and fwd + bwd <= whole, r
