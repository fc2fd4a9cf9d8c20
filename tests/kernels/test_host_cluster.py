"""The host shim's thread-block clusters (tests/host_shim/shim.h, shim_launch_cluster), on which
the cluster variant of the fused sequence kernels is checked without a GPU: a small kernel that
exchanges words between the blocks of a cluster through distributed shared memory must need its
cluster barriers, every schedule must give the same right answer when they are there, and what
the shim refuses stops the launch with an error: a store outside the cluster, into a block not
started yet or already finished (on a GPU undefined: a block's shared memory may be written only
between a cluster barrier after every block started and one before it exits), a mismatched
barrier, the lanes of one warp at different cluster barriers (the kernels' barrier is .aligned),
and a cluster barrier that some threads wait at after others returned. The last is
stricter than a GPU, whose barrier.cluster.wait waits only for the threads that have not exited
(PTX ISA, barrier.cluster); the kernels never return early, and a thread returning before its
cluster's stores are done is the bug the check catches.

Also the shim's groups (shim_launch_group), on which the group variant (the same split on
sm_80, exchanging through global memory) is checked: the barrier on a counter in global memory
(lltm_group_sync) alone, right in every order, its exchange invisible without it (the shim's weak
memory model), a wait across tiles reported as a deadlock, and each of its five statements
deleted in turn caught."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from helpers import host_cluster, mutants
from helpers.host_fused import SCHEDULES

BEFORE, AFTER, BLOCK_BARRIER, DIVERGENT, MISMATCHED, OUTSIDE, SPLIT_WARP = 1, 2, 4, 8, 16, 32, 64


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return host_cluster.build(tmp_path_factory.mktemp("cluster_host"))


def exchange(lib, grid, block, cluster, mode, schedule="ascending", seed=1):
    """(out, error): each thread's word after the exchange, the launch's error (None if none)."""
    host_cluster.set_schedule(lib, schedule, seed)
    out = np.full(grid * block, -7, np.int32)
    lib.lltm_host_cluster_selftest(ctypes.c_uint(grid), ctypes.c_uint(block),
                                   ctypes.c_uint(cluster),
                                   out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(mode))
    host_cluster.set_schedule(lib, "ascending")
    return out, host_cluster.last_error(lib)


def expected(grid, block, cluster):
    """Block b reads what its predecessor in the cluster (cyclically) stored: its thread indices."""
    b = np.arange(grid)
    first = b - b % cluster
    pred = first + (b - first - 1) % cluster
    return (pred[:, None] * block + np.arange(block)[None, :]).ravel().astype(np.int32)


SCHEDULE_RUNS = [("ascending", 1), ("descending", 1), ("random", 1), ("random", 2), ("random", 3)]


@pytest.mark.parametrize("cluster", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("schedule,seed", SCHEDULE_RUNS)
def test_exchange_with_both_cluster_barriers_is_right_in_every_order(lib, cluster, schedule, seed):
    grid, block = 2 * cluster, 5
    out, error = exchange(lib, grid, block, cluster, BEFORE | AFTER, schedule, seed)
    assert error is None, error
    np.testing.assert_array_equal(out, expected(grid, block, cluster))
    assert lib.lltm_host_cluster_barriers() == 2 * 2     # two per cluster, two clusters


@pytest.mark.parametrize("cluster", [2, 4, 8, 16])
def test_exchange_without_the_barrier_after_the_stores_is_caught(lib, cluster):
    """Without the cluster barrier between the stores and the reads, the first block to run (in
    the ascending and in the descending order) reads its word before its predecessor stored it
    (0xFF poison: -1) and returns; its predecessor's store then lands in a finished block."""
    grid, block = cluster, 4
    for schedule in ("ascending", "descending"):
        out, error = exchange(lib, grid, block, cluster, BEFORE, schedule)
        assert error is not None and "has finished" in error, schedule
        first = slice(0, block) if schedule == "ascending" else slice(grid * block - block, None)
        assert (out[first] == -1).all(), (schedule, out)


