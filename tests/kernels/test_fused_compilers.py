"""The fused kernels of every variant through the compilers: NVRTC (what CuPy compiles with at run
time: the nvidia-cuda-nvrtc wheel) builds each variant for every architecture it runs on and
dtype, with the variant's instructions in the PTX (header-free inline PTX), no local memory
(no spill) and registers within the pins below; ptxas -v (nvcc) reports no spill, no static
shared memory, registers for a block and the figures the cubin reader (tests/helpers/cubin.py)
reads from the same cubin. And how the library makes and loads each variant's module (one per
device and dtype, every size in it, the cooperative one for the groups, the shared memory and
cluster-size attributes) on a CuPy that records it.

Runs everywhere (the NVRTC wheel and nvcc, no GPU); the compilers' tests are slow tests.
"""
from __future__ import annotations

import re
import shutil
import threading
import types

import numpy as np
import pytest

from lltm_cupy._cuda import cluster_kernels as _cluster_kernels, fused_kernels as _fused_kernels
from lltm_cupy._cuda import fused_mma as _mma, group_kernels as _group_kernels
from lltm_cupy._cuda import kernels as _kernels
from helpers import cubin as _cubin
from helpers.fused_cases import DTYPES, DTYPES16, LIMIT, LIMIT80, run_ptxas

SIZES = _cluster_kernels.SIZES

#: Registers per thread of each one-block kernel as compiled today: the larger of NVRTC 13.5's
#: (the runtime compiler: the nvidia-cuda-nvrtc wheel) and ptxas 13.0's (nvcc) figure, which
#: differ by a few on sm_100. No variant uses local memory (no spill). Static shared memory is
#: 0 bytes in every variant (all of it is the launch's dynamic shared memory, sized by
#: lltm_cupy/_cuda/fused.shared_bytes).
#:                 float16  bfloat16  float32  float64
#:   sm_80  fwd       64       63        55       96
#:          bwd       54       54        56       80
#:   sm_90  fwd       79       72        71      128
#:          bwd       56       54        56       96
#:   sm_100 fwd       72       80        72      126
#:          bwd       63       63        60       78
REGISTERS = {
    (80, "fwd"): (64, 63, 55, 96), (80, "bwd"): (54, 54, 56, 80),
    (90, "fwd"): (79, 72, 71, 128), (90, "bwd"): (56, 54, 56, 96),
    (100, "fwd"): (72, 80, 72, 126), (100, "bwd"): (63, 63, 60, 78),
}

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

#: Registers per thread of the group kernels as NVRTC (13.x) compiles them for sm_80, the most
#: over the sizes 1, 2, 4 and 8, and no local memory in any (tested with ptxas below too).
#:                 float16  bfloat16  float32  float64
#:   sm_80  fwd       48       48        48       72
#:          bwd       48       48        48       72
GROUP_REGISTERS = {(80, "fwd"): (48, 48, 48, 72), (80, "bwd"): (48, 48, 48, 72)}

#: Registers per thread of the mma kernels as NVRTC 13.x compiles them (no local memory in any;
#: 48 of them hold the W_h fragments kept in registers, LLTM_MMA_KEPT):
#:                 float16  bfloat16
#:   sm_80  fwd      128      127
#:          bwd      116      114
#:   sm_90  fwd      160      160
#:          bwd      124      120
#:   sm_100 fwd      126      127
#:          bwd      119      120
MMA_REGISTERS = {(80, "fwd"): (128, 127), (80, "bwd"): (116, 114), (90, "fwd"): (160, 160),
                 (90, "bwd"): (124, 120), (100, "fwd"): (126, 127), (100, "bwd"): (119, 120)}

#: What a kernel may use beyond its figure: helpers/cubin.register_ceiling (one allocation
#: unit with the compilers the figures come from, more with other versions).
PINS = {"single": REGISTERS, "cluster": CLUSTER_REGISTERS, "cluster16": CLUSTER_REGISTERS_16,
        "group": GROUP_REGISTERS, "mma": MMA_REGISTERS}
