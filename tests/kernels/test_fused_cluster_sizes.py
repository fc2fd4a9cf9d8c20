"""What only the cluster variant of the fused kernels has (cuda_src/lltm_fused_cluster.cu,
lltm_cupy/_cuda/fused_cluster.py): the choice of the cluster size (the smallest that holds W_h,
16 blocks past the portable size, none before sm_90, a forced size that cannot run), the
forward's bits at every size, the shared-memory layout and the documented table, warmup before
sm_90; without a GPU (tests/helpers/fused_devices.py's ``cluster_cupy``: an sm_90 device, the
kernels built as host C++ with cluster semantics). The cases every variant shares:
test_fused_variants.py; the occupancy query and the refusal guard:
test_fused_cluster_occupancy.py.

Runs everywhere (g++, no GPU).
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from lltm_cupy._cuda import cluster_kernels as _cluster_kernels, fused as _fused
from lltm_cupy._cuda import fused_cluster as _cluster, fused_kernels as _fused_kernels
from lltm_cupy._cuda import kernels as _kernels
from helpers.fused_cases import DTYPES, LIMIT, OUT, compare, make, run, want


SIZES = _cluster_kernels.SIZES


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
    compare(fused, stepped, want(case, lengths, reverse), f32, "S=512 P=16")


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
    (test_fused_variants.py's ``group``), not clusters; from sm_90 clusters."""
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


# ------------------------------------------------- shared memory, the table, the module


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


def test_warmup_compiles_no_cluster_module_before_sm_90(cluster_cupy, monkeypatch):
    """lltm_cupy.warmup(fused=True) on sm_80 compiles no cluster module (the group module
    instead: test_fused_variants.py's warmup case runs each variant's)."""
    import lltm_cupy

    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 80)
    emu = cluster_cupy.emulator
    lltm_cupy.warmup(["float32"], fused=True)
    assert ("lltm_fused_cluster.cu", "<f4") not in emu.compiles
    assert ("lltm_fused_cluster.cu", "group", "<f4") in emu.compiles
