"""Result and state types shared by the backends."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["LLTMGrads", "LLTMSaved", "LLTMSequenceGrads", "LLTMSequenceSaved", "LLTMLayersGrads",
           "LLTMLayersSaved", "LLTMCellGrads", "LLTMCellSaved"]


class LLTMGrads(NamedTuple):
    """Gradients of one LLTM step, in the tutorial note's order, each shaped like its argument."""

    d_old_h: Any
    d_input: Any
    d_weights: Any
    d_bias: Any
    d_old_cell: Any


@dataclass(slots=True, eq=False, repr=False)
class LLTMSaved:
    """What :func:`lltm_cupy.backward` needs from a forward call. Pass it back untouched.

    Holds ``X = [old_h, input]`` (batch, state + features), ``new_cell`` (batch, state, the
    forward's output itself) and the gate values the backend's backward reads: on the GPU the
    pre-activations, bias added (batch, 3 * state), from which the kernel recomputes every
    activation and derivative; on the CPU the four products the backward multiplies by,
    gate-major (4, batch, state) (``lltm_cupy._numpy.elementwise.step_factors``). It refers to
    ``weights`` (not a copy): do not modify them in place between forward and backward.
    """

    backend: str  # "numpy" or "cupy"
    X: Any
    gates: Any
    new_cell: Any
    weights: Any
    bias_shape: tuple

    @property
    def nbytes(self) -> int:
        """Bytes of activations held for backward (X, gates, new_cell; not the weights)."""
        return int(self.X.nbytes + self.gates.nbytes + self.new_cell.nbytes)

    def __repr__(self) -> str:
        b, s = self.new_cell.shape
        return (f"{type(self).__name__}(backend={self.backend!r}, batch={b}, state={s}, "
                f"dtype={self.new_cell.dtype}, nbytes={self.nbytes})")


class LLTMSequenceGrads(NamedTuple):
    """Gradients of a whole sequence, each shaped like its argument of forward_sequence."""

    d_inputs: Any
    d_weights: Any
    d_bias: Any
    d_h0: Any
    d_c0: Any


@dataclass(slots=True, eq=False, repr=False)
class LLTMSequenceSaved:
    """What :func:`lltm_cupy.backward_sequence` needs from :func:`lltm_cupy.forward_sequence`.

    Holds the inputs reshaped to (T * B, F) (a view of the caller's array when it is
    contiguous), the hidden states ``hs`` (T + 1, B, S) = [h0, outputs...], and per step the
    backend's gate values (as in :class:`LLTMSaved`: (T, B, 3S) on the GPU, (T, 4, B, S) on the
    CPU) and new_cell (T, B, S): 4 * B * S (GPU) or 5 * B * S (CPU) values per step besides
    the inputs and hidden states. Keeps references to the weights and, where contiguous, the
    inputs: do not modify them in place between forward and backward.
    """

    backend: str  # "numpy" or "cupy"
    inputs: Any
    hs: Any
    gates: Any
    cells: Any
    weights: Any
    bias_shape: tuple
    #: variable lengths (``lengths=`` given): the packed layout (``lltm_cupy._packing.Plan``);
    #: then inputs, hs (the outputs), gates and cells hold packed rows, and h0 is the sorted h0
    plan: Any = None
    h0: Any = None
    #: the forward ran the fused sequence kernel (``fused=True``): so does the backward
    fused: bool = False

    @property
    def dtype(self):
        return self.hs.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held for backward besides the weights (inputs counted only if copied)."""
        return int(self.hs.nbytes + self.gates.nbytes + self.cells.nbytes)

    def __repr__(self) -> str:
        if self.plan is not None:
            return (f"LLTMSequenceSaved(backend={self.backend!r}, packed rows={self.plan.rows}, "
                    f"batch={len(self.plan.perm)}, state={self.cells.shape[-1]}, "
                    f"reverse={self.plan.reverse}, dtype={self.dtype}, nbytes={self.nbytes})")
        t, b, s = self.cells.shape
        return (f"LLTMSequenceSaved(backend={self.backend!r}, steps={t}, batch={b}, state={s}, "
                f"dtype={self.dtype}, nbytes={self.nbytes})")


class LLTMLayersGrads(NamedTuple):
    """Gradients of a whole model (:func:`lltm_cupy.backward_layers`)."""

    d_inputs: Any       # (steps, batch, input_size)
    d_parameters: Any   # dict, the parameters' names and order, each shaped like its parameter
    d_h0: Any           # (layers * directions, batch, hidden)
    d_c0: Any           # (layers * directions, batch, hidden)


@dataclass(slots=True, eq=False, repr=False)
class LLTMLayersSaved:
    """What :func:`lltm_cupy.backward_layers` needs from :func:`lltm_cupy.forward_layers`.

    ``layers``: one :class:`LLTMSequenceSaved` per layer and direction (in the parameters'
    order), each holding its inputs, hidden states and gate values; ``masks``: per layer above
    the first, the dropout mask applied to its input (None without dropout). It refers to the
    parameters (not copies): update them after the backward. Freed when the caller drops it.
    """

    backend: str
    structure: Any                 # lltm_cupy._parameters.Structure
    layers: list
    masks: list
    shape: tuple                   # (steps, batch, input_size) of the inputs

    @property
    def nbytes(self) -> int:
        """Bytes held for backward besides the parameters."""
        return int(sum(s.nbytes for s in self.layers)
                   + sum(m.nbytes for m in self.masks if m is not None))

    def __repr__(self) -> str:
        s = self.structure
        return (f"LLTMLayersSaved(backend={self.backend!r}, layers={s.num_layers}, "
                f"bidirectional={s.bidirectional}, steps={self.shape[0]}, batch={self.shape[1]}, "
                f"hidden={s.hidden_size}, nbytes={self.nbytes})")


class LLTMCellGrads(NamedTuple):
    """Gradients of the fused cell alone (:func:`lltm_cupy.cell_backward`)."""

    d_gates: Any        # (batch, 3 * state), w.r.t. the gate pre-activations
    d_old_cell: Any     # (batch, state)


@dataclass(slots=True, eq=False, repr=False)
class LLTMCellSaved:
    """What :func:`lltm_cupy.cell_backward` needs from :func:`lltm_cupy.cell_forward`: the
    backend's gate values (as in :class:`LLTMSaved`: the pre-activations (batch, 3 * state) on
    the GPU, the four products (4, batch, state) on the CPU) and new_cell (batch, state), its own
    copy on the GPU, where the backward reads it."""

    backend: str
    gates: Any
    new_cell: Any

    @property
    def nbytes(self) -> int:
        return int(self.gates.nbytes + self.new_cell.nbytes)

    __repr__ = LLTMSaved.__repr__
