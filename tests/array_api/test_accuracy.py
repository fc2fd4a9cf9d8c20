"""Accuracy to the last ulps we can justify, on both backends (the CUDA kernels through their
host build, and NumPy), against the exact reference (lltm_cupy.exact: mpmath from the same
rounded inputs).

- every element-wise output (new_h, new_cell, d_old_cell and the three gate gradients before
  the GEMMs) within lltm_cupy.exact.ULP_BOUND ulps of the exact value, relative to that value,
  or to the magnitude of the terms where the exact computation itself cancels; inputs normal at
  scales 1, 10 and 100 (saturated gates), exactly 0, +-1e4, subnormal and tiny values, and a
  property-based search over the whole float range;
- the GEMM outputs within the standard error bound gamma_n * sum |a_k b_k|;
- the torch layer on the CPU equal to the pure-torch reference at rtol=1e-7, atol=0 in
  float64, with torch.randn inputs and weights (pre-activations of tens: saturated gates).
"""
from __future__ import annotations

import numpy as np
import pytest

mpmath = pytest.importorskip("mpmath", reason="mpmath is not installed (pip install .[test])")

from lltm_cupy import _numpy, exact  # noqa: E402
from helpers import elementwise as ew  # noqa: E402

pytestmark = pytest.mark.usefixtures("ieee_arithmetic")
INPUT_NAMES = ("z_i", "z_o", "z_c", "old_cell", "grad_h", "grad_cell")
BACKENDS = [("numpy", np.float32), ("numpy", np.float64), ("kernels", np.float16),
            ("kernels", np.float32), ("kernels", np.float64)]


def _run(backend, inputs, dtype, lib):
    """The backend's element-wise outputs (NumPy's warnings are silenced by the backend itself;
    tests/array_api/test_infinities.py checks that none escapes a public call)."""
    rounded = {k: np.asarray(v, dtype) for k, v in inputs.items()}
    out = (ew.run_numpy(rounded, dtype) if backend == "numpy"
           else ew.run_kernels(lib, rounded, dtype))
    return rounded, out


def _assert_within_bounds(backend, dtype, rounded, out, label):
    worst = exact.max_errors(rounded, out, dtype)
    worst.pop("skipped")
    bound = exact.ULP_BOUND[np.dtype(dtype)]
    bad = {k: (round(e, 2), {n: float(rounded[n][i]) for n in INPUT_NAMES})
           for k, (e, i) in worst.items() if e > bound[k]}
    assert not bad, f"{backend} {np.dtype(dtype).name} {label}: ulps above {bound}: {bad}"


def _scaled(rng, scale, n):
    """Pre-activations and old_cell normal at ``scale``, gradients normal at 1."""
    return {k: rng.standard_normal(n) * (scale if k.startswith("z") or k == "old_cell" else 1)
            for k in INPUT_NAMES}


@pytest.mark.parametrize("backend,dtype", BACKENDS, ids=[f"{b}-{np.dtype(d).name}"
                                                          for b, d in BACKENDS])
@pytest.mark.parametrize("scale", [1, 10, 100])
def test_elementwise_ulps_at_scale(host_lib, backend, dtype, scale):
    rng = np.random.default_rng(scale)
    rounded, out = _run(backend, _scaled(rng, scale, 600), dtype, host_lib)
    _assert_within_bounds(backend, dtype, rounded, out, f"scale {scale}")


@pytest.mark.parametrize("backend,dtype", BACKENDS, ids=[f"{b}-{np.dtype(d).name}"
                                                          for b, d in BACKENDS])
def test_elementwise_ulps_at_special_values(host_lib, backend, dtype):
    """Every input drawn from 0, -0, +-1e4, subnormal, the smallest normal, tiny and 1-ish."""
    rng = np.random.default_rng(7)
    values = ew.special_values(dtype)
    inputs = {k: values[rng.integers(len(values), size=800)] for k in INPUT_NAMES}
    rounded, out = _run(backend, inputs, dtype, host_lib)
    _assert_within_bounds(backend, dtype, rounded, out, "special values")


