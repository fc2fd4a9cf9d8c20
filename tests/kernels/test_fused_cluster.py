"""The fused sequence kernels across a thread-block cluster (cuda_src/lltm_fused_cluster.cu,
lltm_cupy/_cuda/fused_cluster.py), without a GPU: the CUDA source built as host C++ with cluster
semantics (tests/host_shim/shim.h's shim_launch_cluster: every thread of a cluster's blocks a
context, __syncthreads() per block, the cluster barrier, distributed shared memory as pointers into
the peer's buffer) and launched from the GPU backend on the emulated CuPy (an sm_90 device); against
the stepped path and the float64 reference, forward and every gradient, at 1, 2, 4 and 8 blocks per
cluster. Also: deleting any barrier is caught, NVRTC compiles every cluster size for sm_90 and
sm_100, ptxas reports no spill, the launcher's sizes agree with the kernels' layout.

Runs everywhere (g++, the NVRTC wheel and nvcc, no GPU).
"""
from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np
import pytest

from lltm_cupy._cuda import cluster_kernels as _cluster_kernels, fused as _fused
from lltm_cupy._cuda import fused_cluster as _cluster, fused_kernels as _fused_kernels
from lltm_cupy._cuda import group_kernels as _group_kernels, kernels as _kernels
from conftest import gpu_unavailable_reason, max_error
from helpers import cubin as _cubin, host_cluster, host_fused, mutants
from test_fused_sequence import DTYPES, LIMIT, OUT, _run_ptxas, compare, make, run
from test_array_lengths import _reference

SIZES = _cluster_kernels.SIZES


@pytest.fixture(scope="session")
def cluster_lib(tmp_path_factory):
    return host_cluster.build(tmp_path_factory.mktemp("cluster_host"))


@pytest.fixture(scope="session")
def one_block_lib(tmp_path_factory):
    return host_fused.build(tmp_path_factory.mktemp("fused_host_for_clusters"))


def _use(monkeypatch, lib, one_block_lib):
    monkeypatch.setattr(_cluster_kernels, "get_kernels",
                        host_cluster.host_get_cluster_kernels(lib, LIMIT))
    monkeypatch.setattr(_group_kernels, "get_kernels",
                        host_cluster.host_get_group_kernels(lib, LIMIT))
    monkeypatch.setattr(_group_kernels, "resident_blocks", host_cluster.resident_blocks)
    monkeypatch.setattr(_fused_kernels, "get_kernels",
                        host_fused.host_get_fused_kernels(one_block_lib, LIMIT))
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 90)


@pytest.fixture
def cluster_cupy(emulated_cupy, monkeypatch, cluster_lib, one_block_lib):
    """The emulated CuPy as an sm_90 device of LIMIT bytes of shared memory per block, with the
    cluster kernels' and the one-block kernels' host builds; ``monkeypatch`` _cluster.FORCED_SIZE
    to run the cluster kernels where one block would do."""
    _use(monkeypatch, cluster_lib, one_block_lib)
    host_cluster.set_schedule(cluster_lib, "ascending")
    yield emulated_cupy
    host_cluster.set_schedule(cluster_lib, "ascending")


def _want(case, lengths, reverse, T, B):
    full = [T] * B if lengths is None else lengths
    return _reference(case, full, reverse, (case["grad_outputs"], case["grad_h_n"],
                                            case["grad_c_n"]))


LENGTHS = {"full": None, "zeros and ties": [3, 0, 5, 1, 5, 0, 2]}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cluster_equals_stepped_and_reference(cluster_cupy, monkeypatch, dtype, size, lengths,
                                              reverse):
    """7 rows over 3 clusters (tiles of 3, 3 and 1 rows: a tile that does not divide the batch),
    S = 13 (blocks of 1 to 13 states, unequal where P does not divide S; S = 19 for 16 blocks,
    of 1 or 2 states), lengths with zeros, both directions, all dtypes, each cluster size
    forced (16 blocks: past the portable size, which the emulated device holds)."""
    monkeypatch.setattr(_cluster, "FORCED_SIZE", size)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 3 * size)
    emu = cluster_cupy.emulator
    stored, case = make(5, 7, 4, 13 if size <= 13 else 19, dtype, seed=3 + reverse)
    emu.reset()
    fused = run(cluster_cupy, stored, lengths, reverse, True)
    assert emu.log.count(f"kernel:seq_fwd_cluster{size}") == 1
    assert emu.log.count(f"kernel:seq_bwd_cluster{size}") == 1
    assert "kernel:seq_fwd" not in emu.log and "kernel:seq_bwd" not in emu.log
    stepped = run(cluster_cupy, stored, lengths, reverse, False)
    compare(fused, stepped, _want(case, lengths, reverse, 5, 7), dtype, f"P={size}")


def _large_sizes():
    """Above the one-block bound on sm_90: where the launcher itself picks a cluster."""
    cases = []
    for name, dtype in DTYPES.items():
        top = _fused.max_state(LIMIT, dtype)
        top8 = _cluster.max_state(LIMIT, dtype, 8)
        states = {"float16": (top + 1, 512, top8 + 1), "bfloat16": (300, 512, 768),
                  "float32": (top + 1, 388, top8 + 1, 512),
                  "float64": (top + 1, 272, top8 + 1, 384)}[name]
        cases += [pytest.param(dtype, s, id=f"{name}-S{s}") for s in states]
    return cases


