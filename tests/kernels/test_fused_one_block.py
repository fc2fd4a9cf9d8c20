"""The one-block fused sequence kernels (cuda_src/lltm_fused.cu, lltm_cupy/_cuda/fused.py) and the
fused path's choice and API, without a GPU (the kernels built as host C++ with block semantics,
launched from the GPU backend on the emulated CuPy: tests/helpers/fused_devices.py's
``fused_cupy``): several elements per thread, past the bound the stepped path, missing gradients,
empty sequences, launches per call, the public API, the shared-memory layout and bound, the
forward's bank conflicts, and the torch layer (compiled, no_grad, captured). The cases every
variant shares (against the stepped path and the float64 reference): test_fused_variants.py.

Runs everywhere (g++, no GPU).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from lltm_cupy._cuda import fused as _fused, fused_kernels as _fused_kernels, kernels as _kernels
from conftest import assert_engines_agree, max_error, to_numpy
from helpers.fused_cases import DTYPES, LIMIT, OUT, compare, make, run, torch_case as _torch_case
from helpers.lengths_reference import _reference

pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install .[test])")


LENGTHS = {"full": None, "zeros and ties": [3, 0, 5, 1, 5, 0, 2], "all zero": [0] * 7}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_with_several_elements_per_thread(fused_cupy, monkeypatch, dtype, reverse):
    """Blocks of 16 threads over one tile of 7 rows x 6 states (2 or 3 elements per thread, on
    different rows and states): the walk over a thread's elements, and the loads of each element
    issued while the one before it computes (the next one of the step, else the first of the
    next step), with rows that end at different steps."""
    monkeypatch.setattr(_fused, "THREADS", 16)
    stored, case = make(5, 7, 4, 6, dtype, seed=11 + reverse)
    lengths = LENGTHS["zeros and ties"]
    emu = fused_cupy.emulator
    emu.reset()
    fused = run(fused_cupy, stored, lengths, reverse, True)
    assert emu.log.count("kernel:seq_fwd") == 1 and emu.log.count("kernel:seq_bwd") == 1
    stepped = run(fused_cupy, stored, lengths, reverse, False)
    want = _reference(case, lengths, reverse, (case["grad_outputs"], case["grad_h_n"],
                                               case["grad_c_n"]))
    compare(fused, stepped, want, dtype, f"{np.dtype(dtype)}")


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_above_the_bound_runs_the_stepped_path(fused_cupy, monkeypatch, dtype, arch):
    """Past an 8-block group's bound on a device without clusters (sm_80 to sm_89), past a
    16-block cluster's on sm_90 (test_fused_variants.py runs the sizes between)."""
    from lltm_cupy import _cuda
    from lltm_cupy._cuda import fused_cluster

    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: arch)
    state = (fused_cluster.max_state(LIMIT, dtype, 8, group=True) if arch < 90
             else fused_cluster.max_state(LIMIT, dtype, 16)) + 1
    stored, _ = make(2, 1, 2, state, dtype, seed=1)
    emu = fused_cupy.emulator
    a = {k: fused_cupy.asarray(v) for k, v in stored.items()}
    emu.reset()
    *_, saved = _cuda.forward_sequence(*(a[n] for n in ("inputs", "weights", "bias", "h0", "c0")),
                                       fused=True)
    assert not saved.fused and "kernel:seq_fwd" not in emu.log
    assert emu.log.count("kernel:fwd") == 2


@pytest.mark.parametrize("grads", [("grad_outputs", None, None), (None, "grad_h_n", None),
                                   (None, None, "grad_c_n"), (None, None, None)],
                         ids=["outputs", "h_n", "c_n", "none"])
@pytest.mark.parametrize("lengths", [None, [2, 0, 4]], ids=["full", "ragged"])
def test_fused_with_missing_gradients(fused_cupy, grads, lengths):
    stored, _ = make(4, 3, 2, 5, np.dtype(np.float64), seed=9)
    fused = run(fused_cupy, stored, lengths, False, True, grads)
    stepped = run(fused_cupy, stored, lengths, False, False, grads)
    for name, f, s in zip(OUT, fused, stepped):
        assert max_error(f, s) <= 1e-13, name


@pytest.mark.parametrize("shape", [(0, 3), (4, 0), (0, 0)], ids=["T=0", "B=0", "T=B=0"])
def test_fused_with_no_step_or_no_row(fused_cupy, shape):
    T, B = shape
    stored, _ = make(T, B, 2, 5, np.dtype(np.float32), seed=1)
    fused = run(fused_cupy, stored, None, False, True)
    stepped = run(fused_cupy, stored, None, False, False)
    for name, f, s in zip(OUT, fused, stepped):
        assert f.shape == s.shape and np.array_equal(f, s), name


