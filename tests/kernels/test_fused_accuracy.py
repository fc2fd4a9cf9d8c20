"""float32 accuracy of the fused sequence kernels over a long sequence (cuda_src/lltm_fused.cu's
dot products, which the cluster and group kernels share), without a GPU: the kernels built as
host C++ (tests/host_shim) and launched on the emulated CuPy, against the stepped path and a
float64 run, at T = 512, B = 16, F = 32, S = 128, six sets of inputs. For each of the 8 results
(outputs, h_n, c_n and the 5 gradients) the root mean square of the normalised error
|x - x64| / (1 + |x64|); the fused path's must be within :data:`BOUND` of the stepped path's on
the geometric mean over the results and sets (a single set or the largest error says little at
this length: the recurrence amplifies either path's rounding by factors that vary from set to
set).

The stepped path's GEMMs sum in a fixed order here, four partial sums over all the terms
(:func:`four_partial_sums`: the kernels' order before their chunks of 32 terms), so that the
comparison is the same on every host: with the host's BLAS instead, whose order depends on the
CPU and its thread count, the ratio was 0.81 on an Intel Xeon and 1.05-1.18 on an AMD EPYC
(OpenBLAS 0.3.31, two threads and one).

    python -m pytest tests/kernels/test_fused_accuracy.py -s     # also prints the table

Runs everywhere (g++, no GPU).
"""
from __future__ import annotations

import numpy as np
import pytest

from lltm_cupy import reference
from lltm_cupy._cuda import kernels as _kernels
from helpers.fused_cases import OUT, make, run, values
from helpers.lengths_reference import _reference

T, B, F, S = 512, 16, 32, 128
SEEDS = range(6)
#: the largest ratio allowed. Six sets resolve differences of about a tenth, no finer: the
#: kernels' chunked sums gave 1.11 here (1.00 with four partial sums over all the terms, the
#: stepped path's order), the host BLAS comparison 0.81-1.18 depending on the host; an
#: accumulation that loses precision (a term or partial sum dropped, 16-bit sums) drifts many
#: times further.
BOUND = 1.25


def _reference_whole_batch(case) -> list:
    """The float64 reference (lltm_cupy.reference) stepped over the whole batch at once: the 8
    results of test_array_lengths._reference for sequences that all run every step, which steps each
    sequence alone (the same arithmetic row by row, in one call per step instead of one per
    row: B times fewer)."""
    weights = case["weights"]
    h, c = case["h0"], case["c0"]
    outputs, steps = np.zeros(case["grad_outputs"].shape), []
    for t in range(case["inputs"].shape[0]):
        step = reference.lltm_forward(case["inputs"][t], weights, case["bias"], h, c)
        steps.append(step)
        h, c = step[0], step[1]
        outputs[t] = h
    d_h, d_c = case["grad_h_n"].astype(np.float64), case["grad_c_n"].astype(np.float64)
    d_inputs = np.zeros(case["inputs"].shape)
    d_weights, d_bias = np.zeros(weights.shape), np.zeros(weights.shape[0])
    for t in reversed(range(len(steps))):
        d_h, d_inputs[t], d_w, d_b, d_c = reference.lltm_backward(
            d_h + case["grad_outputs"][t], d_c, *steps[t][1:], weights)
        d_weights, d_bias = d_weights + d_w, d_bias + d_b
    return [outputs, h, c, d_inputs, d_weights, d_bias.reshape(case["bias"].shape), d_h, d_c]


def test_the_whole_batch_reference_is_the_per_sequence_one():
    """The reference above against test_array_lengths._reference (each sequence stepped alone), on a
    small case: within 1e-13 of each result's largest value (float64 rounding, rows summed in
    another order)."""
    _, case = make(7, 5, 3, 4, np.dtype(np.float32), seed=2)
    grads = (case["grad_outputs"], case["grad_h_n"], case["grad_c_n"])
    for name, got, want in zip(OUT, _reference_whole_batch(case), _reference(case, [7] * 5,
                                                                              False, grads)):
        assert got.shape == want.shape, name
        assert np.max(np.abs(got - want)) <= 1e-13 * max(1.0, np.max(np.abs(want))), name


def _rms(got, want) -> list:
    return [float(np.sqrt(np.mean(((values(g) - w) / (1 + np.abs(w))) ** 2)))
            for g, w in zip(got, want)]


def four_partial_sums(a, b):
    """``a @ b`` in float32 with four partial sums over all the terms: term k added to partial
    sum k mod 4 in increasing k (each product rounded, then added), the four added as
    (0 + 1) + (2 + 3): the order of the fused kernels before their chunks of 32 terms, and a
    GEMM's whose result does not depend on the host's BLAS. Other dtypes: ``np.matmul``."""
    if a.dtype != np.float32 or b.dtype != np.float32 or a.ndim != 2:
        return np.matmul(a, b)
    part = np.zeros((4, a.shape[0], b.shape[1]), np.float32)
    for k in range(a.shape[1]):
        part[k % 4] += np.multiply.outer(a[:, k], b[k])
    return (part[0] + part[1]) + (part[2] + part[3])


def test_four_partial_sums_is_that_order():
    """The order above, term by term, against a scalar loop written from its description."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 11)).astype(np.float32)
    b = rng.standard_normal((11, 2)).astype(np.float32)
    want = np.zeros((3, 2), np.float32)
    for i in range(3):
        for j in range(2):
            p = [np.float32(0)] * 4
            for k in range(11):
                p[k % 4] = np.float32(p[k % 4] + np.float32(a[i, k] * b[k, j]))
            want[i, j] = np.float32(np.float32(p[0] + p[1]) + np.float32(p[2] + p[3]))
    assert np.array_equal(four_partial_sums(a, b), want)


@pytest.mark.slow
def test_fused_float32_drifts_no_more_than_the_stepped_path(fused_cupy, monkeypatch):
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: B)
    monkeypatch.setattr(fused_cupy.emulator, "product", four_partial_sums)
    fused, stepped = [], []
    for seed in SEEDS:
        stored, case = make(T, B, F, S, np.dtype(np.float32), seed=seed)
        want = _reference_whole_batch(case)
        fused.append(_rms(run(fused_cupy, stored, None, False, True), want))
        stepped.append(_rms(run(fused_cupy, stored, None, False, False), want))
    ratio = np.exp(np.log(np.array(fused)) - np.log(np.array(stepped)))   # (sets, results)
    per_result = np.exp(np.mean(np.log(ratio), axis=0))
    print(f"\nfloat32, T = {T}, B = {B}, F = {F}, S = {S}, {len(SEEDS)} sets: RMS normalised "
          "error, fused / stepped (geometric mean over the sets)")
    for name, r, f, s in zip(OUT, per_result, np.array(fused).T, np.array(stepped).T):
        print(f"  {name:10s} {r:5.2f}   fused {np.median(f):.2e}  stepped {np.median(s):.2e}"
              " (medians)")
    overall = float(np.exp(np.mean(np.log(ratio))))
    print(f"  all        {overall:5.2f}")
    assert overall <= BOUND, (f"the fused path drifts {overall:.2f}x as far as the stepped "
                              f"path (at most {BOUND})")