@pytest.mark.parametrize("dtype,state", _large_sizes())
def test_state_sizes_beyond_one_block_run_in_a_cluster(cluster_cupy, monkeypatch, dtype, state):
    """Past the one-block kernels' bound (S = 138 float32, 195 16-bit, 97 float64 on sm_90) the
    launcher picks the smallest cluster that holds W_h: up to the largest an 8-block cluster
    holds (544, 388, 272), then 16 blocks (the emulated device holds such clusters) up to 768,
    544, 384 (float32 S = 512 among them); packed lengths that end at different steps, 3 rows in
    tiles that do not divide them."""
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 16)
    size = _fused.cluster_size(state, dtype)
    assert size is not None and size > 1
    emu = cluster_cupy.emulator
    stored, case = make(3, 3, 3, state, dtype, seed=state)
    lengths = [3, 1, 2]
    emu.reset()
    fused = run(cluster_cupy, stored, lengths, False, True)
    assert emu.log.count(f"kernel:seq_fwd_cluster{size}") == 1
    assert emu.log.count(f"kernel:seq_bwd_cluster{size}") == 1
    stepped = run(cluster_cupy, stored, lengths, False, False)
    compare(fused, stepped, _want(case, lengths, False, 3, 3), dtype, f"S={state} P={size}")


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_float32_512_runs_in_16_block_clusters(cluster_cupy, monkeypatch, reverse):
    """float32 S = 512, which 8 blocks cannot hold (W_h's share is about 199 KB per block in 16):
    the launcher's own choice is 16 blocks; 5 rows on 32 SMs (tiles of 3 and 2), packed lengths
    with a zero, both directions, against the stepped path and float64."""
    f32 = np.dtype(np.float32)
    assert _cluster.cluster_size(512, f32, LIMIT) is None        # no portable size holds it
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 32)
    assert _fused.cluster_size(512, f32) == 16
    emu = cluster_cupy.emulator
    stored, case = make(3, 5, 2, 512, f32, seed=11 + reverse)
    lengths = [3, 0, 2, 3, 1]
    emu.reset()
    fused = run(cluster_cupy, stored, lengths, reverse, True)
    assert emu.log.count("kernel:seq_fwd_cluster16") == 1
    assert emu.log.count("kernel:seq_bwd_cluster16") == 1
    stepped = run(cluster_cupy, stored, lengths, reverse, False)
    compare(fused, stepped, _want(case, lengths, reverse, 3, 5), f32, "S=512 P=16")


def _no_16(emu, how):
    """Make the emulated device hold no 16-block cluster, ``how``: its GPCs too small (a MIG-like
    slice), the non-portable attribute refused, or the query failing."""
    if how == "small GPCs":
        emu.gpc_sms = (14, 14)
    elif how == "attribute refused":
        def refuse(f, attribute, value):
            raise emu_module.CUDADriverError("CUDA_ERROR_NOT_SUPPORTED: operation not supported")
        from helpers import emulated_cupy as emu_module
        import cupy

        cupy.cuda.driver.funcSetAttribute = refuse
    else:
        emu.occupancy_error = 999


@pytest.mark.parametrize("how", ["small GPCs", "attribute refused", "query fails"])
def test_16_blocks_only_where_the_device_holds_them(cluster_cupy, monkeypatch, how):
    """Where the query does not say that a 16-block cluster fits, float32 S = 512 runs the
    stepped path with fused=True (fused.usable says so), a forced 16 is refused with the reason,
    and the 8-block sizes are still chosen; the reason of a failure is kept."""
    f32 = np.dtype(np.float32)
    emu = cluster_cupy.emulator
    _no_16(emu, how)
    assert not _fused.usable(512, f32)
    assert _fused.usable(388, f32)      # 8 blocks: no query needed to choose them
    if how == "small GPCs":
        assert _cluster.held(512, f32, 16) == 0 and _kernels.cluster_failures == {}
    else:
        assert _cluster.held(512, f32, 16) is None
        kinds = {what if isinstance(what, str) else what[0]
                 for _, _, what in _kernels.cluster_failures}
        assert kinds == ({"non-portable", "occupancy"} if how == "attribute refused"
                         else {"occupancy"}), _kernels.cluster_failures
    from lltm_cupy import _cuda

    stored, _ = make(2, 2, 2, 512, f32, seed=5)
    a = {k: cluster_cupy.asarray(v) for k, v in stored.items()}
    emu.reset()
    saved = _cuda.forward_sequence(*(a[n] for n in ("inputs", "weights", "bias", "h0", "c0")),
                                   fused=True)[3]
    assert not saved.fused and not any("seq_" in e for e in emu.log), emu.log
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 16)
    with pytest.raises(RuntimeError, match="holds no cluster of 16 blocks"):
        _cluster.chosen_size(512, f32)


def test_the_launcher_picks_the_smallest_cluster_that_fits():
    f32 = np.dtype(np.float32)
    assert _cluster.cluster_size(139, f32, LIMIT) == 2
    assert _cluster.cluster_size(_cluster.max_state(LIMIT, f32, 2), f32, LIMIT) == 2
    assert _cluster.cluster_size(_cluster.max_state(LIMIT, f32, 2) + 1, f32, LIMIT) == 4
    assert _cluster.cluster_size(_cluster.max_state(LIMIT, f32) + 1, f32, LIMIT) is None
    for dtype in DTYPES.values():
        assert _cluster.max_state(LIMIT, dtype) > _fused.max_state(LIMIT, dtype)
    assert _cluster.max_state(LIMIT, DTYPES["bfloat16"]) >= 512


def test_no_cluster_before_sm_90(cluster_cupy, monkeypatch):
    """Before sm_90 the state sizes past the one-block bound run the group variant
    (tests/kernels/test_fused_group.py), not clusters; from sm_90 clusters."""
    dtype = np.dtype(np.float32)
    state = _fused.max_state(LIMIT, dtype) + 1
    for arch, clusters in ((80, False), (89, False), (90, True), (100, True)):
        monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: arch)
        assert _fused.usable(state, dtype)
        assert _cluster.uses_clusters(0) == clusters
    assert not _fused.usable(_cluster.max_state(LIMIT, dtype, 16) + 1, dtype)
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 80)   # groups of 8
    top = _cluster.max_state(LIMIT, dtype, 8, group=True)     # the group kernels' layout
    assert _fused.usable(top, dtype)
    assert not _fused.usable(top + 1, dtype)


def test_a_forced_size_that_cannot_run_says_which_sizes_can(cluster_cupy, monkeypatch):
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 2)
    dtype = np.dtype(np.float32)
    stored, _ = make(2, 1, 2, 300, dtype, seed=1)
    with pytest.raises(RuntimeError, match=r"state size 300 in float32 in 2 blocks per tile"
                                           r".*8 blocks: S <= \d+"):
        run(cluster_cupy, stored, None, False, True)


def test_cluster_results_do_not_depend_on_the_thread_order(cluster_cupy, cluster_lib,
                                                           monkeypatch):
    """Bit-identical results whether the cluster's threads run ascending, descending or in a
    random order (no data race between threads or blocks)."""
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 4)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 8)
    stored, _ = make(6, 5, 3, 11, np.dtype(np.float32), seed=5)
    results = {}
    for order, seed in (("ascending", 1), ("descending", 1), ("random", 7), ("random", 8)):
        host_cluster.set_schedule(cluster_lib, order, seed=seed)
        results[(order, seed)] = run(cluster_cupy, stored, [6, 2, 0, 6, 3], True, True)
    for key, got in results.items():
        for name, a, b in zip(OUT, got, results[("ascending", 1)]):
            assert np.array_equal(a, b), f"{name} differs between ascending and {key}"


