"""Benchmark library behind scripts/benchmark.py: our LLTM against the peers a user would pick.

Implementations (names used by ``--impl``):

- ``reference``: the tutorial's pure-torch LLTM, eager (:class:`lltm_cupy.torch.ReferenceLLTMCell`);
- ``compiled``: the same module under ``torch.compile`` (where it compiles on the machine);
- ``cell``: our :class:`lltm_cupy.torch.LLTMCell`;
- ``array``: our array API (NumPy on the CPU, CuPy on the GPU), called directly;
- ``lstm``: ``torch.nn.LSTMCell`` of the same hidden size (different math, comparable work);
- ``cell-graph`` / ``reference-graph`` (CUDA only): our cell / the reference with forward and
  backward each captured in a CUDA graph (``torch.cuda.make_graphed_callables``) and replayed:
  what a training loop that captures its step pays, with no host cost per kernel;
- ``compiled-ro`` (CUDA only): the reference under ``torch.compile(mode="reduce-overhead")``
  (inductor's kernels replayed from CUDA graphs);
- ``cell-op``: our cell called through the ``lltm_cupy::step`` custom operator in eager
  mode (the path torch.compile uses), to measure its per-call cost against ``cell``'s plain
  ``autograd.Function`` (not run unless named in ``--impl``);
- ``cell-floor``: the same backend inside a bare ``autograd.Function`` with no argument checks,
  no version checks and no module (CPU only, parameters' gradients only): not a usable op, the
  floor any NumPy-backed Function can reach (not run unless named in ``--impl``);
- ``function-floor``: a bare ``autograd.Function`` that does no LLTM work (it returns copies of
  the state and zero parameter gradients): the fixed cost of one timed step (Function, the
  tutorial's loss and the autograd engine) that any ``autograd.Function``-based cell pays on top
  of its own work (CPU only, parameters' gradients only; not run unless named in ``--impl``).

Every implementation runs the tutorial's step: ``h, c = cell(x, (h0, c0))`` then a backward of
``h`` and ``c`` with gradient one (the tutorial's ``(h.sum() + c.sum()).backward()``), with
gradients for the parameters only (add ``all_grads`` for the inputs and state too). Timings are
taken in one loop, interleaved and rotated so that machine drift hits all implementations alike:
each iteration times the forward, the backward of that forward, and a whole forward+backward.
On the GPU each timed region is bracketed by synchronisations and timed with CUDA events.

Layout: ``_common`` (configuration, timers, the timing loop), ``cell`` (the one-step peers and
:func:`run_size`), ``sequence`` (whole sequences and :func:`run_sequence`), ``reports`` (tables,
plot), ``diagnostics`` (the GPU-kernel, CPU-BLAS and mixed-model reports). A new peer is a name and a
branch in ``cell`` (one step) or ``sequence`` (whole sequences).
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
           "run_size", "run_sequence", "format_table", "plot_speedups", "plot_inference", "machine_name",
           "gpu_kernel_report", "format_gpu_report", "cpu_blas_report", "format_blas_report",
           "blas_names", "mixed_model_report", "format_mixed"]
