"""The fused backward where no fused variant runs the state size any more: a sequence whose
forward ran split over a cluster of 16 blocks (past one block's shared memory and past every
portable cluster size), whose backward then finds no cluster size chosen (the 16-block size
refused since, by another layer's or direction's launch, or the occupancy query failing now).
It runs on the stepped path, through the array API and the torch layer, instead of a one-block
launch with more shared memory than a block has (which the driver refuses with
CUDA_ERROR_INVALID_VALUE, an error no fallback catches).

On the emulated CuPy (tests/helpers/fault_benches.py's device: an sm_90 of 1,200 bytes of shared
memory per block, so that float32 S = 32 takes 16 blocks), and with stubs at an H100's figures.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import max_error
from helpers.fault_benches import bench  # noqa: F401 (a fixture)
from lltm_cupy._cuda import cluster_kernels, fused, fused_cluster, fused_kernels, kernels

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy  # noqa: E402

SMALL, S = 1200, 32
F32 = np.dtype(np.float32)
#: fused against stepped: the order of the recurrent products' sums
AGREE = 1e-5


def _no_size_now(emu, why):
    """After a forward in 16-block clusters: no cluster size is chosen any more."""
    if why == "refused":
        kernels.refused_sizes.add((0, 16))      # as a later launch's refusal records it
    else:
        cluster_kernels._occupancy.clear()      # the answers kept, forgotten: asked again
        emu.occupancy_error = 999               # and the query fails now


def _arrays(cupy, T=2, B=2, F=3, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"x": (T, B, F), "w": (3 * S, S + F), "b": (3 * S,), "h0": (B, S), "c0": (B, S),
              "go": (T, B, S), "gh": (B, S), "gc": (B, S)}
    return {n: cupy.asarray((rng.uniform(-1, 1, s) / (np.sqrt(S + F) if n == "w" else 1))
                            .astype(np.float32)) for n, s in shapes.items()}


@pytest.mark.parametrize("why", ["refused", "query fails"])
def test_array_api_backward_runs_stepped_where_no_variant_runs_the_state(emulated_cupy, bench,
                                                                           why):
    bench(emulated_cupy, limit=SMALL, sm_count=32)
    emu = emulated_cupy.emulator
    assert fused.max_state(SMALL, F32) < S and fused_cluster.cluster_size(S, F32, SMALL) is None
    a = _arrays(emulated_cupy)
    args = [a[n] for n in ("x", "w", "b", "h0", "c0")]
    grads = (a["go"], a["gh"], a["gc"])
    emu.reset()
    *_, saved = lltm_cupy.forward_sequence(*args, fused=True)
    assert saved.fused and emu.log.count("kernel:seq_fwd_cluster16") == 1, emu.log
    _no_size_now(emu, why)
    emu.reset()
    got = lltm_cupy.backward_sequence(*grads, saved)
    assert not any(e.startswith("kernel:seq_bwd") for e in emu.log), emu.log
    emu.occupancy_error = 0
    *_, stepped = lltm_cupy.forward_sequence(*args)
    want = lltm_cupy.backward_sequence(*grads, stepped)
    for name, g, w in zip(want._fields, got, want):
        assert max_error(g, w) <= AGREE, name


@pytest.mark.parametrize("why", ["refused", "query fails"])
def test_torch_layer_backward_runs_stepped_where_no_variant_runs_the_state(emulated_cuda_torch,
                                                                             bench, why):
    """A bidirectional LLTM(fused=True) whose forward ran both directions in 16-block clusters,
    then no cluster size is chosen any more: its backward runs stepped, with the gradients of a
    stepped model."""
    from lltm_cupy.torch import LLTM

    bench(emulated_cuda_torch, limit=SMALL, sm_count=32, torch_layer=True)
    emu = emulated_cuda_torch.emulator
    torch.manual_seed(0)
    model = LLTM(3, S, bidirectional=True, fused=True)
    stepped = LLTM(3, S, bidirectional=True)
    stepped.load_state_dict(model.state_dict())
    x = torch.randn(2, 2, 3)
    emu.reset()
    out, (h, c) = model(x)
    assert emu.log.count("kernel:seq_fwd_cluster16") == 2, emu.log
    _no_size_now(emu, why)
    emu.reset()
    (out.sum() + h.sum() + c.pow(2).sum()).backward()
    assert not any(e.startswith("kernel:seq_bwd") for e in emu.log), emu.log
    emu.occupancy_error = 0
    out, (h, c) = stepped(x)
    (out.sum() + h.sum() + c.pow(2).sum()).backward()
    for (name, p), q in zip(model.named_parameters(), stepped.parameters()):
        assert max_error(p.grad, q.grad) <= AGREE, name


def test_no_one_block_plan_past_one_blocks_shared_memory_at_an_h100s_figures(monkeypatch):
    """float32 S = 512 on an H100 (232,448 bytes per block; one block holds S <= 138) with no
    cluster size chosen: the backward's plan is no one-block launch of 3,155,968 bytes of shared
    memory but the fallback's signal, LaunchRefused (both directions)."""
    monkeypatch.setattr(kernels, "current_device", lambda: 0)
    monkeypatch.setattr(kernels, "shared_memory_limit", lambda device: 232448)
    monkeypatch.setattr(kernels, "compute_capability", lambda device: 90)
    monkeypatch.setattr(kernels, "_sm_count", lambda device: 132)
    monkeypatch.setattr(fused_cluster, "chosen_size", lambda state, dtype: None)
    monkeypatch.setattr(fused_kernels, "get_kernels", lambda dtype: kernels.FusedKernels(
        "forward kernel", "backward kernel"))
    assert fused.shared_bytes(512, F32, 1, True) == 3155968
    for backward in (True, False):
        with pytest.raises(cluster_kernels.LaunchRefused, match="no fused variant runs state "
                                                               "size 512"):
            fused.variant(16, 512, F32, backward)
    # within one block's shared memory the one-block kernels still run, as planned
    kernel, blocks, threads, tile, shared = fused.variant(16, 138, F32, True)
    assert kernel == "backward kernel" and shared <= 232448
