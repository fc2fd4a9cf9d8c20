"""The CPU backend's GEMMs by torch's BLAS (one BLAS thread pool per process, not two that fight
over the cores): ``torch_mm`` and ``TORCH_GEMM``, which the torch layer passes to the NumPy
backend as its ``mm`` (:mod:`lltm_cupy._cpu_gemm` has the interface, and NumPy's own)."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["torch_mm", "TorchGemm", "TORCH_GEMM"]


def torch_mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b by torch's BLAS, on NumPy arrays, without copies."""
    return torch.mm(torch.from_numpy(a), torch.from_numpy(b)).numpy()


class TorchGemm:
    """The NumPy backend's GEMMs (``lltm_cupy._cpu_gemm``'s interface) by torch's BLAS, on
    tensors over the NumPy arrays' memory: ``operand`` / ``rows`` wrap once per call (``rows``
    with one ``unbind``), so that a step's GEMM costs one torch call."""

    __call__ = staticmethod(torch_mm)
    operand = staticmethod(torch.from_numpy)

    @staticmethod
    def rows(a):
        return a.unbind(0)

    @staticmethod
    def gate_rows(hs):
        return hs.unsqueeze(1).expand(hs.shape[0], 3, *hs.shape[1:]).unbind(0)

    @staticmethod
    def project_gates(x, w, bias, out):
        rows = x.shape[0]
        torch.baddbmm(torch.from_numpy(bias).reshape(3, 1, -1).expand(3, rows, -1),
                      x.expand(3, *x.shape), w, out=out)

    @staticmethod
    def add_gates(out, z, h, w):
        torch.baddbmm(z, h, w, out=out)

    @staticmethod
    def accumulate(out, a, b):
        out.addmm_(a, b)


TORCH_GEMM = TorchGemm()
