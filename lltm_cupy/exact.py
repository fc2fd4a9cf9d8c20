"""The LLTM cell's element-wise math evaluated exactly enough (mpmath, 256-bit mantissas, no
exponent range limit) from the same rounded inputs a backend saw, and errors in units in the
last place (ulps) of the backend's dtype.

"From the same rounded inputs": the pre-activations z, old_cell and the incoming gradients as
stored in the dtype, and, for what the backends compute from ``new_cell`` (new_h and every
gradient), the backend's own rounded new_cell, exactly as both backends read it back.

Where the exact computation itself cancels (new_cell = old_cell + g * i, and d_new_cell =
tanh'(c) * o * grad_h + grad_cell, which every gate gradient multiplies), the error is measured
relative to the magnitude of the terms instead of the (possibly tiny) result.

A factor, or a partial product, that underflows into the subnormal range carries fewer bits: a
product with one is allowed, besides its ulps, the product of the other factors times the
subnormal spacing (``slack``): e.g. d_z_i = g * sigmoid'(z_i) * d_new_cell with z_i = -100 in
float32, where sigmoid' = 4e-44 has three significant bits and g * d_new_cell is about 1. (On
a GPU, CuPy compiles with -ftz=true: subnormal values there are flushed to zero, and the bounds
hold for normal results only; the host build of the tests keeps subnormals.)
"""
from __future__ import annotations

import mpmath  # installed with torch; verification only (the backends never import this)
import numpy as np

__all__ = ["PRECISION_BITS", "OUTPUTS", "ULP_BOUND", "ulp", "element", "ulp_error",
           "representable", "max_errors"]

PRECISION_BITS = 256
#: (mantissa bits including the implicit one, minimum normal exponent) per dtype
_FORMAT = {np.dtype(np.float16): (11, -14), np.dtype(np.float32): (24, -126),
           np.dtype(np.float64): (53, -1022)}
OUTPUTS = ("new_h", "new_cell", "d_old_cell", "d_input_gate", "d_output_gate", "d_candidate")
#: The bounds the tests enforce, in ulps (see :func:`ulp_error`), for both backends'
#: element-wise code in float32 and float64: about twice the largest errors seen (1.9 new_cell,
#: 3.2 new_h, 4.1 d_old_cell, 7.6 d_input_gate, 5.3 d_output_gate, 4.4 d_candidate over the
#: tests' inputs and the property-based search), which is also what adding up each step's error
#: allows (a few ulps per exp/expm1/tanh/cosh, half an ulp per operation). float16 on the
#: kernels: arithmetic in float32, rounded once (0.5 seen).
_BOUND = dict(new_h=6, new_cell=5, d_old_cell=8, d_input_gate=12, d_output_gate=10,
              d_candidate=10)
ULP_BOUND = {np.dtype(np.float16): dict.fromkeys(OUTPUTS, 1.0),
             np.dtype(np.float32): _BOUND, np.dtype(np.float64): _BOUND}


def ulp(x, dtype) -> float:
    """The spacing of ``dtype`` values at magnitude |x| (the subnormal spacing below the normal
    range), as a float64 (an mpf for magnitudes beyond float64's range)."""
    bits, emin = _FORMAT[np.dtype(dtype)]
    x = abs(mpmath.mpf(x))
    e = emin if x == 0 else max(int(mpmath.floor(mpmath.log(x, 2))), emin)
    return mpmath.ldexp(1, e - bits + 1)


def _sigmoid_parts(z):
    """sigmoid(z), sigmoid'(z) exactly (from e = exp(-|z|), no cancellation at any z)."""
    e = mpmath.exp(-abs(z))
    s = (1 if z >= 0 else e) / (1 + e)
    return s, e / (1 + e) ** 2


