"""The cluster variant's occupancy query and refusal guard (lltm_cupy/_cuda/cluster_kernels.py,
fused_cluster.py): CUlaunchConfig against cuda.h, the emulated query, the planner never planning
more clusters than the device holds, 16-block clusters only where the query holds them, a
failed query, a driver that refuses a launch the query said fits, warmup's launch of the
16-block kernels; without a GPU (``cluster_cupy``), and the 16-block clusters on a real GPU.

Runs everywhere (g++, no GPU) but the GPU test.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

from lltm_cupy._cuda import cluster_kernels as _cluster_kernels, fused as _fused
from lltm_cupy._cuda import fused_cluster as _cluster
from lltm_cupy._cuda import kernels as _kernels
from conftest import gpu_unavailable_reason
from helpers.fused_cases import LIMIT, OUT, compare, make, run, run_any as _run_any, want


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
    compare(fused, stepped, want(case, None, False), f32, "failed query")


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
    compare(fused, stepped, want(case, [5, 2, 5, 0, 1, 3, 4], True), f32, "query plan")


# ------------------------------------------- a driver that refuses what the query said fits


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
        compare(got, stepped, want(case, lengths, False), f32, "refused backward")
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


# ---------------------------------------------------------------------------- on a GPU


_GPU_REASON = gpu_unavailable_reason()


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
    compare(fused, stepped, want(case, lengths, False), f32, "gpu 16-block clusters")