def test_cluster_forward_gives_the_same_bits_at_every_size(cluster_cupy, monkeypatch):
    """Every block sums its states' dot products over all of h in the same order: the forward's
    bits do not depend on the cluster size (the backward's partial sums go by block, so its last
    bits do)."""
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 2)
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 1)
    stored, _ = make(4, 3, 3, 18, np.dtype(np.float32), seed=2)
    one = run(cluster_cupy, stored, [4, 3, 1], False, True)
    for size in SIZES[1:]:
        monkeypatch.setattr(_cluster, "FORCED_SIZE", size)
        got = run(cluster_cupy, stored, [4, 3, 1], False, True)
        for name, a, b in zip(OUT[:3], got[:3], one[:3]):
            assert np.array_equal(a, b), f"P={size} {name}"


# ------------------------------------------------------- clusters the device holds at once

def test_launch_config_layout_matches_cuda_h(tmp_path):
    """CUlaunchConfig (ctypes) against cuda.h's CUlaunchConfig, compiled: size and every
    field's offset, the prototype of cuOccupancyMaxActiveClusters that OCCUPANCY_PROTOTYPE
    states, and the attribute number the 16-block clusters set."""
    import shutil
    import subprocess

    include = next((Path(base) / "include" for base in (
        os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")
        if base and (Path(base) / "include" / "cuda.h").is_file()), None)
    assert include is not None, "cuda.h not found (CUDA_HOME, CUDA_PATH or /usr/local/cuda)"
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler (gcc) is required for the layout check"
    fields = [name for name, _ in _cluster_kernels.CUlaunchConfig._fields_]
    program = "\n".join([
        "#include <stddef.h>", "#include <stdio.h>", "#include <cuda.h>",
        "_Static_assert(__builtin_types_compatible_p(__typeof__(&cuOccupancyMaxActiveClusters),"
        " CUresult (*)(int*, CUfunction, const CUlaunchConfig*)), \"prototype\");",
        "int main(void) {",
        '  printf("size %zu\\n", sizeof(CUlaunchConfig));',
        '  printf("result %zu\\n", sizeof(CUresult));',
        '  printf("function %zu\\n", sizeof(CUfunction));',
        '  printf("attribute %d\\n", (int)CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED);',
        *[f'  printf("{f} %zu\\n", offsetof(CUlaunchConfig, {f}));' for f in fields],
        "  return 0;", "}", ""])
    (tmp_path / "layout.c").write_text(program)
    subprocess.run([cc, "-std=c11", f"-I{include}", "-o", str(tmp_path / "layout"),
                    str(tmp_path / "layout.c")], check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True,
                         text=True).stdout
    got = {k: int(v) for k, v in (line.split() for line in out.splitlines())}
    assert got["size"] == ctypes.sizeof(_cluster_kernels.CUlaunchConfig), got
    assert got["result"] == ctypes.sizeof(ctypes.c_int)
    assert got["function"] == ctypes.sizeof(ctypes.c_void_p)
    assert got["attribute"] == _cluster_kernels.NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    for name in fields:
        assert got[name] == getattr(_cluster_kernels.CUlaunchConfig, name).offset, name


def _held(cupy, kernel, size, threads, shared):
    """The emulated driver's answer, asked afresh (not the library's cache)."""
    count = ctypes.c_int(-1)
    config = _cluster_kernels.CUlaunchConfig(gridDimX=size, gridDimY=1, gridDimZ=1,
                                             blockDimX=threads, blockDimY=1, blockDimZ=1,
                                             sharedMemBytes=shared)
    status = _cluster_kernels._occupancy_function()(ctypes.byref(count), kernel.kernel.ptr,
                                                    ctypes.byref(config))
    return count.value if status == 0 else -status


def test_the_emulated_occupancy_query(cluster_cupy):
    """The model the planner is tested against: whole clusters per GPC (H100-like: 16 and 18
    SMs), one block of about 200 KB per SM: 16 clusters of 8, 32 of 4 (not 132 / 4 = 33)."""
    f32 = np.dtype(np.float32)
    big = _cluster.shared_bytes(388, f32, 1, True, 8)
    assert _held(cluster_cupy, _cluster_kernels.get_kernels(f32, 8).bwd, 8, 256, big) == 16
    assert _held(cluster_cupy, _cluster_kernels.get_kernels(f32, 4).bwd, 4, 256, big) == 32
    assert _held(cluster_cupy, _cluster_kernels.get_kernels(f32, 4).bwd, 4, 64, 1000) == \
        sum(n * 32 // 4 for n in cluster_cupy.emulator.gpc_sms)
    cluster_cupy.emulator.gpc_sms = (7, 7)
    assert _held(cluster_cupy, _cluster_kernels.get_kernels(f32, 8).bwd, 8, 256, big) == 0
    cluster_cupy.emulator.occupancy_error = 700
    assert _held(cluster_cupy, _cluster_kernels.get_kernels(f32, 2).fwd, 2, 256, big) == -700


LAYOUTS = {"H100-like": (16, 16, 16, 16, 16, 16, 18, 18), "uneven": (18, 18, 14, 10, 9),
           "small GPCs": (6, 6, 6, 6), "one GPC": (20,)}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_planner_never_plans_more_clusters_than_the_device_holds(cluster_cupy, monkeypatch,
                                                                     layout):
    """For each cluster size, both directions, batches 1 to 70 and three state sizes (the
    largest: one row per tile; 4/5 of it: one block per SM, tiles of up to about 30 rows; small
    blocks, many per SM): the planned clusters are at most the query's
    answer for the planned launch (threads and shared memory), unless the tile is already as
    large as shared memory or the batch allows (the waves the docs speak of); the tile is the
    smallest such from the plan without the query, which it never undercuts."""
    emu = cluster_cupy.emulator
    emu.gpc_sms = layout
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: sum(layout))
    f32 = np.dtype(np.float32)
    waves = 0
    for size in (2, 4, 8):
        top = _cluster.max_state(LIMIT, f32, size)
        for state in (top, top * 4 // 5, 3 * size):
            for backward in (False, True):
                fns = _cluster_kernels.get_kernels(f32, size)
                kernel = fns.bwd if backward else fns.fwd
                fits = (LIMIT - _cluster.shared_bytes(state, f32, 0, backward, size)) // (
                    _cluster.shared_bytes(state, f32, 1, backward, size)
                    - _cluster.shared_bytes(state, f32, 0, backward, size))
                for batch in range(1, 71):
                    plain = _cluster.geometry(batch, state, f32, backward, size)
                    blocks, threads, tile, shared = _cluster.geometry(batch, state, f32,
                                                                      backward, size, kernel)
                    assert shared == _cluster.shared_bytes(state, f32, tile, backward, size)
                    assert blocks == -(-batch // tile) * size and tile >= plain[2]
                    held = _held(cluster_cupy, kernel, size, threads, shared)
                    label = (size, state, backward, batch, tile, held)
                    if blocks // size > held:
                        assert tile == min(fits, batch), label
                        waves += 1
                    for smaller in range(plain[2], tile):
                        threads_s, shared_s = _cluster._launch_shape(state, f32, backward,
                                                                     size, smaller)
                        assert -(-batch // smaller) > _held(cluster_cupy, kernel, size,
                                                            threads_s, shared_s), label
    assert _kernels.cluster_failures == {}
    assert waves > 0 or min(layout) >= 8, "no size needed waves"


def test_the_query_turns_33_tiles_into_17(cluster_cupy, monkeypatch):
    """B = 33 on the H100-like model (132 SMs): float32 S = 256 runs in 4-block clusters, 33 tiles
    of one row without the query, but the GPCs hold 32 such clusters: 17 tiles of 2 rows. At
    S = 388 (8 blocks of about 227 KB) a tile holds one row only: 33 tiles, in waves of 16."""
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 132)
    f32 = np.dtype(np.float32)
    for state, size, tiles in ((256, 4, 17), (388, 8, 33)):
        assert _cluster.cluster_size(state, f32, LIMIT) == size
        for backward in (False, True):
            kernel = _cluster_kernels.get_kernels(f32, size)[backward]
            assert _cluster.geometry(33, state, f32, backward, size)[0] == 33 * size
            blocks, threads, tile, shared = _cluster.geometry(33, state, f32, backward, size,
                                                              kernel)
            assert blocks == tiles * size, (state, backward, blocks)
            assert _held(cluster_cupy, kernel, size, threads, shared) == 128 // size


def test_a_failed_query_leaves_the_plan_without_it(cluster_cupy, monkeypatch):
    """A query that fails (a CUresult other than success) is not an error: the launch goes as
    planned without it, the reason is kept in kernels.cluster_failures, the results are right."""
    emu = cluster_cupy.emulator
    emu.occupancy_error = 999
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 2)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 6)
    f32 = np.dtype(np.float32)
    kernel = _cluster_kernels.get_kernels(f32, 2).fwd
    assert _cluster.geometry(7, 13, f32, False, 2, kernel) == \
        _cluster.geometry(7, 13, f32, False, 2)
    assert any("CUresult 999" in why and what[0] == "occupancy"
               for (_, _, what), why in _kernels.cluster_failures.items()), \
        _kernels.cluster_failures
    stored, case = make(5, 7, 4, 13, f32, seed=4)
    fused = run(cluster_cupy, stored, None, False, True)
    stepped = run(cluster_cupy, stored, None, False, False)
    compare(fused, stepped, _want(case, None, False, 5, 7), f32, "failed query")


