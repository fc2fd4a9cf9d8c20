"""The CUDA backend's kernel families as data (lltm_cupy/_cuda/kernels.py's Family records, one
generic lookup over them): each family's ``get_kernels`` loads one NVRTC module per (device,
dtype) holding every instance of its kernels, named as cuda_src's templates are instantiated,
with its launch kind's settings (the element-wise kernels' function handles; the whole opt-in
shared memory for the others; a cooperative module for the group kernels; the non-portable
cluster size attribute on the 16-block cluster kernels only), kept under (family, device,
dtype); a load that fails part-way keeps nothing, and the next call loads again.

Runs everywhere: CuPy is a recording stand-in (no GPU, nothing compiled).
"""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from lltm_cupy._cuda import cluster_kernels, elementwise, fused_kernels, fused_mma
from lltm_cupy._cuda import group_kernels, kernels as _kernels

LIMIT, STATIC, DEVICE = 232448, 16, 3
_ELEMENTWISE = ("lltm_fwd_kernel", "lltm_bwd_kernel", "lltm_concat_kernel", "lltm_add_kernel")


def _pairs(fwd, bwd, args):
    return {key: [f"{fwd}<float{text}>", f"{bwd}<float{text}>"] for key, text in args.items()}


#: family: (its module, cuda_src files in order, {instance: its kernels' names for float32},
#: cooperative module, whole shared memory)
FAMILIES = {
    "elementwise": (elementwise, ("lltm.cu",),
                    {w: [f"{k}<float, {t}>" for k in _ELEMENTWISE]
                     for w, t in ((False, "unsigned int"), (True, "unsigned long long"))},
                    False, False),
    "fused": (fused_kernels, ("lltm.cu", "lltm_fused.cu"),
              _pairs("lltm_seq_fwd_kernel", "lltm_seq_bwd_kernel", {None: ""}), False, True),
    "fused_mma": (fused_mma, ("lltm.cu", "lltm_fused.cu", "lltm_fused_mma.cu"),
                  _pairs("lltm_seq_fwd_mma_kernel", "lltm_seq_bwd_mma_kernel", {None: ""}),
                  False, True),
    "cluster": (cluster_kernels, ("lltm.cu", "lltm_fused.cu", "lltm_fused_cluster.cu"),
                _pairs("lltm_seq_fwd_cluster_kernel", "lltm_seq_bwd_cluster_kernel",
                       {p: f", {p}" for p in (1, 2, 4, 8, 16)}), False, True),
    "group": (group_kernels, ("lltm.cu", "lltm_fused.cu", "lltm_fused_cluster.cu"),
              _pairs("lltm_seq_fwd_group_kernel", "lltm_seq_bwd_group_kernel",
                     {p: f", {p}" for p in (1, 2, 4, 8)}), True, True),
}


class _Function:
    """A RawKernel as CuPy's RawModule gives it."""

    shared_size_bytes = STATIC
    max_dynamic_shared_size_bytes = 0

    def __init__(self, name):
        self.name = name
        self.kernel = types.SimpleNamespace(ptr=f"function {name}", name=name)


@pytest.fixture
def recording(monkeypatch):
    """A CuPy whose RawModule records (code, name expressions, keywords) of each module made and
    the functions it hands out, and whose driver records each attribute set; ``failing`` names a
    function whose load fails."""
    made, functions, attributes, failing = [], [], [], set()

    class RawModule:
        def __init__(self, code, options, name_expressions, **keywords):
            made.append((code, tuple(name_expressions), keywords))

        def get_function(self, name):
            if name in failing:
                raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: {name}")
            functions.append(_Function(name))
            return functions[-1]

    current = types.SimpleNamespace(id=DEVICE)
    cuda = types.SimpleNamespace(
        Device=lambda: current,
        runtime=types.SimpleNamespace(getDevice=lambda: current.id),
        driver=types.SimpleNamespace(
            funcSetAttribute=lambda f, attribute, value: attributes.append((f, attribute, value))))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule,
                                                                   cuda=cuda))
    monkeypatch.setattr(_kernels, "_cache", {})
    monkeypatch.setattr(_kernels, "cluster_failures", {})
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    return types.SimpleNamespace(made=made, functions=functions, attributes=attributes,
                                 failing=failing, current=current)


def _source(files):
    text = (_kernels.source_path(files[0])).read_text(encoding="utf-8")
    for name in files[1:]:
        text += f'\n#line 1 "{name}"\n' + _kernels.source_path(name).read_text(encoding="utf-8")
    return text


def _get(module, dtype, instance):
    return module.get_kernels(dtype) if instance is None else module.get_kernels(dtype, instance)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_loads_one_module_per_device_and_dtype(recording, family):
    module, files, expected, cooperative, whole_shared = FAMILIES[family]
    f32 = np.dtype(np.float32)
    got = {instance: _get(module, f32, instance) for instance in expected}
    assert len(recording.made) == 1, recording.made
    code, names, keywords = recording.made[0]
    assert code == _source(files) and code == module.source()
    assert list(names) == [n for instance in expected for n in expected[instance]]
    assert keywords == ({"enable_cooperative_groups": True} if cooperative else {})
    assert [f.name for f in recording.functions] == list(names)
    handed = {f.name: f for f in recording.functions}
    for instance, fns in got.items():       # the RawKernels, or (plain) their loaded functions
        assert [f.name for f in fns] == expected[instance]
        assert all(f is (handed[f.name] if whole_shared else handed[f.name].kernel) for f in fns)
    assert {f.max_dynamic_shared_size_bytes for f in recording.functions} == \
        {LIMIT - STATIC if whole_shared else 0}     # the device's whole opt-in memory, or none
    non_portable = [n for instance in expected if family == "cluster" and instance > 8
                    for n in expected[instance]]
    assert sorted(recording.attributes) == [(f"function {n}", 14, 1) for n in sorted(non_portable)]
    assert not _kernels.cluster_failures
    assert list(_kernels._cache) == [(family, DEVICE, f32.str)]
    for instance in expected:                               # kept: nothing loaded again
        assert _get(module, f32, instance) is got[instance]
    assert len(recording.made) == 1
    _get(module, np.float64, next(iter(expected)))          # another dtype: its own module
    recording.current.id = DEVICE + 1                       # another device: its own module
    _get(module, f32, next(iter(expected)))
    assert [m[1][0].split("<")[1].split(",")[0].rstrip(">") for m in recording.made] == \
        ["float", "double", "float"]
    assert sorted(_kernels._cache) == sorted([(family, DEVICE, f32.str),
                                              (family, DEVICE, "<f8"),
                                              (family, DEVICE + 1, f32.str)])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_load_that_fails_part_way_keeps_nothing(recording, family):
    module, _, expected, _, _ = FAMILIES[family]
    last = list(expected)[-1]
    recording.failing.add(expected[last][-1])               # every function but the last loads
    with pytest.raises(RuntimeError, match="CUDA_ERROR_NOT_FOUND"):
        _get(module, np.float32, last)
    assert _kernels._cache == {} and not recording.attributes
    recording.failing.clear()
    assert [f.name for f in _get(module, np.float32, last)] == expected[last]
    assert len(recording.made) == 2 and list(_kernels._cache) == [(family, DEVICE, "<f4")]
