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
cluster's stores are done is the bug the check catches."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from helpers import host_cluster
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