@pytest.mark.parametrize("steps", [1, 4, 9])
def test_launches_per_sequence_do_not_depend_on_the_length(fused_cupy, steps):
    """One fused kernel per call each way plus the batched GEMMs: nothing per step."""
    emu = fused_cupy.emulator
    stored, _ = make(steps, 3, 2, 4, np.dtype(np.float32), seed=steps)
    a = {k: fused_cupy.asarray(v) for k, v in stored.items()}
    from lltm_cupy import _cuda

    emu.reset()
    *_, saved = _cuda.forward_sequence(*(a[n] for n in ("inputs", "weights", "bias", "h0", "c0")),
                                       fused=True)
    forward = [e for e in emu.log if e.startswith(("kernel", "gemm"))]
    assert forward == ["gemm", "kernel:seq_fwd"]
    emu.reset()
    _cuda.backward_sequence(a["grad_outputs"], a["grad_h_n"], a["grad_c_n"], saved)
    backward = [e for e in emu.log if e.startswith(("kernel", "gemm"))]
    assert backward == ["kernel:seq_bwd", "gemm", "gemm", "gemm"]   # d_W (2 halves), d_inputs
    assert emu.log.count("reduce") == 1                               # d_bias


def test_public_api_selects_the_fused_path(fused_cupy):
    import lltm_cupy

    stored, _ = make(3, 2, 2, 4, np.dtype(np.float32), seed=2)
    a = {k: fused_cupy.asarray(v) for k, v in stored.items()}
    args = [a[n] for n in ("inputs", "weights", "bias", "h0", "c0")]
    assert not lltm_cupy.forward_sequence(*args)[3].fused, "the default stays the stepped path"
    for kw in ({}, {"lengths": [3, 1]}, {"reverse": True}):
        *_, saved = lltm_cupy.forward_sequence(*args, fused=True, **kw)
        assert saved.fused
        lltm_cupy.backward_sequence(a["grad_outputs"], None, None, saved)
    # the CPU backend has one path and ignores the flag
    host = [np.asarray(x) for x in args]
    out_f = lltm_cupy.forward_sequence(*host, fused=True)[0]
    np.testing.assert_array_equal(out_f, lltm_cupy.forward_sequence(*host)[0])


# -------------------------------------------------------- shared memory: layout and bound


