"""The torch layer's public functions: :func:`lltm` (one step), :func:`lltm_sequence` (a whole
sequence, padded or with lengths) and :func:`lltm_packed` (a ``PackedSequence``'s rows).

A call first decides, in one cheap pass (:func:`_plain`: plain tensors on one CPU or CUDA
device, one dtype its backend computes in, the expected shapes, and no autocast,
``torch.compile``, ``torch.export``, ``torch.jit.trace`` or ``torch.func`` transform in play),
whether the common case holds. If not, the general path first prepares the arguments
(:func:`_prepared`): under ``torch.autocast`` it casts them (differentiably, so gradients reach
the parameters in their own dtype) to the dtype the cell computes in: the autocast dtype on
CUDA (float16 or bfloat16), float32 under CPU autocast (NumPy has no bfloat16; float64 tensors
are left alone, as autocast leaves them); bfloat16 tensors on the CPU are computed in float32
and the results rounded to bfloat16; and it checks them, with messages that name the argument
and the shapes (:func:`check`).

Then a call takes one of three routes, each for its case:

1. **eager** (:func:`_run_step`, :func:`_run_sequence`): the autograd Function
   (``_functions.LLTMFunction``, ``_sequence_function.LLTMSequenceFunction``) where autograd
   will need a backward, through torch's C++ ``apply`` (Python's ``Function.apply`` under
   ``torch.func``'s transforms, which need it); else the Function's forward body alone
   (``step_inference`` / ``sequence_inference``: nothing computed or kept for a
   backward, the same bits);
2. **torch.compile and meta tensors** (shape inference): the custom operators
   (``_custom_ops``), opaque to the compiler, which run the same Function bodies;
3. **torch.export and torch.jit.trace**: the cell in torch's own operators (``_export``), which
   the recording sees.

Variable lengths (``lengths=``, ``PackedSequence``) run eagerly (route 1; a graph break under
torch.compile: their layout is planned from the lengths' values) and are refused by route 3.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .._checks import check_flag, check_packed_shapes, check_sequence_shapes, check_shapes
from . import _custom_ops, _export, _interop
from ._functions import LLTMFunction, apply, step_inference
from ._interop import cuda_backend
from ._sequence_function import LLTMSequenceFunction, sequence_inference

__all__ = ["lltm", "lltm_sequence", "lltm_packed", "check", "autocast_dtype", "eager_only"]

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
    cuda = cuda_backend(x)
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


# ---------------------------------------------------------------------------------------------
# The general path's parts

def check(tensors, names=_NAMES, check_shapes=check_shapes) -> None:
    """The torch-level checks, before any conversion or kernel: type, device, dtype, shapes;
    TypeError or ValueError naming the argument."""
    for name, t in zip(names, tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"lltm_cupy.torch: {name} must be a torch.Tensor, got "
                            f"{type(t).__qualname__}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"lltm_cupy.torch: all tensors must be on one device, got {listing}")
    device = tensors[0].device
    if device.type not in _interop.DTYPES and device.type != "meta":
        raise ValueError(f"lltm_cupy.torch: tensors on {device} are not supported (CPU or CUDA "
                         f"only)")
    # meta: shape inference only (the custom operators' fake implementations), any CUDA dtype
    kind = "cuda" if cuda_backend(tensors[0]) or device.type == "meta" else "cpu"
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        listing = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors))
        raise TypeError(f"lltm_cupy.torch: all tensors must have the same dtype, got {listing}")
    dtype = tensors[0].dtype
    if dtype not in _interop.DTYPES[kind]:
        allowed = ", ".join(str(d) for d in _interop.DTYPES[kind])
        hint = " (float16 runs on CUDA only)" if dtype == torch.float16 else ""
        raise TypeError(f"lltm_cupy.torch: unsupported dtype {dtype} on {device.type}; expected "
                        f"one of {allowed}{hint}")
    check_shapes(*tensors)


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype the cell computes in under the autocast state of ``device_type``, or None when
    autocast is off there."""
    if device_type not in _interop.DTYPES or not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return dtype
    return torch.float32


def _autocast(tensors):
    device = getattr(tensors[0], "device", None)
    dtype = None if device is None else autocast_dtype(device.type)
    if dtype is None or not all(isinstance(t, Tensor) for t in tensors):
        return tensors  # (the checks name a non-tensor argument)
    return tuple(t if t.dtype == torch.float64 or not t.is_floating_point() else t.to(dtype)
                 for t in tensors)


