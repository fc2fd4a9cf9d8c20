"""What only the group variant of the fused kernels has (cuda_src/lltm_fused_cluster.cu's group
kernels: the cluster kernels' split of W_h over P blocks per tile without a cluster, the blocks
exchanging each step's h and partial d_h through global memory and meeting at a barrier on a
counter in global memory; a cooperative launch, which the launcher runs on sm_80 to sm_89 past
one block's bound): bit for bit the cluster variant's results (one kernel source), several
launches where the tiles do not fit the device at once, the cooperative launch's checks, its
shared-memory layout, the sm_80 floor and the documented table (its cooperative module:
test_fused_compilers.py); without a GPU
(tests/helpers/fused_devices.py's ``group_cupy``: an sm_80 device, A100: 163 KiB of shared
memory per block, the kernels built as host C++ with group semantics: a tile's blocks as
cooperating contexts, a weak model of global memory, the waiting loop yielding). The cases every
variant shares: test_fused_variants.py. No GPU has run the group kernels.

Runs everywhere (g++, no GPU).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from lltm_cupy._cuda import fused as _fused
from lltm_cupy._cuda import fused_cluster as _cluster
from lltm_cupy._cuda import group_kernels as _group_kernels, kernels as _kernels
from helpers import host_cluster
from helpers.fused_cases import DTYPES, LIMIT80, OUT, compare, make, run, want
from helpers.fused_devices import use_cluster as _use_cluster, use_group as _use


SIZES = _group_kernels.SIZES


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
    compare(fused, run(group_cupy, stored, None, False, False), want(case, None, False),
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
