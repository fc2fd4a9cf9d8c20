"""The pure-torch reference: the tutorial's Python LLTM, differentiated by autograd. The
reference of the torch tests, ``scripts/check.py`` and the benchmark; never optimised."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ._cell_module import _CellBase

__all__ = ["lltm_reference", "lltm_sequence_reference", "ReferenceLLTMCell"]


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


def lltm_sequence_reference(inputs, weights, bias, h, c):
    """:func:`lltm_reference` stepped over ``inputs`` (steps, batch, features) from the states
    ``h``, ``c`` (batch, state): ``(outputs, h_n, c_n)`` as ``lltm_sequence`` returns them.
    (TorchScript compiles it as it stands: what ``torch.jit.trace`` of an LLTM records.)"""
    outputs = torch.jit.annotate(List[Tensor], [])
    for t in range(inputs.shape[0]):    # (unbind's list defeats the TorchScript ONNX exporter)
        h, c = lltm_reference(inputs[t], weights, bias, h, c)
        outputs.append(h)
    if len(outputs) == 0:
        return inputs.new_empty(0, h.shape[0], h.shape[1]), h, c
    return torch.stack(outputs), h, c


class ReferenceLLTMCell(_CellBase):
    """The tutorial's pure-Python LLTM module: same parameters as :class:`LLTMCell`."""

    def forward(self, input: Tensor, state: Optional[tuple[Tensor, Tensor]] = None):
        return lltm_reference(*self._args(input, state))
