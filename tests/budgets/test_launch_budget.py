"""The device work of one step, counted on the emulated CuPy (tests/helpers/emulated_cupy.py logs
every kernel launch, GEMM, copy, fill, element-wise op and reduction, and every allocation).

The budget a reviewer can read (see lltm_cupy/_cuda/step.py and sequence.py): forward = one
concatenation kernel, one GEMM, the fused kernel; backward = the fused kernel, the three GEMMs and one reduction; a
sequence = one input-projection GEMM, then per step one GEMM plus one kernel each way. No copy
of an argument that is already contiguous, no allocation beyond the results and the values
saved for backward, except the copies that keep the caller's arrays out of the backward
(lltm_cupy/_aliasing.py): new_cell of a step, and a sequence's outputs and contiguous inputs.
"""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from conftest import make_case
from helpers.launch_counts import BACKWARD, FORWARD

NAMES = ("input", "weights", "bias", "old_h", "old_cell")


def _arrays(cupy, case, names):
    return [cupy.asarray(case[n]) for n in names]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cell_step_budget(emulated_cupy, dtype):
    emu = emulated_cupy.emulator
    case = make_case(16, 32, 128, dtype)
    args = _arrays(emulated_cupy, case, NAMES)
    gh, gc = _arrays(emulated_cupy, case, ("grad_h", "grad_cell"))
    emu.reset()
    new_h, new_cell, saved = lltm_cupy.forward(*args)
    assert emu.log == FORWARD
    # new_h, new_cell (and the caller's copy), and for backward X (B, S+F) and the gates
    # (B, 3S): nothing else
    B, F, S = 16, 32, 128
    item = np.dtype(dtype).itemsize
    expected = (B * (S + F), B * 3 * S, B * S, B * S, B * S)
    assert sorted(emu.allocations) == sorted(n * item for n in expected)
    emu.reset()
    lltm_cupy.backward(gh, gc, saved)
    assert emu.log == BACKWARD
    # d_gates, the five gradients
    assert len(emu.allocations) == 6
    emu.reset()
    lltm_cupy.backward(gh, None, saved, needed=(False, False, True, True, False))
    assert emu.log == ["kernel:bwd", "gemm", "reduce"]


def test_float16_bias_gradient_is_one_reduction_and_one_cast(emulated_cupy):
    emu = emulated_cupy.emulator
    case = make_case(4, 3, 5, np.float16)
    new_h, new_cell, saved = lltm_cupy.forward(*_arrays(emulated_cupy, case, NAMES))
    gh = emulated_cupy.asarray(case["grad_h"])
    emu.reset()
    lltm_cupy.backward(gh, None, saved,
                       needed=(False, False, False, True, False))
    assert emu.log == ["kernel:bwd", "reduce", "copy"]   # summed in float32, rounded once


def test_non_contiguous_arguments_are_copied_once_each(emulated_cupy):
    emu = emulated_cupy.emulator
    case = make_case(6, 5, 7, np.float64)
    args = _arrays(emulated_cupy, case, NAMES)
    wide = emulated_cupy.zeros((6, 14))
    wide[:, ::2] = args[4]
    args[4] = wide[:, ::2]                      # a strided old_cell
    args[1] = emulated_cupy.asfortranarray(args[1])   # Fortran-ordered weights: no copy needed
    emu.reset()
    lltm_cupy.forward(*args)
    assert emu.log == ["kernel:concat", "gemm", "copy", "kernel:fwd", "copy"]   # + new_cell


SEQ_FORWARD = ["copy", "gemm"]  # h0 into the hidden-state buffer; input projection


@pytest.mark.parametrize("steps", [1, 5])
def test_sequence_budget(emulated_cupy, steps):
    emu = emulated_cupy.emulator
    rng = np.random.default_rng(3)
    B, F, S = 4, 3, 6
    xs = emulated_cupy.asarray(rng.standard_normal((steps, B, F)))
    w = emulated_cupy.asarray(rng.standard_normal((3 * S, S + F)) / 3)
    b = emulated_cupy.asarray(rng.standard_normal(3 * S))
    h0, c0 = (emulated_cupy.asarray(rng.standard_normal((B, S))) for _ in range(2))
    emu.reset()
    outputs, h_n, c_n, saved = lltm_cupy.forward_sequence(xs, w, b, h0, c0)
    per_step = ["gemm", "kernel:fwd"]
    # h_n, c_n; then the caller's own outputs and the saved inputs (xs is contiguous)
    assert emu.log == SEQ_FORWARD + per_step * steps + ["copy"] * 4
    emu.reset()     # forward only: the same device work, and nothing to copy for a backward
    lltm_cupy.forward_sequence(xs, w, b, h0, c0, return_saved=False)
    assert emu.log == SEQ_FORWARD + per_step * steps + ["copy", "copy"]   # h_n, c_n
    g = emulated_cupy.asarray(rng.standard_normal((steps, B, S)))
    emu.reset()
    lltm_cupy.backward_sequence(g, None, None, saved)
    loop = ["kernel:bwd", "gemm"] * (steps - 1) + ["kernel:bwd"]
    # grad_outputs copied once (it is accumulated into); the loop; d_h0, d_c0; then the
    # weight gradient (two GEMMs, one per half), the bias reduction and the input GEMM
    assert emu.log == ["copy"] + loop + ["gemm", "copy", "gemm", "gemm", "reduce", "gemm"]
