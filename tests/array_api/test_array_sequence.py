"""forward_sequence / backward_sequence equal stepping the cell, forward and every gradient."""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from lltm_cupy import verify
from conftest import TOLERANCE, dtypes_for, max_error, to_numpy
from helpers.lengths_reference import NAMES as SEQ_NAMES, _case as make_sequence

def stepped(xp, case, grad_outputs, grad_h_n, grad_c_n):
    """The sequence by stepping lltm_cupy.forward / backward from Python, in the same dtype."""
    a = {k: xp.asarray(v) for k, v in case.items()}
    steps = a["inputs"].shape[0]
    h, c, saves, outs = a["h0"], a["c0"], [], []
    for t in range(steps):
        h, c, s = lltm_cupy.forward(a["inputs"][t], a["weights"], a["bias"], h, c)
        outs.append(h)
        saves.append(s)
    dh = None if grad_h_n is None else xp.asarray(grad_h_n)
    dc = None if grad_c_n is None else xp.asarray(grad_c_n)
    d_w = xp.zeros_like(a["weights"])
    d_b = xp.zeros_like(a["bias"])
    d_x = xp.zeros_like(a["inputs"])
    for t in range(steps - 1, -1, -1):
        gh = dh
        if grad_outputs is not None:
            gh = xp.asarray(grad_outputs[t]) if gh is None else gh + xp.asarray(grad_outputs[t])
        g = lltm_cupy.backward(gh, dc, saves[t])
        dh, dc = g.d_old_h, g.d_old_cell
        d_w += g.d_weights
        d_b += g.d_bias
        d_x[t] = g.d_input
    if steps == 0:
        dh = xp.zeros_like(a["h0"]) if dh is None else dh
        dc = xp.zeros_like(a["c0"]) if dc is None else dc
    return outs, h, c, (d_x, d_w, d_b, dh, dc)


def check(got, want, dtype, name):
    assert tuple(got.shape) == tuple(want.shape), f"{name}: {got.shape} != {want.shape}"
    assert got.dtype == dtype, name
    err = max_error(to_numpy(got), to_numpy(want).astype(np.float64))
    # Stepping and the sequence round the same values in different orders (one GEMM vs per-step
    # GEMMs, a sum over T*B vs T sums over B). Largest seen over these cases (NumPy and emulated
    # CuPy): 4.5e-16 (float64), 1.7e-7 (float32), 1.5e-3 (float16), inside the per-dtype table.
    tol = TOLERANCE[np.dtype(dtype)]
    assert err <= tol, f"{name}: max normalised error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("steps", [0, 1, 7])
@pytest.mark.parametrize("missing", ["none", "outputs", "final"])
def test_sequence_equals_stepped_cell(xp, steps, missing):
    compare_with_stepped(xp, steps, 3, missing)


def test_many_rows_equals_stepped_cell(xp):
    """5 steps x 30 rows: the sequence's input projection has 150 rows, past the NumPy backend's
    switch of GEMM orientation at 128 (see _numpy.step._project), while each stepped cell has 30."""
    compare_with_stepped(xp, 5, 30, "none")


def compare_with_stepped(xp, steps, batch, missing):
    for dtype in dtypes_for(xp):
        case = make_sequence(steps, batch, 17, 5, dtype, seed=steps, bias_2d=(steps == 1))
        go = None if missing == "outputs" else case["grad_outputs"]
        ghn = None if missing == "final" else case["grad_h_n"]
        gcn = None if missing == "final" else case["grad_c_n"]
        args = [xp.asarray(case[n]) for n in SEQ_NAMES]
        outputs, h_n, c_n, saved = lltm_cupy.forward_sequence(*args)
        grads = lltm_cupy.backward_sequence(*(None if g is None else xp.asarray(g)
                                              for g in (go, ghn, gcn)), saved)
        outs, h, c, want = stepped(xp, {n: case[n] for n in SEQ_NAMES}, go, ghn, gcn)
        assert outputs.shape == (steps, batch, 5)
        for t in range(steps):
            check(outputs[t], outs[t], dtype, f"outputs[{t}]")
        check(h_n, h if steps else args[3], dtype, "h_n")
        check(c_n, c if steps else args[4], dtype, "c_n")
        assert isinstance(grads, lltm_cupy.LLTMSequenceGrads)
        for name, g, w in zip(grads._fields, grads, want):
            check(g, w, dtype, name)


def test_sequence_does_not_modify_inputs(xp):
    case = make_sequence(4, 2, 3, 5, np.float64, seed=3)
    args = {n: xp.asarray(v) for n, v in case.items()}
    before = {n: to_numpy(v).copy() for n, v in args.items()}
    *_, saved = lltm_cupy.forward_sequence(*(args[n] for n in SEQ_NAMES))
    lltm_cupy.backward_sequence(args["grad_outputs"], args["grad_h_n"], args["grad_c_n"], saved)
    lltm_cupy.backward_sequence(args["grad_outputs"], args["grad_h_n"], args["grad_c_n"], saved)
    for n, v in args.items():
        np.testing.assert_array_equal(to_numpy(v), before[n], err_msg=n)
    assert "LLTMSequenceSaved" in repr(saved)
    # per step: 4 * B * S values (GPU) or 5 * B * S (CPU), plus the hidden states (T + 1) * B * S
    per_element = 5 if xp is np else 4
    assert saved.nbytes == (per_element * 4 * 2 * 5 + 5 * 2 * 5) * 8


