"""float32 accuracy of the fused sequence kernels over a long sequence (cuda_src/lltm_fused.cu's
dot products, which the cluster and group kernels share), without a GPU: the kernels built as
host C++ (tests/host_shim) and launched on the emulated CuPy, against the stepped path (whose
recurrent GEMM is NumPy's here) and a float64 run, at T = 512, B = 16, F = 32, S = 128, six sets
of inputs. For each of the 8 results (outputs, h_n, c_n and the 5 gradients) the root mean
square of the normalised error |x - x64| / (1 + |x64|); the fused path's must be no larger than
the stepped path's on the geometric mean over the results and sets (a single set or the largest
error says little at this length: the recurrence amplifies either path's rounding by factors
that vary from set to set).

    python -m pytest tests/test_fused_accuracy.py -s     # also prints the table

Runs everywhere (g++, no GPU).
"""
from __future__ import annotations

import numpy as np
import pytest

from lltm_cupy import reference
from lltm_cupy._cuda import kernels as _kernels
from test_fused_sequence import OUT, _reference, fused_cupy, fused_lib, make, run, values  # noqa: F401

T, B, F, S = 512, 16, 32, 128
SEEDS = range(6)


def _reference_whole_batch(case) -> list:
    """The float64 reference (lltm_cupy.reference) stepped over the whole batch at once: the 8
    results of test_lengths._reference for sequences that all run every step, which steps each
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
    """The reference above against test_lengths._reference (each sequence stepped alone), on a
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


@pytest.mark.slow
def test_fused_float32_drifts_no_more_than_the_stepped_path(fused_cupy, monkeypatch):
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: B)
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
    assert overall <= 1.0, f"the fused path drifts {overall:.2f}x as far as the stepped path"
