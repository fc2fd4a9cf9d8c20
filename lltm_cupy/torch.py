"""PyTorch layer: differentiable `lltm` and `lltm_sequence`, and the `LLTMCell` and `LLTM` modules.

Tensors move to NumPy (CPU) or CuPy (CUDA) arrays and back without a copy (``Tensor.numpy`` /
``torch.from_numpy`` on the CPU, DLPack on the GPU), and the backends of :mod:`lltm_cupy` do the
work, after the checks here (which cover everything the array API checks). On CUDA every kernel
and GEMM runs on torch's current stream of the tensors' device, read on every call. On the CPU
the NumPy backend's GEMMs run through torch's BLAS, so that the process has one BLAS thread pool.

Two paths give the same results:

- eager calls go through :class:`LLTMFunction`, a plain ``torch.autograd.Function`` (the cheapest
  per call);
- under ``torch.compile`` the same work runs as the custom operators ``lltm_cupy::lltm_forward``
  and ``lltm_cupy::lltm_backward`` (``torch.library.custom_op`` with fake and autograd
  registrations), which the compiler treats as opaque, so a model compiles with no graph break.

The module also holds the pure-torch reference (:func:`lltm_reference`,
:class:`ReferenceLLTMCell`): the tutorial's Python LLTM, differentiated by autograd.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor, nn

from . import _numpy
from ._checks import check_sequence_shapes, check_shapes
from ._types import LLTMSaved, LLTMSequenceSaved

__all__ = ["lltm", "LLTMFunction", "LLTMCell", "lltm_sequence", "LLTMSequenceFunction", "LLTM",
           "lltm_reference", "ReferenceLLTMCell"]

_NAMES = ("input", "weights", "bias", "old_h", "old_cell")
_DTYPES = {"cpu": (torch.float32, torch.float64),
           "cuda": (torch.float16, torch.float32, torch.float64)}


# ---------------------------------------------------------------------------------------------
# Checks and zero-copy conversions

def _check(tensors, names=_NAMES, check=check_shapes) -> None:
    """Torch-level checks, before any conversion or kernel: type, device, dtype, shapes."""
    for name, t in zip(names, tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"lltm_cupy.torch: {name} must be a torch.Tensor, got {type(t).__qualname__}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"lltm_cupy.torch: all tensors must be on one device, got {listing}")
    device = tensors[0].device
    if device.type not in _DTYPES:
        raise ValueError(f"lltm_cupy.torch: tensors on {device} are not supported (CPU or CUDA only)")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        listing = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors))
        raise TypeError(f"lltm_cupy.torch: all tensors must have the same dtype, got {listing}")
    dtype = tensors[0].dtype
    if dtype not in _DTYPES[device.type]:
        allowed = ", ".join(str(d) for d in _DTYPES[device.type])
        hint = (" (bfloat16 is not supported: CuPy has no bfloat16)" if dtype == torch.bfloat16
                else " (float16 runs on CUDA only)" if dtype == torch.float16 else "")
        raise TypeError(f"lltm_cupy.torch: unsupported dtype {dtype} on {device.type}; expected one "
                        f"of {allowed}{hint}")
    check(*tensors)


def _to_array(t: Tensor):
    """A NumPy (CPU) or CuPy (CUDA) view of ``t``'s memory; no copy for contiguous tensors."""
    if t.requires_grad:
        t = t.detach()
    if t.device.type == "cpu":
        return t.numpy()
    import cupy

    # DLPack carries strides, but a contiguous export is the well-trodden path on every version.
    return cupy.from_dlpack(t if t.is_contiguous() else t.contiguous())


def _optional(t):
    return None if t is None else _to_array(t)


def _from_array(a) -> Tensor:
    """A tensor viewing the memory of a NumPy or CuPy array; no copy."""
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


class _StreamRef:
    """A CUDA stream handle offered through the CUDA stream protocol (any torch version)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@contextlib.contextmanager
def _on_torch_stream(device: torch.device):
    """Make CuPy run on ``device`` and on torch's current stream there (read now, not cached)."""
    import cupy

    with cupy.cuda.Device(device.index):
        stream = torch.cuda.current_stream(device).cuda_stream
        with cupy.cuda.Stream.from_external(_StreamRef(stream)):
            yield


def _context(device: torch.device):
    return _on_torch_stream(device) if device.type == "cuda" else contextlib.nullcontext()


def _torch_mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b by torch's BLAS, on NumPy arrays, without copies."""
    return torch.mm(torch.from_numpy(a), torch.from_numpy(b)).numpy()


