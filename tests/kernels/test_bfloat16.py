"""bfloat16: the conversions of cuda_src/lltm.cu (exhaustively, against ml_dtypes), the kernels in
bfloat16 through their host build against the float64 reference, and the GPU backend's bfloat16
path (raw bits in uint16 arrays, cuBLAS gemmEx with CUDA_R_16BF) on the emulated CuPy.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes",
                                reason="ml_dtypes is not installed (pip install .[test])")

from lltm_cupy._cuda import kernels as _kernels  # noqa: E402
from conftest import make_case, reference_results  # noqa: E402
from helpers.host_kernels import ptr  # noqa: E402

BF16 = ml_dtypes.bfloat16
BITS = _kernels.BFLOAT16   # uint16: the backend's bfloat16 storage


def to_bits(a) -> np.ndarray:
    """float values rounded to bfloat16 (ml_dtypes: round to nearest even), as raw bits."""
    return np.ascontiguousarray(np.asarray(a, np.float32).astype(BF16).view(np.uint16))


def from_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(BF16).astype(np.float64)


def _conversions(lib):
    """(widen, narrow) of lltm.cu, bits in and out: uint16 -> float32 bits, float32 bits ->
    uint16."""
    widen = lib.lltm_bf16_to_float32_bits
    widen.restype, widen.argtypes = ctypes.c_uint, [ctypes.c_ushort]
    narrow = lib.lltm_float32_bits_to_bf16
    narrow.restype, narrow.argtypes = ctypes.c_ushort, [ctypes.c_uint]
    return widen, narrow


def test_every_bfloat16_bit_pattern_widens_exactly(host_lib):
    widen, _ = _conversions(host_lib)
    bits = np.arange(2**16, dtype=np.uint16)
    got = np.array([widen(int(b)) for b in bits], np.uint32).view(np.float32)
    want = bits.view(BF16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0 too
    # NaN keeps its sign and payload bits: widening is a plain shift
    assert np.array_equal(got[nan].view(np.uint32), bits[nan].astype(np.uint32) << 16)


def _float32_sweep() -> np.ndarray:
    rng = np.random.default_rng(0)
    info = np.finfo(np.float32)
    bf_max = float(np.finfo(BF16).max)
    # every bfloat16 value and the float32 values just around it, ties exactly between two
    # neighbours (to even), subnormals, the extremes, +-inf and NaNs
    base = np.arange(2**16, dtype=np.uint32) << 16
    near = np.concatenate([base, base + 0x8000, base + 0x7fff, base + 0x8001, base + 1,
                           base + 0xffff])
    special = np.array([0.0, -0.0, info.smallest_subnormal, -info.smallest_subnormal, info.tiny,
                        info.max, -info.max, np.inf, -np.inf, bf_max, -bf_max,
                        np.nextafter(np.float32(bf_max), np.float32(np.inf)), 1.0, -1.0, 1e-40],
                       np.float32)
    return np.concatenate([near.view(np.float32), special,
                           rng.standard_normal(20000).astype(np.float32) * 100,
                           rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
                           .view(np.float32)])


def test_float32_rounds_to_bfloat16_as_ml_dtypes_does(host_lib):
    _, narrow = _conversions(host_lib)
    values = _float32_sweep()
    got = np.array([narrow(int(u)) for u in values.view(np.uint32)], np.uint16)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow casts are the point
        want = values.astype(BF16).view(np.uint16)
    nan = np.isnan(values)
    assert np.isnan(got[nan].view(BF16).astype(np.float32)).all(), "NaN must stay NaN"
    assert np.array_equal(got[nan] & 0x8000, want[nan] & 0x8000), "NaN keeps its sign"
    mismatch = np.flatnonzero(got[~nan] != want[~nan])
    assert mismatch.size == 0, (f"{mismatch.size} of {(~nan).sum()} values round differently, "
                                f"e.g. {values[~nan][mismatch[:5]]}")


# Pre-activations, states and gradients are stored in bfloat16 (8 significant bits, unit
# roundoff u = 2^-9 ~ 2e-3), with float32 arithmetic in between: each stored input carries up to
# u relative error, each output one more rounding, and the backward's products compound three or
# four of them (|relative error| <~ 6u ~ 1.2e-2 in the worst element). As a normalised error
# (max |ours - ref| / max(1, max |ref|)) against the float64 reference on the same rounded
# inputs, 2e-2 leaves room for that and catches any formula or indexing bug (those give O(1)).
BF16_TOLERANCE = 2e-2


def _normalised(actual, expected):
    expected = np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(1.0, np.abs(expected).max()))


@pytest.mark.parametrize("batch,features,state", [(1, 1, 1), (3, 17, 5), (16, 32, 128)])
def test_host_kernels_in_bfloat16_match_the_reference(host_lib, batch, features, state):
    case64 = make_case(batch, features, state, np.float64, seed=batch + state)
    bits = {k: to_bits(v) for k, v in case64.items()}
    case = {k: from_bits(v) for k, v in bits.items()}       # the rounded values, in float64
    ref_h, ref_c, _ = reference_results(case)
    x = np.concatenate([case["old_h"], case["input"]], axis=1)
    gates = to_bits(x @ case["weights"].T)                    # the GEMM's bfloat16 output
    bias = np.ascontiguousarray(bits["bias"].reshape(-1))
    new_h = np.zeros((batch, state), np.uint16)
    new_cell = np.zeros((batch, state), np.uint16)
    host_lib.lltm_fwd_bf16(ctypes.c_uint(3), ctypes.c_uint(32), ptr(gates), ptr(bias),
                           ptr(bits["old_cell"]), ptr(new_h), ptr(new_cell),
                           ctypes.c_longlong(batch * state), ctypes.c_int(state))
    assert _normalised(from_bits(new_h), ref_h) <= BF16_TOLERANCE
    assert _normalised(from_bits(new_cell), ref_c) <= BF16_TOLERANCE
    # backward from the kernel's own saved pre-activations and new_cell
    from lltm_cupy import reference

    z = from_bits(gates).reshape(batch, 3 * state)
    i, o = (1 / (1 + np.exp(-z[:, k * state:(k + 1) * state])) for k in (0, 1))
    zc = z[:, 2 * state:]
    g = np.where(zc > 0, zc, np.expm1(np.minimum(zc, 0)))
    ref_d_gates, ref_d_nc = reference.lltm_backward_gates(
        case["grad_h"], case["grad_cell"], from_bits(new_cell), i, o, g, z)
    d_gates = np.zeros((batch, 3 * state), np.uint16)
    d_old_cell = np.zeros((batch, state), np.uint16)
    host_lib.lltm_bwd_bf16(ctypes.c_uint(2), ctypes.c_uint(64), ptr(bits["grad_h"]),
                           ptr(bits["grad_cell"]), ptr(gates), ptr(new_cell), ptr(d_gates),
                           ptr(d_old_cell), ctypes.c_int(1), ctypes.c_int(1),
                           ctypes.c_longlong(batch * state), ctypes.c_int(state))
    assert _normalised(from_bits(d_gates), ref_d_gates) <= BF16_TOLERANCE
    assert _normalised(from_bits(d_old_cell), ref_d_nc) <= BF16_TOLERANCE


def test_host_add_kernel_in_bfloat16(host_lib):
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal(1000) for _ in range(2))
    xb, yb = to_bits(x), to_bits(y)
    host_lib.lltm_add_bf16(ctypes.c_uint(2), ctypes.c_uint(64), ptr(xb), ptr(yb),
                           ctypes.c_longlong(1000))
    want = to_bits(from_bits(to_bits(x)).astype(np.float32) + from_bits(yb).astype(np.float32))
    assert np.array_equal(xb, want)  # float32 sum of the two, rounded once


# ------------------------------------------------------------------------- the GPU backend

def _bf16_case(batch, features, state, seed):
    """A case rounded to bfloat16: (bits for the backend, the same values in float64)."""
    case64 = make_case(batch, features, state, np.float64, seed=seed)
    bits = {k: to_bits(v) for k, v in case64.items()}
    return bits, {k: from_bits(v) for k, v in bits.items()}


@pytest.mark.parametrize("batch,features,state", [(3, 5, 7), (16, 32, 128), (0, 2, 3)])
def test_cupy_backend_in_bfloat16_on_the_emulator(emulated_cupy, batch, features, state):
    """The GPU backend's bfloat16 path (uint16 bits, gemmEx with CUDA_R_16BF, the bias gradient
    as a GEMM) against the float64 reference on the same rounded inputs."""
    from lltm_cupy import _cuda

    bits, case = _bf16_case(batch, features, state, seed=11)
    arrays = [emulated_cupy.asarray(bits[n]) for n in ("input", "weights", "bias", "old_h",
                                                       "old_cell")]
    new_h, new_cell, saved = _cuda.forward(*arrays)
    assert new_h.dtype == np.uint16 and saved.gates.dtype == np.uint16
    grads = _cuda.backward(emulated_cupy.asarray(bits["grad_h"]),
                           emulated_cupy.asarray(bits["grad_cell"]), saved)
    ref_h, ref_c, ref_grads = reference_results(case)
    names = ("new_h", "new_cell", "d_old_h", "d_input", "d_weights", "d_bias", "d_old_cell")
    for name, got, want in zip(names, (new_h, new_cell, *grads), (ref_h, ref_c, *ref_grads)):
        assert got.dtype == np.uint16, name
        err = _normalised(from_bits(got), want) if np.size(want) else 0.0
        assert err <= BF16_TOLERANCE, f"{name}: {err:.3e}"


def test_cupy_sequence_in_bfloat16_on_the_emulator(emulated_cupy):
    from lltm_cupy import _cuda, reference

    rng = np.random.default_rng(5)
    T, B, F, S = 5, 4, 3, 6
    xs = to_bits(rng.standard_normal((T, B, F)))
    w = to_bits(rng.uniform(-1, 1, (3 * S, S + F)) / 3)
    b = to_bits(rng.uniform(-1, 1, 3 * S))
    h0, c0 = (to_bits(rng.standard_normal((B, S))) for _ in range(2))
    g_out, g_h, g_c = (to_bits(rng.standard_normal(s)) for s in ((T, B, S), (B, S), (B, S)))
    e = emulated_cupy.asarray
    outputs, h_n, c_n, saved = _cuda.forward_sequence(e(xs), e(w), e(b), e(h0), e(c0))
    grads = _cuda.backward_sequence(e(g_out), e(g_h), e(g_c), saved)
    # the float64 reference, stepped, on the rounded values
    W, bias = from_bits(w), from_bits(b)
    h, c, hs, caches = from_bits(h0), from_bits(c0), [], []
    for t in range(T):
        out = reference.lltm_forward(from_bits(xs[t]), W, bias, h, c)
        hs.append(out[0])
        caches.append((h, from_bits(xs[t]), out))
        h, c = out[0], out[1]
    assert _normalised(from_bits(outputs), np.stack(hs)) <= BF16_TOLERANCE
    assert _normalised(from_bits(h_n), h) <= BF16_TOLERANCE
    assert _normalised(from_bits(c_n), c) <= BF16_TOLERANCE
    dh, dc = from_bits(g_h), from_bits(g_c)
    d_w = np.zeros_like(W)
    d_b = np.zeros_like(bias)
    d_x = []
    for t in range(T - 1, -1, -1):
        h_prev, x_t, out = caches[t]
        d_old_h, d_input, dw, db, d_old_c = reference.lltm_backward(
            dh + from_bits(g_out[t]), dc, *out[1:], W)
        d_w += dw
        d_b += db
        d_x.append(d_input)
        dh, dc = d_old_h, d_old_c
    for name, got, want in (("d_inputs", grads.d_inputs, np.stack(d_x[::-1])),
                            ("d_weights", grads.d_weights, d_w), ("d_bias", grads.d_bias, d_b),
                            ("d_h0", grads.d_h0, dh), ("d_c0", grads.d_c0, dc)):
        err = _normalised(from_bits(got), want)
        assert err <= BF16_TOLERANCE, f"{name}: {err:.3e}"


# ------------------------------------------------------------------------------ torch layer

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")


def test_torch_cuda_path_in_bfloat16_on_the_emulator(emulated_cuda_torch):
    """bfloat16 tensors through the torch layer's CUDA path (the kernels' bfloat16
    instantiation on the tensors' pointers, bfloat16 tensors out)."""
    import lltm_cupy.torch as lt

    bits, case = _bf16_case(4, 3, 5, seed=13)
    names = ("input", "weights", "bias", "old_h", "old_cell")
    args = [torch.tensor(case[n]).bfloat16().requires_grad_() for n in names]
    h, c = lt.lltm(*args)
    assert h.dtype == c.dtype == torch.bfloat16
    torch.autograd.backward((h, c), (torch.tensor(case["grad_h"]).bfloat16(),
                                     torch.tensor(case["grad_cell"]).bfloat16()))
    ref_h, ref_c, ref_grads = reference_results(case)
    ref_by_arg = dict(zip(("old_h", "input", "weights", "bias", "old_cell"), ref_grads))
    assert _normalised(h.double().detach().numpy(), ref_h) <= BF16_TOLERANCE
    assert _normalised(c.double().detach().numpy(), ref_c) <= BF16_TOLERANCE
    for name, a in zip(names, args):
        assert a.grad.dtype == torch.bfloat16, name
        assert _normalised(a.grad.double().numpy(), ref_by_arg[name]) <= BF16_TOLERANCE, name


