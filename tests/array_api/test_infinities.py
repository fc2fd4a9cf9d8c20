"""Infinities, NaN, signed zeros, subnormals and the ends of the range: every backend gives the
float64 reference's values (lltm_cupy.reference), forward and backward, and no NumPy warning
escapes a public call.

- element-wise, on the NumPy backend (float32, float64) and on the CUDA kernels through their
  host build (float16, bfloat16, float32, float64): a fixed grid of the special values of each
  dtype (every run hits every infinity) and a property-based search over them and the whole
  float range; judged by tests/helpers/nonfinite.py (NaN exactly where the reference has NaN,
  the same infinities, finite values within an error bound);
- through the public calls (array API on NumPy and on the emulated CuPy; the torch layer on the
  CPU and on the emulated CUDA path), GEMMs included, with infinities and NaN placed in any
  argument or incoming gradient: the reference's NaN and infinities exactly, the rest within
  the dtype's tolerance; the cases users meet first (a -inf bias switching a unit off,
  a +inf input) by name; whole sequences against the stepped reference.
"""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from lltm_cupy import reference
from conftest import TOLERANCE, make_case
from helpers import elementwise as ew
from helpers import nonfinite

pytestmark = [pytest.mark.filterwarnings("error::RuntimeWarning"),
              pytest.mark.usefixtures("ieee_arithmetic")]

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install .[test])")
BF16 = np.dtype(np.uint16)   # the kernels' bfloat16 storage
ELEMENTWISE = [("numpy", np.float32), ("numpy", np.float64), ("kernels", np.float16),
               ("kernels", BF16), ("kernels", np.float32), ("kernels", np.float64)]
IDS = [f"{b}-{'bfloat16' if np.dtype(d) == BF16 else np.dtype(d).name}" for b, d in ELEMENTWISE]


def _to_bits(values):
    with np.errstate(all="ignore"):
        return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _from_bits(bits):
    return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


def _run_elementwise(lib, backend, dtype, values):
    """(inputs as stored, outputs) in float64, from float64 ``values`` rounded to ``dtype``."""
    if np.dtype(dtype) == BF16:
        bits = {k: _to_bits(v) for k, v in values.items()}
        out = ew.run_kernels(lib, bits, BF16)
        return ({k: _from_bits(v) for k, v in bits.items()},
                {k: _from_bits(v) for k, v in out.items()})
    with np.errstate(all="ignore"):
        rounded = {k: np.asarray(v, np.float64).astype(dtype) for k, v in values.items()}
    run = ew.run_numpy if backend == "numpy" else (lambda x, d: ew.run_kernels(lib, x, d))
    out = run(rounded, dtype)
    return ({k: v.astype(np.float64) for k, v in rounded.items()},
            {k: np.asarray(v).astype(np.float64) for k, v in out.items()})


def _compute_dtype(dtype):
    return np.float32 if np.dtype(dtype).itemsize == 2 else dtype


def _assert_elementwise(lib, backend, dtype, values):
    x, got = _run_elementwise(lib, backend, dtype, values)
    bad = nonfinite.mismatches(x, got, _compute_dtype(dtype),
                               ml_dtypes.bfloat16 if np.dtype(dtype) == BF16 else dtype)
    assert not bad, f"{len(bad)} mismatches, first ones:\n" + "\n".join(bad[:8])


@pytest.mark.parametrize("backend,dtype", ELEMENTWISE, ids=IDS)
def test_elementwise_over_a_grid_of_special_values(host_lib, backend, dtype):
    """Every input drawn from +-inf, NaN, +-0, subnormal, the largest value and the overflow
    thresholds of exp and cosh (4000 elements: each pair of inputs meets in all their
    special values)."""
    rng = np.random.default_rng(11)
    specials = np.array(nonfinite.special_values(
        ml_dtypes.bfloat16 if np.dtype(dtype) == BF16 else dtype))
    values = {k: specials[rng.integers(len(specials), size=4000)] for k in nonfinite.INPUTS}
    _assert_elementwise(host_lib, backend, dtype, values)