def test_a_run_planned_by_the_query(cluster_cupy, monkeypatch):
    """End to end: 7 rows, 4-block clusters, 12 SMs (3 tiles of 3 rows without the query) in two
    GPCs of 4 SMs whose shared memory holds one block each: the query holds 2 clusters, so both
    launches run 2 tiles (4 and 3 rows), and the results are the stepped path's."""
    emu = cluster_cupy.emulator
    f32 = np.dtype(np.float32)
    state, size = 13, 4
    need = [_cluster.shared_bytes(state, f32, tile, b, size) + 1024
            for tile in (1, 7) for b in (False, True)]
    emu.sm_shared_bytes = 2 * min(need[:2]) - 1        # one block per SM for every tile
    assert max(need) <= emu.sm_shared_bytes
    emu.gpc_sms = (4, 4)
    monkeypatch.setattr(_cluster, "FORCED_SIZE", size)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 12)
    planned = []
    real = _cluster.geometry

    def geometry(*args):
        planned.append(real(*args))
        return planned[-1]

    monkeypatch.setattr(_cluster, "geometry", geometry)
    stored, case = make(5, 7, 4, state, f32, seed=6)
    fused = run(cluster_cupy, stored, [5, 2, 5, 0, 1, 3, 4], True, True)
    assert [(blocks, tile) for blocks, _, tile, _ in planned] == [(8, 4), (8, 4)], planned
    assert real(7, state, f32, False, size)[0] == 12
    stepped = run(cluster_cupy, stored, [5, 2, 5, 0, 1, 3, 4], True, False)
    compare(fused, stepped, _want(case, [5, 2, 5, 0, 1, 3, 4], True, 5, 7), f32, "query plan")


# ------------------------------------------------------------------------ a missing barrier

_CLUSTER_TEXT = _kernels.source_path(_cluster_kernels.SOURCE_NAME).read_text()


def test_the_kernels_have_the_barriers_the_mutation_test_deletes():
    """The cluster exchange's barriers (one at the start and one per step each way), then one
    block barrier per backward step: four in all."""
    found = [_CLUSTER_TEXT[a:b].rstrip("();")
             for a, b in mutants.cluster_barriers(_CLUSTER_TEXT)]
    assert found == ["lltm_cluster_sync"] * 3 + ["__syncthreads"], found


@pytest.mark.parametrize("which", range(len(mutants.statements("cluster"))))
@pytest.mark.slow
def test_deleting_a_barrier_is_caught(which, tmp_path, emulated_cupy, monkeypatch,
                                      one_block_lib):
    """Each barrier of lltm_fused_cluster.cu deleted in turn (a mutation of the source, all of
    them in one build: tests/helpers/mutants.py): the host run with cluster semantics gives
    wrong numbers or stops with an error, at 2 and 4 blocks per cluster, in the ascending and
    the descending order."""
    lib = host_cluster.build(tmp_path, sources=mutants.sources("harness_cluster.cpp"))
    mutants.delete(lib, "cluster", which)
    _use(monkeypatch, lib, one_block_lib)
    for label, got, errors in _mutation_runs(emulated_cupy, lib, monkeypatch):
        if got is None:
            assert "seq_" in errors, errors     # the shim's report
            continue
        assert max(e if np.isfinite(e) else np.inf for e in errors.values()) > 1e-6, \
            f"barrier {which} deleted, {label}: every result matches: {errors}"