@pytest.mark.parametrize("sequence", [False, True], ids=["cell", "sequence"])
def test_bfloat16_on_the_cpu_computes_in_float32(sequence):
    """bfloat16 CPU tensors: computed in float32 by the NumPy backend, results rounded to
    bfloat16, gradients reaching the bfloat16 leaves in bfloat16."""
    import lltm_cupy.torch as lt

    torch.manual_seed(3)
    T, B, F, S = 3, 4, 5, 6
    shape = (T, B, F) if sequence else (B, F)
    args32 = [torch.randn(*shape), torch.randn(3 * S, S + F) / 3, torch.randn(3 * S),
              torch.randn(B, S), torch.randn(B, S)]
    args16 = [a.bfloat16().requires_grad_() for a in args32]
    fn = lt.lltm_sequence if sequence else lt.lltm
    outs = fn(*args16)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    leaves = [a.detach().float().requires_grad_() for a in args16]
    want = fn(*leaves)
    for o, w in zip(outs, want):
        assert torch.equal(o, w.bfloat16())          # float32 results, rounded once
    sum(o.float().sum() for o in outs).backward()
    sum(w.sum() for w in want).backward()
    for a, w in zip(args16, leaves):
        assert a.grad.dtype == torch.bfloat16
        assert torch.equal(a.grad, w.grad.bfloat16())