def test_the_grid_catches_the_nan_of_min_z_minus_z():
    """The control: the old NumPy form -max(z, 0) = min(z, 0) - z is NaN at z = -inf, and the
    comparison sees that as a mismatch (sigmoid(-inf) = 0 gives a finite new_h)."""
    x = {k: np.zeros(1) for k in nonfinite.INPUTS}
    x["z_i"] = np.array([-np.inf])
    got = {"new_h": np.array([np.nan]), "new_cell": np.zeros(1)}
    bad = nonfinite.mismatches(x, got, np.float32, np.float32, names=("new_h",))
    assert len(bad) == 1 and "new_h[0] = nan, reference 0.0" in bad[0]


hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


def _values(dtype):
    info = nonfinite.finfo(ml_dtypes.bfloat16 if np.dtype(dtype) == BF16 else dtype)
    width = 64 if np.dtype(dtype) == np.float64 else 32
    anything = st.floats(width=width, allow_nan=True, allow_infinity=True)
    if np.dtype(dtype) == np.float16:   # rounded to the dtype afterwards: mostly in range
        anything = st.floats(-2 * float(info.max), 2 * float(info.max), width=32)
    specials = st.sampled_from(nonfinite.special_values(
        ml_dtypes.bfloat16 if np.dtype(dtype) == BF16 else dtype))
    return st.one_of(specials, anything, st.floats(-50, 50, width=width))


@pytest.mark.parametrize("backend,dtype", ELEMENTWISE, ids=IDS)
@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.slow
def test_elementwise_property_over_special_and_arbitrary_values(host_lib, backend, dtype, data):
    n = 8
    values = {k: np.array(data.draw(st.lists(_values(dtype), min_size=n, max_size=n), label=k))
              for k in nonfinite.INPUTS}
    _assert_elementwise(host_lib, backend, dtype, values)


# --------------------------------------------------------------------------- public calls

NAMES = ("input", "weights", "bias", "old_h", "old_cell")
GRADS = ("grad_h", "grad_cell")
API = ["numpy", "cupy-emulated", "torch-cpu", "torch-cuda-emulated"]


def _api_run(request, api, case):
    """new_h, new_cell and the five gradients in LLTMGrads order, as float64 NumPy arrays."""
    if api in ("numpy", "cupy-emulated"):
        xp = np if api == "numpy" else request.getfixturevalue("emulated_cupy")
        arrays = [xp.asarray(case[n]) for n in NAMES]
        h, c, saved = lltm_cupy.forward(*arrays)
        g = lltm_cupy.backward(xp.asarray(case["grad_h"]), xp.asarray(case["grad_cell"]), saved)
        return [np.array(a, np.float64) for a in (h, c, *g)]
    torch = pytest.importorskip("torch")
    import lltm_cupy.torch as lt

    if api == "torch-cuda-emulated":
        request.getfixturevalue("emulated_cuda_torch")
    args = [torch.tensor(case[n]).requires_grad_() for n in NAMES]
    h, c = lt.lltm(*args)
    torch.autograd.backward((h, c), [torch.tensor(case[n]) for n in GRADS])
    grads = dict(zip(NAMES, (a.grad for a in args)))
    order = [grads[n] for n in ("old_h", "input", "weights", "bias", "old_cell")]
    return [t.detach().double().numpy() for t in (h, c, *order)]


def _api_reference(case):
    fwd = reference.lltm_forward(*(case[n] for n in NAMES))
    grads = reference.lltm_backward(case["grad_h"], case["grad_cell"], *fwd[1:], case["weights"])
    d_bias = grads[3].reshape(np.shape(case["bias"]))
    return [fwd[0], fwd[1], grads[0], grads[1], grads[2], d_bias, grads[4]]


OUT_NAMES = ("new_h", "new_cell", "d_old_h", "d_input", "d_weights", "d_bias", "d_old_cell")


