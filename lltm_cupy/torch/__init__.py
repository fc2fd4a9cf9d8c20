"""PyTorch layer: differentiable `lltm` and `lltm_sequence`, and the `LLTMCell` and `LLTM` modules.

The backends of :mod:`lltm_cupy` do the work, after the checks here (which cover everything the
array API checks). On CUDA the kernels are launched on the tensors' device pointers and every
kernel and GEMM (torch's) runs on torch's current stream of the tensors' device; every byte
comes from torch's caching allocator and the results are ordinary torch tensors, so a training
step can be captured in a CUDA graph (``torch.cuda.graph``, or
``torch.compile(mode="reduce-overhead")``). On the CPU tensors reach the NumPy backend as
arrays over their memory, without a copy, and its GEMMs run through torch (its BLAS; a
sequence's per-step products by oneDNN from a size on), so that the process has one thread
pool for them.

One file per job, read top to bottom, each importing only files below it:

- ``_cell_module``, ``_lltm_module``: the modules ``LLTMCell`` and ``LLTM``; ``_module_args``:
  what they share (their checks, the one-step modules' parameters);
- ``_ops``: the public functions ``lltm``, ``lltm_sequence``, ``lltm_packed``: the eager fast
  path's one cheap test, and the general path's routes (eager, compile, export);
  ``_arguments``: the general path's arguments made ready (autocast, bfloat16, checks);
- ``_custom_ops``: the custom operators torch.compile and shape inference run;
- ``_functions``, ``_sequence_function``: the autograd Functions, one per operation (a step, a
  sequence), and their backward with grad mode on (second derivatives);
- ``_export``: what the layer computes while torch.export or jit.trace records it;
  ``reference``: the pure-torch reference (:func:`lltm_reference`, :class:`ReferenceLLTMCell`,
  the backward's formulas in torch operations);
- ``_interop``, ``_cpu_arrays``, ``_torch_gemm``: the bridge to the backends (CPU conversions,
  device, stream, memory, GEMMs); ``_cuda_sequence``, ``_cuda_packed``: sequences on the CUDA
  kernels' pointer launches (one length, fused; variable lengths).
"""
from __future__ import annotations

from ._cell_module import LLTMCell
from ._functions import LLTMFunction
from ._lltm_module import LLTM
from ._ops import lltm, lltm_sequence
from ._sequence_function import LLTMSequenceFunction
from .reference import ReferenceLLTMCell, lltm_reference

__all__ = ["lltm", "LLTMFunction", "LLTMCell", "lltm_sequence", "LLTMSequenceFunction", "LLTM",
           "lltm_reference", "ReferenceLLTMCell"]