def test_cpu_autocast_bfloat16_runs_the_cell_in_float32():
    import lltm_cupy.torch as lt

    cell = lt.LLTMCell(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, c = cell(torch.randn(2, 3).bfloat16())
    assert h.dtype == torch.float32


# ------------------------------------------------------------------------------ GPU tests

from helpers.torch_cuda import needs_cuda  # noqa: E402


@needs_cuda
@pytest.mark.parametrize("size", [(16, 32, 128), (5, 3, 7)])
def test_gpu_bfloat16_cell_matches_the_reference(size):
    import lltm_cupy.torch as lt

    B, F, S = size
    bits, case = _bf16_case(B, F, S, seed=17)
    names = ("input", "weights", "bias", "old_h", "old_cell")
    args = [torch.tensor(case[n], device="cuda").bfloat16().requires_grad_() for n in names]
    h, c = lt.lltm(*args)
    torch.autograd.backward((h, c), tuple(torch.tensor(case[g], device="cuda").bfloat16()
                                          for g in ("grad_h", "grad_cell")))
    ref_h, ref_c, ref_grads = reference_results(case)
    ref_by_arg = dict(zip(("old_h", "input", "weights", "bias", "old_cell"), ref_grads))
    assert _normalised(h.double().cpu().detach().numpy(), ref_h) <= BF16_TOLERANCE
    assert _normalised(c.double().cpu().detach().numpy(), ref_c) <= BF16_TOLERANCE
    for name, a in zip(names, args):
        assert a.grad.dtype == torch.bfloat16
        assert _normalised(a.grad.double().cpu().numpy(), ref_by_arg[name]) <= BF16_TOLERANCE
    # and against our own float32 results on the same rounded values
    args32 = [a.detach().float().requires_grad_() for a in args]
    h32, c32 = lt.lltm(*args32)
    torch.testing.assert_close(h.float(), h32, rtol=2e-2, atol=2e-2)


@needs_cuda
def test_gpu_bfloat16_sequence_matches_float32():
    import lltm_cupy.torch as lt

    torch.manual_seed(0)
    model = lt.LLTM(32, 64, device="cuda")
    xs = torch.randn(8, 16, 32, device="cuda")
    out32, (h32, c32) = model(xs)
    (out32.sum() + c32.sum()).backward()
    grads32 = [p.grad.clone() for p in model.parameters()]
    model16 = lt.LLTM(32, 64, device="cuda", dtype=torch.bfloat16)
    model16.load_state_dict(model.state_dict())
    out, (h, c) = model16(xs.bfloat16())
    assert out.dtype == torch.bfloat16
    (out.float().sum() + c.float().sum()).backward()
    for name, a, b in (("outputs", out, out32), ("h_n", h, h32), ("c_n", c, c32)):
        err = _normalised(a.double().cpu().detach().numpy(), b.double().cpu().detach().numpy())
        assert err <= BF16_TOLERANCE, f"{name}: {err:.3e}"
    for p, g in zip(model16.parameters(), grads32):
        scale = g.abs().max().item()
        assert (p.grad.float() - g).abs().max().item() <= 5e-2 * max(1.0, scale)


@needs_cuda
def test_gpu_autocast_bfloat16_trains_like_float32():
    import lltm_cupy.torch as lt

    losses = {}
    for mode in ("float32", "bfloat16"):
        torch.manual_seed(0)
        cell = lt.LLTMCell(16, 32, device="cuda")
        head = torch.nn.Linear(32, 4, device="cuda")
        params = [*cell.parameters(), *head.parameters()]
        opt = torch.optim.SGD(params, lr=0.1)
        g = torch.Generator(device="cuda").manual_seed(1)
        xs = torch.randn(4, 32, 16, device="cuda", generator=g)
        ys = torch.randint(0, 4, (32,), device="cuda", generator=g)
        losses[mode] = []
        for _ in range(20):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bfloat16"):
                state = None
                for x in xs:
                    state = cell(x, state)
                loss = torch.nn.functional.cross_entropy(head(state[0]).float(), ys)
            loss.backward()
            opt.step()
            losses[mode].append(loss.item())
    a, b = np.array(losses["float32"]), np.array(losses["bfloat16"])
    assert np.isfinite(b).all() and b[-1] < b[0]
    assert np.abs(a - b).max() <= 5e-2 * np.abs(a).max(), (a, b)


def test_the_array_api_still_refuses_uint16_and_bfloat16_arrays():
    """The backend's bfloat16 storage (uint16) is internal: the public array API refuses it, and
    ml_dtypes' bfloat16 arrays, with its TypeError."""
    import lltm_cupy

    for dtype in (np.uint16, BF16):
        args = [np.zeros(s, dtype) for s in ((2, 3), (12, 7), (12,), (2, 4), (2, 4))]
        with pytest.raises(TypeError, match="dtype"):
            lltm_cupy.forward(*args)