def _store_conflicts(state: int, itemsize: int, stride: int) -> int:
    """The worst bank conflict (distinct 4-byte words in one bank, in one memory transaction) of
    the forward kernel's load of W_h: thread i of a warp stores element (g, k) = divmod(i, S) at
    k * stride + g. A 64-bit access is served per half-warp; two threads writing the halves of
    one word (16-bit types) do not conflict."""
    lanes = 16 if itemsize == 8 else 32
    worst = 0
    for start in range(0, 3 * state * state, lanes):
        banks = {}
        for i in range(start, min(start + lanes, 3 * state * state)):
            g, k = divmod(i, state)
            byte = (k * stride + g) * itemsize
            for word in range(byte // 4, (byte + itemsize - 1) // 4 + 1):
                banks.setdefault(word % 32, set()).add(word)
        worst = max(worst, max(len(words) for words in banks.values()))
    return worst


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.slow
def test_forward_weights_load_meets_no_bank_conflict(itemsize):
    """The forward kernel's transposed W_h rows are padded (lltm_cupy/_cuda/fused.wt_stride) so
    that its load's stores meet no bank conflict where a warp stores into one gate's column (S a
    multiple of 32: every warp), at most 2-way where a warp straddles two (S >= 32), at most
    4-way for S < 32 (a warp over several columns); the unpadded stride 3S has a 32-way (16-way
    for 8-byte types) conflict at S = 128."""
    for state in range(1, 200):
        stride = _fused_kernels.wt_stride(state, itemsize)
        assert 3 * state <= stride <= 3 * state + 3
        worst = 1 if state % 32 == 0 else 2 if state >= 32 else 4
        assert _store_conflicts(state, itemsize, stride) <= worst, (state, stride)
    assert _store_conflicts(128, itemsize, 3 * 128) == (16 if itemsize == 8 else 32)


def test_launcher_sizes_shared_memory_as_the_kernels_lay_it_out(fused_lib):
    """fused.shared_bytes and the kernels' own layout functions (built on the host) agree."""
    import ctypes

    fused_lib.lltm_host_w_bytes.restype = ctypes.c_longlong
    for state in range(1, 200):
        for dtype in DTYPES.values():
            item = dtype.itemsize
            assert fused_lib.lltm_host_wt_stride(state, item) == _fused_kernels.wt_stride(state, item)
            for backward in (False, True):
                weights = fused_lib.lltm_host_w_bytes(state, item, int(backward))
                assert weights == _fused.shared_bytes(state, dtype, 0, backward), (state, dtype)


def test_a_launch_with_too_little_shared_memory_is_reported(fused_cupy, monkeypatch):
    """The host build checks the launch's shared memory against the kernels' layout: a launcher
    that asks for less (the forward's padding forgotten) fails instead of writing past it."""
    real = _fused.shared_bytes

    def unpadded(state, dtype, tile, backward):
        return real(state, dtype, tile, True) - 2 * tile * state * _fused_kernels.acc_size(dtype) \
            if not backward else real(state, dtype, tile, backward)

    monkeypatch.setattr(_fused, "shared_bytes", unpadded)
    stored, _ = make(3, 2, 2, 6, np.dtype(np.float32), seed=3)
    with pytest.raises(AssertionError, match="more dynamic shared memory than the launch"):
        run(fused_cupy, stored, None, False, True)


def test_shared_memory_bound_table():
    """The bound documented in lltm_cupy/_cuda/fused.py and the public docstring; every size it
    accepts fits the architecture's shared memory."""
    table = {arch: tuple(_fused.max_state(limit, d) for d in DTYPES.values())
             for arch, limit in _fused.ARCH_SHARED_MEMORY.items()}
    assert table == {80: (165, 165, 117, 82), 90: (195, 195, 138, 97), 100: (195, 195, 138, 97)}
    doc = _fused.__doc__
    for arch, (half, _, single, double) in table.items():
        assert re.search(rf"sm_{arch} .*\s{half}\s+{single}\s+{double}\n", doc), arch
    for arch, limit in _fused.ARCH_SHARED_MEMORY.items():
        for dtype in DTYPES.values():
            top = _fused.max_state(limit, dtype)
            for backward in (False, True):
                # every size the selection accepts, with the largest tile it would choose, fits
                # the architecture's shared memory (the kernels have no static shared memory:
                # test_fused_compilers.py's ptxas check)
                per_row = (_fused.shared_bytes(top, dtype, 1, backward)
                           - _fused.shared_bytes(top, dtype, 0, backward))
                worst = max(_fused.shared_bytes(s, dtype, 1, backward) for s in range(1, top + 1))
                assert worst <= limit and per_row > 0, (arch, dtype, backward)


# ------------------------------------------------------------------------- the torch layer


def test_torch_compiled_sequence_runs_fused(fused_cupy, emulated_cuda_torch):
    """Under torch.compile the sequence op carries ``fused`` to the backend, both ways."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt

    xs, hx = _torch_case(torch, torch.float32)
    w = (torch.rand(18, 9) - 0.5).requires_grad_()
    b = (torch.rand(18) - 0.5).requires_grad_()

    def loss(fused):
        fn = torch.compile(lambda *a: lt.lltm_sequence(*a, fused=fused), backend="aot_eager",
                           fullgraph=True)
        out, h_n, c_n = fn(xs, w, b, hx[0][0], hx[1][0])
        (out.sum() + h_n.sum() + c_n.sum()).backward()
        result = [out.detach(), w.grad.clone(), b.grad.clone()]
        w.grad = b.grad = None
        return result

    emu = fused_cupy.emulator
    want = loss(False)
    emu.reset()
    got = loss(True)
    assert emu.log.count("kernel:seq_fwd") == 1 and emu.log.count("kernel:seq_bwd") == 1
    for g, v in zip(got, want):
        assert max_error(g.double().numpy(), v.double().numpy()) <= 1e-5


def test_benchmark_checks_the_fused_outputs_before_timing():
    """The benchmark's check (scripts/gpu_check.sh's fused rows): equal modules pass, a module
    whose weights differ by a realistic error is refused before anything is timed."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt
    from lltm_bench.sequence import check_fused

    torch.manual_seed(0)
    default, other = lt.LLTM(3, 5), lt.LLTM(3, 5)
    other.load_state_dict(default.state_dict())
    xs, h, c = torch.randn(4, 2, 3), torch.randn(2, 5), torch.randn(2, 5)
    assert check_fused(default, other, xs, h, c, "float32") <= 1e-5
    with torch.no_grad():
        other.weights_l0[0, 0] += 1e-2
    with pytest.raises(RuntimeError, match="not timed"):
        check_fused(default, other, xs, h, c, "float32")