def _mutation_runs(xp, lib, monkeypatch, sm_count=None):
    """(label, results or None, {name: error against the reference} or the launch's error) of
    the mutation check's runs: 2 and 4 blocks per cluster (or group), ascending and descending
    order; ``sm_count(size)``, if given, the device's SMs for each size."""
    stored, case = make(4, 3, 3, 8, np.dtype(np.float64), seed=1)
    want = _want(case, None, False, 4, 3)
    for size in (2, 4):
        if sm_count is not None:
            monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: sm_count(size))
        for order in ("ascending", "descending"):
            monkeypatch.setattr(_cluster, "FORCED_SIZE", size)
            host_cluster.set_schedule(lib, order)
            try:
                got = run(xp, stored, None, False, True)
            except AssertionError as exc:
                yield f"P={size} {order}", None, str(exc)
                continue
            yield f"P={size} {order}", got, {name: max_error(g, w)
                                              for name, g, w in zip(OUT, got, want)}


@pytest.mark.parametrize("build", [
    "source", pytest.param("mutants-none-deleted", marks=pytest.mark.slow)])
def test_unmutated_source_passes_the_mutation_check(cluster_cupy, cluster_lib, one_block_lib,
                                                    monkeypatch, build, tmp_path):
    """The control of the test above: the same runs with every barrier in place are exact, in
    the build of the source as it is and in the mutants' build with no statement deleted."""
    lib = cluster_lib
    if build != "source":
        lib = host_cluster.build(tmp_path, sources=mutants.sources("harness_cluster.cpp"))
        mutants.delete(lib, None)
        _use(monkeypatch, lib, one_block_lib)
    for label, got, errors in _mutation_runs(cluster_cupy, lib, monkeypatch):
        assert got is not None, f"{label}: {errors}"
        assert max(errors.values()) <= 1e-12, (label, errors)


# -------------------------------------------------------------- compilers and the sizes

#: Registers per thread of the cluster kernels as NVRTC (13.x) compiles them, the most over the
#: cluster sizes 1, 2, 4 and 8 (the figures per size differ by up to 20), and no local memory in
#: any; no static shared memory either (tested with ptxas below).
#:                 float16  bfloat16  float32  float64
#:   sm_90  fwd       56       56        56       79
#:          bwd       56       56        64       96
#:   sm_100 fwd       64       64        64       80
#:          bwd       54       54        55       80
CLUSTER_REGISTERS = {
    (90, "fwd"): (56, 56, 56, 79), (90, "bwd"): (56, 56, 64, 96),
    (100, "fwd"): (64, 64, 64, 80), (100, "bwd"): (54, 54, 55, 80),
}
#: The same for 16 blocks per cluster (the forward keeps 16 peer addresses):
#:                 float16  bfloat16  float32  float64
#:   sm_90  fwd       64       64        64       94
#:          bwd       63       56        64       80
#:   sm_100 fwd       64       64        71       96
#:          bwd       56       56        56       93
CLUSTER_REGISTERS_16 = {
    (90, "fwd"): (64, 64, 64, 94), (90, "bwd"): (63, 56, 64, 80),
    (100, "fwd"): (64, 64, 71, 96), (100, "bwd"): (56, 56, 56, 93),
}


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.slow
def test_nvrtc_compiles_the_cluster_kernels(dtype, arch):
    """Every cluster size, header-free inline PTX (mapa, st.shared::cluster, barrier.cluster's
    .aligned forms);
    the cubin records no local memory and registers within the pins (CLUSTER_REGISTERS, with
    test_fused_sequence's margin)."""
    ptx = _cluster_kernels.compile_offline(dtype, arch, output="ptx").decode()
    # each kernel (entry) its own cluster shape: both directions at every size (a kernel that
    # lost __cluster_dims__ would launch without a cluster, and every block would be rank 0)
    entries = ptx.split(".entry ")[1:]
    shapes = [re.findall(r"\.reqnctapercluster (\d+), 1, 1", e.split("\n{", 1)[0]) for e in entries]
    assert all(len(found) == 1 for found in shapes), shapes
    assert sorted(int(found[0]) for found in shapes) == sorted(2 * list(SIZES)), shapes
    for instruction in ("mapa.shared::cluster", "st.shared::cluster",
                        "barrier.cluster.arrive.aligned", "barrier.cluster.wait.aligned",
                        "%cluster_ctarank"):
        assert instruction in ptx, instruction
    cubin = _cluster_kernels.compile_offline(dtype, arch, output="cubin")
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return an ELF cubin"
    resources = _cubin.kernel_resources(cubin)
    assert len(resources) == 2 * len(SIZES), sorted(resources)
    column = list(DTYPES.values()).index(dtype)
    for name, r in resources.items():
        kernel = re.match(r"_Z\d+lltm_seq_(fwd|bwd)_cluster_kernel", name).group(1)
        size = int(re.search(r"Li(\d+)EE", name).group(1))
        assert r.get("frame") == 0 and r.get("stack") == 0, f"sm_{arch} {name}: local memory {r}"
        pins = CLUSTER_REGISTERS_16 if size == 16 else CLUSTER_REGISTERS
        ceiling = _cubin.register_ceiling(pins[arch, kernel][column])
        assert 0 < r["registers"] <= ceiling, f"sm_{arch} {name}: {r['registers']} > {ceiling}"


@pytest.mark.slow
def test_ptxas_reports_no_spill_for_the_cluster_kernels():
    """Every cluster kernel for sm_90: no spill or stack frame, registers for 256 threads, no
    static shared memory."""
    import shutil

    nvcc = shutil.which("nvcc")
    assert nvcc, "nvcc (CUDA toolkit) is required for the ptxas check"
    report, _ = _run_ptxas(nvcc, 90, _cluster_kernels.source(),
                           [_cluster_kernels.name_expression(k, d, p) for d in DTYPES.values()
                            for p in SIZES for k in _cluster_kernels.KERNEL_NAMES])
    assert len(report) == len(DTYPES) * len(SIZES) * 2, sorted(report)
    for name, r in report.items():
        assert r["spills"] == (0, 0) and r["frame"] == 0, f"{name}: spills {r}"
        assert r["registers"] * _fused_kernels.THREADS <= 65536, f"{name}: registers"
        assert r["smem"] == 0, f"{name}: static shared memory {r['smem']}"


