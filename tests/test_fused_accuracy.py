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

from lltm_cupy._cuda import kernels as _kernels
from test_fused_sequence import OUT, _reference, fused_cupy, fused_lib, make, run, values  # noqa: F401

T, B, F, S = 512, 16, 32, 128
SEEDS = range(6)


def _rms(got, want) -> list:
    return [float(np.sqrt(np.mean(((values(g) - w) / (1 + np.abs(w))) ** 2)))
            for g, w in zip(got, want)]


def test_fused_float32_drifts_no_more_than_the_stepped_path(fused_cupy, monkeypatch):
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: B)
    fused, stepped = [], []
    for seed in SEEDS:
        stored, case = make(T, B, F, S, np.dtype(np.float32), seed=seed)
        want = _reference(case, [T] * B, False,
                          (case["grad_outputs"], case["grad_h_n"], case["grad_c_n"]))
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
