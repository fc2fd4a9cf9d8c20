"""The array API's dispatch: each public call checks its arguments, picks the backend from the
arrays' type (NumPy: ``_numpy``, CuPy: ``_cuda``) and hands them on; the helpers the one-step
cell (``_cell``) and the whole models (``_layers``) share with it. Below both: the package's
``__init__`` only hands these names on."""
from __future__ import annotations

import reprlib

import numpy as np

from ._aliasing import private_cell, private_sequence
from ._checks import (check_backward, check_backward_sequence, check_flag, check_forward,
                      check_forward_sequence)

__all__ = ["forward", "backward", "forward_sequence", "backward_sequence", "warmup"]


def _backend(name: str):
    if name == "numpy":
        from . import _numpy as backend
    else:
        from . import _cuda as backend
    return backend


def _needed(needed) -> tuple:
    """``needed``: None, or any iterable of exactly 5 booleans (``bool`` or ``numpy.bool_``: a
    list, tuple, generator or boolean array); TypeError for anything else."""
    if needed is None:
        return (True,) * 5
    try:
        values = tuple(needed)
    except TypeError:
        raise TypeError(f"lltm_cupy: needed must be an iterable of 5 booleans (one per gradient "
                        f"field), got {type(needed).__qualname__}") from None
    if len(values) != 5 or not all(isinstance(v, (bool, np.bool_)) for v in values):
        raise TypeError(f"lltm_cupy: needed must hold 5 booleans (one per gradient field), "
                        f"got {len(values)} values: {reprlib.repr(values)}")
    return tuple(map(bool, values))


def _flag(name: str, value) -> bool:
    return check_flag("lltm_cupy", name, value)


def forward(input, weights, bias, old_h, old_cell, *, return_saved=True):
    """One LLTM step. Returns ``(new_h, new_cell, saved)``.

    input: (batch, features)
    weights: (3 * state, state + features); the first ``state`` columns act on old_h
    bias: (3 * state,) or (1, 3 * state)
    old_h: (batch, state)
    old_cell: (batch, state)

    All NumPy (float32, float64) or all CuPy on one GPU (float16, float32, float64), one dtype.
    ``new_h`` and ``new_cell`` are (batch, state) in the input dtype; ``saved`` is an
    :class:`LLTMSaved` to pass to :func:`backward`. No argument is modified. Infinities and NaN
    give the float64 reference's values (``lltm_cupy.reference``), with no NumPy warning.

    return_saved: False for a forward only (inference): nothing is computed or kept for a
        backward, and ``saved`` is ``None`` (the result still unpacks into three). ``new_h`` and
        ``new_cell`` are bit for bit those of ``return_saved=True``.

    Warning: ``saved`` refers to ``weights`` (no copy, which would cost as much as the step's
    GEMM): modifying the weights in place between this call and :func:`backward` silently gives
    wrong gradients. Update the weights after the backward (as optimisers do), or pass a copy.
    The torch layer (``lltm_cupy.torch``) detects such a change and raises.
    """
    keep = _flag("return_saved", return_saved)
    backend = check_forward(input, weights, bias, old_h, old_cell)
    new_h, new_cell, saved = _backend(backend).forward(input, weights, bias, old_h, old_cell,
                                                       keep=keep)
    if saved is None:
        return new_h, new_cell, None
    return new_h, private_cell(new_cell, saved), saved


def backward(grad_h, grad_cell, saved, *, needed=None):
    """Gradients of one LLTM step. Returns :class:`LLTMGrads`.

    grad_h: (batch, state) gradient of the loss w.r.t. new_h, or None for zero
    grad_cell: (batch, state) gradient w.r.t. new_cell, or None for zero
    saved: what :func:`forward` returned, untouched (it may be used more than once)
    needed: optional 5 booleans in the order of the fields below; a False field is returned as
        None and its GEMM or reduction is skipped (default: all computed)

    Fields, each shaped like its forward argument: ``d_old_h (batch, state)``,
    ``d_input (batch, features)``, ``d_weights (3 * state, state + features)``,
    ``d_bias`` (like the bias given), ``d_old_cell (batch, state)``.
    """
    backend = check_backward(grad_h, grad_cell, saved)
    return _backend(backend).backward(grad_h, grad_cell, saved, _needed(needed))