class _NumpyWithTorchGemm:
    """The NumPy backend with its GEMMs run by torch: one BLAS thread pool in the process.

    NumPy's OpenBLAS threads and torch's OpenMP threads spinning side by side made an LLTMCell
    training step take ~8 ms instead of ~0.3 ms on a 2-core machine.
    """

    @staticmethod
    def forward(*args):
        return _numpy.forward(*args, mm=_torch_mm)

    @staticmethod
    def backward(*args):
        return _numpy.backward(*args, mm=_torch_mm)

    @staticmethod
    def forward_sequence(*args):
        return _numpy.forward_sequence(*args, mm=_torch_mm)

    @staticmethod
    def backward_sequence(*args):
        return _numpy.backward_sequence(*args, mm=_torch_mm)


def _backend(device: torch.device):
    """The backend for tensors on ``device`` (their arguments already checked here)."""
    if device.type == "cpu":
        return _NumpyWithTorchGemm
    from . import _cupy

    return _cupy


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
# Eager path: a plain autograd.Function

class LLTMFunction(torch.autograd.Function):
    """One LLTM step with autograd; ``apply(input, weights, bias, old_h, old_cell)``.

    Prefer :func:`lltm`, which checks the arguments first and also works under torch.compile.
    """

    @staticmethod
    def forward(ctx, input, weights, bias, old_h, old_cell):
        device = input.device
        with _context(device):
            arrays = [_to_array(t) for t in (input, weights, bias, old_h, old_cell)]
            new_h, new_cell, saved = _backend(device).forward(*arrays)
            new_h, new_cell_t = _from_array(new_h), _from_array(new_cell)
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
        with _context(ctx.device):
            grads = _backend(ctx.device).backward(
                _optional(grad_h), _optional(grad_cell), ctx.lltm_saved,
                _to_grads_order(ctx.needs_input_grad))
            return tuple(None if g is None else _from_array(g) for g in _to_argument_order(grads))


# ---------------------------------------------------------------------------------------------
# Compiled path: custom operators

