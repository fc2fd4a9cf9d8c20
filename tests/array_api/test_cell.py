"""The fused cell alone (cell_forward / cell_backward), through the public calls on the NumPy
backend and the emulated CuPy (the CUDA kernels built as host C++; a GPU run adds real CuPy):
within the element-wise ulp bounds of lltm_cupy.exact (as tests/array_api/test_accuracy.py holds the
backends' own element-wise code), equal to the float64 reference at the per-dtype tolerances,
consistent with forward/backward, and with the same argument rules."""
from __future__ import annotations

import numpy as np
import pytest

mpmath = pytest.importorskip("mpmath", reason="mpmath is not installed (pip install .[test])")

import lltm_cupy  # noqa: E402
from lltm_cupy import exact, reference  # noqa: E402
from conftest import TOLERANCE, gpu_unavailable_reason, max_error, to_numpy  # noqa: E402
from helpers import elementwise as ew  # noqa: E402

pytestmark = pytest.mark.usefixtures("ieee_arithmetic")
NAMES = ("z_i", "z_o", "z_c", "old_cell", "grad_h", "grad_cell")
_GPU = [pytest.mark.gpu] + ([pytest.mark.skip(reason=f"GPU test: {gpu_unavailable_reason()}")]
                            if gpu_unavailable_reason() else [])
CASES = [pytest.param("numpy", np.float32, id="numpy-float32"),
         pytest.param("numpy", np.float64, id="numpy-float64"),
         pytest.param("emulated", np.float16, id="emulated-float16"),
         pytest.param("emulated", np.float32, id="emulated-float32"),
         pytest.param("emulated", np.float64, id="emulated-float64"),
         pytest.param("cupy", np.float32, id="cupy-float32", marks=_GPU)]
#: Without the real GPU: CuPy compiles with -ftz=true, so on a GPU results (and inputs) below
#: the smallest normal flush to zero, millions of ulps from the exact value in the cases below
#: whose saturated gates reach subnormal values (seen on an H200). docs/derivation.md states
#: the bounds for IEEE arithmetic; test_accuracy's GPU test checks the GPU on normal values.
IEEE_CASES = [case for case in CASES if case.values[0] != "cupy"]


def _xp(request, array):
    if array == "numpy":
        return np
    if array == "emulated":
        return request.getfixturevalue("emulated_cupy")
    import cupy
    return cupy


def _cell(xp, rounded, dtype):
    """The public cell on flat inputs as one row: ew's named outputs."""
    n = rounded["z_i"].size
    gates = xp.asarray(np.concatenate([rounded[k] for k in ("z_i", "z_o", "z_c")]).reshape(1, 3 * n))
    old_cell = xp.asarray(rounded["old_cell"].reshape(1, n))
    new_h, new_cell, saved = lltm_cupy.cell_forward(gates, old_cell)
    g = lltm_cupy.cell_backward(xp.asarray(rounded["grad_h"].reshape(1, n)),
                                xp.asarray(rounded["grad_cell"].reshape(1, n)), saved)
    d = to_numpy(g.d_gates).reshape(3, n)     # host copies: device memory is reused
    return ew._named(to_numpy(new_h), to_numpy(new_cell), to_numpy(g.d_old_cell),
                     d[0], d[1], d[2])


def _check_ulps(xp, inputs, dtype, label):
    rounded = {k: np.ascontiguousarray(np.asarray(v, dtype).reshape(-1)) for k, v in inputs.items()}
    worst = exact.max_errors(rounded, _cell(xp, rounded, dtype), dtype)
    worst.pop("skipped")
    bound = exact.ULP_BOUND[np.dtype(dtype)]
    bad = {k: round(e, 2) for k, (e, i) in worst.items() if e > bound[k]}
    assert not bad, f"{np.dtype(dtype).name} {label}: ulps above {bound}: {bad}"


@pytest.mark.parametrize("array,dtype", CASES)
@pytest.mark.parametrize("scale", [1, 10])
def test_cell_within_the_ulp_bounds_at_scale(request, array, dtype, scale):
    _check_scale(request, array, dtype, scale)


@pytest.mark.parametrize("array,dtype", IEEE_CASES)
def test_cell_within_the_ulp_bounds_at_saturating_scale(request, array, dtype):
    _check_scale(request, array, dtype, 100)


def _check_scale(request, array, dtype, scale):
    rng = np.random.default_rng(scale)
    inputs = {k: rng.standard_normal(300) * (scale if k.startswith("z") or k == "old_cell" else 1)
              for k in NAMES}
    _check_ulps(_xp(request, array), inputs, dtype, f"scale {scale}")


@pytest.mark.parametrize("array,dtype", IEEE_CASES)
def test_cell_within_the_ulp_bounds_at_special_values(request, array, dtype):
    rng = np.random.default_rng(7)
    values = ew.special_values(dtype)
    inputs = {k: values[rng.integers(len(values), size=400)] for k in NAMES}
    _check_ulps(_xp(request, array), inputs, dtype, "special values")