def _assert_api_matches(got, want, dtype, label):
    tol = TOLERANCE[np.dtype(dtype)]
    for name, res, ref in zip(OUT_NAMES, got, want):
        assert res.shape == ref.shape, f"{label} {name}: shape"
        nan_res, nan_ref = np.isnan(res), np.isnan(ref)
        assert np.array_equal(nan_res, nan_ref), (
            f"{label} {name}: NaN at {np.argwhere(nan_res & ~nan_ref).tolist()[:5]} where the "
            f"reference is {ref[nan_res & ~nan_ref][:5]}, and the reference's NaN at "
            f"{np.argwhere(nan_ref & ~nan_res).tolist()[:5]} is {res[nan_ref & ~nan_res][:5]}")
        inf = np.isinf(ref)
        assert np.array_equal(res[inf], ref[inf]) and not np.isinf(res[~inf]).any(), \
            f"{label} {name}: infinities differ"
        finite = np.isfinite(ref)
        if finite.any():
            scale = max(1.0, float(np.abs(ref[finite]).max()))
            err = float(np.abs(res[finite] - ref[finite]).max()) / scale
            assert err <= tol, f"{label} {name}: normalised error {err:.2e} > {tol:.0e}"


def _with(case, dtype, **changes):
    """The case in ``dtype`` with some elements replaced: name=[(flat index, value), ...]."""
    out = {k: np.array(v, dtype) for k, v in case.items()}
    for name, items in changes.items():
        for index, value in items:
            out[name].reshape(-1)[index] = value
    return out


