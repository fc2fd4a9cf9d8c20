"""Verification: the library code behind scripts/grad_check.py and scripts/check.py.

- Finite differences: every element of every argument is perturbed in float64 and the central
  difference of the scalar loss ``sum(new_h * grad_h) + sum(new_cell * grad_cell)`` is compared
  with :func:`lltm_cupy.backward` (NumPy and CuPy backends), plus ``torch.autograd.gradcheck`` of
  :func:`lltm_cupy.torch.lltm` on every available device.
- Cross-backend comparison: forward and all five gradients of every backend (NumPy, CuPy, torch
  CPU, torch CUDA) and dtype against the pure-torch reference LLTM in float64.
"""
from __future__ import annotations

import warnings

import numpy as np

import lltm_cupy

__all__ = ["FORWARD_NAMES", "GRAD_OF", "TOLERANCE", "normalised_error", "random_case",
           "numeric_gradients", "finite_difference_errors", "format_table", "torch_gradchecks",
           "report_gradients", "compare_backends", "elementwise_accuracy",
           "gpu_unavailable_reason", "to_numpy"]

FORWARD_NAMES = ("input", "weights", "bias", "old_h", "old_cell")
#: LLTMGrads field -> the forward argument it is the gradient of.
GRAD_OF = {"d_old_h": "old_h", "d_input": "input", "d_weights": "weights", "d_bias": "bias",
           "d_old_cell": "old_cell"}
#: Max normalised error (see :func:`normalised_error`) against a float64 reference, per dtype:
#: a few ulp through GEMMs of up to a few hundred terms; float16 also rounds inputs, gate
#: pre-activations and outputs to 11 bits. A wrong formula gives errors of 1e-1 and above.
TOLERANCE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2}


def to_numpy(a):
    """A NumPy array of a NumPy, CuPy or torch array (torch tensors as float64)."""
    if hasattr(a, "detach"):  # torch
        return a.detach().cpu().double().numpy()
    return a.get() if hasattr(a, "get") else np.asarray(a)


def normalised_error(actual, expected) -> float:
    """max |actual - expected| / max(1, max |expected|), in float64; 0 for empty arrays."""
    actual = to_numpy(actual).astype(np.float64)
    expected = to_numpy(expected).astype(np.float64)
    if expected.size == 0:
        return 0.0
    scale = max(1.0, float(np.max(np.abs(expected))))
    return float(np.max(np.abs(actual - expected))) / scale


def random_case(batch=3, features=4, state=5, seed=0):
    """Float64 NumPy arguments and incoming gradients of one step (weights as the tutorial's
    init)."""
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


def numeric_gradients(loss, args: dict, eps=1e-6) -> dict:
    """Central differences of ``loss()`` w.r.t. every element of every array in ``args``.

    args: {name: float64 array} (NumPy or CuPy), perturbed in place one element at a time and
    restored; ``loss`` reads them. Returns {name: NumPy array of the argument's shape}.
    """
    out = {}
    for name, arg in args.items():
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
    grad_h, grad_cell = (xp.asarray(case[g], dtype=np.float64) for g in ("grad_h", "grad_cell"))
    _, _, saved = lltm_cupy.forward(*(args[n] for n in FORWARD_NAMES))
    grads = lltm_cupy.backward(grad_h, grad_cell, saved)

    def loss():
        new_h, new_cell, _ = lltm_cupy.forward(*(args[n] for n in FORWARD_NAMES))
        return float((new_h * grad_h).sum() + (new_cell * grad_cell).sum())

    numeric = numeric_gradients(loss, args, eps)
    return {field: normalised_error(getattr(grads, field), numeric[name])
            for field, name in GRAD_OF.items()}


