"""The benchmark harness behind scripts/benchmark.py (and the other timing scripts beside it):
our LLTM against the peers a user would pick. It lives beside the scripts, outside the
installed package: run it from a checkout (``python scripts/benchmark.py``).

Implementations (names used by ``--impl``):

- ``reference``: the tutorial's pure-torch LLTM, eager (:class:`lltm_cupy.torch.ReferenceLLTMCell`);
  ``compiled``: the same under ``torch.compile``; ``compiled-ro`` (CUDA): under
  ``mode="reduce-overhead"`` (inductor's kernels replayed from CUDA graphs);
- ``cell``: our :class:`lltm_cupy.torch.LLTMCell`; ``array``: our array API (NumPy on the CPU,
  CuPy on the GPU), called directly; ``lstm``: ``torch.nn.LSTMCell`` of the same hidden size
  (different math, comparable work);
- ``cell-graph`` / ``reference-graph`` (CUDA): our cell / the reference with forward and
  backward captured in CUDA graphs (``torch.cuda.make_graphed_callables``) and replayed: what a
  training loop that captures its step pays, with no host cost per kernel;
- run only when named in ``--impl``: ``cell-op``, our cell through the ``lltm_cupy::step``
  custom operator in eager mode (the path torch.compile uses); ``cell-floor``, the same backend
  in a bare ``autograd.Function`` with no checks and no module, the floor any NumPy-backed
  Function can reach; ``function-floor``, a bare Function that does no LLTM work, the fixed
  cost of one timed step (Function, loss, autograd engine) any Function-based cell pays (the
  floors: CPU only, parameters' gradients only).

Every implementation runs the tutorial's step, ``h, c = cell(x, (h0, c0))``, then a backward of
``h`` and ``c`` with gradient one, into the parameters only (``all_grads``: the inputs and state
too). The timings are interleaved and rotated in one loop, so that machine drift hits all alike:
each iteration times the forward, the backward of that forward, and a whole forward+backward;
on the GPU between synchronisations, with CUDA events.

Layout: ``_common`` (configuration, timers, timing loops, the record), ``cell`` (the one-step
peers, :func:`run_size`), ``sequence`` (whole sequences, :func:`run_sequence`), ``reports``
(tables, plots), ``diagnostics`` (GPU kernels, CPU BLAS, the mixed model), ``inference`` and
``scaling`` (the CPU sequence reports of ``--inference`` and ``scripts/cpu_scaling.py``).
"""
from __future__ import annotations

from ._common import PHASES, Config, ImplementationError, machine_name
from .cell import CPU_SIZES, EXTRA_IMPLS, GPU_SIZES, GRAPH_IMPLS, IMPLS, run_size
from .diagnostics import (blas_names, cpu_blas_report, format_blas_report, format_gpu_report,
                          format_mixed, gpu_kernel_report, mixed_model_report)
from .reports import format_table, plot_inference, plot_speedups
from .sequence import PAIRED_SEQUENCE_IMPLS, SEQUENCE_IMPLS, SEQUENCE_SIZES, run_sequence

__all__ = ["Config", "IMPLS", "EXTRA_IMPLS", "GRAPH_IMPLS", "PHASES", "CPU_SIZES", "GPU_SIZES",
           "SEQUENCE_IMPLS", "PAIRED_SEQUENCE_IMPLS", "SEQUENCE_SIZES", "ImplementationError",
           "run_size", "run_sequence", "format_table", "plot_speedups", "plot_inference",
           "machine_name", "gpu_kernel_report", "format_gpu_report", "cpu_blas_report",
           "format_blas_report", "blas_names", "mixed_model_report", "format_mixed"]
