"""PyTorch layer: differentiable `lltm` and `lltm_sequence`, and the `LLTMCell` and `LLTM` modules.

Tensors move to NumPy (CPU) or CuPy (CUDA) arrays without a copy and the backends of
:mod:`lltm_cupy` do the work, after the checks here (which cover everything the array API
checks). On CUDA every kernel and GEMM runs on torch's current stream of the tensors' device,
every byte comes from torch's caching allocator, and the results are ordinary torch tensors, so
a training step can be captured in a CUDA graph (``torch.cuda.graph``, or
``torch.compile(mode="reduce-overhead")``). On the CPU the NumPy backend's GEMMs run through
torch's BLAS, so that the process has one BLAS thread pool.

One file per job:

- ``_interop``: checks, conversions, device, stream, memory and GEMM of a backend call;
- ``_dispatch``: what every call decides before the backend runs (autocast, forward only);
- ``_cell_op`` / ``_sequence_op``: the autograd Functions (eager) and custom operators
  (torch.compile) of one step and of whole sequences;
- ``_module_args``, ``_cell_module``, ``_lltm_module``: ``LLTMCell`` and ``LLTM``, their checks;
- ``reference``: the pure-torch reference (:func:`lltm_reference`, :class:`ReferenceLLTMCell`),
  the tutorial's Python LLTM differentiated by autograd.
"""
from __future__ import annotations

from ._cell_module import LLTMCell
from ._cell_op import LLTMFunction, lltm
from ._lltm_module import LLTM
from ._sequence_op import LLTMSequenceFunction, lltm_sequence
from .reference import ReferenceLLTMCell, lltm_reference

__all__ = ["lltm", "LLTMFunction", "LLTMCell", "lltm_sequence", "LLTMSequenceFunction", "LLTM",
           "lltm_reference", "ReferenceLLTMCell"]