def gpu_unavailable_reason():
    """None when CuPy arrays can run here, else why not (also the GPU tests' skip reason)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return f"CuPy is not importable ({exc.__class__.__name__}: {exc})"
    try:
        return None if cupy.cuda.is_available() else "CuPy finds no GPU on this machine"
    except Exception as exc:
        return f"CuPy cannot query the GPU ({exc})"


def _array_backends(skipped: list) -> list:
    """(label, xp, dtypes) of each array backend that can run here: NumPy, and CuPy (float16
    too) where a GPU is; one that cannot is appended to ``skipped`` as (label, reason)."""
    backends = [("numpy", np, (np.float32, np.float64))]
    reason = gpu_unavailable_reason()
    if reason:
        skipped.append(("cupy", reason))
    else:
        import cupy

        backends.append(("cupy", cupy, (np.float16, np.float32, np.float64)))
    return backends


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


def _torch_devices(skipped: list):
    """Devices torch can run lltm_cupy on here: cpu, and cuda when torch and CuPy see a GPU."""
    import torch

    devices = ["cpu"]
    reason = None if torch.cuda.is_available() else "torch finds no CUDA device"
    reason = reason or gpu_unavailable_reason()
    if reason:
        skipped.append(("torch cuda", reason))
    else:
        devices.append("cuda")
    return devices


def torch_gradchecks(case=None, skipped=None, fn=None):
    """torch.autograd.gradcheck of ``fn`` (default lltm_cupy.torch.lltm) per available device,
    in float64 at gradcheck's tolerances and in float32 at eps=1e-3, atol=rtol=1e-2 (what
    finite differences in single precision are good to; gradcheck's warning against float32
    at its float64 defaults is silenced, and the message names the tolerances). float16 is left
    to :func:`compare_backends`. Returns [(label, passed, message)]."""
    import torch
    # torch.autograd.gradcheck is the function; its module holds the exception.
    from torch.autograd.gradcheck import GradcheckError

    from . import torch as lt

    fn = lt.lltm if fn is None else fn
    case = random_case() if case is None else case
    skipped = [] if skipped is None else skipped
    results = []
    for device in _torch_devices(skipped):
        for dtype, opts in ((torch.float64, {}),
                            (torch.float32, dict(eps=1e-3, atol=1e-2, rtol=1e-2))):
            args = [torch.tensor(case[n], dtype=dtype, device=device, requires_grad=True)
                    for n in FORWARD_NAMES]
            label = f"torch {device} {str(dtype).replace('torch.', '')}"
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*not a double precision",
                                            category=UserWarning)
                    ok = torch.autograd.gradcheck(fn, args, **opts)
                results.append((label, bool(ok), "gradcheck passed" + (
                    f" (eps={opts['eps']:g}, atol=rtol={opts['atol']:g})" if opts else "")))
            except GradcheckError as exc:
                results.append((label, False, str(exc).splitlines()[0]))
    return results


def report_gradients(case, eps, tol, with_torch=True, out=print) -> list:
    """The gradient check of ``scripts/grad_check.py`` and ``python -m lltm_cupy``: finite
    differences of every available array backend (a table), then, with torch installed and
    ``with_torch``, :func:`torch_gradchecks`; what could not run is printed with the reason.
    Returns the labels of the checks that failed; None if no array backend could run."""
    skipped = []
    rows = [(f"{label} float64", finite_difference_errors(xp, case, eps))
            for label, xp, _ in _array_backends(skipped)]
    for name, why in skipped:
        out(f"skipped {name}: {why}")
    if not rows:
        out("no backend could run")
        return None
    out(format_table(rows, tol))
    failed = [n for n, errs in rows if any(not e <= tol for e in errs.values())]
    if not with_torch:
        out("torch gradcheck: not run (--no-torch)")
        return failed
    try:
        import torch  # noqa: F401
    except ImportError:
        out("torch gradcheck: skipped, torch is not installed")
        return failed
    torch_skipped = []
    for label, ok, message in torch_gradchecks(case, torch_skipped):
        out(f"{label:<22}{message}  {'ok' if ok else 'FAIL'}")
        if not ok:
            failed.append(label)
    for name, why in torch_skipped:
        out(f"skipped {name}: {why}")
    return failed


def _torch_reference(case):
    """Forward + gradients of the pure-torch reference in float64 on the CPU."""
    from . import torch as lt

    out = _run_torch(lt.lltm_reference, "cpu", case, np.float64)
    return {k: to_numpy(v) for k, v in out.items()}


def _run_arrays(xp, case, dtype):
    args = [xp.asarray(case[n], dtype=dtype) for n in FORWARD_NAMES]
    new_h, new_cell, saved = lltm_cupy.forward(*args)
    grads = lltm_cupy.backward(xp.asarray(case["grad_h"], dtype=dtype),
                               xp.asarray(case["grad_cell"], dtype=dtype), saved)
    return {"new_h": new_h, "new_cell": new_cell, **grads._asdict()}


def _run_torch(fn, device, case, dtype):
    """Outputs and the five gradients of ``fn`` (lltm or the reference) on torch tensors."""
    import torch

    tdtype = getattr(torch, np.dtype(dtype).name)
    args = [torch.tensor(case[n], dtype=tdtype, device=device, requires_grad=True)
            for n in FORWARD_NAMES]
    h, c = fn(*args)
    torch.autograd.backward((h, c), tuple(torch.tensor(case[g], dtype=tdtype, device=device)
                                          for g in ("grad_h", "grad_cell")))
    out = {"new_h": h, "new_cell": c}
    out.update({field: args[FORWARD_NAMES.index(name)].grad for field, name in GRAD_OF.items()})
    return out


def _max_relative_error(got, ref) -> float:
    """max |got - ref| / |ref| over the elements where ref != 0 (0 if there are none)."""
    got, ref = to_numpy(got).astype(np.float64), np.asarray(ref, np.float64)
    mask = ref != 0
    return float((np.abs(got - ref)[mask] / np.abs(ref[mask])).max()) if mask.any() else 0.0


def _elementwise_ulps(xp, case, dtype) -> dict:
    """Largest error in ulps (lltm_cupy.exact) of the element-wise outputs the array API returns
    (new_h, new_cell, d_old_cell), from the backend's own rounded pre-activations."""
    from . import _numpy, exact

    args = [xp.asarray(case[n], dtype=dtype) for n in FORWARD_NAMES]
    new_h, new_cell, saved = lltm_cupy.forward(*args)
    gh, gc = (xp.asarray(case[g], dtype=dtype) for g in ("grad_h", "grad_cell"))
    d_old_cell = lltm_cupy.backward(gh, gc, saved, needed=(False,) * 4 + (True,)).d_old_cell
    batch, state = new_cell.shape
    if xp is np:  # the NumPy backend saves products, not z: its projection again, bit for bit
        X = np.concatenate((args[3], args[0]), axis=1)
        z = _numpy.step._project(X, args[1], args[2], np.matmul, 1, batch)[0]
    else:
        z = to_numpy(saved.gates).reshape(batch, 3, state).transpose(1, 0, 2)
    flat = {"z_i": z[0], "z_o": z[1], "z_c": z[2], "old_cell": args[4], "grad_h": gh,
            "grad_cell": gc}
    flat = {k: to_numpy(v).reshape(-1) for k, v in flat.items()}
    out = {"new_h": new_h, "new_cell": new_cell, "d_old_cell": d_old_cell}
    out = {k: to_numpy(v).reshape(-1) for k, v in out.items()}
    worst = exact.max_errors(flat, out, dtype, names=tuple(out))
    return {k: worst[k][0] for k in out}


