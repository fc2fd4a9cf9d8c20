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