def element(z_i, z_o, z_c, old_cell, new_cell, grad_h, grad_cell):
    """Exact values and error scales of every element-wise output of one element.

    Arguments are the backend's rounded values (any float type). Returns {output: (exact,
    scale, slack)}: the error of an output is measured in ulps of ``scale`` plus ``slack``
    subnormal spacings (see the module docstring).
    """
    with mpmath.workprec(PRECISION_BITS):
        z_i, z_o, z_c, old, c, gh, gc = (mpmath.mpf(float(v)) for v in
                                         (z_i, z_o, z_c, old_cell, new_cell, grad_h, grad_cell))
        i, d_i = _sigmoid_parts(z_i)
        o, d_o = _sigmoid_parts(z_o)
        g = z_c if z_c > 0 else mpmath.expm1(z_c)
        d_g = 1 if z_c > 0 else mpmath.exp(z_c)
        t = mpmath.tanh(c)
        d_t = mpmath.sech(c) ** 2
        term = d_t * o * gh
        d_new_cell = term + gc
        dnc_scale = abs(term) + abs(gc)
        dnc_slack = _slack3(d_t, o, gh) + 1
        d_output_gate = t * gh * d_o
        return {
            "new_cell": (old + g * i, abs(old) + abs(g * i), abs(g) + abs(i) + 1),
            "new_h": (t * o, abs(t * o), abs(t) + abs(o)),
            "d_old_cell": (d_new_cell, dnc_scale, dnc_slack),
            "d_input_gate": (g * d_i * d_new_cell, abs(g * d_i) * dnc_scale,
                             _slack3(g, d_i, dnc_scale) + abs(g * d_i) * dnc_slack),
            "d_output_gate": (d_output_gate, abs(d_output_gate), _slack3(t, gh, d_o)),
            "d_candidate": (i * d_g * d_new_cell, abs(i * d_g) * dnc_scale,
                            _slack3(i, d_g, dnc_scale) + abs(i * d_g) * dnc_slack),
        }


def _slack3(a, b, c):
    """Subnormal slack of a product a * b * c in any order: each factor, and each partial
    product of two, may be subnormal (absolute error up to the spacing) once."""
    a, b, c = abs(a), abs(b), abs(c)
    return b * c + a * c + a * b + a + b + c


def ulp_error(computed, exact, scale, slack, dtype) -> float:
    """|computed - exact| in units of ulp(scale) + slack * (the subnormal spacing) in ``dtype``;
    inf for a non-finite result where the exact one is finite."""
    computed = float(computed)
    if not np.isfinite(computed):
        return float("inf")
    with mpmath.workprec(PRECISION_BITS):
        unit = ulp(scale, dtype) + slack * mpmath.mpf(float(np.finfo(dtype).smallest_subnormal))
        return float(abs(mpmath.mpf(computed) - exact) / unit)


def representable(value, dtype) -> bool:
    """Whether ``value`` lies within the finite range of ``dtype`` (no overflow when rounded)."""
    return abs(value) <= mpmath.mpf(float(np.finfo(dtype).max))


def max_errors(inputs, outputs, dtype, names=OUTPUTS) -> dict:
    """Largest ulp error per output over flat arrays.

    inputs: dict of flat arrays z_i, z_o, z_c, old_cell, grad_h, grad_cell (the rounded inputs);
    outputs: dict of flat arrays of what the backend computed (new_cell, and the ``names``
    measured). Elements whose exact values (or their error scales) leave the dtype's finite
    range are skipped. Returns {output: (ulps, index)} plus {"skipped": [indices]}.
    """
    worst = {name: (0.0, -1) for name in names}
    skipped = []
    n = len(inputs["z_i"])
    for k in range(n):
        exact = element(inputs["z_i"][k], inputs["z_o"][k], inputs["z_c"][k],
                        inputs["old_cell"][k], outputs["new_cell"][k], inputs["grad_h"][k],
                        inputs["grad_cell"][k])
        if not all(representable(exact[name][0], dtype) and representable(exact[name][1], dtype)
                   for name in names):
            skipped.append(k)
            continue
        for name in names:
            err = ulp_error(outputs[name][k], *exact[name], dtype)
            if err > worst[name][0]:
                worst[name] = (err, k)
    return {**worst, "skipped": skipped}
