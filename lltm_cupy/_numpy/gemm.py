"""The GEMMs of the CPU backend (:mod:`lltm_cupy._numpy`), done by NumPy's BLAS.

The backend takes its GEMMs from an object with this interface (``mm=``), so that the torch
layer can run them with torch's BLAS instead (``lltm_cupy.torch._torch_gemm.TorchGemm``: one
BLAS thread pool per process, not two that fight over the cores). Besides ``mm(a, b)`` (a new
array ``a @ b``), the sequence loops use:

- ``into(a, b, out)``: ``a @ b`` written into ``out`` (a C-contiguous array or a view of one
  with unit column stride, such as a column block of the weights' gradient; returned);
- ``operand(a)``: the array ``a`` as the GEMM calls take it (NumPy: the array itself; torch: a
  tensor over the same memory); ``kept(a)``: the same for an operand a workspace keeps between
  calls (torch: an ordinary tensor even under ``inference_mode``); ``gate_weights(w)``: the
  (3S, K) weights' gate-major copy (3, K, S) as an operand;
- per-step operands, made in one call before a loop, not one per step: ``steps_of(op,
  sizes)``, consecutive pieces of ``op``'s rows (its second-to-last axis); ``row_blocks(op,
  starts, sizes)``, the rows ``op[s:s + n]``; ``gate_inputs(op, starts, sizes)``, the same as
  the ``h`` of ``bmm`` (torch: expanded to (3, n, S));
- ``project_gates(x, w, bias, out)``: ``out[g] = x @ w[g] + bias[g]`` for the three gates
  (``out`` (3, R, S) gate-major, the layout the element-wise step runs on);
- ``empty(shape, dtype)`` / ``zeros(shape, dtype)``: the arrays a call returns (outputs,
  final states, gradients) and keeps for its backward (NumPy: its own; torch: arrays over
  ``torch.empty`` tensors, which the torch layer hands back as those tensors: ordinary,
  resizable torch tensors, not ``torch.from_numpy`` wrappers);
- ``bmm(h, w, out=out)``: ``out[g] = h @ w[g]`` (out (3, n, S), w (3, S, S) as
  ``gate_weights`` made it), and ``addmm_(out, a, b)``: ``out += a @ b`` (b the (3S, S)
  recurrent weights as ``recurrent(b)`` made them), the loops' per-step GEMMs: for torch,
  torch's own functions, so that a step's GEMM is one call into torch and no Python call of
  this library.

Gate-major GEMMs (three (B, S) products against per-gate weights (3, K, S), one batched call)
write the layout the element-wise step reads, so that no pass transposes the products; the
step's recurrent product is ``torch.bmm`` and one NumPy add of its projection, not
``torch.baddbmm`` (which copies the projection into the output first) nor NumPy's ``matmul``:
the times are in docs/performance.md, "The sequence loops' step".
"""
from __future__ import annotations

import numpy as np

from .memory import recycled

__all__ = ["NumpyGemm", "NUMPY_GEMM", "gate_weights", "row_blocks", "consecutive", "copy"]


def gate_weights(w):
    """(3S, K) weights as (3, K, S): ``[g] = w[g * S: (g + 1) * S].T``, C-contiguous (a copy)."""
    three_s, k = w.shape
    return np.ascontiguousarray(w.reshape(3, three_s // 3, k).transpose(0, 2, 1))


def copy(mm, a):
    """A copy of ``a`` in memory of the engine ``mm`` (``mm.empty``), C-ordered."""
    out = mm.empty(a.shape, a.dtype)
    np.copyto(out, a)
    return out


def _pieces(a, sizes) -> list:
    """Consecutive pieces of ``a`` along its second-to-last axis (one reshape where they are
    of one size, else a slice each)."""
    if len(sizes) and sizes[0] and [*sizes] == [sizes[0]] * len(sizes):
        n, steps = sizes[0], len(sizes)
        cut = a[..., : n * steps, :].reshape(a.shape[:-2] + (steps, n, a.shape[-1]))
        return [*(cut if a.ndim == 2 else cut.swapaxes(0, 1))]     # (2-D, or 3-D gate-major)
    out, start = [], 0
    for n in sizes:
        out.append(a[..., start: start + n, :])
        start += n
    return out


def row_blocks(a, starts, sizes) -> list:
    """``a[s:s + n]`` for each (s, n), as a list: one reshape and ``list`` where the blocks
    are consecutive and of one size (a fixed-length sequence's steps), else a slice each."""
    if consecutive(starts, sizes):
        n, s0, steps = sizes[0], starts[0], len(sizes)
        return [*a[s0: s0 + n * steps].reshape((steps, n) + a.shape[1:])]
    return [a[s: s + n] for s, n in zip(starts, sizes)]


def consecutive(starts, sizes) -> bool:
    """Whether blocks [s, s + n) are consecutive and of one size (a fixed-length sequence's
    steps): ``starts`` s0, s0 + n, s0 + 2n, ... (a ``range`` of step n, or equal to one)."""
    n = sizes[0] if len(sizes) else 0
    if type(starts) is range:
        return n > 0 and starts.step == n and len(starts) == len(sizes) and (
            type(sizes) is not tuple or sizes.count(n) == len(sizes))
    return n > 0 and [*sizes] == [n] * len(sizes) and [*starts] == [
        *range(starts[0], starts[0] + n * len(sizes), n)]


class NumpyGemm:
    """GEMMs by ``numpy.matmul``, and NumPy's own arrays (large ones in memory of earlier
    calls' that nothing refers to any more: ``memory.recycled``)."""

    @staticmethod
    def empty(shape, dtype):
        return recycled(dtype, shape)[0]

    zeros = staticmethod(np.zeros)

    def __call__(self, a, b):
        return np.matmul(a, b)

    @staticmethod
    def into(a, b, out):
        return np.matmul(a, b, out=out)

    @staticmethod
    def operand(a):
        return a

    kept = operand

    gate_weights = staticmethod(gate_weights)

    steps_of = staticmethod(_pieces)
    row_blocks = gate_inputs = staticmethod(row_blocks)    # (matmul broadcasts (n, S) @ (3, S, S))
    recurrent = operand

    @staticmethod
    def project_gates(x, w, bias, out):
        np.matmul(x, w, out=out)
        np.add(out, bias.reshape(3, 1, -1), out)

    @staticmethod
    def bmm(h, w, *, out):
        np.matmul(h, w, out=out)

    @staticmethod
    def addmm_(out, a, b):
        np.add(out, np.matmul(a, b), out)


NUMPY_GEMM = NumpyGemm()