@pytest.mark.parametrize("array,dtype", CASES)
def test_cell_against_the_reference_and_forward(request, array, dtype):
    """Batch 5, state 17 (not a multiple of a block): the float64 reference's element-wise
    forward and backward at the per-dtype tolerance, and the same numbers as forward/backward
    given the gates they compute."""
    xp = _xp(request, array)
    rng = np.random.default_rng(3)
    batch, features, state = 5, 6, 17
    x = rng.standard_normal((batch, features))
    W = rng.uniform(-1, 1, (3 * state, state + features))
    b = rng.uniform(-1, 1, 3 * state)
    h, c = rng.uniform(-1, 1, (batch, state)), rng.standard_normal((batch, state))
    gh, gc = rng.standard_normal((batch, state)), rng.standard_normal((batch, state))
    new_h, new_cell, ig, og, cc, X, gates = reference.lltm_forward(x, W, b, h, c)
    d_gates, d_new_cell = reference.lltm_backward_gates(gh, gc, new_cell, ig, og, cc, gates)
    a = {k: xp.asarray(v.astype(dtype)) for k, v in dict(gates=gates, c=c, gh=gh, gc=gc).items()}
    before = to_numpy(a["gates"]).copy()
    got_h, got_c, saved = lltm_cupy.cell_forward(a["gates"], a["c"])
    g = lltm_cupy.cell_backward(a["gh"], a["gc"], saved)
    np.testing.assert_array_equal(to_numpy(a["gates"]), before, err_msg="gates modified")
    tol = TOLERANCE[np.dtype(dtype)]
    for name, got, want in (("new_h", got_h, new_h), ("new_cell", got_c, new_cell),
                            ("d_gates", g.d_gates, d_gates), ("d_old_cell", g.d_old_cell,
                                                              d_new_cell)):
        assert got.dtype == dtype and tuple(got.shape) == want.shape, name
        assert max_error(got, want) <= tol, f"{name}: {max_error(got, want):.2e} > {tol:.0e}"
    if dtype != np.float16:     # the step's gates rounded as forward rounds them: same cell
        args = [xp.asarray(v.astype(dtype)) for v in (x, W, b, h, c)]
        f_h, f_c, f_saved = lltm_cupy.forward(*args)
        fg = lltm_cupy.backward(a["gh"], a["gc"], f_saved)
        X_d = np.concatenate([h, x], 1).astype(dtype)
        z = (X_d @ W.astype(dtype).T + b.astype(dtype)).astype(dtype)
        c_h, c_c, c_saved = lltm_cupy.cell_forward(xp.asarray(z), a["c"])
        cg = lltm_cupy.cell_backward(a["gh"], a["gc"], c_saved)
        for name, u, v in (("new_h", c_h, f_h), ("new_cell", c_c, f_c),
                           ("d_old_cell", cg.d_old_cell, fg.d_old_cell),
                           ("d_bias", to_numpy(cg.d_gates).sum(0), fg.d_bias)):
            assert max_error(u, to_numpy(v).astype(np.float64)) <= tol, name


@pytest.mark.parametrize("array", ["numpy", "emulated"])
def test_cell_missing_gradients_and_empty_batch(request, array):
    xp = _xp(request, array)
    rng = np.random.default_rng(0)
    gates, c = rng.standard_normal((3, 12)), rng.standard_normal((3, 4))
    gh = rng.standard_normal((3, 4))
    *_, saved = lltm_cupy.cell_forward(xp.asarray(gates), xp.asarray(c))
    full = lltm_cupy.cell_backward(xp.asarray(gh), xp.asarray(np.zeros((3, 4))), saved)
    only_h = lltm_cupy.cell_backward(xp.asarray(gh), None, saved)
    none = lltm_cupy.cell_backward(None, None, saved)
    for u, v in zip(only_h, full):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-15, atol=0)
    assert not np.asarray(none.d_gates).any() and not np.asarray(none.d_old_cell).any()
    h0, c0, s0 = lltm_cupy.cell_forward(xp.asarray(np.zeros((0, 12))), xp.asarray(np.zeros((0, 4))))
    assert h0.shape == (0, 4) and lltm_cupy.cell_backward(None, None, s0).d_gates.shape == (0, 12)


@pytest.mark.parametrize("array", ["numpy", "emulated"])
def test_cell_backward_reads_no_caller_array(request, array):
    xp = _xp(request, array)
    rng = np.random.default_rng(1)
    gates, c, gh = (xp.asarray(rng.standard_normal(s)) for s in ((2, 9), (2, 3), (2, 3)))
    *_, ref = lltm_cupy.cell_forward(gates.copy(), c.copy())
    want = lltm_cupy.cell_backward(gh, gh, ref)
    new_h, new_cell, saved = lltm_cupy.cell_forward(gates, c)
    new_h[...] = 5.0
    new_cell[...] = 5.0
    gates[...] = 5.0
    c[...] = 5.0
    got = lltm_cupy.cell_backward(gh, gh, saved)
    for u, v in zip(got, want):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("args,error,words", [
    (((2, 9), (2, 4)), ValueError, "gates must have shape (2, 12)"),
    (((2, 12), (2, 4, 1)), ValueError, "old_cell must be 2-D"),
])
def test_cell_bad_shapes(args, error, words):
    with pytest.raises(error) as info:
        lltm_cupy.cell_forward(np.zeros(args[0]), np.zeros(args[1]))
    assert words in str(info.value)


def test_cell_bad_kinds():
    with pytest.raises(TypeError, match="same dtype"):
        lltm_cupy.cell_forward(np.zeros((2, 12)), np.zeros((2, 4), np.float32))
    with pytest.raises(TypeError, match="LLTMCellSaved"):
        *_, saved = lltm_cupy.forward(*(np.zeros(s) for s in ((1, 2), (3, 3), (3,), (1, 1), (1, 1))))
        lltm_cupy.cell_backward(None, None, saved)
