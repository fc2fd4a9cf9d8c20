"""Float64 central differences of the CPU backend against its own backward, every element."""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from conftest import GRAD_NAMES, make_case

NAMES = ("input", "weights", "bias", "old_h", "old_cell")
# grads field -> forward argument it belongs to
OF = dict(zip(GRAD_NAMES, ("old_h", "input", "weights", "bias", "old_cell")))


def loss(case, grad_h, grad_cell):
    new_h, new_cell, _ = lltm_cupy.forward(*(case[n] for n in NAMES))
    return float(np.sum(new_h * grad_h) + np.sum(new_cell * grad_cell))


@pytest.mark.parametrize("bias_2d", [False, True], ids=["bias_1d", "bias_2d"])
@pytest.mark.parametrize("zeros", [(), (1,)], ids=["random", "with_zero_preactivations"])
def test_backward_matches_central_differences(bias_2d, zeros):
    case = make_case(3, 4, 5, np.float64, seed=29, bias_2d=bias_2d, zeros_at=zeros)
    gh, gc = case.pop("grad_h"), case.pop("grad_cell")
    _, _, saved = lltm_cupy.forward(*(case[n] for n in NAMES))
    grads = lltm_cupy.backward(gh, gc, saved)
    eps = 1e-6
    # At z == 0 the ELU (alpha = 1) has a continuous first derivative (1 from both sides) but a
    # jump in the second, so a central difference there errs by O(eps) = ~1e-6 instead of
    # O(eps^2). The note's d_elu(0) = 0 would be off by ~1e-1 at the same elements.
    tol = 1e-5 if zeros else 1e-7
    for field in GRAD_NAMES:
        arg = case[OF[field]]
        numeric = np.zeros_like(arg)
        for idx in np.ndindex(arg.shape):
            orig = arg[idx]
            arg[idx] = orig + eps
            up = loss(case, gh, gc)
            arg[idx] = orig - eps
            down = loss(case, gh, gc)
            arg[idx] = orig
            numeric[idx] = (up - down) / (2 * eps)
        got = getattr(grads, field)
        err = np.max(np.abs(got - numeric)) if arg.size else 0.0
        assert err < tol, f"{field}: max |analytic - numeric| = {err:.2e}"
