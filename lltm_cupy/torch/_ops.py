"""The torch layer's public functions: :func:`lltm` (one step), :func:`lltm_sequence` (a whole
sequence, padded or with lengths) and :func:`lltm_packed` (a ``PackedSequence``'s rows).

A call first decides, in one cheap pass (:func:`_plain`: plain tensors on one CPU or CUDA
device, one dtype its backend computes in, the expected shapes, and no autocast,
``torch.compile``, ``torch.export``, ``torch.jit.trace`` or ``torch.func`` transform in play),
whether the common case holds. If not, the general path (:func:`_sequence` for sequences) first
makes the arguments ready (``_arguments.prepared``: cast as autocast asks, bfloat16 on the CPU
computed in float32, checked with messages that name the argument and the shapes).

Then a call takes one of three routes, each for its case:

1. **eager** (:func:`_run_step`, :func:`_run_sequence`): the autograd Function
   (``_functions.LLTMFunction``, ``_sequence_function.LLTMSequenceFunction``) where autograd
   will need a backward, through torch's C++ ``apply`` (Python's ``Function.apply`` under
   ``torch.func``'s transforms, which need it); else the Function's forward body alone
   (``step_inference`` / ``sequence_inference``: nothing computed or kept for a
   backward, the same bits);
2. **torch.compile and meta tensors** (shape inference): the custom operators
   (``_custom_ops.compiled_step`` / ``compiled_sequence``), opaque to the compiler, which run the
   same Function bodies;
3. **torch.export and torch.jit.trace**: the cell in torch's own operators (``_export``), which
   the recording sees.

Variable lengths (``lengths=``, ``PackedSequence``) run eagerly (route 1, :func:`_variable`; a
graph break under torch.compile: their layout is planned from the lengths' values) and are
refused by route 3.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._checks import check_packed_shapes, check_sequence_shapes, check_shapes
from . import _custom_ops, _export, _interop
from ._arguments import prepared
from ._functions import LLTMFunction, apply, step_inference
from ._sequence_function import LLTMSequenceFunction, sequence_inference

__all__ = ["lltm", "lltm_sequence", "lltm_packed", "eager_only"]

_NAMES = ("input", "weights", "bias", "old_h", "old_cell")
_SEQ_NAMES = ("inputs", "weights", "bias", "h0", "c0")

#: What the eager fast path takes: plain tensors (parameters too), and per device kind the
#: dtypes its backend computes in
_PLAIN = frozenset((Tensor, torch.nn.Parameter))
_CPU_DTYPES = frozenset(_interop.DTYPES["cpu"])
_CUDA_DTYPES = frozenset(_interop.DTYPES["cuda"])

_step_apply = super(torch.autograd.Function, LLTMFunction).apply
_sequence_apply = super(torch.autograd.Function, LLTMSequenceFunction).apply
_functorch_active = torch._C._are_functorch_transforms_active
_tracing = torch._C._is_tracing
_autocast_on = torch.is_autocast_enabled
_grad_on = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_exporting = _export._exporting

#: :func:`_plain`'s shapes: the input's dimensions, and which of them is the batch (matched
#: against the state's rows; None: a PackedSequence's rows, any number)
STEP, SEQUENCE, ROWS = (2, 0), (3, 1), (2, None)


def _plain(x, weights, bias, h, c, form) -> bool:
    """Whether a call takes the eager fast path (see the module docstring): one pass over
    types, device, dtype and shapes (``form``: :data:`STEP`, :data:`SEQUENCE` or
    :data:`ROWS`), and the environment."""
    if _compiling() or not (type(x) in _PLAIN and type(weights) in _PLAIN
                            and type(bias) in _PLAIN and type(h) in _PLAIN
                            and type(c) in _PLAIN):
        return False
    cuda = x.is_cuda    # the device's kind (emulated CUDA: CPU float16 takes the general path)
    if cuda:
        device = x.device
        if not (x.dtype in _CUDA_DTYPES and weights.device == device
                and bias.device == device and h.device == device and c.device == device):
            return False
    elif not (x.is_cpu and x.dtype in _CPU_DTYPES and weights.is_cpu and bias.is_cpu
              and h.is_cpu and c.is_cpu):
        return False
    dtype = x.dtype
    shape = x.shape
    h_shape = h.shape
    dims, batch = form
    if (len(shape) != dims or len(h_shape) != 2 or weights.dtype != dtype or bias.dtype != dtype
            or h.dtype != dtype or c.dtype != dtype or c.shape != h_shape
            or (batch is not None and h_shape[0] != shape[batch])):
        return False
    state = h_shape[1]
    if weights.shape != (3 * state, state + shape[-1]) or (
            bias.shape != (3 * state,) and bias.shape != (1, 3 * state)):
        return False
    return not (_autocast_on("cuda" if cuda else "cpu") or _functorch_active() or _tracing()
                or _exporting())


def eager_step(input, weights, bias, old_h, old_cell):
    """One step on the eager fast path: ``(new_h, new_cell)``, or None where it does not apply
    (then :func:`lltm` takes the general path)."""
    if not _plain(input, weights, bias, old_h, old_cell, STEP):
        return None
    if _grad_on() and (input.requires_grad or weights.requires_grad or bias.requires_grad
                       or old_h.requires_grad or old_cell.requires_grad):
        return _step_apply(input, weights, bias, old_h, old_cell)[:2]
    return step_inference(input, weights, bias, old_h, old_cell)


def _needs_backward(a, b, c, d, e) -> bool:
    """Whether autograd will record the call: grad mode on (off under ``torch.no_grad`` and
    ``torch.inference_mode``) and some argument requiring grad. Read at trace time under
    torch.compile, where Dynamo guards on both, so the choice costs no graph break."""
    return _grad_on() and (a.requires_grad or b.requires_grad or c.requires_grad
                           or d.requires_grad or e.requires_grad)


def _run_step(tensors):
    """Route 1 for one step: the Function where a backward will follow (or a ``torch.func``
    transform's wrapper is among the arguments), else its forward alone."""
    if _needs_backward(*tensors) or _transformed(tensors):
        return apply(LLTMFunction, *tensors)[:2]
    return step_inference(*tensors)


def _run_sequence(tensors, plan, fused):
    """Route 1 for a sequence (``plan``: None, or the packed layout of variable lengths)."""
    if _needs_backward(*tensors) or _transformed(tensors):
        return apply(LLTMSequenceFunction, *tensors, plan, fused)[:3]
    return sequence_inference(*tensors, plan, fused)


def _transformed(tensors) -> bool:
    """Whether any argument is a ``torch.func`` transform's wrapper (vmap's batched tensor,
    grad's tracking tensor): those go to the autograd Functions, which support grad and refuse
    vmap clearly."""
    check_wrapped = getattr(getattr(torch._C, "_functorch", None),
                            "is_functorch_wrapped_tensor", None)
    return check_wrapped is not None and any(check_wrapped(t) for t in tensors)


def eager_only(fn):
    """``fn`` run eagerly under torch.compile (a graph break), as ``torch.compiler.disable(fn)``,
    but without importing torch's compiler at import time or in eager calls (``disable`` imports
    ``torch._dynamo`` and with it sympy and more): ``disable`` is applied only when dynamo,
    already loaded, traces the call."""
    disabled = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------------------------------
# The public functions

def lltm(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
         old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """One differentiable LLTM step. Returns ``(new_h, new_cell)``, each (batch, state).

    input: (batch, features)
    weights: (3 * state, state + features); the first ``state`` columns act on old_h
    bias: (3 * state,) or (1, 3 * state)
    old_h: (batch, state)
    old_cell: (batch, state)

    One device (CPU or CUDA) and one dtype for all: float32, float64, bfloat16 (on the CPU
    computed in float32 and rounded), float16 on CUDA; under ``torch.autocast`` the arguments are
    cast first (see the module docstring). Bad input raises TypeError/ValueError before any
    kernel runs. Second derivatives (``create_graph=True``) are supported eagerly.
    """
    out = eager_step(input, weights, bias, old_h, old_cell)
    if out is not None:
        return out
    tensors, _, finish = prepared((input, weights, bias, old_h, old_cell), _NAMES, check_shapes)
    if _export.recording():                                         # route 3
        from .reference import lltm_reference

        out = lltm_reference(*tensors)
    elif _compiling() or tensors[0].device.type == "meta":          # route 2
        out = _custom_ops.compiled_step(tensors, _needs_backward(*tensors))
    else:                                                           # route 1
        out = _run_step(tensors)
    return out if finish is None else finish(out)


def lltm_sequence(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor, c0: Tensor,
                  lengths=None, reverse: bool = False, *,
                  fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The cell over a whole sequence, differentiable. Returns ``(outputs, h_n, c_n)``.

    inputs: (steps, batch, features)
    weights: (3 * state, state + features); bias: (3 * state,) or (1, 3 * state)
    h0, c0: (batch, state)
    lengths: optional (batch,) integers in [0, steps] (a CPU tensor, list or array; a CUDA
        tensor is copied to the host first, which waits for the device): as for
        :func:`lltm_cupy.forward_sequence`, the sequences run packed, outputs past a length are
        zero, h_n / c_n are each sequence's state at its own last step (run eagerly: a graph
        break under torch.compile). Under CUDA-graph capture the same lengths must have run
        once eagerly before (else RuntimeError, before any work is queued), and the graph
        is valid for those lengths only.
    reverse: each sequence runs from its own last valid step back to step 0
    fused: on CUDA, every step of the sequence (and of its backward) in one launch of the fused
        sequence kernel, as :func:`lltm_cupy.forward_sequence`'s ``fused``: state sizes whose
        weights fit neither a block's shared memory nor, on sm_90 and newer, a cluster's of up
        to 8 blocks (or of 16 where the device holds one), and CPU tensors, run as without it.
        Off by default until a GPU has measured it faster than the default path.

    outputs: (steps, batch, state), the hidden state after every step; h_n, c_n: (batch, state).
    Same device, dtype and autocast rules as :func:`lltm`; second derivatives as there.
    """
    if (lengths is None and reverse.__class__ is bool and fused.__class__ is bool
            and _plain(inputs, weights, bias, h0, c0, SEQUENCE)):
        if reverse:
            inputs = inputs.flip(0)
        if _needs_backward(inputs, weights, bias, h0, c0):
            outputs, h_n, c_n = _sequence_apply(inputs, weights, bias, h0, c0, None, fused)[:3]
        else:
            outputs, h_n, c_n = sequence_inference(inputs, weights, bias, h0, c0, None,
                                                   fused)
        return (outputs.flip(0) if reverse else outputs), h_n, c_n
    return _sequence((inputs, weights, bias, h0, c0), lengths, None, reverse, fused)


def lltm_packed(data: Tensor, weights: Tensor, bias: Tensor, h0: Tensor, c0: Tensor,
                plan, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """One layer and direction over a ``PackedSequence``'s ``data`` (rows, features), laid out
    as ``plan`` says (``lltm_cupy._packing.packed_plan`` of its ``batch_sizes`` and the
    direction): returns ``(out_data, h_n, c_n)``, ``out_data`` (rows, state) in the same layout;
    the states h0, c0 and h_n, c_n (batch, state) are in the sorted batch order (the caller
    applies ``sorted_indices`` / ``unsorted_indices``, as :class:`LLTM` does).
    What :class:`LLTM` runs for PackedSequence input: no padded tensor is made, in or out.
    Autocast, dtype and ``fused`` rules as :func:`lltm_sequence`; eager only."""
    if fused.__class__ is bool and _plain(data, weights, bias, h0, c0, ROWS):
        if _needs_backward(data, weights, bias, h0, c0):
            return _sequence_apply(data, weights, bias, h0, c0, plan, fused)[:3]
        return sequence_inference(data, weights, bias, h0, c0, plan, fused)
    return _sequence((data, weights, bias, h0, c0), None, plan, False, fused)


def _sequence(tensors, lengths, plan, reverse, fused):
    """The general path of :func:`lltm_sequence` (``lengths``: None or the sequences' lengths)
    and :func:`lltm_packed` (``plan``: the packed rows' layout)."""
    packed = plan is not None
    tensors, (reverse, fused), finish = prepared(
        tensors, _SEQ_NAMES, check_packed_shapes if packed else check_sequence_shapes,
        f"lltm_cupy.torch.{'lltm_packed' if packed else 'lltm_sequence'}", reverse=reverse,
        fused=fused)
    x, weights, bias, h0, c0 = tensors
    fixed = lengths is None and not packed    # every sequence full length
    if fixed and reverse:
        x = x.flip(0)
    meta = x.device.type == "meta"
    recording = _export.recording()
    if recording and not fixed:     # (meta too: a recording would keep route 2's stand-in)
        raise _export.refusal("packed variable-length input" if packed
                              else "lltm_sequence with lengths=")
    if recording and not meta:                                      # route 3
        out = _export.sequence(x, weights, bias, h0, c0)
    elif meta or (fixed and _compiling()):                          # route 2
        backward = _needs_backward(*tensors)
        if packed:
            # shape inference: the N rows as one step of N sequences (the first state row each)
            # gives every result its shape and dtype, connected to every argument for autograd
            rows, batch = x.shape[0], h0.shape[0]
            out = _custom_ops.compiled_sequence(x[None], weights, bias, h0[:1].expand(rows, -1),
                                                c0[:1].expand(rows, -1), fused, backward)
            out = out[0][0], out[1][:batch], out[2][:batch]
        else:   # (lengths and direction change no shape)
            out = _custom_ops.compiled_sequence(x, weights, bias, h0, c0, fused, backward)
    elif fixed:                                                     # route 1
        out = _run_sequence((x, weights, bias, h0, c0), None, fused)
    else:                                                           # route 1, eagerly
        out = _variable(tensors, lengths, plan, reverse, fused)
    if fixed and reverse:
        out = (out[0].flip(0), *out[1:])
    return tuple(out) if finish is None else finish(out)


@eager_only
def _variable(tensors, lengths, plan, reverse: bool, fused: bool):
    """Route 1 for variable lengths (see the module docstring; an error under torch.compile
    with fullgraph=True). ``plan``: a PackedSequence's layout, or None: that of ``lengths``."""
    if plan is None:
        plan, = _interop.use_plans((), tensors[0], lengths, reverse)
    return _run_sequence(tensors, plan, fused)
