"""The emulated devices the fused sequence kernels run on without a GPU, as fixtures (the root
conftest.py loads this module as a plugin, so that every folder's tests use them), and the
variants of the kernels as data (:class:`Variant`, :data:`VARIANTS`).

The kernels' CUDA source is built as host C++ (tests/helpers/host_fused.py, host_cluster.py:
the shim's block, cluster and group semantics) and launched from the GPU backend on the emulated
CuPy (tests/helpers/emulated_cupy.py):

- ``fused_cupy``: an sm_90 device of LIMIT bytes of shared memory per block and one SM
  (``monkeypatch`` _kernels._sm_count for more) running the one-block kernels of lltm_fused.cu
  (their FMA version in every dtype: the tensor-core kernels are off);
- ``cluster_cupy``: the same device with the cluster kernels (lltm_fused_cluster.cu) past one
  block's bound, or where ``_cluster.FORCED_SIZE`` asks for them;
- ``group_cupy``: an sm_80 device (A100: LIMIT80) with the group kernels (the cluster kernels'
  source without a cluster; a cluster kernel's launch is an error);
- ``mma_cupy``: the sm_90 device whose 16-bit kernels run on tensor cores
  (lltm_fused_mma.cu) where they apply.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from lltm_cupy._cuda import cluster_kernels as _cluster_kernels, fused as _fused
from lltm_cupy._cuda import fused_cluster as _cluster, fused_kernels as _fused_kernels
from lltm_cupy._cuda import fused_mma as _mma, group_kernels as _group_kernels
from lltm_cupy._cuda import kernels as _kernels
from . import host_cluster, host_fused
from .fused_cases import LIMIT, LIMIT80


def _host_build(name, build, folder, doc):
    """A session fixture ``name``: ``build`` (host_fused.build or host_cluster.build) loaded from
    a copy of its own in ``folder`` (the builds are cached: each fixture's state, the threads'
    schedule, is its own)."""
    def lib(tmp_path_factory):
        return build(tmp_path_factory.mktemp(folder))

    lib.__doc__ = doc
    return pytest.fixture(scope="session", name=name)(lib)


fused_lib = _host_build("fused_lib", host_fused.build, "fused_host",
                        "lltm_fused.cu and lltm_fused_mma.cu built as host C++ (harness_fused.cpp)")
cluster_lib = _host_build("cluster_lib", host_cluster.build, "cluster_host",
                          "lltm_fused_cluster.cu built as host C++ with cluster semantics")
one_block_lib = _host_build("one_block_lib", host_fused.build, "fused_host_for_clusters",
                            "the one-block kernels' host build that ``cluster_cupy`` runs")
group_lib = _host_build("group_lib", host_cluster.build, "group_host",
                        "lltm_fused_cluster.cu built as host C++ for ``group_cupy``")
one_block_lib80 = _host_build("one_block_lib80", host_fused.build, "fused_host_for_groups",
                              "the one-block kernels' host build that ``group_cupy`` runs")


def group_kernels_not_built(dtype, size):
    """get_group_kernels where its host build is not loaded: records the module's compile, as
    warmup on an emulated sm_80 device asks for it; a launch is an error."""
    from . import emulated_cupy as emu

    def launch(*args, **kwargs):
        raise AssertionError("a group kernel launched without its host build")

    emu._state.compile("lltm_fused_cluster.cu", "group", np.dtype(dtype).str)
    return _kernels.FusedKernels(launch, launch)


def _refuse_clusters(dtype, size):
    raise AssertionError("the cluster kernels launched on an sm_80 device")


def use_single(monkeypatch, lib, limit=LIMIT):
    """The one-block kernels (FMA in every dtype) of ``lib`` on an sm_90 device of ``limit``."""
    monkeypatch.setattr(_fused_kernels, "get_kernels",
                        host_fused.host_get_fused_kernels(lib, limit))
    monkeypatch.setattr(_group_kernels, "get_kernels", group_kernels_not_built)
    monkeypatch.setattr(_mma, "usable", lambda state, dtype, backward=False: False)
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: limit)


def use_mma(monkeypatch, lib):
    """The one-block kernels of ``lib``, the 16-bit ones on tensor cores, on an sm_90 device."""
    monkeypatch.setattr(_fused_kernels, "get_kernels",
                        host_fused.host_get_fused_kernels(lib, LIMIT))
    monkeypatch.setattr(_mma, "get_kernels", host_fused.host_get_mma_kernels(lib, LIMIT))
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 90)
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)


def use_cluster(monkeypatch, lib, one_block_lib):
    """The cluster kernels of ``lib`` and the one-block kernels of ``one_block_lib`` on an sm_90
    device of LIMIT bytes per block."""
    monkeypatch.setattr(_cluster_kernels, "get_kernels",
                        host_cluster.host_get_cluster_kernels(lib, LIMIT))
    monkeypatch.setattr(_group_kernels, "get_kernels",
                        host_cluster.host_get_group_kernels(lib, LIMIT))
    monkeypatch.setattr(_group_kernels, "resident_blocks", host_cluster.resident_blocks)
    monkeypatch.setattr(_fused_kernels, "get_kernels",
                        host_fused.host_get_fused_kernels(one_block_lib, LIMIT))
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 90)


def use_group(monkeypatch, lib, one_block_lib, limit=LIMIT80):
    """The group kernels of ``lib`` and the one-block kernels of ``one_block_lib`` on an sm_80
    device of ``limit`` bytes per block (a cluster kernel's launch is an error)."""
    monkeypatch.setattr(_group_kernels, "get_kernels",
                        host_cluster.host_get_group_kernels(lib, limit))
    monkeypatch.setattr(_cluster_kernels, "get_kernels", _refuse_clusters)
    monkeypatch.setattr(_fused_kernels, "get_kernels",
                        host_fused.host_get_fused_kernels(one_block_lib, limit))
    monkeypatch.setattr(_group_kernels, "resident_blocks", host_cluster.resident_blocks)
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: limit)
    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 80)
    monkeypatch.setattr(_mma, "usable", lambda state, dtype, backward=False: False)