def test_the_bounds_catch_the_tutorials_forms():
    """The tutorial's (1 + tanh(z / 2)) / 2 loses every digit of a saturated gate: the exact
    reference sees it (so the bounds above are a check)."""
    z, old, c = -30.0, 0.5, 0.25
    tutorial_o = (1 + np.tanh(z / 2)) / 2
    ref = exact.element(0.0, z, 0.0, old, c, 1.0, 0.0)
    err = exact.ulp_error(np.tanh(c) * tutorial_o, *ref["new_h"], np.float64)
    assert err > 1e6, err


# ------------------------------------------------------------------------------- properties

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st  # noqa: E402


class _Pinned:
    """An explicit example (``hypothesis.example(data=_Pinned(...))``) of a test that draws its
    inputs from ``st.data()`` through :func:`_draw_inputs`: the inputs ``inputs(dtype)`` gives
    for the dtype of the test's parametrisation."""

    def __init__(self, inputs):
        self.inputs = inputs


def _draw_inputs(data, dtype, strategy):
    """The inputs of one test case: drawn, ``strategy(name)`` for each input, or pinned."""
    if isinstance(data, _Pinned):
        return data.inputs(dtype)
    return {k: data.draw(strategy(k), label=k) for k in INPUT_NAMES}


def _largest_gradient_near_a_zero_cell(dtype):
    """Found by the search over the whole float range (float64 kernels: d_old_cell,
    d_input_gate and d_candidate came out inf where the exact values are finite): grad_h at the
    largest finite value and a new cell near 0, where tanh'(c) = 4 e2 / (1 + e2)^2 rounds to
    1 + 1 ulp for some c (these old_cells give such a c in float64 and in float32)."""
    old_cell = [2e-9, 1e-7, 7e-12, 8e-8, 0.0, -2e-9, -8e-8, 1.0]
    n = len(old_cell)
    return dict(z_i=[10.0] * n, z_o=[37.0] * n, z_c=[2.93e-11] * n, old_cell=old_cell,
                grad_h=[float(np.finfo(dtype).max)] * n, grad_cell=[0.0] * n)


def _float(dtype):
    width = np.dtype(dtype).itemsize * 8
    return st.floats(allow_nan=False, allow_infinity=False, width=width)


def _bounded(dtype, limit):
    width = np.dtype(dtype).itemsize * 8
    return st.floats(-limit, limit, allow_nan=False, width=width)


def _property(test):
    """A property-based test over BACKENDS: 150 examples of 8 elements per backend and dtype."""
    test = given(data=st.data())(test)
    test = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])(test)
    return pytest.mark.parametrize("backend,dtype", BACKENDS,
                                   ids=[f"{b}-{np.dtype(d).name}" for b, d in BACKENDS])(test)


@_property
@example(data=_Pinned(_largest_gradient_near_a_zero_cell))
@pytest.mark.slow
def test_elementwise_ulps_over_the_whole_float_range(host_lib, backend, dtype, data):
    """Pre-activations anywhere in the finite range; old_cell and the gradients too, as long as
    no exact result leaves the dtype's range (those elements are skipped by max_errors)."""
    n = 8
    values = _draw_inputs(data, dtype, lambda k: st.lists(_float(dtype), min_size=n, max_size=n))
    rounded, out = _run(backend, values, dtype, host_lib)
    _assert_within_bounds(backend, dtype, rounded, out, "hypothesis")


@_property
@pytest.mark.slow
def test_elementwise_ulps_with_moderate_state(host_lib, backend, dtype, data):
    """Pre-activations over the whole range with old_cell and gradients within +-100, where
    most elements have every output in range (the search above skips many)."""
    n = 8
    values = {k: data.draw(st.lists(_float(dtype) if k.startswith("z") else _bounded(dtype, 100),
                                    min_size=n, max_size=n), label=k) for k in INPUT_NAMES}
    rounded, out = _run(backend, values, dtype, host_lib)
    assume(all(np.isfinite(v).all() for v in rounded.values()))
    _assert_within_bounds(backend, dtype, rounded, out, "hypothesis")


# ------------------------------------------------------------------------------------ GEMMs