def test_sequence_finite_differences():
    case = make_sequence(3, 2, 3, 4, np.float64, seed=5)
    args = {n: case[n].copy() for n in SEQ_NAMES}
    go, ghn, gcn = case["grad_outputs"], case["grad_h_n"], case["grad_c_n"]

    def loss():
        outputs, h_n, c_n, _ = lltm_cupy.forward_sequence(*(args[n] for n in SEQ_NAMES))
        return float((outputs * go).sum() + (h_n * ghn).sum() + (c_n * gcn).sum())

    *_, saved = lltm_cupy.forward_sequence(*(args[n] for n in SEQ_NAMES))
    grads = lltm_cupy.backward_sequence(go, ghn, gcn, saved)
    numeric = verify.numeric_gradients(loss, args, eps=1e-6)
    for name, g in zip(SEQ_NAMES, grads):
        err = np.abs(g - numeric[name]).max()
        assert err < 1e-7, f"d_{name}: max |analytic - numeric| = {err:.2e}"


@pytest.mark.parametrize("reverse", [False, True])
def test_empty_batch(reverse):
    """A batch of no sequences (B = 0) runs forward, forward only and backward: the outputs
    (T, 0, S) and zero weight gradients (the loops' per-step views of zero rows)."""
    case = make_sequence(3, 0, 4, 5, np.float32)
    args = [case[n] for n in SEQ_NAMES]
    only = lltm_cupy.forward_sequence(*args, reverse=reverse, return_saved=False)
    outputs, h_n, c_n, saved = lltm_cupy.forward_sequence(*args, reverse=reverse)
    assert outputs.shape == only[0].shape == (3, 0, 5) and h_n.shape == c_n.shape == (0, 5)
    grads = lltm_cupy.backward_sequence(np.ones_like(outputs), None, None, saved)
    assert grads.d_inputs.shape == (3, 0, 4) and grads.d_h0.shape == (0, 5)
    assert not grads.d_weights.any() and not grads.d_bias.any()


def test_sequence_errors():
    case = make_sequence(2, 3, 4, 5, np.float32)
    args = [case[n] for n in SEQ_NAMES]
    with pytest.raises(ValueError, match=r"inputs must be 3-D \(steps, batch, features\)"):
        lltm_cupy.forward_sequence(args[0][0], *args[1:])
    with pytest.raises(ValueError, match=r"h0 must have shape \(3, 5\)"):
        lltm_cupy.forward_sequence(args[0], args[1], args[2], args[3][:2], args[4])
    with pytest.raises(ValueError, match=r"weights must have shape \(15, 9\)"):
        lltm_cupy.forward_sequence(args[0], args[1][:, :8], *args[2:])
    with pytest.raises(TypeError, match="same dtype"):
        lltm_cupy.forward_sequence(args[0].astype(np.float64), *args[1:])
    *_, saved = lltm_cupy.forward_sequence(*args)
    with pytest.raises(ValueError, match=r"grad_outputs must have shape \(2, 3, 5\)"):
        lltm_cupy.backward_sequence(case["grad_outputs"][:1], None, None, saved)
    with pytest.raises(TypeError, match="LLTMSequenceSaved"):
        lltm_cupy.backward_sequence(None, None, None, object())


def test_sequence_needed_skips_fields(xp):
    case = make_sequence(3, 2, 3, 4, np.float64, seed=9)
    *_, saved = lltm_cupy.forward_sequence(*(xp.asarray(case[n]) for n in SEQ_NAMES))
    grads_in = [xp.asarray(case[n]) for n in ("grad_outputs", "grad_h_n", "grad_c_n")]
    full = lltm_cupy.backward_sequence(*grads_in, saved)
    for i in range(5):
        needed = [True] * 5
        needed[i] = False
        got = lltm_cupy.backward_sequence(*grads_in, saved, needed=needed)
        for j, (name, a, b) in enumerate(zip(got._fields, got, full)):
            if j == i:
                assert a is None, name
            else:
                np.testing.assert_array_equal(to_numpy(a), to_numpy(b), err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("group", [3, 5, 8])
def test_factor_groups_change_no_bit(monkeypatch, dtype, group):
    """The NumPy training forward computes the backward's factors for a group of steps in one
    call each (as many steps as fit ``_numpy.memory._GROUP_BYTES``, cut at the input projection's
    blocks: here blocks of 8 steps, T = 23, so groups of 3 and 5 straddle nothing and end
    short at every block's end). The grouping changes no bit of the outputs, the saved factors
    or any gradient against computing them step by step (groups of one). (A workspace reads
    the group size when made: ``memory.forget`` before each run.)"""
    from lltm_cupy import _numpy

    steps, batch, features, state = 23, 2, 3, 5
    case = make_sequence(steps, batch, features, state, dtype, seed=4)
    monkeypatch.setattr(_numpy.sequence, "_BLOCK_ROWS", 8 * batch)
    per_step = _numpy.memory._GROUP_ROWS * batch * state * np.dtype(dtype).itemsize

    def run(steps_per_group):
        monkeypatch.setattr(_numpy.memory, "_GROUP_BYTES", steps_per_group * per_step)
        _numpy.memory.forget()
        out, h_n, c_n, saved = lltm_cupy.forward_sequence(*(case[n] for n in SEQ_NAMES))
        space = _numpy.memory.workspace(batch, state, np.dtype(dtype))
        assert space.group == steps_per_group, (space.group, steps_per_group)
        grads = lltm_cupy.backward_sequence(case["grad_outputs"], case["grad_h_n"],
                                            case["grad_c_n"], saved)
        return (out, h_n, c_n, saved.gates, saved.cells) + tuple(grads)

    names = ("outputs", "h_n", "c_n", "factors", "cells", "d_inputs", "d_weights", "d_bias",
             "d_h0", "d_c0")
    for name, a, b in zip(names, run(1), run(group)):
        assert np.array_equal(a, b), f"{name} differs with groups of {group} steps"
    _numpy.memory.forget()
