"""The modules: :class:`LLTMCell` (one step, a drop-in for the tutorial's ``LLTM`` and shaped
like ``nn.LSTMCell``) and :class:`LLTM` (whole sequences, with ``nn.LSTM``'s interface: layers,
both directions, dropout between layers, packed variable-length input)."""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from .._parameters import layer_plan
from ._ops import eager_only, lltm, lltm_packed, lltm_sequence

__all__ = ["LLTMCell", "LLTM"]


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


def _check_packed(input, features: int) -> None:
    """A PackedSequence's parts agree: data (N, features) with N the sum of batch_sizes, a 1-D
    non-increasing batch_sizes of positive integers, indices of batch_sizes[0] entries."""
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


class LLTM(nn.Module):
    """The LLTM over whole sequences with ``nn.LSTM``'s interface.

    ``LLTM(input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
    bidirectional=False, proj_size=0, device=None, dtype=None, *, fused=False)``, checked as
    nn.LSTM checks them
    (TypeError for a size that is not an int or a flag that is not a bool, ValueError for a
    value out of range; proj_size must be 0); the tutorial's ``input_features=`` /
    ``state_size=`` are accepted too, and readable as attributes. nn.LSTM's ``mode``
    ("LLTM"), ``proj_size`` (0), ``all_weights`` and ``flatten_parameters()`` (a no-op) are
    there for code written for nn.LSTM; whole models pickle and ``torch.save``.
    ``fused=True`` (an attribute too): on CUDA, each layer and direction runs all its steps,
    forward and backward, in one launch of the fused sequence kernel (the recurrent weights held
    in shared memory), where the hidden size fits (see :func:`lltm_sequence`); off by default.

    Parameters per layer k and direction: ``weights_l{k}`` (3 * hidden_size, hidden_size +
    in_k), ``bias_l{k}`` (1, 3 * hidden_size), and ``weights_l{k}_reverse`` / ``bias_l{k}_reverse``
    when bidirectional; in_0 = input_size, in_k = hidden_size * num_directions; uniform in
    +-1/sqrt(hidden_size), as the cell's. A state_dict of the tutorial's module, of
    :class:`LLTMCell` or of a one-layer LLTM with ``weights`` / ``bias`` loads into a one-layer
    unidirectional LLTM (and ``.weights`` / ``.bias`` name layer 0's forward parameters).

    forward(input, hx=None) -> (output, (h_n, c_n)), shaped as ``nn.LSTM`` returns them:
        input: (steps, batch, input_size) ((batch, steps, input_size) if batch_first), an
            unbatched (steps, input_size), or a ``torch.nn.utils.rnn.PackedSequence`` (sorted
            or not: its sequences run packed, no work for padding)
        hx: (h_0, c_0), each (num_layers * num_directions, batch, hidden_size), or
            (num_layers * num_directions, hidden_size) for unbatched input; None for zeros. A
            one-layer unidirectional LLTM also takes (batch, hidden_size) states, and then
            returns h_n, c_n shaped so.
        output: (steps, batch, num_directions * hidden_size) (batch first if batch_first;
            a PackedSequence with the input's sorted_indices for packed input): the last
            layer's hidden states, both directions concatenated, forward first
        h_n, c_n: (num_layers * num_directions, batch, hidden_size), each sequence's final
            state (at its own last step), in the caller's batch order
    Layer k > 0 takes the previous layer's output, with dropout (torch's RNG) in training mode.
    """

    def __init__(self, input_size: Optional[int] = None, hidden_size: Optional[int] = None,
                 num_layers: int = 1, bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 device=None, dtype=None, *, input_features=None, state_size=None,
                 fused: bool = False):
        super().__init__()
        input_size, hidden_size = _sizes("LLTM", input_size, hidden_size, input_features,
                                         state_size)
        self.fused = _check_bool("LLTM", "fused", fused)
        if not isinstance(num_layers, int) or isinstance(num_layers, bool):
            raise TypeError(f"LLTM: num_layers should be of type int, got: "
                            f"{type(num_layers).__name__} {num_layers!r}")
        if num_layers < 1:
            raise ValueError(f"LLTM: num_layers must be an integer >= 1, got {num_layers!r}")
        if (not isinstance(dropout, numbers.Real) or isinstance(dropout, bool)
                or not 0 <= dropout <= 1):
            raise ValueError(f"LLTM: dropout must be a number in [0, 1] (the probability of an "
                             f"element being zeroed), got {dropout!r}")
        for flag, value in (("bias", bias), ("batch_first", batch_first),
                            ("bidirectional", bidirectional)):
            _check_bool("LLTM", flag, value)
        if not isinstance(proj_size, int) or isinstance(proj_size, bool):
            raise TypeError(f"LLTM: proj_size should be of type int, got: "
                            f"{type(proj_size).__name__} {proj_size!r}")
        if proj_size != 0:
            raise ValueError(f"LLTM: proj_size={proj_size} is not supported (nn.LSTM's output "
                             f"projection has no LLTM counterpart); only proj_size=0")
        if dropout > 0 and num_layers == 1:
            warnings.warn(f"LLTM: dropout={dropout} applies between layers, and num_layers=1 "
                          f"has none: it does nothing (as in nn.LSTM)", UserWarning, stacklevel=2)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.batch_first, self.dropout = bool(batch_first), float(dropout)
        self.bidirectional = bool(bidirectional)
        self.mode, self.proj_size = "LLTM", 0   # as nn.LSTM's mode ("LSTM") and proj_size
        factory = {"device": device, "dtype": dtype}
        self._names = []
        # names, shapes and order shared with the array API's forward_layers (a state dict
        # moves between the two unchanged)
        for layer in layer_plan(input_size, hidden_size, num_layers, self.bidirectional):
            w, b = layer.weights, layer.bias
            self.register_parameter(w, nn.Parameter(
                torch.empty(3 * hidden_size, hidden_size + layer.width, **factory)))
            self.register_parameter(b, nn.Parameter(torch.empty(1, 3 * hidden_size, **factory))
                                    if bias else None)
            self._names.append((w, b))
        self.reset_parameters()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.num_layers == 1 and not self.bidirectional:
            # a state_dict of the tutorial's module, of LLTMCell or of a one-layer LLTM with
            # weights / bias loads too
            _rename_old_keys(state_dict, prefix, {"weights": "weights_l0", "bias": "bias_l0"})
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    input_features = property(lambda self: self.input_size, doc="The tutorial's input_size")
    state_size = property(lambda self: self.hidden_size, doc="The tutorial's hidden_size")
    weights = property(lambda self: self.weights_l0, doc="Layer 0's forward weights")
    bias = property(lambda self: self.bias_l0, doc="Layer 0's forward bias (None if bias=False)")

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def _all_weights(self) -> list[list[str]]:
        """nn.LSTM's: the parameter names of each layer and direction (weights, then bias)."""
        return [[n for n in pair if getattr(self, n) is not None] for pair in self._names]

    @property
    def _flat_weights_names(self) -> list[str]:
        """nn.LSTM's: every parameter name, layer by layer, forward before reverse."""
        return [n for names in self._all_weights for n in names]

    @property
    def _flat_weights(self) -> list[Tensor]:
        """nn.LSTM's: every parameter, in the order of ``_flat_weights_names``."""
        return [getattr(self, n) for n in self._flat_weights_names]

    @property
    def all_weights(self) -> list[list[nn.Parameter]]:
        """As nn.LSTM's: the parameters of each layer and direction, ``[weights_l{k}{suffix},
        bias_l{k}{suffix}]`` (no bias when ``bias=False``)."""
        return [[getattr(self, n) for n in names] for names in self._all_weights]

    __prepare_scriptable__ = _refuse_torchscript   # torch.jit.script calls it first

    def flatten_parameters(self) -> None:
        """Does nothing, and is there for code written for nn.LSTM (which calls it after loading
        or moving a model): nn.LSTM packs its weights into one cuDNN buffer here; the LLTM's
        kernels take each layer's parameters as they are."""

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for weight in self.parameters():
            weight.data.uniform_(-stdv, stdv)

    def _layer_parameters(self, k: int, d: int):
        w, b = self._names[k * self.num_directions + d]
        weights, bias = getattr(self, w), getattr(self, b)
        return weights, (bias if bias is not None else weights.new_zeros(3 * self.hidden_size))

    def _hx(self, hx, batch: int, like: Tensor, unbatched: bool):
        """(h_0, c_0) as (layers * directions, batch, hidden) and whether to return (batch,
        hidden) states (a 2-D state given to a one-layer unidirectional LLTM)."""
        count, S = self.num_layers * self.num_directions, self.hidden_size
        if hx is None:
            zeros = like.new_zeros(count, batch, S)
            return (zeros, zeros), False
        _check_pair("LLTM", hx)
        h, c = hx
        flat = count == 1 and not unbatched and h.dim() == 2 and c.dim() == 2
        expected = (count, S) if unbatched else (count, batch, S)
        for name, t in (("h_0", h), ("c_0", c)):
            shape = tuple(t.shape)
            if shape != expected and not (flat and shape == (batch, S)):
                also = f" or {(batch, S)}" if count == 1 and not unbatched else ""
                raise ValueError(f"LLTM: {name} must have shape {expected}{also} (num_layers * "
                                 f"num_directions, {'' if unbatched else 'batch, '}hidden_size), "
                                 f"got {shape}")
        if unbatched:
            return (h.unsqueeze(1), c.unsqueeze(1)), False
        if flat:
            return (h.unsqueeze(0), c.unsqueeze(0)), True
        return (h, c), False

    def forward(self, input, hx: Optional[tuple[Tensor, Tensor]] = None):
        from torch.nn.utils.rnn import PackedSequence

        if isinstance(input, PackedSequence):
            return self._forward_packed(input, hx)
        return self._forward(input, hx, False)

    @eager_only
    def _forward_packed(self, input, hx):
        """PackedSequence input runs eagerly (a graph break under torch.compile): its layout
        depends on the lengths' values."""
        _check_packed(input, self.input_size)
        if input.data.device.type == "meta" and input.sorted_indices is not None:
            # shape inference: the sequences' order (values a meta tensor lacks) changes no shape
            from torch.nn.utils.rnn import PackedSequence

            out, state = self._forward(PackedSequence(input.data, input.batch_sizes), hx, True)
            return PackedSequence(out.data, out.batch_sizes, input.sorted_indices,
                                  input.unsorted_indices), state
        return self._forward(input, hx, True)

    def _forward(self, input, hx, packed: bool):
        if packed:
            # PackedSequence: every layer runs on the packed rows themselves (its data, (N, F)),
            # no padded tensor in or out; the output keeps the input's layout. One packing plan
            # per direction serves every layer; it depends on batch_sizes (on the host) alone and
            # works in the sorted order: the states are permuted on the device, as nn.LSTM does.
            from torch.nn.utils.rnn import PackedSequence

            from .._packing import packed_plan
            from ._interop import refuse_capture_without

            _check_input("LLTM", input.data, "(rows, input_size)", self.input_size)
            plans = [packed_plan(input.batch_sizes, reverse=d == 1)
                     for d in range(self.num_directions)]
            refuse_capture_without(plans, input.data.device)
            x, unbatched = input.data, False
            batch = int(input.batch_sizes[0]) if len(input.batch_sizes) else 0
        else:
            unbatched = isinstance(input, Tensor) and input.dim() == 2
            dims = ("(steps, input_size)" if unbatched else "(batch, steps, input_size)"
                    if self.batch_first else "(steps, batch, input_size)")
            _check_input("LLTM", input, dims, self.input_size)
            x = input.unsqueeze(1) if unbatched else (
                input.transpose(0, 1) if self.batch_first else input)
            batch = x.shape[1]
        (h0, c0), flat = self._hx(hx, batch, x, unbatched)
        if packed and input.sorted_indices is not None and hx is not None:
            order = input.sorted_indices
            h0, c0 = h0.index_select(1, order), c0.index_select(1, order)
        h_n, c_n = [], []
        # The array API's forward_layers (lltm_cupy/_layers.py) runs the same plan; its loop
        # writes the backward out and draws dropout from the caller's generator, this one is
        # differentiated by autograd and draws from torch's: two short loops, not one.
        for k in range(self.num_layers):
            outs = []
            for d in range(self.num_directions):
                i = k * self.num_directions + d
                if packed:
                    out, h, c = lltm_packed(x, *self._layer_parameters(k, d), h0[i], c0[i],
                                            plans[d], fused=getattr(self, "fused", False))
                else:
                    out, h, c = lltm_sequence(x, *self._layer_parameters(k, d), h0[i], c0[i],
                                              reverse=d == 1, fused=getattr(self, "fused", False))
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            x = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            if self.dropout and self.training and k < self.num_layers - 1:
                x = nn.functional.dropout(x, self.dropout, training=True)
        h_n, c_n = torch.stack(h_n), torch.stack(c_n)
        if packed and input.unsorted_indices is not None:
            h_n = h_n.index_select(1, input.unsorted_indices)
            c_n = c_n.index_select(1, input.unsorted_indices)
        if packed:
            return (PackedSequence(x, input.batch_sizes, input.sorted_indices,
                                   input.unsorted_indices), (h_n, c_n))
        if unbatched:
            return x.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))
        if flat:
            h_n, c_n = h_n[0], c_n[0]
        return (x.transpose(0, 1) if self.batch_first else x), (h_n, c_n)

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            text += f", num_layers={self.num_layers}"
        if self.bias_l0 is None:
            text += ", bias=False"
        text += f", batch_first={self.batch_first}"
        if self.dropout:
            text += f", dropout={self.dropout}"
        if self.bidirectional:
            text += ", bidirectional=True"
        if getattr(self, "fused", False):
            text += ", fused=True"
        return text


# Pickles (torch.save of a whole model) name the classes by their public home, so that they load
# whatever file inside lltm_cupy.torch defines them.
LLTMCell.__module__ = LLTM.__module__ = "lltm_cupy.torch"