def test_launcher_sizes_shared_memory_as_the_kernels_lay_it_out(cluster_lib):
    cluster_lib.lltm_host_cluster_w_bytes.restype = ctypes.c_longlong
    for state in range(1, 120):
        for size in SIZES:
            most = -(-state // size)
            for dtype in DTYPES.values():
                item = dtype.itemsize
                assert cluster_lib.lltm_host_cluster_wt_stride(most, item) == \
                    _fused_kernels.wt_stride(most, item)
                for backward in (False, True):
                    weights = cluster_lib.lltm_host_cluster_w_bytes(state, most, item,
                                                                    int(backward))
                    assert weights == _cluster.shared_bytes(state, dtype, 0, backward, size), \
                        (state, size, dtype, backward)


def test_a_launch_with_too_little_shared_memory_is_reported(cluster_cupy, monkeypatch):
    """The host build checks the launch's shared memory against the kernels' layout."""
    real = _cluster.shared_bytes
    monkeypatch.setattr(_cluster, "shared_bytes",
                        lambda state, dtype, tile, backward, size, group=False:
                        real(state, dtype, tile, backward, size, group) - 8)
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 2)
    stored, _ = make(3, 2, 2, 6, np.dtype(np.float32), seed=3)
    with pytest.raises(AssertionError, match="more dynamic shared memory than the launch"):
        run(cluster_cupy, stored, None, False, True)


def test_cluster_size_table():
    """The largest state sizes documented in lltm_cupy/_cuda/fused_cluster.py, docs/api.md and
    forward_sequence's docstring."""
    import lltm_cupy

    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    text = " ".join(lltm_cupy.forward_sequence.__doc__.split())
    for size, after in ((8, "; speed not measured yet)"), (16, ") where the device")):
        tops = [_cluster.max_state(LIMIT, d, size) for d in DTYPES.values()]
        assert tops[0] == tops[1]
        doc = _cluster.__doc__
        assert re.search(rf"\n\s+{size}\s+{tops[0]}\s+{tops[2]}\s+{tops[3]}\n", doc), \
            (tops, doc)
        assert f"| sm_90, sm_100 | {size} | {tops[0]} | {tops[2]} | {tops[3]} |" in api
        assert f"(up to {tops[0]}, {tops[2]}, {tops[3]}{after}" in text
    assert _cluster.max_state(LIMIT, DTYPES["float32"], 16) >= 512


@pytest.mark.parametrize("arch", [80, 90])
def test_warmup_with_fused_compiles_the_cluster_kernels_from_sm_90(cluster_cupy, monkeypatch,
                                                                   arch):
    """lltm_cupy.warmup(fused=True) compiles the cluster module where the device can run it,
    after which a call that runs a cluster compiles nothing."""
    import lltm_cupy

    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: arch)
    emu = cluster_cupy.emulator
    lltm_cupy.warmup(["float32"], fused=True)
    assert (("lltm_fused_cluster.cu", "<f4") in emu.compiles) == (arch >= 90)
    if arch >= 90:
        emu.reset()
        monkeypatch.setattr(_cluster, "FORCED_SIZE", 2)
        stored, _ = make(3, 2, 2, 5, np.dtype(np.float32), seed=0)
        run(cluster_cupy, stored, [3, 1], False, True)
        assert emu.compiles == [], f"compiled after warmup: {emu.compiles}"


def test_cluster_kernels_compile_once_per_dtype_with_the_whole_shared_memory(emulated_cupy,
                                                                            monkeypatch):
    """cluster_kernels.get_kernels (and fused_kernels.get_kernels, which loads the same way) on a CuPy
    whose RawModule records what it is asked: one module per device and dtype holding every
    cluster size, each function allowed the device's opt-in shared memory less its static, and
    the 16-block ones (only they) the non-portable cluster size, on their loaded function
    (``RawKernel.kernel.ptr``, CuPy's ``driver.funcSetAttribute(f, attribute, value)``)."""
    import types

    modules, attributes = [], []

    class Function:
        shared_size_bytes = 16
        max_dynamic_shared_size_bytes = 0

        def __init__(self, name):
            self.name = name
            self.kernel = types.SimpleNamespace(ptr=name)

    class RawModule:
        def __init__(self, code, options, name_expressions):
            modules.append((code, tuple(name_expressions)))

        def get_function(self, name):
            return Function(name)

    monkeypatch.setattr(emulated_cupy, "RawModule", RawModule, raising=False)
    monkeypatch.setattr(emulated_cupy.cuda.driver, "funcSetAttribute",
                        lambda f, attribute, value: attributes.append((f, attribute, value)))
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    monkeypatch.setattr(_kernels, "_cache", {})
    f32 = np.dtype(np.float32)
    got = {p: _cluster_kernels.get_kernels(f32, p) for p in SIZES}
    assert len(modules) == 1 and modules[0][0] == _cluster_kernels.source()
    assert sorted(attributes) == sorted((f"{k}<float, 16>", 14, 1)
                                        for k in _cluster_kernels.KERNEL_NAMES), attributes
    for p, fns in got.items():
        assert fns.fwd.name == f"lltm_seq_fwd_cluster_kernel<float, {p}>"
        assert fns.bwd.name == f"lltm_seq_bwd_cluster_kernel<float, {p}>"
        assert fns.fwd.max_dynamic_shared_size_bytes == LIMIT - 16
    one = _fused_kernels.get_kernels(f32)
    assert len(modules) == 2 and modules[1][0] == _fused_kernels.source()
    assert one.fwd.name == "lltm_seq_fwd_kernel<float>" and one.bwd.name.startswith("lltm_seq_bwd")
    assert one.bwd.max_dynamic_shared_size_bytes == LIMIT - 16
    _cluster_kernels.get_kernels(f32, 8)
    _fused_kernels.get_kernels(f32)
    assert len(modules) == 2


