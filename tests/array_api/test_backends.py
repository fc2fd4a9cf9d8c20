"""Each backend (NumPy; CuPy when a GPU is present) against the float64 reference: forward and all
five gradients, on awkward sizes, layouts, bias shapes and numerically hard inputs."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import lltm_cupy
from lltm_cupy import reference
from conftest import (BACKENDS, GRAD_NAMES, assert_close, dtypes_for, make_case,
                      reference_results, to_numpy)

FORWARD_NAMES = ("input", "weights", "bias", "old_h", "old_cell")


@pytest.fixture
def poison(monkeypatch, xp):
    """Make xp.empty return NaN-filled float arrays, so an element a kernel never writes fails."""
    original = xp.empty

    def poisoned(shape, dtype=float, *args, **kwargs):
        out = original(shape, dtype, *args, **kwargs)
        if np.dtype(dtype).kind == "f":
            out.fill(np.nan)
        return out

    monkeypatch.setattr(xp, "empty", poisoned)


def layout(xp, a, kind):
    """The values of NumPy array ``a`` as an ``xp`` array with the given memory layout."""
    if kind == "contiguous":
        return xp.asarray(a)
    if kind == "strided":  # every other element of a larger array
        big = xp.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        big[..., ::2] = xp.asarray(a)
        return big[..., ::2]
    if kind == "fortran":
        return xp.asfortranarray(xp.asarray(a))
    if kind == "transposed":  # a transposed view of the transposed copy
        return xp.ascontiguousarray(xp.asarray(a).T).T
    raise ValueError(kind)


def run(xp, case, kind="contiguous"):
    args = [layout(xp, case[n], kind) for n in FORWARD_NAMES]
    new_h, new_cell, saved = lltm_cupy.forward(*args)
    grads = lltm_cupy.backward(layout(xp, case["grad_h"], kind),
                               layout(xp, case["grad_cell"], kind), saved)
    return new_h, new_cell, grads, saved


def check_against_reference(xp, case, dtype, kind="contiguous"):
    new_h, new_cell, grads, saved = run(xp, case, kind)
    ref_h, ref_c, ref_grads = reference_results(case)
    assert isinstance(new_h, xp.ndarray) and new_h.dtype == dtype and new_cell.dtype == dtype
    assert_close(new_h, ref_h, dtype, "new_h")
    assert_close(new_cell, ref_c, dtype, "new_cell")
    assert isinstance(grads, lltm_cupy.LLTMGrads)
    for name, got, ref in zip(GRAD_NAMES, grads, ref_grads):
        assert isinstance(got, xp.ndarray) and got.dtype == dtype, name
        assert_close(got, ref, dtype, name)
    return saved


# 128 and 129 rows straddle the NumPy backend's switch of GEMM orientation (see _numpy.step._project).
@pytest.mark.parametrize("batch", [0, 1, 3, 16, 128, 129])
@pytest.mark.parametrize("state", [1, 5, 129])
@pytest.mark.parametrize("features", [1, 17])
def test_matches_reference(xp, poison, batch, state, features):
    for dtype in dtypes_for(xp):
        case = make_case(batch, features, state, dtype, seed=batch * 1000 + state * 10 + features)
        check_against_reference(xp, case, dtype)


@pytest.mark.parametrize("kind", ["strided", "fortran", "transposed"])
@pytest.mark.parametrize("bias_2d", [False, True], ids=["bias_1d", "bias_2d"])
def test_layouts_and_bias_shapes(xp, kind, bias_2d):
    for dtype in dtypes_for(xp):
        case = make_case(7, 17, 5, dtype, seed=3, bias_2d=bias_2d)
        check_against_reference(xp, case, dtype, kind)


def test_read_only_numpy_inputs():
    case = make_case(4, 3, 6, np.float64, seed=5)
    for a in case.values():
        a.setflags(write=False)
    check_against_reference(np, case, np.float64)


def test_exact_zero_preactivations(xp):
    """z == 0 exactly in all three gates: elu'(0) must be 1 (PyTorch), not the note's 0."""
    for dtype in dtypes_for(xp):
        case = make_case(5, 4, 6, dtype, seed=7, zeros_at=(0, 3, 5))
        _, _, grads, _ = run(xp, case)
        z = reference.lltm_forward(*(case[n] for n in FORWARD_NAMES))[-1]
        assert (z[:, [0, 3, 5, 6, 9, 11, 12, 15, 17]] == 0).all()
        check_against_reference(xp, case, dtype)
        # With elu'(0) = 1 the candidate rows of d_weights at the zero columns are non-zero.
        assert np.abs(to_numpy(grads.d_weights)[[12, 15, 17]]).max() > 1e-3


@pytest.mark.parametrize("scale", [30.0, 1e4])
def test_large_preactivations(xp, scale):
    """Saturated gates: finite, correct results, and (NumPy) no overflow, invalid or divide
    warning (underflow to 0 is expected and harmless)."""
    for dtype in dtypes_for(xp):
        if dtype == np.float16 and scale > 6e4:
            continue
        case = make_case(6, 5, 9, dtype, seed=11, scale=scale)
        with warnings.catch_warnings(), np.errstate(over="raise", invalid="raise", divide="raise"):
            warnings.simplefilter("error")
            new_h, new_cell, grads, _ = run(xp, case)
        for a in (new_h, new_cell, *grads):
            assert np.isfinite(to_numpy(a)).all()
        check_against_reference(xp, case, dtype)


def test_inputs_not_modified(xp):
    for dtype in dtypes_for(xp):
        case = make_case(5, 4, 7, dtype, seed=13)
        args = {n: xp.asarray(a) for n, a in case.items()}
        before = {n: to_numpy(a).copy() for n, a in args.items()}
        new_h, new_cell, saved = lltm_cupy.forward(*(args[n] for n in FORWARD_NAMES))
        lltm_cupy.backward(args["grad_h"], args["grad_cell"], saved)
        for n, a in args.items():
            np.testing.assert_array_equal(to_numpy(a), before[n], err_msg=n)


def test_backward_twice_and_saved_budget(xp):
    """saved is not consumed by backward, and holds X plus exactly 4 * B * S values (GPU: three
    pre-activations and new_cell) or 5 * B * S (CPU: four backward factors and new_cell)."""
    for dtype in dtypes_for(xp):
        case = make_case(6, 5, 8, dtype, seed=17)
        new_h, new_cell, grads, saved = run(xp, case)
        again = lltm_cupy.backward(xp.asarray(case["grad_h"]), xp.asarray(case["grad_cell"]), saved)
        for name, a, b in zip(GRAD_NAMES, grads, again):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b), err_msg=name)
        itemsize = np.dtype(dtype).itemsize
        per_element = 5 if xp is np else 4
        assert saved.nbytes == (6 * (8 + 5) + per_element * 6 * 8) * itemsize
        assert "LLTMSaved" in repr(saved)


@pytest.mark.parametrize("missing", ["grad_h", "grad_cell", "both"])
def test_missing_gradient_is_zero(xp, missing):
    for dtype in dtypes_for(xp):
        case = make_case(4, 3, 5, dtype, seed=19)
        if missing in ("grad_h", "both"):
            case["grad_h"] = np.zeros_like(case["grad_h"])
        if missing in ("grad_cell", "both"):
            case["grad_cell"] = np.zeros_like(case["grad_cell"])
        _, _, expected, saved = run(xp, case)
        gh = None if missing in ("grad_h", "both") else xp.asarray(case["grad_h"])
        gc = None if missing in ("grad_cell", "both") else xp.asarray(case["grad_cell"])
        got = lltm_cupy.backward(gh, gc, saved)
        for name, a, b in zip(GRAD_NAMES, got, expected):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b), err_msg=name)


def test_empty_batch(xp):
    for dtype in dtypes_for(xp):
        case = make_case(0, 3, 4, dtype)
        new_h, new_cell, grads, _ = run(xp, case)
        assert new_h.shape == (0, 4) and new_cell.shape == (0, 4)
        assert grads.d_input.shape == (0, 3) and grads.d_old_h.shape == (0, 4)
        assert grads.d_weights.shape == (12, 7) and not to_numpy(grads.d_weights).any()
        assert grads.d_bias.shape == (12,) and not to_numpy(grads.d_bias).any()


def test_needed_skips_fields_and_keeps_the_others(xp):
    case = make_case(4, 3, 5, np.float64, seed=31)
    _, _, full, saved = run(xp, case)
    for i in range(5):
        needed = [True] * 5
        needed[i] = False
        got = lltm_cupy.backward(xp.asarray(case["grad_h"]), xp.asarray(case["grad_cell"]), saved,
                                 needed=needed)
        for j, (name, a, b) in enumerate(zip(GRAD_NAMES, got, full)):
            if j == i:
                assert a is None, name
            else:
                np.testing.assert_array_equal(to_numpy(a), to_numpy(b), err_msg=name)
    with pytest.raises(TypeError, match="needed must hold 5 booleans"):
        lltm_cupy.backward(None, None, saved, needed=(True,))


def test_results_are_contiguous_and_independent(xp):
    case = make_case(4, 3, 5, np.float32, seed=37)
    new_h, new_cell, grads, _ = run(xp, case)
    for name, a in zip(("new_h", "new_cell", *GRAD_NAMES), (new_h, new_cell, *grads)):
        assert a.flags.c_contiguous, name
    assert not xp.shares_memory(grads.d_old_h, grads.d_input)


@pytest.mark.parametrize("xp", [p for p in BACKENDS if p.id != "numpy"], indirect=True)
@pytest.mark.parametrize("kind", ["cell", "sequence"])
def test_float16_d_bias_is_the_float32_sum_rounded_once(xp, kind):
    """d_bias in float16 over many rows: the float32 sum of the float16 d_gates, rounded to
    float16 once. The rows are one row repeated 3001 times, so the exact sum is 3001 times the
    one-row d_bias (exact in float32: 11 by 12 significant bits); summing in float16 rounds at
    every partial sum and lands many ulps away (the 1e-2 tolerance of the table would not see
    it)."""
    rows = 3001
    case = make_case(1, 7, 9, np.float16, seed=23)
    many = {n: np.repeat(a, rows, axis=0) if a.ndim == 2 and n not in ("weights",) else a
            for n, a in case.items()}

    def d_bias(c):
        args = [xp.asarray(c[n]) for n in FORWARD_NAMES]
        grads = [xp.asarray(c[n]) for n in ("grad_h", "grad_cell")]
        if kind == "cell":
            *_, saved = lltm_cupy.forward(*args)
            return to_numpy(lltm_cupy.backward(*grads, saved).d_bias)
        *_, saved = lltm_cupy.forward_sequence(args[0][None], *args[1:])
        return to_numpy(lltm_cupy.backward_sequence(grads[0][None], None, grads[1],
                                                    saved).d_bias)

    one = d_bias(case)
    want = (one.astype(np.float32) * np.float32(rows)).astype(np.float16)
    got = d_bias(many)
    assert got.dtype == np.float16
    ulps = np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want)).astype(np.float64)
    assert ulps.max() <= 1, f"d_bias off by up to {ulps.max():.0f} float16 ulps of the " \
                            f"float32 sum rounded once"