#: per variant: its module, the architectures NVRTC builds it for, its dtypes
VARIANTS = {"single": (_fused_kernels, (80, 90, 100), DTYPES),
            "cluster": (_cluster_kernels, (90, 100), DTYPES),
            "group": (_group_kernels, (80, 90, 100), DTYPES),
            "mma": (_mma, (80, 90, 100), DTYPES16)}
#: the kernels' dtype template argument as the Itanium ABI mangles it
_MANGLED = {"float16": "9lltm_half", "bfloat16": "9lltm_bf16", "float32": "f", "float64": "d"}


def _kernel(kind, symbol):
    """("fwd" | "bwd", the pins' key) of a kernel's mangled name (cluster kernels of 16 blocks
    have their own pins)."""
    m = re.match(r"_Z\d+lltm_seq_(fwd|bwd)(?:_(?:cluster|group|mma))?_kernelI", symbol)
    assert m, f"not a fused kernel: {symbol}"
    size = re.search(r"Li(\d+)EE", symbol)
    return m.group(1), ("cluster16" if kind == "cluster" and size and size.group(1) == "16"
                        else kind)


def _ceiling(kind, arch, symbol, dtype_name, compiler="nvrtc"):
    """The register ceiling of a kernel, or None where no pin is kept (the group kernels past
    sm_80)."""
    kernel, key = _kernel(kind, symbol)
    dtypes = list(VARIANTS[kind][2])
    pin = PINS[key].get((arch, kernel))
    return None if pin is None else _cubin.register_ceiling(pin[dtypes.index(dtype_name)],
                                                            compiler)


def _check_ptx(kind, ptx, dtype):
    """The variant's own instructions: a cluster shape per kernel at every size, the cluster's
    shared-memory and barrier instructions; the group's fences, atomics and cache-global
    exchange, no cluster; the tensor cores' mma.sync of the dtype, no trap."""
    if kind == "cluster":
        # a kernel that lost __cluster_dims__ would launch without a cluster, every block rank 0
        entries = ptx.split(".entry ")[1:]
        shapes = [re.findall(r"\.reqnctapercluster (\d+), 1, 1", e.split("\n{", 1)[0])
                  for e in entries]
        assert all(len(found) == 1 for found in shapes), shapes
        assert sorted(int(found[0]) for found in shapes) == sorted(2 * list(SIZES)), shapes
        present = ("mapa.shared::cluster", "st.shared::cluster", "barrier.cluster.arrive.aligned",
                   "barrier.cluster.wait.aligned", "%cluster_ctarank")
        absent = ()
    elif kind == "group":
        assert ptx.count(".entry ") == 2 * len(_group_kernels.SIZES)
        present = ("fence.acq_rel.gpu", "red.relaxed.gpu.global.add.u32",
                   "ld.relaxed.gpu.global.u32", "st.global.cg.f", "ld.global.cg.f")
        absent = ("cluster", "mapa")
    elif kind == "mma":
        name = "f16" if dtype == DTYPES["float16"] else "bf16"
        present, absent = (f"mma.sync.aligned.m16n8k16.row.col.f32.{name}.{name}.f32",), ("trap;",)
    else:
        present, absent = (), ()
    for instruction in present:
        assert instruction in ptx, instruction
    for instruction in absent:
        assert instruction not in ptx, instruction


def _nvrtc_cases():
    return [pytest.param(kind, arch, dtype, id=f"{kind}-sm{arch}-{name}")
            for kind, (_, archs, dtypes) in VARIANTS.items()
            for arch in archs for name, dtype in dtypes.items()]