def _ascending(cupy, host, lib):
    """``cupy``, with ``lib``'s threads run in ascending order (host: host_fused or host_cluster)
    during the test and after it."""
    host.set_schedule(lib, "ascending")
    yield cupy
    host.set_schedule(lib, "ascending")


@pytest.fixture
def fused_cupy(emulated_cupy, monkeypatch, fused_lib):
    """The emulated CuPy with the one-block kernels' host build (module docstring)."""
    use_single(monkeypatch, fused_lib)
    yield from _ascending(emulated_cupy, host_fused, fused_lib)


@pytest.fixture
def mma_cupy(emulated_cupy, monkeypatch, fused_lib):
    """The emulated CuPy whose 16-bit kernels run on tensor cores (module docstring)."""
    use_mma(monkeypatch, fused_lib)
    yield from _ascending(emulated_cupy, host_fused, fused_lib)


@pytest.fixture
def cluster_cupy(emulated_cupy, monkeypatch, cluster_lib, one_block_lib):
    """The emulated CuPy as an sm_90 device with the cluster kernels (module docstring)."""
    use_cluster(monkeypatch, cluster_lib, one_block_lib)
    yield from _ascending(emulated_cupy, host_cluster, cluster_lib)


@pytest.fixture
def group_cupy(emulated_cupy, monkeypatch, group_lib, one_block_lib80):
    """The emulated CuPy as an sm_80 device with the group kernels (module docstring)."""
    use_group(monkeypatch, group_lib, one_block_lib80)
    yield from _ascending(emulated_cupy, host_cluster, group_lib)


# ------------------------------------------------------------------------------ the variants

@dataclass(frozen=True)
class Variant:
    """One variant of the fused kernels on its emulated device: ``kind`` "single" (one block per
    tile, FMA), "cluster" (P blocks of an sm_90 cluster), "group" (P blocks of a cooperative
    launch, sm_80), "mma" (one block, tensor cores); ``size``: P forced, or None for the
    launcher's own choice."""

    kind: str
    size: int | None = None

    @property
    def name(self) -> str:
        return self.kind + ("" if self.size is None else str(self.size))

    @property
    def fixture(self) -> str:
        return {"single": "fused_cupy"}.get(self.kind, f"{self.kind}_cupy")

    def device(self, request, monkeypatch, sm_count=None):
        """The emulated CuPy of this variant (its fixture), with its size forced and ``sm_count``
        SMs if given."""
        xp = request.getfixturevalue(self.fixture)
        if self.kind in ("cluster", "group"):
            monkeypatch.setattr(_cluster, "FORCED_SIZE", self.size)
        if sm_count is not None:
            monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: sm_count)
        return xp

    def blocks(self, state, dtype) -> int:
        """The blocks per tile a call of this state size runs in."""
        if self.size is not None:
            return self.size
        if self.kind in ("cluster", "group"):       # the device's own choice
            return _fused.cluster_size(state, dtype) or 1
        return 1

    def kernels(self, state, dtype) -> tuple:
        """The emulator's log entries of the forward and the backward kernel's launch."""
        if self.kind in ("cluster", "group"):
            p = self.blocks(state, dtype)
            return f"kernel:seq_fwd_{self.kind}{p}", f"kernel:seq_bwd_{self.kind}{p}"
        return "kernel:seq_fwd", "kernel:seq_bwd"

    def assert_ran(self, emu, state, dtype, forwards=1, backwards=1):
        """The fused calls since ``emu.reset()`` launched this variant's kernels, ``forwards``
        and ``backwards`` times, and no other variant's."""
        fwd, bwd = self.kernels(state, dtype)
        launches = [e for e in emu.log if e.startswith("kernel:seq_")]
        assert launches.count(fwd) == forwards and launches.count(bwd) == backwards and \
            len(launches) == forwards + backwards, (self.name, emu.log)
        on_tensor_cores = emu.log.count("variant:mma")
        if self.kind == "mma":
            assert on_tensor_cores == forwards + backwards * _mma.usable(state, dtype, True), \
                emu.log
        else:
            assert on_tensor_cores == 0, (self.name, emu.log)


SINGLE, MMA = Variant("single"), Variant("mma")
CLUSTERS = {p: Variant("cluster", p) for p in _cluster_kernels.SIZES}
GROUPS = {p: Variant("group", p) for p in _group_kernels.SIZES}
#: the launcher's own choice of the blocks per tile
CLUSTER, GROUP = Variant("cluster"), Variant("group")