B, F, S = 3, 4, 5
#: The reported cases and their neighbours: (name, changes), state unit 1 of batch 3.
CASES = [
    ("input-gate bias -inf (unit switched off)", dict(bias=[(1, -np.inf)])),
    ("output-gate bias -inf", dict(bias=[(S + 1, -np.inf)])),
    ("candidate bias -inf", dict(bias=[(2 * S + 1, -np.inf)])),
    ("input-gate bias +inf", dict(bias=[(1, np.inf)])),
    ("candidate bias +inf", dict(bias=[(2 * S + 1, np.inf)])),
    ("candidate +inf, input gate -inf: inf * 0", dict(bias=[(2 * S + 1, np.inf), (1, -np.inf)])),
    ("one input element +inf", dict(input=[(2, np.inf)])),
    ("one input element -inf", dict(input=[(5, -np.inf)])),
    ("one input element NaN", dict(input=[(0, np.nan)])),
    ("old_h +inf", dict(old_h=[(3, np.inf)])),
    ("old_cell -inf", dict(old_cell=[(4, -np.inf)])),
    ("a weight -inf", dict(weights=[(7, -np.inf)])),
    ("grad_h +inf", dict(grad_h=[(6, np.inf)])),
    ("grad_cell -inf and NaN", dict(grad_cell=[(2, -np.inf), (9, np.nan)])),
    ("-0.0 everywhere in the bias", dict(bias=[(i, -0.0) for i in range(3 * S)])),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("api", API)
@pytest.mark.parametrize("label,changes", CASES, ids=[c[0] for c in CASES])
def test_public_calls_give_the_reference_at_infinities(request, api, dtype, label, changes):
    case = _with(make_case(B, F, S, np.float64, seed=3), dtype, **changes)
    _assert_api_matches(_api_run(request, api, case), _api_reference(case), dtype, label)


def test_a_unit_switched_off_by_a_minus_inf_bias_keeps_its_old_cell():
    """What a user does with it: sigmoid(-inf) = 0, so the unit's cell is old_cell and its h
    is tanh(old_cell) * output_gate, finite."""
    case = _with(make_case(B, F, S, np.float64, seed=3), np.float32, bias=[(1, -np.inf)])
    h, c, _ = lltm_cupy.forward(*(case[n] for n in NAMES))
    assert np.isfinite(h).all() and np.array_equal(c[:, 1], case["old_cell"][:, 1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("api", API)
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_public_calls_property_with_infinities_anywhere(request, api, dtype, data):
    seed = data.draw(st.integers(0, 2**16), label="seed")
    case = make_case(B, F, S, np.float64, seed=seed, bias_2d=data.draw(st.booleans()))
    changes = {}
    for _ in range(data.draw(st.integers(1, 4), label="count")):
        name = data.draw(st.sampled_from(NAMES + GRADS), label="argument")
        index = data.draw(st.integers(0, np.size(case[name]) - 1), label="index")
        value = data.draw(st.sampled_from([np.inf, -np.inf, np.nan]), label="value")
        changes.setdefault(name, []).append((index, value))
    case = _with(case, dtype, **changes)
    _assert_api_matches(_api_run(request, api, case), _api_reference(case), dtype, str(changes))


# ------------------------------------------------------------------------------ sequences

def _stepped_reference(seq):
    """Outputs, h_n, c_n and the five sequence gradients by stepping the float64 reference."""
    T = seq["inputs"].shape[0]
    h, c, caches, outs = seq["h0"], seq["c0"], [], []
    for t in range(T):
        fwd = reference.lltm_forward(seq["inputs"][t], seq["weights"], seq["bias"], h, c)
        caches.append(fwd)
        outs.append(fwd[0])
        h, c = fwd[0], fwd[1]
    dh, dc = seq["grad_h_n"].astype(np.float64), seq["grad_c_n"].astype(np.float64)
    d_w, d_b, d_x = 0.0, 0.0, [None] * T
    for t in range(T - 1, -1, -1):
        d_old_h, d_input, dw, db, d_old_c = reference.lltm_backward(
            dh + seq["grad_outputs"][t], dc, *caches[t][1:], seq["weights"])
        with np.errstate(invalid="ignore"):
            d_w, d_b = d_w + dw, d_b + db
        d_x[t] = d_input
        dh, dc = d_old_h, d_old_c
    return [np.stack(outs), h, c, np.stack(d_x), d_w, d_b, dh, dc]


@pytest.mark.parametrize("api", ["numpy", "cupy-emulated"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_sequences_give_the_stepped_reference_at_infinities(request, api, dtype):
    rng = np.random.default_rng(4)
    T = 4
    seq = {"inputs": rng.standard_normal((T, B, F)), "weights": rng.uniform(-.5, .5, (3 * S, S + F)),
           "bias": rng.uniform(-1, 1, 3 * S), "h0": rng.uniform(-1, 1, (B, S)),
           "c0": rng.standard_normal((B, S)), "grad_outputs": rng.standard_normal((T, B, S)),
           "grad_h_n": rng.standard_normal((B, S)), "grad_c_n": rng.standard_normal((B, S))}
    seq = {k: v.astype(dtype) for k, v in seq.items()}
    seq["bias"][1] = -np.inf                 # input gate of unit 1 off at every step
    seq["inputs"][2, 1, 3] = np.inf          # one input element at step 2
    seq["grad_outputs"][0, 2, 4] = -np.inf
    xp = np if api == "numpy" else request.getfixturevalue("emulated_cupy")
    a = {k: xp.asarray(v) for k, v in seq.items()}
    outputs, h_n, c_n, saved = lltm_cupy.forward_sequence(a["inputs"], a["weights"], a["bias"],
                                                          a["h0"], a["c0"])
    g = lltm_cupy.backward_sequence(a["grad_outputs"], a["grad_h_n"], a["grad_c_n"], saved)
    got = [np.array(v, np.float64) for v in (outputs, h_n, c_n, *g)]
    want = _stepped_reference(seq)
    names = ("outputs", "h_n", "c_n", "d_inputs", "d_weights", "d_bias", "d_h0", "d_c0")
    for name, res, ref in zip(names, got, want):
        assert np.array_equal(np.isnan(res), np.isnan(ref)), f"{name}: NaN positions differ"
        inf = np.isinf(ref)
        assert np.array_equal(res[inf], ref[inf]), f"{name}: infinities differ"
        finite = np.isfinite(ref)
        if finite.any():
            err = np.abs(res[finite] - ref[finite]).max() / max(1, np.abs(ref[finite]).max())
            assert err <= 10 * TOLERANCE[np.dtype(dtype)], f"{name}: {err:.2e}"