def test_the_kernel_time_script_times_the_cluster_kernels(cluster_cupy, capsys):
    """scripts/fused_kernel_time.py on the emulated sm_90 device: past one block's bound it
    checks and times the cluster kernels (their launches alone) and says how many blocks ran;
    the kernels' getters are restored after."""
    from helpers import gpu_scripts

    script = gpu_scripts.load("fused_kernel_time")
    real = (_fused_kernels.get_kernels, _cluster_kernels.get_kernels)
    status = script.main(["--sizes", "3x2x2x150,3x2x2x5", "--dtypes", "float32", "--runs", "2",
                          "--warmup", "0"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert (_fused_kernels.get_kernels, _cluster_kernels.get_kernels) == real
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["3"]]
    assert [(r[3], r[-1]) for r in rows] == [("150", "2"), ("5", "1")], out
    for r in rows:
        fwd, bwd, whole = map(float, r[5:8])
        assert 0 < fwd and 0 < bwd and fwd + bwd <= whole, r


# ---------------------------------------------------------------------------- on a GPU

_GPU_REASON = gpu_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_GPU_REASON is not None, reason=f"GPU test: {_GPU_REASON}")
@pytest.mark.parametrize("dtype,state,size", [
    ("float32", 13, 2), ("float32", 13, 8), ("float32", 256, None), ("bfloat16", 512, None)],
    ids=["float32-S13-P2", "float32-S13-P8", "float32-S256", "bfloat16-S512"])
def test_gpu_cluster_equals_the_stepped_path(monkeypatch, dtype, state, size):
    """The cluster kernels on a real GPU (sm_90 or newer: NVRTC, __cluster_dims__, distributed
    shared memory): forced cluster sizes at a small S, and the launcher's own choice past one
    block's bound (float32 S = 256: 4 blocks; bfloat16 S = 512: 8 blocks of about 200 KB of
    shared memory each), packed lengths, against the stepped path and the float64 reference."""
    import cupy

    if _kernels.compute_capability(cupy.cuda.Device().id) < _cluster.MIN_ARCH:
        pytest.skip("GPU test: the cluster kernels need sm_90 or newer")
    monkeypatch.setattr(_cluster, "FORCED_SIZE", size)
    dtype = DTYPES[dtype]
    if size is None:
        assert _fused.cluster_size(state, dtype) is not None, "the one-block kernels would run"
    lengths = [7, 0, 3, 7, 1]
    stored, case = make(7, 5, 6, state, dtype, seed=state)
    fused = run(cupy, stored, lengths, False, True)
    stepped = run(cupy, stored, lengths, False, False)
    compare(fused, stepped, _want(case, lengths, False, 7, 5), dtype, "gpu cluster")


@pytest.mark.gpu
@pytest.mark.skipif(_GPU_REASON is not None, reason=f"GPU test: {_GPU_REASON}")
def test_gpu_warmup_and_16_block_clusters():
    """The non-portable cluster size on a real GPU (sm_90 or newer): lltm_cupy.warmup(fused=True)
    compiles every fused module and launches the 16-block kernels once each way where the
    occupancy query says the device holds such a cluster (the non-portable size attribute, the
    query, the refusal guard); then float32 S = 512, which only 16 blocks hold, runs in 16-block
    clusters, packed lengths, against the stepped path and the float64 reference. Where the
    device holds none (or its driver refused the launch) the same call must run the stepped
    path, bit for bit; the test then checks that and skips, saying why (a device property,
    allowed by scripts/gpu_check.sh)."""
    import cupy
    import lltm_cupy

    if _kernels.compute_capability(cupy.cuda.Device().id) < _cluster.MIN_ARCH:
        pytest.skip("GPU test: the cluster kernels need sm_90 or newer")
    f32 = np.dtype(np.float32)
    lltm_cupy.warmup(["float32"], fused=True)
    lengths = [5, 0, 3, 5, 1]
    stored, case = make(5, 5, 6, 512, f32, seed=16)
    stepped = run(cupy, stored, lengths, False, False)
    held = _cluster.held(512, f32, 16)
    if not held:
        got, ran_fused = _run_any(cupy, stored, lengths, False, True)
        assert not ran_fused and not _fused.usable(512, f32)
        for name, a, b in zip(OUT, got, stepped):
            assert np.array_equal(a, b), name
        pytest.skip(f"GPU test: this device holds no 16-block cluster of the fused kernels "
                    f"(occupancy query: {held}; refused sizes: {sorted(_kernels.refused_sizes)}; "
                    f"{_kernels.cluster_failures or 'no failure recorded'}): the stepped path ran")
    assert _fused.cluster_size(512, f32) == 16
    fused = run(cupy, stored, lengths, False, True)
    compare(fused, stepped, _want(case, lengths, False, 5, 5), f32, "gpu 16-block clusters")


def test_the_fused_choice_is_made_on_the_arrays_device(emulated_cupy, monkeypatch):
    """Whether the fused kernels run a state size depends on the device (its shared memory, its
    architecture): asked with the arrays' device current, not whichever device is current."""
    from lltm_cupy._cuda import sequence as _sequence

    entered, asked = [], []
    real = _sequence.on_device

    def on_device(device_id):
        entered.append(device_id)
        return real(device_id)

    monkeypatch.setattr(_sequence, "on_device", on_device)
    monkeypatch.setattr(_fused, "usable", lambda state, dtype: asked.append(list(entered)))
    cupy = emulated_cupy
    rng = np.random.default_rng(0)
    T, B, F, S = 3, 2, 4, 5
    args = [cupy.asarray(rng.standard_normal(shape).astype(np.float32))
            for shape in ((T, B, F), (3 * S, S + F), (3 * S,), (B, S), (B, S))]
    import lltm_cupy

    lltm_cupy.forward_sequence(*args, fused=True)
    assert asked == [[args[0].data.device_id]], (asked, entered)


# ------------------------------------------- a driver that refuses what the query said fits

def _run_any(xp, stored, lengths, reverse, fused):
    """test_fused_sequence.run without asserting which path ran: (results, saved.fused)."""
    ran = []
    return run(xp, stored, lengths, reverse, fused, ran=ran), ran[0]