def _in_float32(tensors) -> bool:
    """bfloat16 tensors all on a device the NumPy backend serves: computed in float32."""
    return (all(isinstance(t, Tensor) and t.dtype == torch.bfloat16 for t in tensors)
            and not cuda_backend(tensors[0]))


def _prepared(tensors, names, shapes):
    """The general path's arguments: ``(tensors, finish)``, the tensors cast as autocast asks
    and checked (:func:`check` with ``names`` and ``shapes``), and ``finish``, which takes the
    results back to the arguments' dtype (bfloat16 on the CPU, computed in float32) or is
    None."""
    tensors = _autocast(tensors)
    finish = None
    if _in_float32(tensors):
        tensors = tuple(t.float() for t in tensors)
        finish = _to_bfloat16
    check(tensors, names, shapes)
    return tensors, finish


def _to_bfloat16(results):
    return tuple(t.bfloat16() for t in results)


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


def _compiling_or_meta(tensors) -> bool:
    """Route 2's case: torch.compile traces the call, or the tensors are meta tensors."""
    return _compiling() or tensors[0].device.type == "meta"


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
    tensors, finish = _prepared((input, weights, bias, old_h, old_cell), _NAMES, check_shapes)
    if _export.recording():                                         # route 3
        from .reference import lltm_reference

        out = lltm_reference(*tensors)
    elif _compiling_or_meta(tensors):                               # route 2
        out = (_custom_ops.lltm_forward_op(*tensors)[:2] if _needs_backward(*tensors)
               else _custom_ops.lltm_inference_op(*tensors))
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
    reverse = check_flag("lltm_cupy.torch.lltm_sequence", "reverse", reverse)
    fused = check_flag("lltm_cupy.torch.lltm_sequence", "fused", fused)
    tensors, finish = _prepared((inputs, weights, bias, h0, c0), _SEQ_NAMES,
                                check_sequence_shapes)
    if tensors[0].device.type == "meta":    # route 2 (lengths and direction change no shape)
        hs, h_n, c_n = _custom_ops.sequence_forward_op(*tensors)[:3]
        out = hs[1:], h_n, c_n
    elif lengths is not None:               # route 1, eagerly
        if _export.recording():
            raise _export.refusal("lltm_sequence with lengths=")
        out = _packed_sequence(tensors, lengths, reverse, fused)
    else:
        x = tensors[0].flip(0) if reverse else tensors[0]  # (every sequence full length)
        if _export.recording():                                     # route 3
            out = _export.sequence(x, *tensors[1:])
        elif _compiling():                                          # route 2
            if _needs_backward(*tensors):
                hs, h_n, c_n = _custom_ops.sequence_forward_op(x, *tensors[1:], fused)[:3]
                out = hs[1:], h_n, c_n
            else:
                out = _custom_ops.sequence_inference_op(x, *tensors[1:], fused)
        else:                                                       # route 1
            out = _run_sequence((x, *tensors[1:]), None, fused)
        if reverse:
            out = (out[0].flip(0), *out[1:])
    return tuple(out) if finish is None else finish(out)


@eager_only
def _packed_sequence(tensors, lengths, reverse: bool, fused: bool = False):
    """Variable lengths run eagerly (a graph break under torch.compile; an error with
    fullgraph=True): the packed layout depends on the lengths' values."""
    from .. import _packing

    steps, batch = tensors[0].shape[:2]
    _interop.use_plans((), tensors[0], lengths)     # lengths on the GPU: refused now
    plan = _packing.cached_plan(_packing.check_lengths(lengths, steps, batch), steps, reverse,
                                "torch")
    _interop.use_plans((plan,), tensors[0])
    return _run_sequence(tensors, plan, fused)


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
    fused = check_flag("lltm_cupy.torch.lltm_packed", "fused", fused)
    tensors, finish = _prepared((data, weights, bias, h0, c0), _SEQ_NAMES, check_packed_shapes)
    if _export.recording():
        raise _export.refusal("packed variable-length input")
    if tensors[0].device.type == "meta":                            # route 2
        # shape inference: the N rows as one step of N sequences (the first state row each)
        # gives every result its shape and dtype, connected to every argument for autograd
        data, weights, bias, h0, c0 = tensors
        rows, batch = data.shape[0], h0.shape[0]
        hs, h_n, c_n = _custom_ops.sequence_forward_op(
            data[None], weights, bias, h0[:1].expand(rows, -1), c0[:1].expand(rows, -1))[:3]
        out = hs[1], h_n[:batch], c_n[:batch]
    else:                                                           # route 1
        out = _run_sequence(tensors, plan, fused)
    return tuple(out) if finish is None else finish(out)
