"""Float64 central differences of each backend against its own backward, every element."""
from __future__ import annotations

import numpy as np
import pytest

from lltm_cupy import verify
from conftest import make_case


@pytest.mark.parametrize("bias_2d", [False, True], ids=["bias_1d", "bias_2d"])
@pytest.mark.parametrize("zeros", [(), (1,)], ids=["random", "with_zero_preactivations"])
def test_backward_matches_central_differences(xp, bias_2d, zeros):
    case = make_case(3, 4, 5, np.float64, seed=29, bias_2d=bias_2d, zeros_at=zeros)
    errors = verify.finite_difference_errors(xp, case, eps=1e-6)
    # At z == 0 the ELU (alpha = 1) has a continuous first derivative (1 from both sides) but a
    # jump in the second, so a central difference there errs by O(eps) = ~1e-6 instead of
    # O(eps^2). The note's d_elu(0) = 0 would be off by ~1e-1 at the same elements.
    tol = 1e-5 if zeros else 1e-7
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"finite-difference errors above {tol:.0e}: {bad}"
    assert set(errors) == set(verify.GRAD_OF)


def test_finite_differences_catch_a_wrong_gradient(monkeypatch):
    """The check itself can fail: a backward with a wrong d_bias is reported."""
    import lltm_cupy

    real = lltm_cupy.backward

    def wrong(*a):
        g = real(*a)
        return g._replace(d_bias=g.d_bias * 1.01)

    monkeypatch.setattr(lltm_cupy, "backward", wrong)
    errors = verify.finite_difference_errors(np, verify.random_case(seed=1))
    assert errors["d_bias"] > 1e-4 and errors["d_weights"] < 1e-7
