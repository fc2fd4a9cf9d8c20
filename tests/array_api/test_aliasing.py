"""No array the caller holds is one a later backward reads: modifying an output in place or
refilling an input buffer between a forward and its backward leaves the gradients unchanged,
on the NumPy backend and the emulated CuPy, for the one step, the sequence (fixed and variable
lengths) and the whole-model calls."""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from conftest import to_numpy

T, B, F, S = 5, 3, 4, 6


def _arrays(xp, seed=0):
    rng = np.random.default_rng(seed)
    a = dict(xs=rng.standard_normal((T, B, F)), W=rng.uniform(-0.5, 0.5, (3 * S, S + F)),
             b=rng.uniform(-0.5, 0.5, 3 * S), h=rng.uniform(-1, 1, (B, S)),
             c=rng.standard_normal((B, S)), g=rng.standard_normal((T, B, S)),
             gh=rng.standard_normal((B, S)))
    return {k: xp.asarray(v) for k, v in a.items()}


def _same(got, want):
    for name, g, w in zip(got._fields, got, want):
        np.testing.assert_array_equal(to_numpy(g), to_numpy(w), err_msg=name)


PATHS = {"fixed": {}, "lengths": {"lengths": [5, 2, 4]}, "reverse": {"reverse": True}}


@pytest.mark.parametrize("path", PATHS, ids=PATHS.keys())
@pytest.mark.parametrize("change", ["output modified", "input refilled"])
def test_sequence_backward_reads_no_caller_array(xp, change, path):
    a = _arrays(xp)
    kw = PATHS[path]
    *_, saved_ref = lltm_cupy.forward_sequence(a["xs"].copy(), a["W"], a["b"], a["h"], a["c"], **kw)
    want = lltm_cupy.backward_sequence(a["g"], a["gh"], None, saved_ref)
    xs = a["xs"].copy()
    outputs, h_n, c_n, saved = lltm_cupy.forward_sequence(xs, a["W"], a["b"], a["h"], a["c"], **kw)
    if change == "output modified":
        outputs[...] = 7.0          # e.g. np.tanh(outputs, out=outputs)
        h_n[...] = 7.0
        c_n[...] = 7.0
    else:
        xs[...] = 3.0               # a data loader refilling its buffer
    _same(lltm_cupy.backward_sequence(a["g"], a["gh"], None, saved), want)


def test_step_backward_reads_no_caller_array(xp):
    """On the GPU the one-step backward reads new_cell: the caller gets a copy."""
    a = _arrays(xp)
    args = (a["xs"][0].copy(), a["W"], a["b"], a["h"].copy(), a["c"].copy())
    *_, saved_ref = lltm_cupy.forward(*(x.copy() for x in args))
    want = lltm_cupy.backward(a["gh"], a["gh"], saved_ref)
    new_h, new_cell, saved = lltm_cupy.forward(*args)
    new_h[...] = 7.0
    new_cell[...] = 7.0
    for x in (args[0], args[3], args[4]):
        x[...] = 3.0
    _same(lltm_cupy.backward(a["gh"], a["gh"], saved), want)


def test_copy_cost_script_runs():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "scripts" / "copy_cost.py"), "--sizes",
                           "3x2x3x4", "--rounds", "2"], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "with them x" in proc.stdout and "a weights copy: forward x" in proc.stdout