def test_forward_layers_runs_every_layer_fused(fused_cupy):
    import lltm_cupy

    emu = fused_cupy.emulator
    rng = np.random.default_rng(0)
    params = {k: fused_cupy.asarray(v) for k, v in lltm_cupy.init_parameters(
        3, 5, 2, bidirectional=True, rng=rng).items()}
    xs = fused_cupy.asarray(rng.standard_normal((4, 2, 3)).astype(np.float32))
    emu.reset()
    fused = lltm_cupy.forward_layers(xs, params, lengths=[4, 2], fused=True)
    assert emu.log.count("kernel:seq_fwd") == 4 and "kernel:fwd" not in emu.log
    default = lltm_cupy.forward_layers(xs, params, lengths=[4, 2])
    for a, b in zip(fused[:3], default[:3]):
        assert max_error(to_numpy(a), to_numpy(b)) <= 1e-5
    g_out = fused_cupy.asarray(rng.standard_normal(fused[0].shape).astype(np.float32))
    emu.reset()
    got = lltm_cupy.backward_layers(g_out, None, None, fused[3])
    assert emu.log.count("kernel:seq_bwd") == 4 and "kernel:bwd" not in emu.log
    want = lltm_cupy.backward_layers(g_out, None, None, default[3])
    assert max_error(to_numpy(got.d_inputs), to_numpy(want.d_inputs)) <= 1e-5
    for name, g in got.d_parameters.items():
        assert max_error(to_numpy(g), to_numpy(want.d_parameters[name])) <= 1e-5, name


@pytest.mark.parametrize("lengths", [None, [5, 2, 1, 4]], ids=["padded", "packed"])
def test_torch_lltm_fused_without_grad_runs_the_fused_forward_only(fused_cupy,
                                                                    emulated_cuda_torch, lengths):
    """Under no_grad the torch layer runs the forward only; with fused=True the fused kernel."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt
    from torch.nn.utils.rnn import pack_padded_sequence

    xs, hx = _torch_case(torch, torch.float32)
    default = lt.LLTM(3, 6, num_layers=2, bidirectional=True)
    fused = lt.LLTM(3, 6, num_layers=2, bidirectional=True, fused=True)
    fused.load_state_dict(default.state_dict())
    x = xs if lengths is None else pack_padded_sequence(xs, torch.tensor(lengths),
                                                        enforce_sorted=False)
    emu = fused_cupy.emulator
    with torch.no_grad():
        want = default(x, hx)
        emu.reset()
        got = fused(x, hx)
    assert emu.log.count("kernel:seq_fwd") == 4 and "kernel:fwd" not in emu.log
    out_g, out_w = (o if lengths is None else o.data for o in (got[0], want[0]))
    for g, w in ((out_g, out_w), (got[1][0], want[1][0]), (got[1][1], want[1][1])):
        assert max_error(g.double().numpy(), w.double().numpy()) <= 1e-5


@pytest.mark.parametrize("lengths", [None, [7, 10, 1, 3]], ids=["padded", "packed"])
def test_torch_lltm_fused_under_capture_copies_nothing(fused_cupy, emulated_cuda_torch,
                                                       lengths):
    """LLTM(fused=True) captured after an eager call with the same lengths (as CUDA graphs ask):
    no host-device copy (the step offsets come from the plan's device arrays, the backward's
    hidden states from one gather, not a concatenation of more than 8 steps, which uploads
    their pointers), the fused kernels, and the eager results; training and no_grad."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    import lltm_cupy.torch as lt
    from torch.nn.utils.rnn import pack_padded_sequence

    g = torch.Generator().manual_seed(3)
    T, B, F, H = 10, 4, 3, 6
    xs = torch.randn(T, B, F, generator=g, dtype=torch.float64)
    hx = tuple(torch.randn(4, B, H, generator=g, dtype=torch.float64) for _ in range(2))
    torch.manual_seed(1)
    model = lt.LLTM(F, H, num_layers=2, bidirectional=True, dtype=torch.float64, fused=True)

    def step():
        for p in model.parameters():
            p.grad = None
        x = xs.clone().requires_grad_()
        inp = x if lengths is None else pack_padded_sequence(x, torch.tensor(lengths),
                                                             enforce_sorted=False)
        out, (h, c) = model(inp, hx)
        out = out if lengths is None else out.data
        (out.sum() + h.pow(2).sum() + c.sum()).backward()
        with torch.no_grad():
            out_only, (h_only, c_only) = model(inp, hx)
        out_only = out_only if lengths is None else out_only.data
        return [t.detach().clone() for t in (out, h, c, x.grad, *(p.grad for p in
                                                                   model.parameters()),
                                             out_only, h_only, c_only)]

    emu = fused_cupy.emulator
    eager = step()
    emu.reset()
    with emu.capture():
        captured = step()
    assert emu.transfers == [] and emu.syncs == 0
    assert emu.log.count("kernel:seq_fwd") == 8 and emu.log.count("kernel:seq_bwd") == 4
    for i, (a, b) in enumerate(zip(eager, captured)):
        assert_engines_agree(b, a, f"result {i}")
