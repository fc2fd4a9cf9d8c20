"""The differentiable operations: ``lltm`` and ``lltm_sequence``.

Two paths give the same results:

- eager calls go through :class:`LLTMFunction` / :class:`LLTMSequenceFunction`, plain
  ``torch.autograd.Function`` s (the cheapest per call);
- under ``torch.compile`` the same work runs as the custom operators ``lltm_cupy::lltm_forward``,
  ``lltm_cupy::lltm_backward`` and their sequence twins (``torch.library.custom_op`` with fake and
  autograd registrations), which the compiler treats as opaque: no graph break, and CUDA graphs
  (``mode="reduce-overhead"``) capture them like torch's own kernels.

Whenever autograd will not need a backward (grad mode off, as under ``torch.no_grad`` and
``torch.inference_mode``, or no argument requiring grad), both paths run the backends' forward
only (``keep=False``: nothing computed or kept for a backward, the same bits): eagerly as a plain
call, compiled as the custom operators ``lltm_cupy::lltm_inference`` and
``lltm_cupy::lltm_sequence_inference`` (no autograd registration needed).

Under ``torch.autocast`` the arguments are first cast (differentiably, so gradients reach the
parameters in their own dtype) to the dtype the cell computes in: the autocast dtype on CUDA
(float16 or bfloat16), float32 under CPU autocast (NumPy has no bfloat16). float64 tensors are
left alone, as autocast leaves them. bfloat16 tensors on the CPU are computed in float32 and the
results rounded to bfloat16.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import _interop
from .._checks import check_flag, check_packed_shapes, check_sequence_shapes
from .._types import LLTMSaved, LLTMSequenceSaved

__all__ = ["lltm", "LLTMFunction", "lltm_sequence", "LLTMSequenceFunction", "autocast_dtype"]

_SEQ_NAMES = ("inputs", "weights", "bias", "h0", "c0")


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
            and not _interop.uses_cupy(tensors[0].device))


# LLTMGrads order (d_old_h, d_input, d_weights, d_bias, d_old_cell) <-> forward argument order
# (input, weights, bias, old_h, old_cell).
def _to_argument_order(g):
    return g[1], g[2], g[3], g[0], g[4]


def _to_grads_order(needs):
    return needs[3], needs[0], needs[1], needs[2], needs[4]


def _refuse_double_backward() -> None:
    # The engine runs backward with grad mode on exactly when create_graph=True. Our backward is
    # not differentiable; returning its result would silently give zero second derivatives.
    if torch.is_grad_enabled():
        raise RuntimeError("lltm_cupy.torch: double backward (create_graph=True) is not supported: "
                           "the LLTM backward kernels are not differentiable")


# ---------------------------------------------------------------------------------------------
# Forward only: chosen whenever autograd will not need the backward

def _needs_grad(tensors) -> bool:
    """Whether autograd will record the call: grad mode on (off under ``torch.no_grad`` and
    ``torch.inference_mode``) and some argument requiring grad. Read at trace time under
    torch.compile, where Dynamo guards on both, so the choice costs no graph break."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _transformed(tensors) -> bool:
    """Whether any argument is a ``torch.func`` transform's wrapper (vmap's batched tensor,
    grad's tracking tensor): those go to the autograd Functions, which refuse them clearly.
    Eager calls only."""
    check = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return check is not None and any(check(t) for t in tensors)


def _forward_only(tensors, sequence: bool, fused: bool = False, **kw):
    """The backend's forward with ``keep=False``: nothing computed or kept for a backward."""
    with _interop.backend_call(tensors[0].device) as call:
        run = call.backend.forward_sequence if sequence else call.backend.forward
        if sequence:
            kw.update(_fused_kw(call, fused))
        results = run(*(call.array(t) for t in tensors), keep=False, **call.kw, **kw)
        return tuple(call.tensor(a) for a in results[:-1])


