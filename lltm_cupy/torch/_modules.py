"""The modules: :class:`LLTMCell` (one step, a drop-in for the tutorial's ``LLTM``) and
:class:`LLTM` (whole sequences, shaped like a one-layer ``nn.LSTM``)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from ._ops import lltm, lltm_sequence

__all__ = ["LLTMCell", "LLTM"]


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

    def _check_input(self, input, dims: str) -> None:
        """input: a tensor of ``len(dims)`` dimensions whose last is input_features."""
        name = type(self).__name__
        if not isinstance(input, Tensor):
            hint = (" (PackedSequence is not supported: pass the padded tensor)"
                    if type(input).__name__ == "PackedSequence" else "")
            raise TypeError(f"{name}: input must be a torch.Tensor {dims}, got "
                            f"{type(input).__module__}.{type(input).__qualname__}{hint}")
        if input.dim() != dims.count(",") + 1:
            raise ValueError(f"{name}: input must be {dims.count(',') + 1}-D {dims}, got shape "
                             f"{tuple(input.shape)}")
        if input.shape[-1] != self.input_features:
            raise ValueError(f"{name}: input has {input.shape[-1]} features, the module expects "
                             f"{self.input_features} (input_features)")

    def _state(self, state, batch: int, like: Tensor, layered_ok: bool = False):
        """(h, c) from ``state``: None (zeros) or two tensors, each (batch, state_size) (or
        (1, batch, state_size) where ``layered_ok``); clear errors for anything else."""
        name = type(self).__name__
        if state is None:
            zeros = like.new_zeros(batch, self.state_size)
            return zeros, zeros
        if isinstance(state, Tensor) or not isinstance(state, (tuple, list)):
            raise TypeError(f"{name}: state must be a tuple (h, c) of two tensors or None, got "
                            f"{'a single Tensor' if isinstance(state, Tensor) else type(state).__qualname__}")
        if len(state) != 2:
            raise ValueError(f"{name}: state must hold two tensors (h, c), got {len(state)}")
        expected = (batch, self.state_size)
        for part, t in zip("hc", state):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}: {part} of state must be a torch.Tensor, got "
                                f"{type(t).__qualname__}")
            shape = tuple(t.shape)
            if shape != expected and not (layered_ok and shape == (1, *expected)):
                also = f" or {(1, *expected)}" if layered_ok else ""
                raise ValueError(f"{name}: {part} of state must have shape {expected}{also} "
                                 f"(batch, state_size), got {shape}")
        return tuple(state)

    def _bias(self):
        return self.bias if self.bias is not None else self.weights.new_zeros(3 * self.state_size)

    def _args(self, input: Tensor, state):
        self._check_input(input, "(batch, input_features)")
        old_h, old_cell = self._state(state, input.shape[0], input)
        return input, self.weights, self._bias(), old_h, old_cell

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
        """One step: ``(h, c)``, each (batch, state_size), from ``input`` (batch,
        input_features) and ``state`` = (h, c) of the same shapes (None: zeros). TypeError or
        ValueError, naming the argument, for anything else."""
        return lltm(*self._args(input, state))


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
        self._check_input(input, "(batch, steps, input_features)" if self.batch_first
                          else "(steps, batch, input_features)")
        if self.batch_first:
            input = input.transpose(0, 1)
        state = self._state(state, input.shape[1], input, layered_ok=True)
        layered = state[0].dim() == 3  # nn.LSTM's (num_layers = 1, batch, state)
        if layered != (state[1].dim() == 3):
            raise ValueError(f"LLTM: h0 must be (batch, state) or (1, batch, state) like c0, got "
                             f"{tuple(state[0].shape)} and {tuple(state[1].shape)}")
        if layered:
            state = (state[0][0], state[1][0])
        output, h_n, c_n = lltm_sequence(input, self.weights, self._bias(), *state)
        if self.batch_first:
            output = output.transpose(0, 1)
        if layered:
            h_n, c_n = h_n.unsqueeze(0), c_n.unsqueeze(0)
        return output, (h_n, c_n)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", batch_first={self.batch_first}"
