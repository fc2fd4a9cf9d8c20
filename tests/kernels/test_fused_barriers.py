"""Every barrier of the fused kernels deleted in turn, in every variant (a mutation of the source,
all of them in one build: tests/helpers/mutants.py): the host run with the variant's semantics
(tests/host_shim/shim.h: block, cluster or group) gives results off the float64 reference or
stops with an error; the control, the same runs with every barrier in place, is exact. Also a
divergent __syncthreads() is reported.

Runs everywhere (g++, no GPU); the mutants are slow tests.
"""
from __future__ import annotations

import numpy as np
import pytest

from lltm_cupy._cuda import cluster_kernels as _cluster_kernels, fused_cluster as _cluster
from lltm_cupy._cuda import fused_kernels as _fused_kernels, fused_mma as _mma
from lltm_cupy._cuda import kernels as _kernels
from conftest import max_error
from helpers import host_cluster, host_fused, mutants
from helpers.fused_cases import LIMIT, OUT, make, run, want
from helpers.fused_devices import use_cluster, use_group, use_mma, use_single

#: per variant: its harness, the mutants' group of statements, and the device it runs on
_MUTANTS = {"single": ("harness_fused.cpp", "fused"), "cluster": ("harness_cluster.cpp", "cluster"),
            "group": ("harness_cluster.cpp", "group"), "mma": ("harness_fused.cpp", "mma")}
#: what a run must be off the reference by to count as caught (float64, but float16 for the
#: tensor cores, whose products round in their own way), and the shim's reports of a launch
#: that stopped
_CAUGHT = {"single": (1e-6, ("__syncthreads",)), "cluster": (1e-6, ("seq_",)),
           "group": (1e-6, ("seq_",)), "mma": (0.1, ("warp-level product", "__syncthreads"))}


def _install(kind, monkeypatch, request, lib):
    """The variant's kernels from ``lib`` (its own build or a mutants' build) on its device."""
    if kind == "single":
        use_single(monkeypatch, lib)
    elif kind == "mma":
        use_mma(monkeypatch, lib)
    elif kind == "cluster":
        use_cluster(monkeypatch, lib, request.getfixturevalue("one_block_lib"))
    else:
        use_group(monkeypatch, lib, request.getfixturevalue("one_block_lib80"))


def _mutant_build(kind, tmp_path):
    harness = _MUTANTS[kind][0]
    build = host_fused.build if harness == "harness_fused.cpp" else host_cluster.build
    return build(tmp_path, sources=mutants.sources(harness))


def _runs(kind, xp, lib, monkeypatch):
    """(label, results or None, {name: error against the reference} or the launch's error) of
    the mutation check's runs: one block: one run of float64 S = 8 (the tensor cores: float16
    S = 40); clusters and groups: 2 and 4 blocks per tile (the group: on two tiles' SMs), in the
    ascending and the descending order."""
    dtype, state = (np.float16, 40) if kind == "mma" else (np.float64, 8)
    sizes = [2, 4] if kind in ("cluster", "group") else [None]
    stored, case = make(4, 3, 3, state, np.dtype(dtype), seed=1)
    reference = want(case, None, False)
    for size in sizes:
        orders = ["ascending"] if size is None else ["ascending", "descending"]
        if kind == "group":
            monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 2 * size)
        for order in orders:
            if size is not None:
                monkeypatch.setattr(_cluster, "FORCED_SIZE", size)
                host_cluster.set_schedule(lib, order)
            label = f"{kind} P={size} {order}"
            try:
                got = run(xp, stored, None, False, True)
            except AssertionError as exc:       # the shim's report
                yield label, None, str(exc)
                continue
            yield label, got, {name: max_error(g, w) for name, g, w in zip(OUT, got, reference)}


def _barriers(kind):
    """The barriers of the variant's source, as its mutants' statements find them."""
    if kind in ("single", "mma"):
        text = _kernels.source_path((_fused_kernels if kind == "single" else _mma).SOURCE_NAME)
        text = text.read_text()
        return ["__syncthreads"] * text.count("__syncthreads();")
    text = _kernels.source_path(_cluster_kernels.SOURCE_NAME).read_text()
    if kind == "cluster":
        return [text[a:b].rstrip("();") for a, b in mutants.cluster_barriers(text)]
    return [text[a:b].split("(")[0] for a, b in mutants.group_barriers(text)]


