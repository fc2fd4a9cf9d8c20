"""Result and state types shared by the backends."""
from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["LLTMGrads", "LLTMSaved"]


class LLTMGrads(NamedTuple):
    """Gradients of one LLTM step, in the tutorial note's order, each shaped like its argument."""

    d_old_h: Any
    d_input: Any
    d_weights: Any
    d_bias: Any
    d_old_cell: Any


class LLTMSaved:
    """What :func:`lltm_cupy.backward` needs from a forward call. Pass it back untouched.

    Holds ``X = [old_h, input]`` (batch, state + features), the gate pre-activations with the
    bias added (batch, 3 * state) and ``new_cell`` (batch, state): X plus 4 * batch * state
    values. It also keeps a reference to ``weights`` (not a copy): do not modify the weights in
    place between forward and backward.
    """

    __slots__ = ("backend", "X", "gates", "new_cell", "weights", "bias_shape")

    def __init__(self, backend, X, gates, new_cell, weights, bias_shape):
        self.backend = backend
        self.X = X
        self.gates = gates
        self.new_cell = new_cell
        self.weights = weights
        self.bias_shape = bias_shape

    @property
    def nbytes(self) -> int:
        """Bytes of activations held for backward (X, gates, new_cell; not the weights)."""
        return int(self.X.nbytes + self.gates.nbytes + self.new_cell.nbytes)

    def __repr__(self) -> str:
        b, s = self.new_cell.shape
        return (f"LLTMSaved(backend={self.backend!r}, batch={b}, state={s}, "
                f"dtype={self.new_cell.dtype}, nbytes={self.nbytes})")