def _gemm_bound(a, b, dtype, extra_terms=0):
    """The standard bound gamma_n * sum_k |a_ik b_kj| (n = k + extra_terms), in float64."""
    n = a.shape[1] + extra_terms
    u = float(np.finfo(dtype).eps) / 2
    gamma = n * u / (1 - n * u)
    return gamma * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))


def _exact_product(a, b):
    """a @ b in extended precision (x87 long double: 64-bit mantissa, 11 more bits than float64;
    the products of float32 inputs are exact in float64)."""
    return a.astype(np.longdouble) @ b.astype(np.longdouble)


def _torch_mm():
    pytest.importorskip("torch")
    from lltm_cupy.torch._torch_gemm import torch_mm

    return torch_mm


@pytest.mark.parametrize("mm_name", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [16, 129])  # both orientations of the projection GEMM
def test_gemm_outputs_within_the_standard_bound(mm_name, dtype, batch):
    mm = np.matmul if mm_name == "numpy" else _torch_mm()
    rng = np.random.default_rng(batch)
    F, S = 32, 64
    X = rng.standard_normal((batch, S + F)).astype(dtype)
    W = (rng.standard_normal((3 * S, S + F)) * 3).astype(dtype)
    b = rng.standard_normal(3 * S).astype(dtype)
    z = _numpy.step._project(X, W, b, mm, 1, batch)[0]              # (3, B, S), bias added
    want = (_exact_product(X, W.T) + b.astype(np.longdouble)).reshape(batch, 3, S)
    bound = _gemm_bound(X, W.T, dtype, extra_terms=1) + np.abs(b.astype(np.float64))
    bound = bound * (1 + 1e-12)  # the bound's own float64 evaluation
    err = np.abs(z.transpose(1, 0, 2).astype(np.longdouble) - want).astype(np.float64)
    ratio = (err / bound.reshape(batch, 3, S)).max()
    assert ratio <= 1, f"projection error {ratio:.2f}x the standard bound"
    # The backward's GEMMs (weights, old_h and input gradients) on the backward's d_gates.
    d = rng.standard_normal((batch, 3 * S)).astype(dtype)
    for a, m in ((d.T, X), (d, W)):
        got = mm(np.ascontiguousarray(a), np.ascontiguousarray(m))
        err = np.abs(got.astype(np.longdouble) - _exact_product(a, m)).astype(np.float64)
        ratio = (err / _gemm_bound(a, m, dtype)).max()
        assert ratio <= 1, f"GEMM error {ratio:.2f}x the standard bound"


# ----------------------------------------------------------------------- torch layer on CPU

@pytest.mark.parametrize("size", [(16, 32, 128), (5, 7, 9), (64, 16, 33)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torch_cell_equals_the_pure_torch_reference_at_1e_7(size, seed):
    torch = pytest.importorskip("torch")
    import lltm_cupy.torch as lt

    B, F, S = size
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, F), (3 * S, S + F), (3 * S,), (B, S), (B, S))
    args = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    grads = [torch.randn(B, S, generator=g, dtype=torch.float64) for _ in range(2)]
    results = []
    for fn in (lt.lltm, lt.lltm_reference):
        leaves = [a.clone().requires_grad_() for a in args]
        h, c = fn(*leaves)
        torch.autograd.backward((h, c), grads)
        results.append([h.detach(), c.detach()] + [t.grad for t in leaves])
    names = ("new_h", "new_cell", "input", "weights", "bias", "old_h", "old_cell")
    for name, ours, ref in zip(names, *results):
        torch.testing.assert_close(ours, ref, rtol=1e-7, atol=0, msg=name)


@pytest.mark.gpu
def test_cupy_kernels_on_the_gpu_within_the_bounds():
    """The NVRTC-compiled kernels on a real GPU (CuPy's -ftz=true flushes subnormals; the case's
    values are normal): new_h, new_cell and d_old_cell within the ulp bounds."""
    from conftest import gpu_unavailable_reason
    from lltm_cupy import verify

    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"GPU test: {reason}")
    rows = [r for r in verify.elementwise_accuracy() if r[0] == "cupy"]
    assert len(rows) == 3 and all(ok for *_, ok in rows), rows
