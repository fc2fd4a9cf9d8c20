"""The GEMMs done by torch in the torch layer.

- CPU: torch's BLAS (one BLAS thread pool per process, not two that fight over the cores):
  ``torch_mm`` and ``TORCH_GEMM``, which the torch layer passes to the NumPy backend as its
  ``mm`` (:mod:`lltm_cupy._numpy.gemm` has the interface, and NumPy's own); for the sequence
  loops' per-step GEMMs from a size on, ``ONEDNN_GEMM``: torch's oneDNN with the weights packed
  once per call (:func:`cpu_gemm` chooses).
- CUDA: torch's cuBLAS on the tensors themselves (``_mm``, ``_addmm_``), eagerly and under
  CUDA-graph capture (``_interop`` says why one engine, and why not CuPy's).
"""
from __future__ import annotations

import numpy as np
import torch

from .._numpy.gemm import consecutive
from . import _cpu_arrays

__all__ = ["torch_mm", "kept_operand", "TorchGemm", "TORCH_GEMM", "OneDnnGemm", "ONEDNN_GEMM",
           "onednn_mm", "cpu_gemm"]


def torch_mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b by torch's BLAS, on NumPy arrays, without copies (the result over a torch tensor,
    which the torch layer returns)."""
    return _cpu_arrays.to_array(torch.mm(torch.from_numpy(a), torch.from_numpy(b)))


def kept_operand(a: np.ndarray) -> torch.Tensor:
    """A tensor over ``a``'s memory that outlives the call making it (a workspace's): made
    outside ``torch.inference_mode``, so that it is an ordinary tensor, which a later call
    outside inference mode may write into (an inference tensor refuses that)."""
    with torch.inference_mode(False):
        return torch.from_numpy(a)


class TorchGemm:
    """The NumPy backend's GEMMs (``lltm_cupy._numpy.gemm``'s interface) by torch's BLAS, on
    tensors over the NumPy arrays' memory: ``operand`` wraps once per call, and the per-step
    operands come in one call each (``split_with_sizes``, ``unbind``), so that a step's GEMM
    costs one torch call (``bmm``, ``addmm_``: torch's own functions)."""

    __call__ = staticmethod(torch_mm)
    operand = recurrent = staticmethod(torch.from_numpy)
    kept = staticmethod(kept_operand)

    #: a NumPy array over a new ``torch.empty`` (``torch.zeros``) tensor, which the torch layer
    #: returns (``_cpu_arrays.to_tensor``)
    empty = staticmethod(_cpu_arrays.empty)

    @staticmethod
    def zeros(shape, dtype):
        return _cpu_arrays.to_array(torch.zeros(shape, dtype=_cpu_arrays.TORCH_DTYPE[dtype]))

    @staticmethod
    def into(a, b, out):
        torch.mm(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(out))
        return out

    @staticmethod
    def gate_weights(w):
        """(3S, K) weights as the (3, K, S) tensor ``[g] = w[g * S: (g + 1) * S].T`` (a copy,
        as ``lltm_cupy._numpy.gemm.gate_weights``)."""
        three_s, k = w.shape
        return torch.from_numpy(np.ascontiguousarray(
            w.reshape(3, three_s // 3, k).transpose(0, 2, 1)))

    @staticmethod
    def steps_of(a, sizes):
        """Consecutive pieces of the tensor ``a`` of ``sizes`` rows along its second-to-last
        dimension."""
        n = sizes[0] if sizes else 0
        if n and [*sizes] == [n] * len(sizes):       # (one size: one view, unbind)
            k = len(sizes)
            return a.narrow(-2, 0, n * k).view(*a.shape[:-2], k, n, a.shape[-1]).unbind(-3)
        return a.narrow(-2, 0, sum(sizes)).split_with_sizes([*sizes], -2)

    @staticmethod
    def row_blocks(a, starts, sizes):
        """``a[s:s + n]`` for each (s, n), from one ``split_with_sizes`` or ``unbind`` (blocks
        in increasing order, not overlapping)."""
        return _blocks(a, starts, sizes, 0)

    @staticmethod
    def gate_inputs(h, starts, sizes):
        """The rows ``h[s:s + n]`` of each step as ``bmm``'s h: (3, n, S), expanded."""
        return _blocks(h.expand(3, *h.shape), starts, sizes, 1)

    @staticmethod
    def project_gates(x, w, bias, out):
        rows = x.shape[0]
        torch.baddbmm(torch.from_numpy(bias).reshape(3, 1, -1).expand(3, rows, -1),
                      x.expand(3, *x.shape), w, out=out)

    #: out = h @ w (three gates' products in one call), and out += a @ b: torch's own
    #: functions, so that a step's GEMM is one call into torch
    bmm = staticmethod(torch.bmm)
    addmm_ = staticmethod(torch.Tensor.addmm_)


def _blocks(a, starts, sizes, dim):
    """The blocks [s, s + n) of ``a`` along ``dim``, in increasing order, not overlapping: the
    pieces of one ``split_with_sizes`` (the gaps between them split off and dropped), or of one
    ``unbind`` where they are consecutive and of one size."""
    if consecutive(starts, sizes):         # consecutive, of one size: one view, unbind
        n, steps = sizes[0], len(sizes)
        shape = (*a.shape[:dim], steps, n, *a.shape[dim + 1:])
        return a.narrow(dim, starts[0], n * steps).view(shape).unbind(dim)
    pieces, at = [], 0
    for s, n in zip(starts, sizes):
        pieces += (s - at, n)
        at = s + n
    pieces.append(a.shape[dim] - at)
    return a.split_with_sizes(pieces, dim)[1::2]


TORCH_GEMM = TorchGemm()


class OneDnnGemm(TorchGemm):
    """:class:`TorchGemm` with every product by torch's oneDNN (``mkldnn``) linear operator:
    the loops' weight products (the input projection, each step's recurrent product, forward
    and backward) on weights packed once per call, the layout its kernels read, and the
    backward's products over all rows (weight and input gradients) on the operands as they
    are. Where torch's BLAS is MKL on a CPU it does not tune for (AMD's), oneDNN's kernels are
    faster at the loops' sizes; below :data:`ONEDNN_MIN` the packing and the copies into the
    step's gate-major layout cost more than they save (figures: docs/performance.md, "GEMM
    engines"). float32 only (oneDNN has no float64 linear)."""

    @staticmethod
    def __call__(a, b):
        if not a.shape[1]:      # (oneDNN refuses an empty inner dimension)
            return torch_mm(a, b)
        return _cpu_arrays.to_array(onednn_mm(torch.from_numpy(a), torch.from_numpy(b)))

    @staticmethod
    def into(a, b, out):
        if not a.shape[1]:
            return TorchGemm.into(a, b, out)
        torch.from_numpy(out).copy_(onednn_mm(torch.from_numpy(a), torch.from_numpy(b)))
        return out

    @staticmethod
    def gate_weights(w):
        """The (3S, K) weights packed as the linear operator's ``weight`` (out = 3S: its
        product's columns are the three gates' blocks)."""
        return _pack(torch.from_numpy(np.ascontiguousarray(w)), None)

    @staticmethod
    def recurrent(w):
        """The (3S, S) recurrent weights packed for ``d_gates @ w`` (``weight`` = w.T)."""
        return _pack(torch.from_numpy(w).t().contiguous(), None)

    @staticmethod
    def gate_inputs(h, starts, sizes):
        return _blocks(h, starts, sizes, 0)

    @staticmethod
    def project_gates(x, w, bias, out):
        product = _linear(x, w, torch.from_numpy(bias).reshape(-1), "none", [], "")
        out.copy_(product.view(x.shape[0], 3, -1).transpose(0, 1))

    @staticmethod
    def bmm(h, w, *, out):
        out.copy_(_linear(h, w, None, "none", [], "").view(h.shape[0], 3, -1).transpose(0, 1))

    @staticmethod
    def addmm_(out, a, b):
        out.copy_(_linear_add(a, out, b, None, "add"))


def onednn_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D tensors) by oneDNN's linear operator, ``b.T`` its weight. A weight that is
    a column slice of a larger matrix (``weights[:, :S]``) is copied dense first: oneDNN runs
    such strides on a reference loop, thousands of times slower; ``a`` may be any strides and
    ``b`` contiguous or a transposed contiguous matrix."""
    w = b.t()
    if not (w.is_contiguous() or b.is_contiguous()):
        w = w.contiguous()
    return _linear(a, w, None, "none", [], "")


#: a sequence's per-step GEMMs go to oneDNN from rows * state * state of this on (float32),
#: the smallest size measured where it beat the BLAS engine (docs/performance.md, "GEMM engines")
ONEDNN_MIN = 1 << 20


def _onednn():
    """(pack, linear, linear with a binary post-op) of torch's oneDNN, or None where this
    build of torch has none (no ``mkldnn``, or not an x86-64 CPU, where it is not measured)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or \
            not torch.backends.mkldnn.is_available():
        return None
    try:
        ops = torch.ops.mkldnn
        return ops._reorder_linear_weight, ops._linear_pointwise, ops._linear_pointwise.binary
    except (AttributeError, RuntimeError):
        return None


_found = _onednn()
ONEDNN_GEMM = None if _found is None else OneDnnGemm()
if _found is not None:
    _pack, _linear, _linear_add = _found
_mkldnn_enabled = torch._C._get_mkldnn_enabled


def cpu_gemm(rows: int, state: int, dtype: torch.dtype) -> TorchGemm:
    """The GEMM engine of a CPU sequence call on at most ``rows`` rows a step: ONEDNN_GEMM for
    float32 from :data:`ONEDNN_MIN` on (while ``torch.backends.mkldnn`` is enabled), else
    TORCH_GEMM."""
    if rows * state * state >= ONEDNN_MIN and dtype is torch.float32 and \
            ONEDNN_GEMM is not None and _mkldnn_enabled():
        return ONEDNN_GEMM
    return TORCH_GEMM


# ------------------------------------------------------------------------------------ CUDA

#: the two torch calls every GEMM of the CUDA path goes through (``out = a @ b``, ``out += a @
#: b``); the tests' emulated CUDA path wraps them
_mm = torch.mm
_addmm_ = torch.Tensor.addmm_