@pytest.mark.parametrize("cluster", [2, 8])
def test_a_block_barrier_does_not_order_the_blocks(lib, cluster):
    """__syncthreads() in place of the cluster barrier waits for the block's own threads only:
    block 0 passes it, reads unwritten words and returns before its predecessor stores."""
    out, error = exchange(lib, cluster, 4, cluster, BEFORE | BLOCK_BARRIER)
    assert error is not None and "has finished" in error
    assert (out[:4] == -1).all()
    assert lib.lltm_host_barriers() >= 1 and lib.lltm_host_cluster_barriers() == 1


def test_a_store_before_the_peer_started_is_an_error(lib):
    """Without the cluster barrier before the stores, block 0 writes into block 1 before any of
    block 1's threads ran (ascending order): on a GPU the peer may not be running yet."""
    _, error = exchange(lib, 2, 3, 2, AFTER, "ascending")
    assert error is not None and "has not started" in error


def test_a_divergent_cluster_barrier_is_an_error(lib):
    _, error = exchange(lib, 4, 4, 2, BEFORE | AFTER | DIVERGENT)
    assert error is not None and "divergent cluster barrier" in error


def test_threads_at_different_barriers_are_a_deadlock(lib):
    _, error = exchange(lib, 2, 4, 2, BEFORE | AFTER | MISMATCHED)
    assert error is not None and "deadlock" in error


@pytest.mark.parametrize("schedule", ["ascending", "descending", "random"])
def test_a_warp_split_over_two_cluster_barriers_is_an_error(lib, schedule):
    """Every thread of the cluster at a cluster barrier, but the odd lanes of each warp at
    another call than the even ones: allowed for barrier.cluster without .aligned, undefined with
    it (the kernels' form), so the shim stops. The same exchange with one call is right."""
    _, error = exchange(lib, 4, 64, 2, BEFORE | AFTER | SPLIT_WARP, schedule)
    assert error is not None and "lanes of one warp at different cluster barriers" in error
    out, error = exchange(lib, 4, 64, 2, BEFORE | AFTER, schedule)
    assert error is None and np.array_equal(out, expected(4, 64, 2))


def test_a_store_outside_the_cluster_is_an_error(lib):
    _, error = exchange(lib, 2, 4, 2, BEFORE | AFTER | OUTSIDE)
    assert error is not None and "outside the cluster's shared memory" in error


def test_a_grid_of_part_of_a_cluster_is_an_error(lib):
    _, error = exchange(lib, 3, 4, 2, BEFORE | AFTER)
    assert error is not None and "whole number of clusters" in error


def test_every_schedule_is_known():
    assert set(SCHEDULES) == {"ascending", "descending", "random"}


# ------------------------------------------------------- groups: the barrier in global memory

NO_BARRIER, GRID_WIDE = 1, 2