def elementwise_accuracy(case=None, skipped=None):
    """Every array backend and dtype against the exact reference, and against the torch one.

    Returns [(label, dtype, {new_h, new_cell, d_old_cell: ulps, "max_rel_vs_torch": x}, ok)],
    ok when the ulps are within lltm_cupy.exact.ULP_BOUND. The relative error is the largest
    |ours - reference| / |reference| over all seven outputs, the GEMM outputs included (where a
    sum cancels it measures the float32 GEMM, not a bug).
    """
    from . import exact

    case = random_case(16, 32, 128) if case is None else case
    rows = []
    for label, xp, dtypes in _array_backends([] if skipped is None else skipped):
        for dtype in dtypes:
            rounded = {k: np.asarray(v, dtype=dtype).astype(np.float64) for k, v in case.items()}
            ulps = _elementwise_ulps(xp, rounded, dtype)
            ref = _torch_reference(rounded)
            got = _run_arrays(xp, rounded, dtype)
            rel = max(_max_relative_error(got[k], ref[k]) for k in ref)
            bound = exact.ULP_BOUND[np.dtype(dtype)]
            ok = all(ulps[k] <= bound[k] for k in ulps)
            rows.append((label, np.dtype(dtype).name, {**ulps, "max_rel_vs_torch": rel}, ok))
    return rows


def compare_backends(case=None, skipped=None):
    """Every backend and dtype against the torch reference (float64, CPU).

    The case's values are first rounded to each dtype, and the reference is computed from those
    rounded values, so the comparison measures the computation, not the input rounding.
    Returns [(label, dtype, {output: normalised error}, ok)].
    """
    from . import torch as lt

    case = random_case(16, 32, 128) if case is None else case
    skipped = [] if skipped is None else skipped
    runners = [(label, lambda c, d, xp=xp: _run_arrays(xp, c, d), dtypes)
               for label, xp, dtypes in _array_backends(skipped)]

    for device in _torch_devices(skipped):
        dts = (np.float32, np.float64) + ((np.float16,) if device == "cuda" else ())
        runners.append((f"torch {device}",
                        lambda c, d, dev=device: _run_torch(lt.lltm, dev, c, d), dts))
    rows = []
    for label, run, dtypes in runners:
        for dtype in dtypes:
            rounded = {k: np.asarray(v, dtype=dtype).astype(np.float64) for k, v in case.items()}
            ref = _torch_reference(rounded)
            got = run(rounded, dtype)
            errors = {k: normalised_error(got[k], ref[k]) for k in ref}
            tol = TOLERANCE[np.dtype(dtype)]
            rows.append((label, np.dtype(dtype).name, errors,
                         all(e <= tol for e in errors.values())))
    return rows
