"""The GEMMs of the CPU backend (:mod:`lltm_cupy._numpy`), done by NumPy's BLAS.

The backend takes its GEMMs from an object with this interface (``mm=``), so that the torch
layer can run them with torch's BLAS instead (``lltm_cupy.torch._torch_gemm.TorchGemm``: one
BLAS thread pool per process, not two that fight over the cores). Besides ``mm(a, b)`` (a new
array ``a @ b``), the sequence loops use:

- ``into(a, b, out)``: ``a @ b`` written into the C-contiguous array ``out`` (returned);
- ``operand(a)``: the array ``a`` as the GEMM calls take it (NumPy: the array itself; torch: a
  tensor over the same memory); ``rows(op)``: the operand's ``op[i]`` for every i, made in one
  call before a loop, not one per step;
- ``gate_rows(op)``: each ``op[t]`` (B, S) as the ``h`` of ``add_gates``;
- ``project_gates(x, w, bias, out)``: ``out[g] = x @ w[g] + bias[g]`` for the three gates
  (``out`` (3, R, S) gate-major, the layout the element-wise step runs on);
- ``add_gates(out, z, h, w)``: ``out[g] = z[g] + h @ w[g]`` (out, z (3, B, S), w (3, S, S));
- ``accumulate(out, a, b)``: ``out += a @ b``.

Gate-major GEMMs (three (B, S) products against per-gate weights (3, K, S), one batched call)
write the layout the element-wise step reads, so that no pass transposes the products. With
torch's BLAS (MKL, one thread, float32) the step's recurrent product plus its projection,
``torch.baddbmm(z, h, w, out=out)``, took 12.3 / 76 / 685 us at (B, S) = (16, 128) / (32, 256) /
(64, 512), against 15.6 / 88 / 703 us for one (B, 3S) product and the pass that adds it into
gate-major order, and 14.9 / 80 / 692 us for ``baddbmm_`` into the strided projection itself.
"""
from __future__ import annotations

import numpy as np

__all__ = ["NumpyGemm", "NUMPY_GEMM", "gate_weights"]


def gate_weights(w):
    """(3S, K) weights as (3, K, S): ``[g] = w[g * S: (g + 1) * S].T``, C-contiguous (a copy)."""
    three_s, k = w.shape
    return np.ascontiguousarray(w.reshape(3, three_s // 3, k).transpose(0, 2, 1))


class NumpyGemm:
    """GEMMs by ``numpy.matmul``."""

    def __call__(self, a, b):
        return np.matmul(a, b)

    def into(self, a, b, out):
        return np.matmul(a, b, out=out)

    def operand(self, a):
        return a

    def rows(self, a):
        return list(a)

    gate_rows = rows

    def project_gates(self, x, w, bias, out):
        np.matmul(x, w, out=out)
        np.add(out, bias.reshape(3, 1, -1), out)

    def add_gates(self, out, z, h, w):
        np.add(z, np.matmul(h, w), out)

    def accumulate(self, out, a, b):
        np.add(out, np.matmul(a, b), out)


NUMPY_GEMM = NumpyGemm()