@torch.library.custom_op("lltm_cupy::lltm_forward", mutates_args=())
def _lltm_forward_op(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                     old_cell: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (new_h, new_cell, X, gates): the outputs plus what the backward op needs."""
    with _context(input.device):
        arrays = [_to_array(t) for t in (input, weights, bias, old_h, old_cell)]
        new_h, new_cell, saved = _backend(input.device).forward(*arrays)
        return tuple(_from_array(a) for a in (new_h, new_cell, saved.X, saved.gates))


def _empty_gates(like: Tensor, batch: int, state: int, *steps: int) -> Tensor:
    """An empty tensor shaped like the backend's saved gate values: gate-major (..., 3, B, S)
    from the NumPy backend (CPU), (..., B, 3S) from the CuPy backend (CUDA)."""
    if like.device.type == "cpu":
        return like.new_empty(*steps, 3, batch, state)
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
    with _context(X.device):
        state = new_cell.shape[1]
        saved = LLTMSaved("numpy" if X.device.type == "cpu" else "cupy",
                          *(_to_array(t.contiguous()) for t in (X, gates, new_cell, weights)),
                          (1, 3 * state) if bias_2d else (3 * state,))
        grads = _backend(X.device).backward(_optional(grad_h), _optional(grad_cell), saved,
                                            (True,) * 5)
        return tuple(_from_array(g) for g in grads)


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


# ---------------------------------------------------------------------------------------------
# Public function and modules

def lltm(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
         old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """One differentiable LLTM step. Returns ``(new_h, new_cell)``, each (batch, state).

    input: (batch, features)
    weights: (3 * state, state + features); the first ``state`` columns act on old_h
    bias: (3 * state,) or (1, 3 * state)
    old_h: (batch, state)
    old_cell: (batch, state)

    One device (CPU or CUDA) and one dtype (float32, float64; float16 on CUDA) for all. Bad input
    raises TypeError/ValueError before any kernel runs.
    """
    tensors = (input, weights, bias, old_h, old_cell)
    _check(tensors)
    if torch.compiler.is_compiling():
        new_h, new_cell, _, _ = _lltm_forward_op(*tensors)
        return new_h, new_cell
    return LLTMFunction.apply(*tensors)


class _CellBase(nn.Module):
    """Parameters named, shaped and initialised like the tutorial's ``LLTM`` module."""

    def __init__(self, input_features: int, state_size: int, bias: bool = True, device=None,
                 dtype=None):
        super().__init__()
        if input_features < 0 or state_size < 1:
            raise ValueError(f"{type(self).__name__}: need input_features >= 0 and state_size >= 1, "
                             f"got {input_features} and {state_size}")
        factory = {"device": device, "dtype": dtype}
        self.input_features = input_features
        self.state_size = state_size
        self.weights = nn.Parameter(torch.empty(3 * state_size, input_features + state_size, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(1, 3 * state_size, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.state_size)
        for weight in self.parameters():
            weight.data.uniform_(-stdv, stdv)

    def _args(self, input: Tensor, state):
        if state is None:
            zeros = input.new_zeros(input.shape[0], self.state_size)
            state = (zeros, zeros)
        old_h, old_cell = state
        bias = self.bias if self.bias is not None else self.weights.new_zeros(3 * self.state_size)
        return input, self.weights, bias, old_h, old_cell

    def extra_repr(self) -> str:
        return (f"input_features={self.input_features}, state_size={self.state_size}, "
                f"bias={self.bias is not None}")


class LLTMCell(_CellBase):
    """The LLTM cell as a module, a drop-in for the tutorial's ``LLTM``.

    Parameters: ``weights (3 * state_size, input_features + state_size)`` and
    ``bias (1, 3 * state_size)``, uniform in +-1/sqrt(state_size), so a state_dict of the
    tutorial's module loads into this one.

    forward(input, state=None) -> (h, c)
        input: (batch, input_features)
        state: (h, c), each (batch, state_size), or None for zeros (as nn.LSTMCell)
    """

    def forward(self, input: Tensor, state: Optional[tuple[Tensor, Tensor]] = None):
        return lltm(*self._args(input, state))


# ---------------------------------------------------------------------------------------------
# Whole sequences

_SEQ_NAMES = ("inputs", "weights", "bias", "h0", "c0")


class LLTMSequenceFunction(torch.autograd.Function):
    """A whole sequence with autograd; ``apply(inputs, weights, bias, h0, c0)``.

    Returns ``(outputs, h_n, c_n)``. Prefer :func:`lltm_sequence`.
    """

    @staticmethod
    def forward(ctx, inputs, weights, bias, h0, c0):
        device = inputs.device
        with _context(device):
            outputs, h_n, c_n, saved = _backend(device).forward_sequence(
                *(_to_array(t) for t in (inputs, weights, bias, h0, c0)))
            outputs, h_n, c_n = (_from_array(a) for a in (outputs, h_n, c_n))
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
        with _context(ctx.device):
            grads = _backend(ctx.device).backward_sequence(
                _optional(grad_outputs), _optional(grad_h_n), _optional(grad_c_n),
                ctx.lltm_saved, tuple(ctx.needs_input_grad))
            return tuple(None if g is None else _from_array(g) for g in grads)


@torch.library.custom_op("lltm_cupy::lltm_sequence_forward", mutates_args=())
def _sequence_forward_op(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor,
                         c0: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (hs, h_n, c_n, gates, cells); the outputs are hs[1:]."""
    with _context(inputs.device):
        _, h_n, c_n, saved = _backend(inputs.device).forward_sequence(
            *(_to_array(t) for t in (inputs, weights, bias, h0, c0)))
        return tuple(_from_array(a) for a in (saved.hs, h_n, c_n, saved.gates, saved.cells))


@_sequence_forward_op.register_fake
def _(inputs, weights, bias, h0, c0):
    steps, batch, _ = inputs.shape
    state = h0.shape[1]
    return (inputs.new_empty(steps + 1, batch, state), inputs.new_empty(batch, state),
            inputs.new_empty(batch, state), _empty_gates(inputs, batch, state, steps),
            inputs.new_empty(steps, batch, state))


@torch.library.custom_op("lltm_cupy::lltm_sequence_backward", mutates_args=())
def _sequence_backward_op(grad_outputs: Optional[Tensor], grad_h_n: Optional[Tensor],
                          grad_c_n: Optional[Tensor], inputs: Tensor, hs: Tensor, gates: Tensor,
                          cells: Tensor, weights: Tensor,
                          bias_2d: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (d_inputs, d_weights, d_bias, d_h0, d_c0)."""
    with _context(inputs.device):
        steps, batch, features = inputs.shape
        state = hs.shape[2]
        saved = LLTMSequenceSaved(
            "numpy" if inputs.device.type == "cpu" else "cupy",
            _to_array(inputs.contiguous()).reshape(steps * batch, features),
            *(_to_array(t.contiguous()) for t in (hs, gates, cells, weights)),
            (1, 3 * state) if bias_2d else (3 * state,))
        grads = _backend(inputs.device).backward_sequence(
            _optional(grad_outputs), _optional(grad_h_n), _optional(grad_c_n), saved, (True,) * 5)
        return tuple(_from_array(g) for g in grads)


@_sequence_backward_op.register_fake
def _(grad_outputs, grad_h_n, grad_c_n, inputs, hs, gates, cells, weights, bias_2d):
    state = hs.shape[2]
    return (inputs.new_empty(inputs.shape), weights.new_empty(weights.shape),
            weights.new_empty((1, 3 * state) if bias_2d else (3 * state,)),
            hs.new_empty(hs.shape[1:]), hs.new_empty(hs.shape[1:]))


def _sequence_setup_context(ctx, inputs, output):
    x, weights, bias, _, _ = inputs
    hs, _, _, gates, cells = output
    ctx.save_for_backward(x, hs, gates, cells, weights)
    ctx.bias_2d = bias.dim() == 2


def _sequence_backward_autograd(ctx, grad_hs, grad_h_n, grad_c_n, _grad_gates, _grad_cells):
    _refuse_double_backward()
    x, hs, gates, cells, weights = ctx.saved_tensors
    grad_outputs = None if grad_hs is None else grad_hs[1:]
    return _sequence_backward_op(grad_outputs, grad_h_n, grad_c_n, x, hs, gates, cells, weights,
                                 ctx.bias_2d)


_sequence_forward_op.register_autograd(_sequence_backward_autograd,
                                       setup_context=_sequence_setup_context)


def lltm_sequence(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor,
                  c0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The cell over a whole sequence, differentiable. Returns ``(outputs, h_n, c_n)``.

    inputs: (steps, batch, features)
    weights: (3 * state, state + features); bias: (3 * state,) or (1, 3 * state)
    h0, c0: (batch, state)

    outputs: (steps, batch, state), the hidden state after every step; h_n, c_n: (batch, state).
    """
    tensors = (inputs, weights, bias, h0, c0)
    _check(tensors, _SEQ_NAMES, check_sequence_shapes)
    if torch.compiler.is_compiling():
        hs, h_n, c_n, _, _ = _sequence_forward_op(*tensors)
        return hs[1:], h_n, c_n
    return LLTMSequenceFunction.apply(*tensors)


class LLTM(_CellBase):
    """The LLTM over whole sequences, shaped like a one-layer ``nn.LSTM``.

    Same parameters (names, shapes, initialisation) as :class:`LLTMCell`, so a cell's
    state_dict loads into it.

    forward(input, state=None) -> (output, (h_n, c_n))
        input: (steps, batch, input_features), or (batch, steps, input_features) if batch_first
        state: (h0, c0), each (batch, state_size) as for the cell, or (1, batch, state_size) as
            for a one-layer nn.LSTM; None for zeros
        output: (steps, batch, state_size) (or batch first); h_n, c_n: shaped like the state
            given ((batch, state_size) when it is None)
    """

    def __init__(self, input_features: int, state_size: int, batch_first: bool = False,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(input_features, state_size, bias=bias, device=device, dtype=dtype)
        self.batch_first = batch_first

    def forward(self, input: Tensor, state: Optional[tuple[Tensor, Tensor]] = None):
        if self.batch_first:
            input = input.transpose(0, 1)
        if state is None:
            zeros = input.new_zeros(input.shape[1], self.state_size)
            state = (zeros, zeros)
        layered = state[0].dim() == 3  # nn.LSTM's (num_layers = 1, batch, state)
        if layered:
            for name, t in zip(("h0", "c0"), state):
                if t.dim() != 3 or t.shape[0] != 1:
                    raise ValueError(f"LLTM: {name} must be (batch, state) or (1, batch, state) "
                                     f"like both states, got {tuple(t.shape)}")
            state = (state[0][0], state[1][0])
        bias = self.bias if self.bias is not None else self.weights.new_zeros(3 * self.state_size)
        output, h_n, c_n = lltm_sequence(input, self.weights, bias, *state)
        if self.batch_first:
            output = output.transpose(0, 1)
        if layered:
            h_n, c_n = h_n.unsqueeze(0), c_n.unsqueeze(0)
        return output, (h_n, c_n)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", batch_first={self.batch_first}"


# ---------------------------------------------------------------------------------------------
# The pure-torch reference (the tutorial's Python LLTM), differentiated by autograd

def lltm_reference(input, weights, bias, old_h, old_cell):
    """The tutorial's LLTM in torch ops; autograd gives the gradients. Returns (new_h, new_cell)."""
    X = torch.cat([old_h, input], dim=1)
    gate_weights = torch.addmm(bias, X, weights.t())
    gates = gate_weights.chunk(3, dim=1)
    input_gate = torch.sigmoid(gates[0])
    output_gate = torch.sigmoid(gates[1])
    candidate_cell = torch.nn.functional.elu(gates[2], alpha=1.0)
    new_cell = old_cell + candidate_cell * input_gate
    new_h = torch.tanh(new_cell) * output_gate
    return new_h, new_cell


class ReferenceLLTMCell(_CellBase):
    """The tutorial's pure-Python LLTM module: same parameters as :class:`LLTMCell`."""

    def forward(self, input: Tensor, state: Optional[tuple[Tensor, Tensor]] = None):
        return lltm_reference(*self._args(input, state))