@pytest.mark.parametrize("kind", _MUTANTS)
def test_the_kernels_have_the_barriers_the_mutation_test_deletes(kind):
    """lltm_fused.cu's four __syncthreads(); the cluster exchange's barriers (one at the start
    and one per step each way), then one block barrier per backward step; the group exchange's:
    a block barrier at the start, forward the group barrier and a block barrier after the copy
    of h, backward the group barrier, then the backward body's block barrier; lltm_fused_mma.cu's
    five __syncthreads(). The mutants delete each of them."""
    want = {"single": ["__syncthreads"] * 4,
            "cluster": ["lltm_cluster_sync"] * 3 + ["__syncthreads"],
            "group": ["__syncthreads", "lltm_group_sync", "__syncthreads", "lltm_group_sync",
                      "__syncthreads"],
            "mma": ["__syncthreads"] * 5}[kind]
    found = _barriers(kind)
    assert found == want, found
    assert len(mutants.statements(_MUTANTS[kind][1])) == len(found)


@pytest.mark.parametrize("kind,which", [
    pytest.param(kind, which, id=f"{kind}-{which}") for kind in _MUTANTS
    for which in range(len(mutants.statements(_MUTANTS[kind][1])))])
@pytest.mark.slow
def test_deleting_a_barrier_is_caught(request, tmp_path, emulated_cupy, monkeypatch, kind, which):
    """Each barrier of each variant deleted in turn: every run of the check (_runs) gives
    results off the reference, or stops with the shim's report (a divergent barrier, a
    deadlock, a NaN of an exchange buffer read before it was written, a lane missing from the
    warp-level product)."""
    lib = _mutant_build(kind, tmp_path)
    mutants.delete(lib, _MUTANTS[kind][1], which)
    _install(kind, monkeypatch, request, lib)
    bound, reports = _CAUGHT[kind]
    for label, got, errors in _runs(kind, emulated_cupy, lib, monkeypatch):
        if got is None:
            assert any(r in errors for r in reports), errors
            continue
        assert max(e if np.isfinite(e) else np.inf for e in errors.values()) > bound, \
            f"barrier {which} deleted, {label}: every result matches: {errors}"


@pytest.mark.parametrize("build", [
    "source", pytest.param("mutants-none-deleted", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["single", "cluster", "group"])
def test_unmutated_source_passes_the_mutation_check(request, tmp_path, emulated_cupy, monkeypatch,
                                                    kind, build):
    """The control of the test above: the same runs with every barrier in place are exact, in
    the build of the source as it is and in the mutants' build with no statement deleted. (The
    tensor cores' control: the next test.)"""
    if build == "source":
        lib = request.getfixturevalue({"single": "fused_lib", "cluster": "cluster_lib",
                                       "group": "group_lib"}[kind])
    else:
        lib = _mutant_build(kind, tmp_path)
        mutants.delete(lib, None)
    _install(kind, monkeypatch, request, lib)
    try:
        for label, got, errors in _runs(kind, emulated_cupy, lib, monkeypatch):
            assert got is not None, f"{label}: {errors}"
            assert max(errors.values()) <= 1e-12, (label, errors)
    finally:
        if kind != "single":
            host_cluster.set_schedule(lib, "ascending")


@pytest.mark.slow
def test_the_mma_mutants_build_with_none_deleted_gives_the_sources_bits(tmp_path, emulated_cupy,
                                                                       fused_lib, monkeypatch):
    """The tensor cores' control (their float16 products are not exact): the mutants' build
    (every barrier of lltm_fused_mma.cu and lltm_fused.cu behind the mutants' switch, none
    deleted) gives the bits of the build of the source as it is in the check's run."""
    gated = _mutant_build("mma", tmp_path)
    mutants.delete(gated, None)
    results = []
    for lib in (fused_lib, gated):
        with monkeypatch.context() as m:
            use_mma(m, lib)
            results.append([got for _, got, _ in _runs("mma", emulated_cupy, lib, m)][0])
    for name, a, b in zip(OUT, *results):
        assert np.array_equal(a, b), name


@pytest.mark.slow
def test_a_divergent_barrier_is_reported(tmp_path, emulated_cupy, monkeypatch):
    """A __syncthreads() that only some threads reach stops the host launch with an error."""
    source = _kernels.source_path(_fused_kernels.SOURCE_NAME).read_text()
    text = source.replace("      if (r >= active) {             // finished:",
                          "      if (r >= active) { __syncthreads();  //", 1)
    assert text != source
    (tmp_path / _fused_kernels.SOURCE_NAME).write_text(text)
    lib = host_fused.build(tmp_path, source_dir=tmp_path)
    monkeypatch.setattr(_fused_kernels, "get_kernels",
                        host_fused.host_get_fused_kernels(lib, LIMIT))
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    stored, _ = make(3, 2, 2, 4, np.dtype(np.float64), seed=1)
    with pytest.raises(AssertionError, match="divergent __syncthreads"):
        run(emulated_cupy, stored, [3, 1], False, True)