def forward_sequence(inputs, weights, bias, h0, c0, lengths=None, reverse=False, *,
                     return_saved=True, fused=False):
    """Run the cell over a whole sequence. Returns ``(outputs, h_n, c_n, saved)``.

    inputs: (steps, batch, features)
    weights: (3 * state, state + features), as for :func:`forward`
    bias: (3 * state,) or (1, 3 * state)
    h0, c0: (batch, state), the initial state
    lengths: optional (batch,) integers in [0, steps] (a list, NumPy or CuPy array, or torch
        tensor): sequence b runs its first ``lengths[b]`` steps; its outputs past them are zero
        and its ``h_n``, ``c_n`` are its state after its last step (``h0``, ``c0`` for length 0).
        Lengths on a GPU are copied to the host first (a wait); under CUDA-graph capture the
        same ``lengths`` must have run once before (docs/gpu-training.md).
    reverse: run each sequence from its own last valid step back to step 0 (the reverse
        direction of a bidirectional layer); outputs stay at their time positions
    return_saved: False for a forward only (inference): ``saved`` is ``None`` (the result still
        unpacks into four), nothing is kept for a backward, and memory beyond the outputs does
        not grow with ``steps``; the outputs and final states are bit for bit the same.

    ``outputs`` (steps, batch, state) holds the hidden state after every step; ``h_n`` and
    ``c_n`` (batch, state) are the final state: :func:`forward` stepped ``steps`` times, with
    the input projection of all steps in one GEMM. Same array, dtype and device rules as
    :func:`forward`; steps may be 0. With ``lengths`` (or ``reverse``) the batch runs packed
    (as ``PackedSequence``): padded positions cost nothing.

    fused: GPU only (CuPy arrays; the CPU backend ignores it): run all steps in one launch of
        the fused sequence kernel per call, the recurrent weights held in shared memory for every
        step, and its backward the same way; state sizes whose weights do not fit one block's
        shared memory (above 195 in 16-bit types, 138 in float32, 97 in float64 on H100/H200;
        165, 117, 82 on A100) run in a cluster of up to 8 blocks on sm_90 and newer (up to 544,
        388, 272; speed not measured yet), or of 16 blocks (up to 768, 544, 384) where the device
        can hold one (a non-portable cluster size, which CUDA's occupancy query must say fits;
        not yet run on a GPU); on sm_80 to sm_89 in a cooperative group of up to 8 blocks
        exchanging through global memory (up to 464, 328, 232 on A100; never run on a GPU yet);
        larger ones the stepped path as without it. Off by default: the stepped path is the one
        measured on a GPU so far (see docs/performance.md).

    Warning: ``saved`` refers to ``weights`` and, when contiguous, to ``inputs``: do not modify
    them in place before :func:`backward_sequence` (the gradients would be silently wrong).
    """
    keep = _flag("return_saved", return_saved)
    backend = check_forward_sequence(inputs, weights, bias, h0, c0)
    reverse = _flag("reverse", reverse)
    outputs, h_n, c_n, saved = _forward_sequence(backend, inputs, weights, bias, h0, c0,
                                                 sequence_plan(inputs, lengths, reverse), keep,
                                                 _flag("fused", fused))
    if saved is None:       # nothing kept: the outputs are the caller's alone
        return outputs, h_n, c_n, None
    return private_sequence(inputs, outputs, saved), h_n, c_n, saved