@pytest.mark.parametrize("lengths", [None, [3, 0, 2, 3, 1]], ids=["full", "packed"])
@pytest.mark.parametrize("refused", ["seq_fwd_cluster16", "seq_bwd_cluster16"])
def test_a_refused_16_block_launch_runs_the_stepped_path(cluster_cupy, monkeypatch, refused,
                                                         lengths):
    """float32 S = 512 (16 blocks, which the query says fit) on a driver that refuses the launch
    (CUDA_ERROR_INVALID_CLUSTER_SIZE from the launch call): no error reaches the caller; a refused
    forward gives the stepped path's results bit for bit (and its backward is the stepped one), a
    refused backward the stepped backward on the fused forward's values; the reason is kept, the
    size is refused on the device (later calls plan without it and do not retry, a forced 16
    names the refusal), and the portable sizes run as before."""
    f32 = np.dtype(np.float32)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 32)
    emu = cluster_cupy.emulator
    emu.refused_launches = {refused: emu_module().CUDA_ERROR_INVALID_CLUSTER_SIZE}
    assert _fused.usable(512, f32)
    stored, case = make(3, 5, 2, 512, f32, seed=13)
    emu.reset()
    got, ran_fused = _run_any(cluster_cupy, stored, lengths, False, True)
    assert ran_fused == (refused == "seq_bwd_cluster16")
    assert emu.log.count("kernel:seq_fwd_cluster16") == ran_fused
    assert "kernel:seq_bwd_cluster16" not in emu.log
    stepped = run(cluster_cupy, stored, lengths, False, False)
    if ran_fused:
        compare(got, stepped, _want(case, lengths, False, 3, 5), f32, "refused backward")
    else:
        for name, a, b in zip(OUT, got, stepped):
            assert np.array_equal(a, b), name
    assert _kernels.refused_sizes == {(0, 16)}
    reasons = [why for (_, name, what), why in _kernels.cluster_failures.items()
               if what == "launch"]
    assert len(reasons) == 1 and "912" in reasons[0], _kernels.cluster_failures
    assert not _fused.usable(512, f32)
    emu.reset()
    again, ran_fused = _run_any(cluster_cupy, stored, lengths, False, True)
    assert not ran_fused and not any("cluster16" in e for e in emu.log), emu.log
    for name, a, b in zip(OUT, again, stepped):
        assert np.array_equal(a, b), name
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 16)
    with pytest.raises(RuntimeError, match="holds no cluster of 16 blocks.*refused its launch.*912"):
        _cluster.chosen_size(512, f32)
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 2)
    small, _ = make(3, 5, 2, 13, f32, seed=2)
    emu.reset()
    run(cluster_cupy, small, None, False, True)
    assert emu.log.count("kernel:seq_fwd_cluster2") == 1


def emu_module():
    from helpers import emulated_cupy

    return emulated_cupy


def test_other_launch_errors_of_16_block_clusters_are_raised(cluster_cupy, monkeypatch):
    """A launch error that is not a refusal of the cluster size (CUDA_ERROR_ILLEGAL_ADDRESS, an
    earlier kernel's fault reported at the launch) reaches the caller; nothing is refused."""
    f32 = np.dtype(np.float32)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 32)
    emu = cluster_cupy.emulator
    emu.refused_launches = {"seq_fwd_cluster16": 700}
    stored, _ = make(3, 5, 2, 512, f32, seed=13)
    with pytest.raises(emu_module().CUDADriverError, match="700"):
        _run_any(cluster_cupy, stored, None, False, True)
    assert _kernels.refused_sizes == set() and _fused.usable(512, f32)


@pytest.mark.parametrize("refuse", [False, True], ids=["accepted", "refused"])
def test_warmup_launches_the_16_block_clusters(cluster_cupy, monkeypatch, refuse):
    """lltm_cupy.warmup(fused=True) on sm_90 launches the 16-block kernels once each way (so that
    a refusal happens there, outside any graph capture); a refusal is recorded, not raised, and
    a later call runs the stepped path without launching them."""
    import lltm_cupy

    emu = cluster_cupy.emulator
    if refuse:
        emu.refused_launches = {"seq_fwd_cluster16": emu_module().CUDA_ERROR_INVALID_CLUSTER_SIZE}
    emu.reset()
    lltm_cupy.warmup(["float32"], fused=True)
    assert emu.log.count("kernel:seq_fwd_cluster16") == (0 if refuse else 1)
    assert emu.log.count("kernel:seq_bwd_cluster16") == (0 if refuse else 1)
    assert _kernels.refused_sizes == ({(0, 16)} if refuse else set())
    assert _fused.usable(512, np.dtype(np.float32)) != refuse


def test_a_query_without_a_context_binds_one_and_a_failure_is_asked_again(cluster_cupy):
    """A thread with no current CUDA context (the emulated driver answers
    CUDA_ERROR_INVALID_CONTEXT there): the query binds one first (cudaMemGetInfo) and answers;
    a query that fails once (the invalid-context status) is asked again at the next call rather
    than disabling the size for good."""
    f32 = np.dtype(np.float32)
    emu = cluster_cupy.emulator
    emu.contexts = set()
    assert _cluster.held(512, f32, 16)
    assert _fused.usable(512, f32)
    _cluster_kernels._occupancy.clear()
    emu.occupancy_error = 201
    assert _cluster.held(512, f32, 16) is None and not _fused.usable(512, f32)
    emu.occupancy_error = 0
    assert _cluster.held(512, f32, 16) and _fused.usable(512, f32)


def test_a_forced_16_where_none_fits_raises(cluster_cupy, monkeypatch):
    """A forced cluster size of 16 on a device whose GPCs hold no such cluster raises from the
    sequence call (as other forced sizes that cannot run do) instead of running stepped
    (float32 S = 512: one block of about 199 KB per SM, 16 of them in no GPC of 14 SMs)."""
    emu = cluster_cupy.emulator
    emu.gpc_sms = (14, 14)
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 16)
    stored, _ = make(2, 2, 2, 512, np.dtype(np.float32), seed=5)
    with pytest.raises(RuntimeError, match="holds no cluster of 16 blocks"):
        _run_any(cluster_cupy, stored, None, False, True)


def test_a_portable_size_the_query_says_none_fits_is_not_launched(cluster_cupy, monkeypatch):
    """GPCs of 6 SMs hold no cluster of 8 (the query answers 0): float32 S = 388 (8 blocks) runs
    the stepped path and a forced 8 is refused with the query's answer, while S = 256 (4 blocks,
    one per GPC) still runs in clusters."""
    f32 = np.dtype(np.float32)
    emu = cluster_cupy.emulator
    emu.gpc_sms = (6, 6)
    assert _cluster.cluster_size(388, f32, LIMIT) == 8 and _cluster.held(388, f32, 8) == 0
    assert not _fused.usable(388, f32)
    assert _fused.cluster_size(256, f32) == 4 and _fused.usable(256, f32)
    monkeypatch.setattr(_cluster, "FORCED_SIZE", 8)
    with pytest.raises(RuntimeError, match="holds no cluster of 8 blocks.*answered 0"):
        _cluster.chosen_size(388, f32)
