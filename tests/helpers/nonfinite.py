"""The float64 reference's element-wise values at any input, infinities and NaN included, and
a comparison that a reviewer can check by hand.

For each output of one element (new_h, new_cell, d_old_cell and the three gate gradients) the
backend's value must be:

- NaN exactly where the reference's is NaN, the same infinity where the reference's is
  infinite;
- where the reference's value is finite, within an error bound from the magnitude of its terms
  (as lltm_cupy.exact measures it: ``slack`` subnormal spacings plus ``TOL_ULPS`` ulps of the
  terms, i.e. far looser than tests/array_api/test_accuracy.py, which holds the finite inputs to a
  few ulps; this file is about where the values go at infinities and at the ends of the range). A
  value beyond the dtype's largest finite number may round to the infinity of its sign, and a
  value within that bound of it may too;
- the gate gradients are judged on d_new_cell as the compute type holds it: where it
  overflows there (d_old_cell itself overflows), they are the reference's products with
  +-inf; within the error bound of that overflow threshold they are not judged;
- "either": an infinite factor times a finite product too small for the compute type
  (below its smallest normal number, or within its error bound of zero) is inf in exact
  arithmetic but may be ``inf * 0 = NaN`` in the dtype, where that product underflows or
  cancels to 0 (e.g. an input gate's sigmoid'(-110) = 2e-48 in float64 is 0 in float32). There
  any non-finite value is accepted, but no finite one.

Outputs computed from new_cell use the backend's own rounded new_cell (as the backends read it
back), so that each output is judged on its own inputs.
"""
from __future__ import annotations

import numpy as np

from lltm_cupy import reference

OUTPUTS = ("new_h", "new_cell", "d_old_cell", "d_input_gate", "d_output_gate", "d_candidate")
INPUTS = ("z_i", "z_o", "z_c", "old_cell", "grad_h", "grad_cell")
TOL_ULPS = 16
_QUIET = dict(all="ignore")


def _prod(*factors):
    out = np.ones_like(factors[0])
    for f in factors:
        out = out * f
    return out


def _slack(*factors):
    """Subnormal slack of a product (lltm_cupy.exact._slack3): each factor and each partial
    product of two may be subnormal once."""
    a = [np.abs(f) for f in factors]
    if len(a) == 2:
        return a[0] + a[1] + 1
    return a[1] * a[2] + a[0] * a[2] + a[0] * a[1] + a[0] + a[1] + a[2]


def _either(terms, exact, tiny, err=None):
    """An infinite factor times a finite rest that the compute type may round to zero:
    ``terms`` are the factors, ``exact`` for each whether its zero is exact (from an exact
    input, e.g. sigmoid(-inf) = 0); ``err`` optionally, per factor, its error bound."""
    inf = np.zeros(terms[0].shape, bool)
    rest = np.ones(terms[0].shape)
    exact_zero = np.zeros(terms[0].shape, bool)
    uncertain = np.zeros(terms[0].shape, bool)
    for k, (f, ex) in enumerate(zip(terms, exact)):
        inf |= np.isinf(f)
        rest = rest * np.where(np.isinf(f), 1.0, np.abs(f))
        exact_zero |= (f == 0) & ex
        if err is not None and err[k] is not None:
            uncertain |= np.abs(f) <= err[k]
    return inf & ~exact_zero & ((rest < tiny) | uncertain)


