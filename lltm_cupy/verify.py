"""Gradient verification by finite differences: the library code behind scripts/grad_check.py.

Every element of every argument is perturbed in float64 and the central difference of the
scalar loss ``sum(new_h * grad_h) + sum(new_cell * grad_cell)`` is compared with
:func:`lltm_cupy.backward`.
"""
from __future__ import annotations

import numpy as np

import lltm_cupy

__all__ = ["FORWARD_NAMES", "GRAD_OF", "random_case", "numeric_gradients", "finite_difference_errors"]

FORWARD_NAMES = ("input", "weights", "bias", "old_h", "old_cell")
#: LLTMGrads field -> the forward argument it is the gradient of.
GRAD_OF = {"d_old_h": "old_h", "d_input": "input", "d_weights": "weights", "d_bias": "bias",
           "d_old_cell": "old_cell"}


def random_case(batch=3, features=4, state=5, seed=0):
    """Float64 NumPy arguments and incoming gradients of one step (weights ~ the tutorial's init)."""
    rng = np.random.default_rng(seed)
    bound = 1.0 / np.sqrt(state)
    return dict(
        input=rng.standard_normal((batch, features)),
        weights=rng.uniform(-bound, bound, (3 * state, state + features)),
        bias=rng.uniform(-bound, bound, 3 * state),
        old_h=rng.uniform(-1, 1, (batch, state)),
        old_cell=rng.standard_normal((batch, state)),
        grad_h=rng.standard_normal((batch, state)),
        grad_cell=rng.standard_normal((batch, state)),
    )


def numeric_gradients(args: dict, grad_h, grad_cell, eps=1e-6) -> dict:
    """Central differences of the loss w.r.t. every element of every forward argument.

    args: {name: float64 array} for the five forward arguments (NumPy or CuPy; perturbed in place
    one element at a time and restored). Returns {name: NumPy array of the argument's shape}.
    """
    def loss():
        new_h, new_cell, _ = lltm_cupy.forward(*(args[n] for n in FORWARD_NAMES))
        return float((new_h * grad_h).sum() + (new_cell * grad_cell).sum())

    out = {}
    for name in FORWARD_NAMES:
        arg = args[name]
        numeric = np.zeros(arg.shape)
        for idx in np.ndindex(*arg.shape):
            orig = float(arg[idx])
            arg[idx] = orig + eps
            up = loss()
            arg[idx] = orig - eps
            down = loss()
            arg[idx] = orig
            numeric[idx] = (up - down) / (2 * eps)
        out[name] = numeric
    return out


def finite_difference_errors(xp=np, case=None, eps=1e-6) -> dict:
    """{grad field: max |analytic - numeric| / max(1, max |numeric|)} for one float64 case.

    xp: numpy or cupy, the backend to verify. case: as from :func:`random_case` (the default).
    """
    case = random_case() if case is None else case
    args = {n: xp.array(case[n], dtype=np.float64) for n in FORWARD_NAMES}
    grad_h = xp.asarray(case["grad_h"], dtype=np.float64)
    grad_cell = xp.asarray(case["grad_cell"], dtype=np.float64)
    _, _, saved = lltm_cupy.forward(*(args[n] for n in FORWARD_NAMES))
    grads = lltm_cupy.backward(grad_h, grad_cell, saved)
    numeric = numeric_gradients(args, grad_h, grad_cell, eps)
    errors = {}
    for field, name in GRAD_OF.items():
        analytic = getattr(grads, field)
        analytic = analytic.get() if hasattr(analytic, "get") else np.asarray(analytic)
        ref = numeric[name]
        scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
        errors[field] = float(np.abs(analytic - ref).max()) / scale if ref.size else 0.0
    return errors


def _gpu_reason():
    try:
        import cupy
    except Exception as exc:
        return f"CuPy not importable ({exc.__class__.__name__})"
    try:
        return None if cupy.cuda.is_available() else "no GPU found by CuPy"
    except Exception as exc:
        return f"CuPy cannot query the GPU ({exc})"


def available_backends(skipped: list):
    """Yield (name, check(case, eps) -> errors) for each backend that can run here.

    Backends that cannot run are appended to ``skipped`` as (name, reason).
    """
    yield "numpy float64", lambda case, eps: finite_difference_errors(np, case, eps)
    reason = _gpu_reason()
    if reason:
        skipped.append(("cupy float64", reason))
    else:
        import cupy

        yield "cupy float64", lambda case, eps: finite_difference_errors(cupy, case, eps)


def format_table(rows, tol) -> str:
    """rows: [(backend, {field: error})] -> a text table with a pass/fail column."""
    fields = list(GRAD_OF)
    head = f"{'backend':<22}" + "".join(f"{f:>12}" for f in fields) + "  result"
    lines = [head, "-" * len(head)]
    for name, errs in rows:
        ok = all(errs[f] <= tol for f in fields)
        lines.append(f"{name:<22}" + "".join(f"{errs[f]:>12.2e}" for f in fields)
                     + ("  ok" if ok else "  FAIL"))
    return "\n".join(lines)