def group_exchange(lib, grid, block, size, rounds, mode=0, schedule="ascending", seed=1):
    """(out (rounds, grid, block), error, spins, counters) of the shim's group barrier test
    kernel (harness_cluster.cpp, shim_selftest_group); the exchange buffer starts as -1 words."""
    host_cluster.set_schedule(lib, schedule, seed)
    exchange = np.full(grid // size * 2 * size * block, -1, np.int32)
    counters = np.zeros(grid, np.uint32)
    out = np.full(rounds * grid * block, -7, np.int32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    lib.lltm_host_group_selftest(ctypes.c_uint(grid), ctypes.c_uint(block), ctypes.c_uint(size),
                                 ptr(exchange), ptr(counters), ptr(out), ctypes.c_int(rounds),
                                 ctypes.c_int(mode))
    host_cluster.set_schedule(lib, "ascending")
    return (out.reshape(rounds, grid, block), host_cluster.last_error(lib),
            lib.lltm_host_group_spins(), counters)


def group_expected(grid, block, size, rounds):
    """Round k: each thread reads what the same thread of the previous block of its group
    stored."""
    b = np.arange(grid)
    first = b - b % size
    pred = first + (b - first - 1) % size
    ids = pred[:, None] * block + np.arange(block)[None, :]
    return np.stack([k * 1000000 + ids for k in range(rounds)]).astype(np.int32)


GROUP_RUNS = SCHEDULE_RUNS + [("random", 4), ("random", 5)]


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("schedule,seed", GROUP_RUNS)
def test_group_barrier_is_right_in_every_order(lib, size, schedule, seed):
    """Three rounds over a double-buffered exchange, two groups: every order gives each thread
    its predecessor block's word of the round; each group's counter ends at rounds * size
    arrivals; with more than one block the waiting loop really waited (spins)."""
    grid, block, rounds = 2 * size, 3, 3
    out, error, spins, counters = group_exchange(lib, grid, block, size, rounds, 0, schedule,
                                                 seed)
    assert error is None, error
    np.testing.assert_array_equal(out, group_expected(grid, block, size, rounds))
    np.testing.assert_array_equal(counters[:2], [rounds * size] * 2)
    assert (spins > 0) == (size > 1), spins
    assert lib.lltm_host_group_fences() == 2 * rounds * grid   # thread 0, two per barrier


def test_group_exchange_without_the_barrier_reads_old_words(lib):
    """Without the barrier no block's stores are published to the others (the memory model of
    the shim): every read gives the buffer's old word."""
    for schedule in ("ascending", "descending", "random"):
        out, error, _, _ = group_exchange(lib, 4, 3, 2, 2, NO_BARRIER, schedule)
        assert error is None, error
        assert (out == -1).all(), (schedule, out)


def test_a_tile_waiting_for_another_tiles_blocks_is_a_deadlock(lib):
    """The shim runs the groups one after another: a barrier that waits for blocks of other
    tiles (one counter for the whole grid) never completes, and the shim says so."""
    _, error, _, _ = group_exchange(lib, 4, 3, 2, 2, GRID_WIDE)
    assert error is not None and "deadlock" in error and "global memory" in error


def test_cluster_primitives_are_refused_in_a_group_launch(lib):
    """A group launch has no cluster: the shim refuses lltm_cluster_sync there (and the group
    primitives outside a group launch: the cluster self-test calls none, so it passes)."""
    _, error = exchange(lib, 2, 4, 2, BEFORE | AFTER)
    assert error is None
    lib.lltm_host_group_mixed(ctypes.c_uint(2), ctypes.c_uint(2))
    assert "outside shim_launch_cluster" in host_cluster.last_error(lib)


def _missing_part_runs(lib):
    """(size, schedule, seed, error) of every run of the check below that went wrong: 2 and 4
    blocks per group, every order of GROUP_RUNS."""
    wrong = []
    for size in (2, 4):
        want = group_expected(2 * size, 3, size, 3)
        for schedule, seed in GROUP_RUNS:
            out, error, _, _ = group_exchange(lib, 2 * size, 3, size, 3, 0, schedule, seed)
            if error is not None or not np.array_equal(out, want):
                wrong.append((size, schedule, seed, error))
    return wrong


@pytest.mark.parametrize("mutant", mutants.GROUP_SYNC_PARTS, ids=list(mutants.GROUP_SYNC_PARTS))
@pytest.mark.slow
def test_a_barrier_missing_a_part_is_caught(mutant, tmp_path):
    """lltm_group_sync with one of its statements deleted (a mutation of
    cuda_src/lltm_fused_cluster.cu, all of them in one build: tests/helpers/mutants.py): under
    some order of the threads the self-test reads a wrong word or the shim reports the launch (a
    deadlock without the arrival)."""
    mutant_lib = host_cluster.build(tmp_path, sources=mutants.sources("harness_cluster.cpp"))
    mutants.delete(mutant_lib, "group sync", list(mutants.GROUP_SYNC_PARTS).index(mutant))
    assert _missing_part_runs(mutant_lib), f"{mutant} deleted: every run right"


@pytest.mark.parametrize("build", [
    "source", pytest.param("mutants-none-deleted", marks=pytest.mark.slow)])
def test_no_part_missing_passes_the_check(lib, build, tmp_path):
    """The control of the test above: with every statement of the barrier in place every run is
    right, in the build of the source as it is and in the mutants' build with none deleted."""
    if build != "source":
        lib = host_cluster.build(tmp_path, sources=mutants.sources("harness_cluster.cpp"))
        mutants.delete(lib, None)
    assert not _missing_part_runs(lib)
