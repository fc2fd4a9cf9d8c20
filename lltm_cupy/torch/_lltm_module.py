"""The sequence module :class:`LLTM`, with ``nn.LSTM``'s interface: layers, both directions,
dropout between layers, packed variable-length input."""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from .._parameters import layer_plan
from ._export import recording, refusal
from ._module_args import (_check_bool, _check_pair, _layer_input, _refuse_torchscript,
                           _rename_old_keys, _sizes)
from ._ops import eager_only, lltm_packed, lltm_sequence

__all__ = ["LLTM"]


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
            if recording():     # (before the graph break of _forward_packed)
                raise refusal("LLTM with PackedSequence input")
            return self._forward_packed(input, hx)
        return self._forward(input, hx, False)

    @eager_only
    def _forward_packed(self, input, hx):
        """PackedSequence input runs eagerly (a graph break under torch.compile): its layout
        depends on the lengths' values."""
        return self._forward(input, hx, True)

    def _forward(self, input, hx, packed: bool):
        x, batch, unbatched = _layer_input(input, packed, self.input_size, self.batch_first)
        (h0, c0), flat = self._hx(hx, batch, x, unbatched)
        # the sequences' order of a PackedSequence (meta data: shape inference, where the order
        # changes no shape and the states cannot be permuted by it)
        permuted = packed and not x.is_meta
        if packed:
            # PackedSequence: every layer runs on the packed rows themselves (its data, (N, F)),
            # no padded tensor in or out; the output keeps the input's layout. One packing plan
            # per direction serves every layer; it depends on batch_sizes (on the host) alone and
            # works in the sorted order: the states are permuted on the device, as nn.LSTM does.
            from torch.nn.utils.rnn import PackedSequence

            from .._packing import packed_plan
            from ._interop import use_plans

            if permuted and input.sorted_indices is not None and hx is not None:
                order = input.sorted_indices
                h0, c0 = h0.index_select(1, order), c0.index_select(1, order)
            plans = [packed_plan(input.batch_sizes, d == 1, "torch")
                     for d in range(self.num_directions)]
            use_plans(plans, x)
        h_n, c_n = [], []
        directions = self.num_directions
        # The array API's forward_layers (lltm_cupy/_layers.py) runs the same plan; its loop
        # writes the backward out and draws dropout from the caller's generator, this one is
        # differentiated by autograd and draws from torch's: two short loops, not one.
        for k in range(self.num_layers):
            outs = []
            for d in range(directions):
                i = k * directions + d
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
        if permuted and input.unsorted_indices is not None:
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


# Pickles (torch.save of a whole model) name the class by its public home, so that it loads
# whatever file inside lltm_cupy.torch defines it.
LLTM.__module__ = "lltm_cupy.torch"
