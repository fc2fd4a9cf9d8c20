"""The one-step module :class:`LLTMCell`: a drop-in for the tutorial's ``LLTM``, shaped like
``nn.LSTMCell``."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from ._cell_op import lltm
from ._module_args import (_check_bool, _check_input, _check_pair, _refuse_torchscript,
                           _rename_old_keys, _sizes)

__all__ = ["LLTMCell"]


class _CellBase(nn.Module):
    """Parameters named, shaped and initialised like the tutorial's ``LLTM`` module."""

    def __init__(self, input_size: Optional[int] = None, hidden_size: Optional[int] = None,
                 bias: bool = True, device=None, dtype=None, *, input_features=None,
                 state_size=None):
        super().__init__()
        name = type(self).__name__
        input_size, hidden_size = _sizes(name, input_size, hidden_size, input_features,
                                         state_size, min_input=0)
        bias = _check_bool(name, "bias", bias)
        factory = {"device": device, "dtype": dtype}
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.weights = nn.Parameter(torch.empty(3 * hidden_size, input_size + hidden_size, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(1, 3 * hidden_size, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a one-layer LLTM's state_dict (weights_l0, bias_l0) loads too
        _rename_old_keys(state_dict, prefix, {"weights_l0": "weights", "bias_l0": "bias"})
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def input_features(self) -> int:
        """The tutorial's name of ``input_size``."""
        return self.input_size

    @property
    def state_size(self) -> int:
        """The tutorial's name of ``hidden_size``."""
        return self.hidden_size

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for weight in self.parameters():
            weight.data.uniform_(-stdv, stdv)

    __prepare_scriptable__ = _refuse_torchscript   # torch.jit.script calls it first

    def _check_input(self, input, dims: str) -> None:
        """input: a tensor of ``len(dims)`` dimensions whose last is input_size."""
        _check_input(type(self).__name__, input, dims, self.input_size)

    def _state(self, state, batch: int, like: Tensor, layered_ok: bool = False):
        """(h, c) from ``state``: None (zeros) or two tensors, each (batch, hidden_size) (or
        (1, batch, hidden_size) where ``layered_ok``); clear errors for anything else."""
        name = type(self).__name__
        if state is None:
            zeros = like.new_zeros(batch, self.hidden_size)
            return zeros, zeros
        _check_pair(name, state)
        expected = (batch, self.hidden_size)
        for part, t in zip("hc", state):
            shape = tuple(t.shape)
            if shape != expected and not (layered_ok and shape == (1, *expected)):
                also = f" or {(1, *expected)}" if layered_ok else ""
                raise ValueError(f"{name}: {part} of state must have shape {expected}{also} "
                                 f"(batch, hidden_size), got {shape}")
        return tuple(state)

    def _bias(self):
        return self.bias if self.bias is not None else self.weights.new_zeros(3 * self.hidden_size)

    def _args(self, input: Tensor, state):
        self._check_input(input, "(batch, input_size)")
        old_h, old_cell = self._state(state, input.shape[0], input)
        return input, self.weights, self._bias(), old_h, old_cell

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, bias={self.bias is not None}"


class LLTMCell(_CellBase):
    """The LLTM cell as a module: a drop-in for the tutorial's ``LLTM``, called like
    ``nn.LSTMCell``.

    ``LLTMCell(input_size, hidden_size, bias=True, device=None, dtype=None)`` (the tutorial's
    ``input_features=`` / ``state_size=`` are accepted too, and readable as attributes).
    Parameters: ``weights (3 * hidden_size, input_size + hidden_size)`` and
    ``bias (1, 3 * hidden_size)``, uniform in +-1/sqrt(hidden_size), so a state_dict of the
    tutorial's module loads into this one.
    """

    def forward(self, input: Tensor, state: Optional[tuple[Tensor, Tensor]] = None):
        """One step: ``(h, c)``, each (batch, hidden_size), from ``input`` (batch, input_size)
        and ``state`` = (h, c) of the same shapes (None: zeros). An unbatched ``input``
        (input_size,) takes and returns (hidden_size,) states, as ``nn.LSTMCell``. TypeError
        or ValueError, naming the argument, for anything else."""
        if isinstance(input, Tensor) and input.dim() == 1:
            if state is not None:
                _check_pair("LLTMCell", state)
                state = tuple(t.unsqueeze(0) if t.dim() == 1 else t for t in state)
            h, c = lltm(*self._args(input.unsqueeze(0), state))
            return h.squeeze(0), c.squeeze(0)
        return lltm(*self._args(input, state))


# Pickles (torch.save of a whole model) name the class by its public home, so that it loads
# whatever file inside lltm_cupy.torch defines it.
LLTMCell.__module__ = "lltm_cupy.torch"
