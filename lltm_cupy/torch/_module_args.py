"""What the modules share: their argument checks (sizes and flags checked as nn.LSTM checks them,
the input and state checks with messages naming the module), older state-dict keys renamed,
the TorchScript refusal, and :class:`_CellBase`, the parameters of the one-step modules
(``LLTMCell`` and the pure-torch ``ReferenceLLTMCell``)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

def _rename_old_keys(state_dict, prefix: str, renames: dict) -> None:
    """Rename keys of an older layout (old name -> new name) under ``prefix``, in place, before
    ``load_state_dict`` reads them. Called from the modules' ``_load_from_state_dict`` (a method,
    not a registered hook: a closure hook in the instance would make the module unpicklable)."""
    for old, new in renames.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


def _check_int(module: str, name: str, value, minimum: int) -> int:
    """A size argument: an int (not a bool, float or NumPy integer: TypeError, as nn.LSTM) of
    at least ``minimum`` (ValueError)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{module}: {name} should be of type int, got: {type(value).__name__} "
                        f"{value!r}")
    if value < minimum:
        raise ValueError(f"{module}: {name} must be >= {minimum}, got {value}")
    return value


def _check_bool(module: str, name: str, value) -> bool:
    """A flag: a bool (TypeError otherwise, as nn.LSTM's bias and batch_first)."""
    if not isinstance(value, bool):
        raise TypeError(f"{module}: {name} should be of type bool, got: {type(value).__name__} "
                        f"{value!r}")
    return value


def _sizes(name, input_size, hidden_size, input_features, state_size, min_input: int = 1):
    """nn.LSTM's names, or the tutorial's (``input_features``, ``state_size``)."""
    input_size = input_features if input_size is None else input_size
    hidden_size = state_size if hidden_size is None else hidden_size
    if input_size is None or hidden_size is None:
        raise TypeError(f"{name}: input_size and hidden_size are required")
    return (_check_int(name, "input_size", input_size, min_input),
            _check_int(name, "hidden_size", hidden_size, 1))


def _refuse_torchscript(module):
    raise RuntimeError(f"{type(module).__name__} does not support TorchScript (torch.jit.script): "
                       f"its forward runs NumPy or CuPy code, which TorchScript cannot compile. "
                       f"Run the model eagerly or with torch.compile (padded input without "
                       f"graph breaks)")


def _check_input(name, input, dims, features) -> None:
    if not isinstance(input, Tensor):
        hint = (" (PackedSequence goes to LLTM, not to a cell)"
                if type(input).__name__ == "PackedSequence" else "")
        raise TypeError(f"{name}: input must be a torch.Tensor {dims}, got "
                        f"{type(input).__module__}.{type(input).__qualname__}{hint}")
    if input.dim() != dims.count(",") + 1:
        raise ValueError(f"{name}: input must be {dims.count(',') + 1}-D {dims}, got shape "
                         f"{tuple(input.shape)}")
    if input.shape[-1] != features:
        raise ValueError(f"{name}: input has {input.shape[-1]} features, the module expects "
                         f"{features} (input_size)")
    if not input.is_floating_point():
        raise TypeError(f"{name}: input must be a floating-point tensor, got {input.dtype} (as "
                        f"for nn.LSTM, convert it: input.float(), or embed integer tokens first)")


def _check_packed(input, features: int) -> int:
    """A PackedSequence's parts agree: data (N, features) with N the sum of batch_sizes, a 1-D
    non-increasing batch_sizes of positive integers, indices of batch_sizes[0] entries. Returns
    the batch (batch_sizes[0])."""
    _check_input("LLTM", input.data, "(rows, input_size)", features)
    sizes = input.batch_sizes
    if (not isinstance(sizes, Tensor) or sizes.dim() != 1 or sizes.is_floating_point()
            or sizes.device.type != "cpu"):
        raise ValueError(f"LLTM: the PackedSequence's batch_sizes must be a 1-D integer CPU tensor "
                         f"(as pack_padded_sequence makes it), got {sizes!r}")
    if len(sizes) and (sizes.min() < 1 or (sizes[1:] > sizes[:-1]).any()):
        raise ValueError(f"LLTM: the PackedSequence's batch_sizes must be positive and "
                         f"non-increasing, got {sizes.tolist()}")
    rows = int(sizes.sum())
    if input.data.shape[0] != rows:
        raise ValueError(f"LLTM: the PackedSequence's data has {input.data.shape[0]} rows, but its "
                         f"batch_sizes {sizes.tolist()} sum to {rows}: build it with "
                         f"pack_padded_sequence / pack_sequence")
    batch = int(sizes[0]) if len(sizes) else 0
    for name in ("sorted_indices", "unsorted_indices"):
        index = getattr(input, name)
        if index is not None and tuple(index.shape) != (batch,):
            raise ValueError(f"LLTM: the PackedSequence's {name} must have shape ({batch},) "
                             f"(batch_sizes[0] sequences), got {tuple(index.shape)}")
    return batch


def _layer_input(input, packed: bool, features: int, batch_first: bool):
    """:class:`LLTM`'s input checked: ``(x, batch, unbatched)``, ``x`` the PackedSequence's rows
    (``packed``) or the input as (steps, batch, features) (a 2-D ``unbatched`` input as one
    sequence, ``batch_first`` input transposed)."""
    if packed:
        return input.data, _check_packed(input, features), False
    unbatched = isinstance(input, Tensor) and input.dim() == 2
    dims = ("(steps, input_size)" if unbatched else "(batch, steps, input_size)"
            if batch_first else "(steps, batch, input_size)")
    _check_input("LLTM", input, dims, features)
    x = input.unsqueeze(1) if unbatched else input.transpose(0, 1) if batch_first else input
    return x, x.shape[1], unbatched


def _check_pair(name, state) -> None:
    if isinstance(state, Tensor) or not isinstance(state, (tuple, list)):
        raise TypeError(f"{name}: state must be a tuple (h, c) of two tensors or None, got "
                        f"{'a single Tensor' if isinstance(state, Tensor) else type(state).__qualname__}")
    if len(state) != 2:
        raise ValueError(f"{name}: state must hold two tensors (h, c), got {len(state)}")
    for part, t in zip("hc", state):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {part} of state must be a torch.Tensor, got "
                            f"{type(t).__qualname__}")


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
