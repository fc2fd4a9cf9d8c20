"""Variable-length sequences in the array API (forward_sequence(..., lengths, reverse)): every
output, h_n, c_n and gradient against the float64 reference stepped over each sequence alone
at its own length (reversed for reverse=True), on the NumPy backend and the emulated CuPy (the
CUDA path's indexing, GEMMs and kernels on row prefixes)."""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from conftest import TOLERANCE, max_error
from helpers.lengths_reference import NAMES, OUT, _case, _reference, _run

LENGTHS = {
    "unsorted with 0, 1, T and ties": [3, 0, 6, 1, 6, 3],
    "all full": [6] * 6,
    "all zero": [0] * 6,
    "one long, rest 1": [1, 1, 6, 1, 1, 1],
}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("array", ["numpy", "emulated"])
def test_lengths_match_each_sequence_alone(request, array, dtype, lengths, reverse):
    xp = np if array == "numpy" else request.getfixturevalue("emulated_cupy")
    case = _case(6, 6, 4, 5, dtype, seed=sum(lengths) + reverse, bias_2d=reverse)
    grads = (case["grad_outputs"], case["grad_h_n"], case["grad_c_n"])
    got = _run(xp, case, lengths, reverse, grads)
    want = _reference(case, lengths, reverse, grads)
    tol = TOLERANCE[np.dtype(dtype)]
    for name, g, w in zip(OUT, got, want):
        assert tuple(g.shape) == w.shape and g.dtype == dtype, name
        err = max_error(g, w)
        assert err <= tol, f"{name}: {err:.2e} > {tol:.0e}"
    padded = np.arange(6)[:, None] >= np.array(lengths)[None, :]
    assert not np.asarray(got[0])[padded].any(), "outputs past a sequence's length are zero"


@pytest.mark.parametrize("which", ["outputs only", "final state only", "none", "h_n and c_n"])
@pytest.mark.parametrize("array", ["numpy", "emulated"])
def test_lengths_with_missing_gradients(request, array, which):
    xp = np if array == "numpy" else request.getfixturevalue("emulated_cupy")
    case = _case(5, 4, 3, 4, np.float64, seed=2)
    full = (case["grad_outputs"], case["grad_h_n"], case["grad_c_n"])
    grads = {"outputs only": (full[0], None, None), "final state only": (None, full[1], None),
             "none": (None, None, None), "h_n and c_n": (None, full[1], full[2])}[which]
    lengths = [2, 5, 0, 3]
    got = _run(xp, case, lengths, False, grads)
    want = _reference(case, lengths, False, grads)
    for name, g, w in zip(OUT, got, want):
        assert max_error(g, w) <= 1e-11, name


def test_full_lengths_equal_the_fixed_length_path():
    case = _case(5, 3, 4, 6, np.float64, seed=4)
    grads = (case["grad_outputs"], case["grad_h_n"], case["grad_c_n"])
    fixed = _run(np, case, None, False, grads)
    packed = _run(np, case, np.full(3, 5), False, grads)
    for name, a, b in zip(OUT, fixed, packed):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13, err_msg=name)


def test_padded_positions_cost_nothing(emulated_cupy):
    """Device work of a ragged batch: per step one GEMM and one kernel on the rows still
    running (the kernel's element count is the prefix's)."""
    emu = emulated_cupy.emulator
    case = _case(6, 4, 3, 5, np.float32, seed=1)
    a = {k: emulated_cupy.asarray(v) for k, v in case.items()}
    emu.reset()
    lltm_cupy.forward_sequence(*(a[n] for n in NAMES), lengths=[6, 1, 3, 1])
    assert emu.log.count("kernel:fwd") == 6 and emu.log.count("gemm") == 1 + 6


@pytest.mark.parametrize("lengths,error,words", [
    ([1, 2], ValueError, "lengths must have shape (3,)"),
    ([1, 2, 7], ValueError, "lengths must lie in [0, 5]"),
    ([1, -1, 2], ValueError, "lengths must lie in [0, 5]"),
    ([1.5, 2, 3], TypeError, "lengths must hold integers"),
    ([True, False, True], TypeError, "lengths must hold integers"),
    ([True, 2, 3], TypeError, "lengths must hold integers, got a bool"),   # NumPy: [1, 2, 3]
    ((2, np.True_, 3), TypeError, "lengths must hold integers, got a bool"),
])
def test_bad_lengths(lengths, error, words):
    case = _case(5, 3, 4, 2, np.float32, seed=0)
    with pytest.raises(error) as info:
        lltm_cupy.forward_sequence(*(case[n] for n in NAMES), lengths=lengths)
    assert words in str(info.value)