@pytest.mark.parametrize("kind,arch,dtype", _nvrtc_cases())
@pytest.mark.slow
def test_nvrtc_compiles_the_kernels(kind, arch, dtype):
    """NVRTC builds both kernels of the variant (every cluster or group size) for the dtype and
    architecture: the variant's instructions in the PTX, an ELF cubin recording no local memory,
    every kernel of the dtype, registers within the pins and for a block of threads."""
    module, _, dtypes = VARIANTS[kind]
    name = next(k for k, v in dtypes.items() if v == dtype)
    if kind != "single":
        _check_ptx(kind, module.compile_offline(dtype, arch, output="ptx").decode(), dtype)
    cubin = module.compile_offline(dtype, arch, output="cubin")
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return an ELF cubin"
    resources = _cubin.kernel_resources(cubin)
    count = 2 * len(module.SIZES) if kind in ("cluster", "group") else 2
    assert len(resources) == count, sorted(resources)
    assert sorted(_kernel(kind, k)[0] for k in resources) == sorted(["bwd", "fwd"] * (count // 2))
    threads = 32 * _mma.WARPS if kind == "mma" else _fused_kernels.THREADS
    for symbol, r in resources.items():
        assert symbol.split("_kernelI", 1)[1].startswith(_MANGLED[name]), (symbol, name)
        assert r.get("frame") == 0 and r.get("stack") == 0, f"sm_{arch} {symbol}: local memory {r}"
        assert 0 < r["registers"] and r["registers"] * threads <= 65536, f"sm_{arch} {symbol}"
        ceiling = _ceiling(kind, arch, symbol, name)
        assert ceiling is None or r["registers"] <= ceiling, \
            f"sm_{arch} {symbol}: {r['registers']} registers > {ceiling}"


def _ptxas_kernels(kind):
    """(source, kernel name expressions) of a variant's every kernel for ptxas."""
    if kind == "single":
        return None, None
    if kind == "mma":
        return _mma.source(), [_mma.name_expression(k, d) for d in DTYPES16.values()
                               for k in _mma.KERNEL_NAMES]
    module = _cluster_kernels if kind == "cluster" else _group_kernels
    return _cluster_kernels.source(), [_cluster_kernels.name_expression(k, d, p)
                                       for d in DTYPES.values() for p in module.SIZES
                                       for k in module.KERNEL_NAMES]


@pytest.mark.parametrize("kind,arch", [
    pytest.param(kind, arch, id=f"{kind}-sm{arch}") for kind, archs in (
        ("single", (80, 90, 100)), ("cluster", (90,)), ("group", (80,)), ("mma", (80, 90, 100)))
    for arch in archs])
@pytest.mark.slow
def test_ptxas_reports_no_spill(kind, arch):
    """ptxas -v (nvcc 13.0's, on the same source text as NVRTC's) on every kernel of the variant
    in every dtype: no spill or stack frame, no static shared memory (all of it is the launch's
    dynamic shared memory), registers for a block of threads and, where pinned (the one-block
    and tensor-core kernels), within the pins; and the cubin reader of the NVRTC test above
    reads ptxas's own figures from the same cubin."""
    nvcc = shutil.which("nvcc")
    assert nvcc, "nvcc (CUDA toolkit) is required for the ptxas check"
    source, names = _ptxas_kernels(kind)
    report, cubin = run_ptxas(nvcc, arch, source, names)
    dtypes = VARIANTS[kind][2]
    per_dtype = 2 * len(VARIANTS[kind][0].SIZES) if kind in ("cluster", "group") else 2
    assert len(report) == len(dtypes) * per_dtype, sorted(report)
    read = _cubin.kernel_resources(cubin)
    assert sorted(read) == sorted(report)
    threads = 32 * _mma.WARPS if kind == "mma" else _fused_kernels.THREADS
    for symbol, r in report.items():
        assert (read[symbol]["registers"], read[symbol]["frame"]) == (r["registers"], r["frame"]), \
            f"sm_{arch} {symbol}: the cubin reader says {read[symbol]}, ptxas -v {r}"
        assert r["spills"] == (0, 0) and r["frame"] == 0, f"sm_{arch} {symbol}: spills {r}"
        assert r["registers"] * threads <= 65536, f"sm_{arch} {symbol}: registers"
        assert r["smem"] == 0, f"sm_{arch} {symbol}: {r['smem']} bytes of static shared memory"
        if kind in ("single", "mma"):
            name = next(k for k, v in _MANGLED.items()
                        if symbol.split("_kernelI", 1)[1].startswith(v))
            ceiling = _ceiling(kind, arch, symbol, name, "ptxas")
            assert r["registers"] <= ceiling, f"sm_{arch} {symbol}: {r['registers']} > {ceiling}"


# ------------------------------------------------------------ the modules' compile and load

def _recording_cupy(monkeypatch, cupy, static):
    """``cupy`` (the emulated one) whose RawModule records (code, name expressions, keyword
    options) of every module made, in the list returned; its functions have ``static`` bytes
    of static shared memory and their own name as their pointer. No module cached before."""
    modules = []

    class Function:
        shared_size_bytes = static
        max_dynamic_shared_size_bytes = 0

        def __init__(self, name):
            self.name = name
            self.kernel = types.SimpleNamespace(ptr=name)

    class RawModule:
        def __init__(self, code, options, name_expressions, **kwargs):
            modules.append((code, tuple(name_expressions), kwargs))

        def get_function(self, name):
            return Function(name)

    monkeypatch.setattr(cupy, "RawModule", RawModule, raising=False)
    monkeypatch.setattr(_kernels, "_cache", {})
    return modules


def test_cluster_kernels_compile_once_per_dtype_with_the_whole_shared_memory(emulated_cupy,
                                                                            monkeypatch):
    """cluster_kernels.get_kernels (and fused_kernels.get_kernels, which loads the same way) on
    a CuPy whose RawModule records what it is asked: one module per device and dtype holding every
    cluster size, each function allowed the device's opt-in shared memory less its static, and
    the 16-block ones (only they) the non-portable cluster size, on their loaded function
    (``RawKernel.kernel.ptr``, CuPy's ``driver.funcSetAttribute(f, attribute, value)``)."""
    modules, attributes = _recording_cupy(monkeypatch, emulated_cupy, static=16), []
    monkeypatch.setattr(emulated_cupy.cuda.driver, "funcSetAttribute",
                        lambda f, attribute, value: attributes.append((f, attribute, value)))
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT)
    f32 = np.dtype(np.float32)
    got = {p: _cluster_kernels.get_kernels(f32, p) for p in SIZES}
    assert len(modules) == 1 and modules[0][0] == _cluster_kernels.source()
    assert modules[0][2] == {}
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


def test_group_kernels_compile_once_per_dtype_in_a_cooperative_module(emulated_cupy,
                                                                      monkeypatch):
    """group_kernels.get_kernels on a CuPy whose RawModule records what it is asked: one module
    per device and dtype holding every group size, made with enable_cooperative_groups=True
    (CuPy then launches each of its kernels with cuLaunchCooperativeKernel), each function
    allowed the device's opt-in shared memory; the cluster module is not cooperative.
    resident_blocks asks the driver's occupancy of the kernel's function times the SMs, once per
    (kernel, threads, shared bytes)."""
    modules, asked = _recording_cupy(monkeypatch, emulated_cupy, static=0), []

    def occupancy(ptr, threads, shared):     # a driver call: needs the thread's context
        if threading.get_ident() not in emulated_cupy.emulator.contexts:
            raise RuntimeError("CUDA_ERROR_INVALID_CONTEXT: invalid device context")
        asked.append((ptr, threads, shared))
        return 2

    emulated_cupy.emulator.contexts = set()     # none bound yet (the library binds one first)

    monkeypatch.setattr(emulated_cupy.cuda, "driver",
                        type("D", (), {"occupancyMaxActiveBlocksPerMultiprocessor":
                                       staticmethod(occupancy)}), raising=False)
    monkeypatch.setattr(_kernels, "shared_memory_limit", lambda device_id: LIMIT80)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 108)
    monkeypatch.setattr(_group_kernels, "_resident", {})
    f32 = np.dtype(np.float32)
    got = {p: _group_kernels.get_kernels(f32, p) for p in _group_kernels.SIZES}
    assert len(modules) == 1 and modules[0][0] == _cluster_kernels.source()
    assert modules[0][2] == {"enable_cooperative_groups": True}
    for p, fns in got.items():
        assert fns.fwd.name == f"lltm_seq_fwd_group_kernel<float, {p}>"
        assert fns.bwd.name == f"lltm_seq_bwd_group_kernel<float, {p}>"
        assert fns.bwd.max_dynamic_shared_size_bytes == LIMIT80
    _cluster_kernels.get_kernels(f32, 2)
    assert len(modules) == 2 and modules[1][2] == {}
    assert _group_kernels.resident_blocks(got[4].fwd, 256, 1000) == 216
    assert _group_kernels.resident_blocks(got[4].fwd, 256, 1000) == 216
    assert asked == [("lltm_seq_fwd_group_kernel<float, 4>", 256, 1000)]