def reference_values(x: dict, new_cell, compute_dtype, out_dtype) -> dict:
    """{output: (value, tolerance, either)} in float64 for flat float64 inputs ``x`` (INPUTS,
    as the backend stored them) and the backend's new_cell (float64)."""
    eps_c = float(finfo(compute_dtype).eps)
    tiny = float(finfo(compute_dtype).tiny)
    sub_c = float(finfo(compute_dtype).smallest_subnormal)
    eps_o = float(finfo(out_dtype).eps)
    sub_o = float(finfo(out_dtype).smallest_subnormal)
    zi, zo, zc, old, gh, gc = (np.asarray(x[k], np.float64) for k in INPUTS)
    c = np.asarray(new_cell, np.float64)
    with np.errstate(**_QUIET):
        ig, og = reference.sigmoid(zi), reference.sigmoid(zo)
        dsi, dso = reference.d_sigmoid(zi), reference.d_sigmoid(zo)
        cand, de = reference.elu(zc), reference.d_elu(zc)
        t, dt = np.tanh(c), reference.d_tanh(c)
        yes = np.ones(zi.shape, bool)
        ex = dict(ig=zi == -np.inf, dsi=np.isinf(zi), og=zo == -np.inf, dso=np.isinf(zo),
                  cand=zc == 0, de=zc == -np.inf, t=c == 0, dt=np.isinf(c))

        def tol(scale, slack):
            bound = (TOL_ULPS * eps_c + eps_o) * scale + TOL_ULPS * sub_c * slack + sub_o
            return np.where(np.isnan(bound), np.inf, bound)

        gi = cand * ig
        cell = old + gi
        either_gi = _either([cand, ig], [ex["cand"], ex["ig"]], tiny)
        a = dt * og * gh
        either_a = _either([dt, og, gh], [ex["dt"], ex["og"], yes], tiny)
        dnc_exact = a + gc
        dnc_scale = np.abs(a) + np.abs(gc)
        dnc_slack = _slack(dt, og, gh) + 1
        dnc_err = tol(dnc_scale, dnc_slack)
        dnc_either = either_a
        # The gate gradients multiply d_new_cell as the backend holds it, in the compute type:
        # beyond its range it is +-inf there (an overflow of d_old_cell itself), and at the
        # boundary it may be either (such elements are not judged: ``unjudged``).
        big_c = float(finfo(compute_dtype).max)
        dnc = np.where(np.abs(dnc_exact) > big_c, np.sign(dnc_exact) * np.inf, dnc_exact)
        unjudged = np.isfinite(dnc_exact) & (np.abs(np.abs(dnc_exact) - big_c) <= dnc_err)
        d_o = t * gh * dso
        d_i = cand * dsi * dnc
        d_c = ig * de * dnc
        return {
            "new_cell": (cell, tol(np.abs(old) + np.abs(gi), _slack(cand, ig)), either_gi),
            "new_h": (t * og, tol(np.abs(t * og), _slack(t, og)), np.zeros(zi.shape, bool)),
            "d_old_cell": (dnc_exact, dnc_err, dnc_either),
            "d_output_gate": (d_o, tol(np.abs(d_o), _slack(t, gh, dso)),
                              _either([t, gh, dso], [ex["t"], yes, ex["dso"]], tiny)),
            "d_input_gate": (d_i, tol(np.abs(cand * dsi) * dnc_scale,
                                      _slack(cand, dsi, dnc_scale)
                                      + np.abs(cand * dsi) * dnc_slack),
                             dnc_either | _either([cand, dsi, dnc], [ex["cand"], ex["dsi"], yes],
                                                  tiny, [None, None, dnc_err])),
            "d_candidate": (d_c, tol(np.abs(ig * de) * dnc_scale,
                                     _slack(ig, de, dnc_scale) + np.abs(ig * de) * dnc_slack),
                            dnc_either | _either([ig, de, dnc], [ex["ig"], ex["de"], yes], tiny,
                                                 [None, None, dnc_err])),
            "unjudged": unjudged,
        }


def mismatches(x: dict, got: dict, compute_dtype, out_dtype, names=OUTPUTS) -> list:
    """Every element-output where ``got`` (flat float64 arrays of OUTPUTS) breaks the rules of
    the module docstring: a list of readable rows (empty when all agree)."""
    big = float(finfo(out_dtype).max)
    ref = reference_values(x, got["new_cell"], compute_dtype, out_dtype)
    unjudged = ref.pop("unjudged")
    bad = []
    for name in names:
        want, tol, either = ref[name]
        res = np.asarray(got[name], np.float64)
        with np.errstate(**_QUIET):
            finite_ok = (np.isfinite(res) & (np.abs(res - want) <= tol))
            overflow_ok = (np.isinf(res) & (np.sign(res) == np.sign(want))
                           & (np.abs(want) + tol >= big))
            ok = np.where(either, ~np.isfinite(res),
                          np.where(np.isnan(want), np.isnan(res),
                                   np.where(np.isinf(want), res == want,
                                            finite_ok | overflow_ok)))
        if name in ("d_input_gate", "d_candidate"):
            ok |= unjudged
        for k in np.flatnonzero(~ok):
            inputs = ", ".join(f"{n}={float(x[n][k])!r}" for n in INPUTS)
            bad.append(f"{name}[{k}] = {float(res[k])!r}, reference {float(want[k])!r} "
                       f"(tol {tol[k]:.3g}{', either' if either[k] else ''}) at {inputs}")
    return bad


def special_values(dtype) -> list:
    """+-inf, NaN, +-0, the smallest subnormal and normal, the largest value, and the overflow
    thresholds of exp (ln max) and cosh (ln 2 max) with their neighbours, both signs, and a few
    ordinary values, as float64 values of ``dtype``."""
    info = finfo(dtype)
    big = float(info.max)
    ln = float(np.log(big))
    values = [np.inf, np.nan, 0.0, float(info.smallest_subnormal), float(info.tiny), big, ln,
              ln * (1 + 4 * float(info.eps)), ln + float(np.log(2)), 0.5, 1.0, 3.0, 20.0, 40.0,
              100.0, 800.0]
    return values + [-v for v in values if v == v]


def finfo(dtype):
    """np.finfo, for bfloat16 too (ml_dtypes; the backend's bfloat16 storage is uint16)."""
    import ml_dtypes

    if np.dtype(dtype) in (np.dtype(np.uint16), np.dtype(ml_dtypes.bfloat16)):
        return ml_dtypes.finfo(ml_dtypes.bfloat16)
    return np.finfo(dtype)