@torch.library.custom_op("lltm_cupy::lltm_inference", mutates_args=())
def _lltm_inference_op(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                       old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """One step, forward only: (new_h, new_cell)."""
    return _forward_only((input, weights, bias, old_h, old_cell), False)


@_lltm_inference_op.register_fake
def _(input, weights, bias, old_h, old_cell):
    return old_h.new_empty(old_h.shape), old_h.new_empty(old_h.shape)


# ---------------------------------------------------------------------------------------------
# One step, eager: a plain autograd.Function

class LLTMFunction(torch.autograd.Function):
    """One LLTM step with autograd; ``apply(input, weights, bias, old_h, old_cell)``.

    Prefer :func:`lltm`, which checks the arguments first, handles autocast and also works
    under torch.compile.
    """

    @staticmethod
    def forward(ctx, input, weights, bias, old_h, old_cell):
        device = input.device
        with _interop.backend_call(device) as call:
            new_h, new_cell, saved = call.backend.forward(
                *(call.array(t) for t in (input, weights, bias, old_h, old_cell)), **call.kw)
            new_h, new_cell_t = call.tensor(new_h), call.tensor(new_cell)
        ctx.lltm_saved = saved
        ctx.device = device
        # Saved through autograd so that an in-place change of the weights, or of the returned
        # new_cell (which backward reads), raises instead of giving wrong gradients.
        ctx.save_for_backward(weights, new_cell_t)
        ctx.set_materialize_grads(False)
        return new_h, new_cell_t

    @staticmethod
    def backward(ctx, grad_h, grad_cell):
        _refuse_double_backward()
        ctx.saved_tensors  # noqa: B018 -- the version check
        if grad_h is None and grad_cell is None:
            return (None,) * 5
        with _interop.backend_call(ctx.device) as call:
            grads = call.backend.backward(call.optional(grad_h), call.optional(grad_cell),
                                          ctx.lltm_saved, _to_grads_order(ctx.needs_input_grad),
                                          **call.kw)
            return tuple(None if g is None else call.tensor(g) for g in _to_argument_order(grads))


# ---------------------------------------------------------------------------------------------
# One step, compiled: custom operators

def _backend_name(device: torch.device) -> str:
    return "cupy" if _interop.uses_cupy(device) else "numpy"


@torch.library.custom_op("lltm_cupy::lltm_forward", mutates_args=())
def _lltm_forward_op(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                     old_cell: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (new_h, new_cell, X, gates): the outputs plus what the backward op needs."""
    with _interop.backend_call(input.device) as call:
        new_h, new_cell, saved = call.backend.forward(
            *(call.array(t) for t in (input, weights, bias, old_h, old_cell)), **call.kw)
        return tuple(call.tensor(a) for a in (new_h, new_cell, saved.X, saved.gates))


def _empty_gates(like: Tensor, batch: int, state: int, *steps: int) -> Tensor:
    """An empty tensor shaped like the backend's saved gate values: the four backward factors
    (..., 4, B, S) from the NumPy backend (CPU), the pre-activations (..., B, 3S) from the CuPy
    backend (CUDA)."""
    if not _interop.uses_cupy(like.device):
        return like.new_empty(*steps, 4, batch, state)
    return like.new_empty(*steps, batch, 3 * state)


@_lltm_forward_op.register_fake
def _(input, weights, bias, old_h, old_cell):
    batch, features = input.shape
    state = old_h.shape[1]
    return (input.new_empty(batch, state), input.new_empty(batch, state),
            input.new_empty(batch, state + features), _empty_gates(input, batch, state))


@torch.library.custom_op("lltm_cupy::lltm_backward", mutates_args=())
def _lltm_backward_op(grad_h: Optional[Tensor], grad_cell: Optional[Tensor], X: Tensor,
                      gates: Tensor, new_cell: Tensor, weights: Tensor,
                      bias_2d: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (d_old_h, d_input, d_weights, d_bias, d_old_cell)."""
    with _interop.backend_call(X.device) as call:
        state = new_cell.shape[1]
        saved = LLTMSaved(_backend_name(X.device),
                          *(call.array(t.contiguous()) for t in (X, gates, new_cell, weights)),
                          (1, 3 * state) if bias_2d else (3 * state,))
        grads = call.backend.backward(call.optional(grad_h), call.optional(grad_cell), saved,
                                      (True,) * 5, **call.kw)
        return tuple(call.tensor(g) for g in grads)


@_lltm_backward_op.register_fake
def _(grad_h, grad_cell, X, gates, new_cell, weights, bias_2d):
    batch, state = new_cell.shape
    features = X.shape[1] - state
    return (X.new_empty(batch, state), X.new_empty(batch, features), weights.new_empty(weights.shape),
            weights.new_empty((1, 3 * state) if bias_2d else (3 * state,)),
            X.new_empty(batch, state))


def _setup_context(ctx, inputs, output):
    _, weights, bias, _, _ = inputs
    _, new_cell, X, gates = output
    ctx.save_for_backward(X, gates, new_cell, weights)
    ctx.bias_2d = bias.dim() == 2


def _backward_op_autograd(ctx, grad_h, grad_cell, _grad_X, _grad_gates):
    _refuse_double_backward()
    X, gates, new_cell, weights = ctx.saved_tensors
    grads = _lltm_backward_op(grad_h, grad_cell, X, gates, new_cell, weights, ctx.bias_2d)
    return _to_argument_order(grads)


_lltm_forward_op.register_autograd(_backward_op_autograd, setup_context=_setup_context)


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
    kernel runs.
    """
    tensors = _autocast((input, weights, bias, old_h, old_cell))
    if _in_float32(tensors):
        new_h, new_cell = lltm(*(t.float() for t in tensors))
        return new_h.bfloat16(), new_cell.bfloat16()
    _interop.check(tensors)
    meta = tensors[0].device.type == "meta"     # shape inference: the ops' fake versions
    if not _needs_grad(tensors):
        if torch.compiler.is_compiling() or meta:
            return _lltm_inference_op(*tensors)
        if not _transformed(tensors):
            return _forward_only(tensors, False)
    if torch.compiler.is_compiling() or meta:
        new_h, new_cell, _, _ = _lltm_forward_op(*tensors)
        return new_h, new_cell
    return LLTMFunction.apply(*tensors)


# ---------------------------------------------------------------------------------------------
# Whole sequences

def _fused_kw(call, fused: bool) -> dict:
    """The backend keyword of ``fused``: only the GPU backend has the fused sequence kernels."""
    return {"fused": True} if fused and call.backend.__name__.endswith("._cupy") else {}


class LLTMSequenceFunction(torch.autograd.Function):
    """A whole sequence with autograd; ``apply(inputs, weights, bias, h0, c0, plan, fused)``.

    Returns ``(outputs, h_n, c_n)``. Prefer :func:`lltm_sequence`.
    """

    @staticmethod
    def forward(ctx, inputs, weights, bias, h0, c0, plan=None, fused=False):
        device = inputs.device
        kw = {} if plan is None else {"plan": plan}
        with _interop.backend_call(device) as call:
            kw.update(_fused_kw(call, fused))
            outputs, h_n, c_n, saved = call.backend.forward_sequence(
                *(call.array(t) for t in (inputs, weights, bias, h0, c0)), **call.kw, **kw)
            outputs, h_n, c_n = (call.tensor(a) for a in (outputs, h_n, c_n))
        ctx.lltm_saved = saved
        ctx.device = device
        # The saved hidden states are the outputs' memory, and the saved inputs may be the
        # caller's: saved through autograd so that an in-place change raises at backward.
        ctx.save_for_backward(inputs, weights, outputs)
        ctx.set_materialize_grads(False)
        return outputs, h_n, c_n

    @staticmethod
    def backward(ctx, grad_outputs, grad_h_n, grad_c_n):
        _refuse_double_backward()
        ctx.saved_tensors  # noqa: B018 -- the version check
        with _interop.backend_call(ctx.device) as call:
            grads = call.backend.backward_sequence(
                call.optional(grad_outputs), call.optional(grad_h_n), call.optional(grad_c_n),
                ctx.lltm_saved, tuple(ctx.needs_input_grad[:5]), **call.kw)
            return tuple(None if g is None else call.tensor(g) for g in grads) + (None, None)


@torch.library.custom_op("lltm_cupy::lltm_sequence_forward", mutates_args=())
def _sequence_forward_op(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor,
                         c0: Tensor, fused: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (hs, h_n, c_n, gates, cells); the outputs are hs[1:]."""
    with _interop.backend_call(inputs.device) as call:
        _, h_n, c_n, saved = call.backend.forward_sequence(
            *(call.array(t) for t in (inputs, weights, bias, h0, c0)), **call.kw,
            **_fused_kw(call, fused))
        return tuple(call.tensor(a) for a in (saved.hs, h_n, c_n, saved.gates, saved.cells))


@_sequence_forward_op.register_fake
def _(inputs, weights, bias, h0, c0, fused=False):
    steps, batch, _ = inputs.shape
    state = h0.shape[1]
    return (inputs.new_empty(steps + 1, batch, state), inputs.new_empty(batch, state),
            inputs.new_empty(batch, state), _empty_gates(inputs, batch, state, steps),
            inputs.new_empty(steps, batch, state))


@torch.library.custom_op("lltm_cupy::lltm_sequence_backward", mutates_args=())
def _sequence_backward_op(grad_outputs: Optional[Tensor], grad_h_n: Optional[Tensor],
                          grad_c_n: Optional[Tensor], inputs: Tensor, hs: Tensor, gates: Tensor,
                          cells: Tensor, weights: Tensor, bias_2d: bool, fused: bool = False
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (d_inputs, d_weights, d_bias, d_h0, d_c0)."""
    with _interop.backend_call(inputs.device) as call:
        steps, batch, features = inputs.shape
        state = hs.shape[2]
        saved = LLTMSequenceSaved(
            _backend_name(inputs.device),
            call.array(inputs.contiguous()).reshape(steps * batch, features),
            *(call.array(t.contiguous()) for t in (hs, gates, cells, weights)),
            (1, 3 * state) if bias_2d else (3 * state,))
        if _fused_kw(call, fused):      # as the forward chose: the fused kernels where they fit
            from .._cupy_fused import usable

            saved.fused = usable(state, saved.hs.dtype)
        grads = call.backend.backward_sequence(
            call.optional(grad_outputs), call.optional(grad_h_n), call.optional(grad_c_n), saved,
            (True,) * 5, **call.kw)
        return tuple(call.tensor(g) for g in grads)


@_sequence_backward_op.register_fake
def _(grad_outputs, grad_h_n, grad_c_n, inputs, hs, gates, cells, weights, bias_2d, fused=False):
    state = hs.shape[2]
    return (inputs.new_empty(inputs.shape), weights.new_empty(weights.shape),
            weights.new_empty((1, 3 * state) if bias_2d else (3 * state,)),
            hs.new_empty(hs.shape[1:]), hs.new_empty(hs.shape[1:]))


def _sequence_setup_context(ctx, inputs, output):
    x, weights, bias = inputs[:3]
    hs, _, _, gates, cells = output
    ctx.save_for_backward(x, hs, gates, cells, weights)
    ctx.bias_2d = bias.dim() == 2
    ctx.fused = bool(inputs[5]) if len(inputs) > 5 else False


def _sequence_backward_autograd(ctx, grad_hs, grad_h_n, grad_c_n, _grad_gates, _grad_cells):
    _refuse_double_backward()
    x, hs, gates, cells, weights = ctx.saved_tensors
    grad_outputs = None if grad_hs is None else grad_hs[1:]
    return _sequence_backward_op(grad_outputs, grad_h_n, grad_c_n, x, hs, gates, cells, weights,
                                 ctx.bias_2d, ctx.fused) + (None,)   # (fused has none)


_sequence_forward_op.register_autograd(_sequence_backward_autograd,
                                       setup_context=_sequence_setup_context)


@torch.library.custom_op("lltm_cupy::lltm_sequence_inference", mutates_args=())
def _sequence_inference_op(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor,
                           c0: Tensor, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """A sequence, forward only: (outputs, h_n, c_n)."""
    return _forward_only((inputs, weights, bias, h0, c0), True, fused)


@_sequence_inference_op.register_fake
def _(inputs, weights, bias, h0, c0, fused=False):
    steps, batch, _ = inputs.shape
    state = h0.shape[1]
    return (inputs.new_empty(steps, batch, state), inputs.new_empty(batch, state),
            inputs.new_empty(batch, state))


def eager_only(fn):
    """``fn`` run eagerly under torch.compile (a graph break), as ``torch.compiler.disable(fn)``,
    but without importing torch's compiler at import time or in eager calls (``disable`` imports
    ``torch._dynamo`` and with it sympy and more, which doubled the import of this module):
    ``disable`` is applied only when dynamo, already loaded, traces the call."""
    disabled = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper


@eager_only
def _packed_sequence(tensors, lengths, reverse: bool, fused: bool = False):
    """Variable lengths run eagerly (a graph break under torch.compile; an error with
    fullgraph=True): the packed layout depends on the lengths' values."""
    from .. import _packing

    steps, batch = tensors[0].shape[:2]
    device = tensors[0].device
    _interop.refuse_capture_without((), device, lengths)     # lengths on the GPU: refused now
    plan = _packing.cached_plan(_packing.check_lengths(lengths, steps, batch), steps, reverse)
    _interop.refuse_capture_without((plan,), device)
    if not _needs_grad(tensors) and not _transformed(tensors):
        return _forward_only(tensors, True, fused, plan=plan)
    return LLTMSequenceFunction.apply(*tensors, plan, fused)


def lltm_packed(data: Tensor, weights: Tensor, bias: Tensor, h0: Tensor, c0: Tensor,
                plan, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """One layer and direction over a ``PackedSequence``'s ``data`` (rows, features), laid out
    as ``plan`` says (``lltm_cupy._packing.packed_plan`` of its ``batch_sizes`` and the
    direction): returns ``(out_data, h_n, c_n)``, ``out_data`` (rows, state) in the same layout;
    the states h0, c0 and h_n, c_n (batch, state) are in the sorted batch order (the caller
    applies ``sorted_indices`` / ``unsorted_indices``, as :class:`LLTM` does).
    What :class:`LLTM` runs for PackedSequence input: no padded tensor is made, in or out.
    Autocast, dtype and ``fused`` rules as :func:`lltm_sequence`; eager only."""
    fused = check_flag("lltm_cupy.torch.lltm_packed", "fused", fused)
    tensors = _autocast((data, weights, bias, h0, c0))
    if _in_float32(tensors):
        return tuple(t.bfloat16() for t in lltm_packed(*(t.float() for t in tensors), plan))
    _interop.check(tensors, _SEQ_NAMES, check_packed_shapes)
    if tensors[0].device.type == "meta":
        # shape inference: the N rows as one step of N sequences (the first state row each)
        # gives every result its shape and dtype, connected to every argument for autograd
        data, weights, bias, h0, c0 = tensors
        rows, batch = data.shape[0], h0.shape[0]
        hs, h_n, c_n, _, _ = _sequence_forward_op(data[None], weights, bias,
                                                  h0[:1].expand(rows, -1), c0[:1].expand(rows, -1))
        return hs[1], h_n[:batch], c_n[:batch]
    if not _needs_grad(tensors) and not _transformed(tensors):
        return _forward_only(tensors, True, fused, plan=plan)
    return LLTMSequenceFunction.apply(*tensors, plan, fused)


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
        weights do not fit a block's shared memory, and CPU tensors, run as without it.
        Off by default until a GPU has measured it faster than the default path.

    outputs: (steps, batch, state), the hidden state after every step; h_n, c_n: (batch, state).
    Same device, dtype and autocast rules as :func:`lltm`.
    """
    reverse = check_flag("lltm_cupy.torch.lltm_sequence", "reverse", reverse)
    fused = check_flag("lltm_cupy.torch.lltm_sequence", "fused", fused)
    tensors = _autocast((inputs, weights, bias, h0, c0))
    if _in_float32(tensors):
        return tuple(t.bfloat16() for t in lltm_sequence(*(t.float() for t in tensors),
                                                           lengths=lengths, reverse=reverse,
                                                           fused=fused))
    _interop.check(tensors, _SEQ_NAMES, check_sequence_shapes)
    if tensors[0].device.type == "meta":   # shape inference: lengths, direction change none
        hs, h_n, c_n, _, _ = _sequence_forward_op(*tensors)
        return hs[1:], h_n, c_n
    if lengths is not None:
        return _packed_sequence(tensors, lengths, reverse, fused)
    if reverse:     # every sequence full length: run the time-reversed sequence
        outputs, h_n, c_n = lltm_sequence(tensors[0].flip(0), *tensors[1:], fused=fused)
        return outputs.flip(0), h_n, c_n
    if not _needs_grad(tensors):
        if torch.compiler.is_compiling():
            return _sequence_inference_op(*tensors, fused)
        if not _transformed(tensors):
            return _forward_only(tensors, True, fused)
    if torch.compiler.is_compiling():
        hs, h_n, c_n, _, _ = _sequence_forward_op(*tensors, fused)
        return hs[1:], h_n, c_n
    return LLTMSequenceFunction.apply(*tensors, None, fused)