def sequence_plan(inputs, lengths, reverse):
    """None for the fixed-length forward path, else the packed layout of ``lengths`` (all
    ``steps`` when None) for ``inputs`` (steps, batch, ...)."""
    if lengths is None and not reverse:
        return None
    from . import _packing

    steps, batch = inputs.shape[:2]
    checked = (np.full(batch, steps, np.int64) if lengths is None
               else _packing.check_lengths(lengths, steps, batch))
    return _packing.cached_plan(checked, steps, reverse=bool(reverse))


def _forward_sequence(backend, inputs, weights, bias, h0, c0, plan, keep=True, fused=False):
    """The backend's forward_sequence on checked arguments (no copies for the caller);
    ``keep=False``: forward only, saved is None; ``fused``: the GPU's fused sequence kernels
    (the CPU backend has one path)."""
    kw = {} if plan is None else {"plan": plan}
    if fused and backend == "cupy":
        kw["fused"] = True
    return _backend(backend).forward_sequence(inputs, weights, bias, h0, c0, keep=keep, **kw)


def backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved, *, needed=None):
    """Gradients of a sequence (backpropagation through time). Returns :class:`LLTMSequenceGrads`.

    grad_outputs: (steps, batch, state) gradient w.r.t. outputs, or None for zero
    grad_h_n, grad_c_n: (batch, state) gradients w.r.t. the final state, or None for zero
    saved: what :func:`forward_sequence` returned, untouched (with ``lengths``, the gradients
        at padded positions of ``grad_outputs`` are ignored, and ``d_inputs`` is zero there)
    needed: optional 5 booleans in the order of the fields below; a False field is returned as
        None and its GEMM or reduction is skipped (default: all computed)

    Fields: ``d_inputs (steps, batch, features)``, ``d_weights (3 * state, state + features)``,
    ``d_bias`` (like the bias given), ``d_h0 (batch, state)``, ``d_c0 (batch, state)``.
    """
    backend = check_backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved)
    return _backend(backend).backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved,
                                               _needed(needed))


def warmup(dtypes=("float32",), device=None, *, fused=False) -> None:
    """Compile and load now every GPU kernel the calls above launch for these dtypes.

    dtypes: one dtype or several: NumPy dtypes or names ("float16", "float32", "float64"), and
        "bfloat16" or ``torch.bfloat16`` for the torch layer's bfloat16 tensors (torch dtypes are
        read by name; torch is not imported)
    device: the GPU: an int, a ``cupy.cuda.Device`` or a ``torch.device("cuda:N")``; None (or a
        torch device without an index) for CuPy's current device
    fused: also the fused sequence kernels (``fused=True`` of the sequence calls), on the
        same paths (a compile of their own module per dtype)

    Otherwise kernels compile (NVRTC) and load at their first use. Call this once per process,
    device and dtype before capturing CUDA graphs, so that nothing compiles or loads inside a
    capture (docs/gpu-training.md), or to take the compile time out of a benchmark: it runs
    every code path of the four calls on tiny arrays and synchronises; where torch is imported
    it also makes torch's cuBLAS handles and CUDA context for the calling thread and autograd's.
    Fused plans past one block's shared memory depend on shapes it does not know: run such a
    call eagerly once before capturing it. Needs CuPy and a GPU (RuntimeError otherwise).
    """
    from . import _cuda

    try:
        specs = [dtypes] if isinstance(dtypes, str) else list(dtypes)
    except TypeError:
        specs = [dtypes]
    parsed = list(dict.fromkeys(_cuda.warmup_dtype(d) for d in specs))
    if device is None or isinstance(device, int):
        device_id = device
    elif getattr(device, "type", "cuda") != "cuda":
        raise ValueError(f"lltm_cupy.warmup: device must be a CUDA device, got {device}")
    else:
        device_id = getattr(device, "index", getattr(device, "id", None))
    _cuda.warmup(parsed, device_id, fused=_flag("fused", fused))
    import sys

    if "torch" in sys.modules:      # a torch user: torch's cuBLAS handles for a later capture
        from .torch import _interop

        _interop.prepare_capture(_cuda.kernels.cupy_module().cuda.Device(device_id).id)
