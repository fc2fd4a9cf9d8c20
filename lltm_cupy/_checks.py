"""Every argument check of the public API, in one place, with messages that say what to fix.

Checks run once, at the public boundary; the backends and kernel launchers trust their input.
"""
from __future__ import annotations

import reprlib
import sys

import numpy as np

from ._types import LLTMCellSaved, LLTMLayersSaved, LLTMSaved, LLTMSequenceSaved

__all__ = ["array_backend", "check_shapes", "check_forward", "check_backward",
           "check_sequence_shapes", "check_forward_sequence", "check_backward_sequence",
           "check_forward_layers", "check_backward_layers", "check_cell_forward",
           "check_cell_backward", "check_flag"]

_FORWARD_NAMES = ("input", "weights", "bias", "old_h", "old_cell")
_FLOATS = {
    "numpy": (np.dtype(np.float32), np.dtype(np.float64)),
    "cupy": (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)),
}


def _kind(x) -> str | None:
    # A CuPy array can only exist if cupy was imported: never import it here. (Checked first so
    # that a stand-in CuPy whose arrays subclass numpy.ndarray, as in the tests, is recognised.)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    if isinstance(x, np.ndarray):
        return "numpy"
    return None


def check_flag(where: str, name: str, value) -> bool:
    """A yes/no argument: a bool (or NumPy's bool); TypeError naming it for anything else, where
    ``bool(value)`` would quietly read "no" or 0 as a choice."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be True or False, got "
                        f"{type(value).__qualname__} {reprlib.repr(value)}")
    return bool(value)


def _refuse_subclass(name: str, x) -> None:
    """ndarray subclasses whose meaning the backend would drop: masked arrays (the mask) and
    np.matrix (2-D-only semantics, ``*`` as a matrix product)."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"lltm_cupy: {name} is a masked array, and the mask would be ignored; "
                        f"pass np.ma.filled({name}, value) or {name}.data if that is meant")
    if isinstance(x, np.matrix):
        raise TypeError(f"lltm_cupy: {name} is a numpy.matrix; pass np.asarray({name})")


def array_backend(named: dict) -> str:
    """Return "numpy" or "cupy" for a dict {name: array}; TypeError for anything else or a mix."""
    kinds = {}
    for name, x in named.items():
        k = _kind(x)
        if k == "numpy" and type(x) is not np.ndarray:
            _refuse_subclass(name, x)
        if k is None:
            raise TypeError(
                f"lltm_cupy: {name} must be a numpy.ndarray or a cupy.ndarray, "
                f"got {type(x).__module__}.{type(x).__qualname__}"
                + (" (for torch tensors use lltm_cupy.torch)" if type(x).__module__.startswith("torch")
                   else ""))
        kinds.setdefault(k, []).append(name)
    if len(kinds) > 1:
        parts = "; ".join(f"{k}: {', '.join(v)}" for k, v in kinds.items())
        raise TypeError(f"lltm_cupy: all arrays must be of one kind (all NumPy or all CuPy), got {parts}")
    return next(iter(kinds))


def _check_dtypes(named: dict, backend: str) -> np.dtype:
    dtypes = {name: x.dtype for name, x in named.items()}
    first = next(iter(dtypes.values()))
    if any(d != first for d in dtypes.values()):
        listing = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise TypeError(f"lltm_cupy: all arrays must have the same dtype, got {listing}")
    if first not in _FLOATS[backend]:
        allowed = ", ".join(str(d) for d in _FLOATS[backend])
        hint = " (float16 runs on the GPU backend only)" if first == np.float16 else ""
        if not first.isnative:
            hint = (f" (a non-native byte order: convert first, e.g. "
                    f"a.astype(a.dtype.newbyteorder('=')) gives {first.newbyteorder('=')})")
        raise TypeError(f"lltm_cupy: unsupported dtype {first} for the {backend} backend; "
                        f"expected one of {allowed}{hint}")
    return first


def _expect_shape(name: str, x, expected: tuple, meaning: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"lltm_cupy: {name} must have shape {expected} {meaning}, got {tuple(x.shape)}")


def _check_weights_and_bias(weights, bias, state, features, state_from, features_from) -> None:
    """weights (3 * state, state + features) and bias, with state and features taken from the
    arguments named: the message names the argument most likely wrong (for a module's fixed
    weights, the input or the state)."""
    if weights.ndim != 2:
        raise ValueError(f"lltm_cupy: weights must be 2-D (3 * state, state + features), got "
                         f"shape {tuple(weights.shape)}")
    rows, cols = weights.shape
    expected = (3 * state, state + features)
    if (rows, cols) != expected:
        if rows == 3 * state:    # the state agrees: the input's width is off, or the weights
            raise ValueError(
                f"lltm_cupy: {features_from} has {features} features, but weights of shape "
                f"{(rows, cols)} with state {state} (from {state_from}) take {cols - state}: "
                f"weights must have shape {expected} (3 * state, state + features), "
                f"got {(rows, cols)}")
        if rows % 3 == 0 and cols - rows // 3 == features:   # the input agrees: the state is off
            raise ValueError(
                f"lltm_cupy: {state_from} has {state} state columns, but weights of shape "
                f"{(rows, cols)} are for state {rows // 3}: weights must have shape {expected} "
                f"(3 * state, state + features), got {(rows, cols)}")
        _expect_shape("weights", weights, expected,
                      f"(3 * state, state + features) with state from {state_from} and features "
                      f"from {features_from}")
    if tuple(bias.shape) not in ((3 * state,), (1, 3 * state)):
        raise ValueError(f"lltm_cupy: bias must have shape ({3 * state},) or (1, {3 * state}) "
                         f"(3 * state), got {tuple(bias.shape)}")


def _check_state(h_name, c_name, h, c, batch, batch_from) -> int:
    """h, c (batch, state); returns state."""
    if h.ndim != 2:
        raise ValueError(f"lltm_cupy: {h_name} must be 2-D (batch, state), got shape "
                         f"{tuple(h.shape)}")
    state = h.shape[1]
    if h.shape[0] != batch:
        raise ValueError(f"lltm_cupy: {h_name} has batch {h.shape[0]} but {batch_from} has "
                         f"batch {batch}: {h_name} must have shape {(batch, state)} "
                         f"(batch, state) with batch from {batch_from}, got {tuple(h.shape)}")
    _expect_shape(c_name, c, (batch, state), f"(batch, state) like {h_name}")
    return state


def _check_device(named: dict) -> None:
    devices = {name: x.device.id for name, x in named.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on GPU {d}" for n, d in devices.items())
        raise ValueError(f"lltm_cupy: all arrays must be on one GPU, got {listing}")


def check_shapes(input, weights, bias, old_h, old_cell) -> None:
    """Shape checks of the forward arguments (anything with .ndim and .shape, torch tensors too)."""
    if input.ndim != 2:
        raise ValueError(f"lltm_cupy: input must be 2-D (batch, features), got shape {tuple(input.shape)}")
    batch, features = input.shape
    state = _check_state("old_h", "old_cell", old_h, old_cell, batch, "input")
    _check_weights_and_bias(weights, bias, state, features, "old_h", "input")


def _check_arguments(names, arrays, check_shapes_fn) -> str:
    """Kind, dtype, shapes and device of a forward call's arrays; return the backend name."""
    named = dict(zip(names, arrays))
    backend = array_backend(named)
    _check_dtypes(named, backend)
    check_shapes_fn(*arrays)
    if backend == "cupy":
        _check_device(named)
    return backend


def _check_gradients(expected: dict, saved, dtype, reference) -> str:
    """expected: {name: (gradient or None, shape, meaning)}; return the backend name."""
    named = {n: g for n, (g, _, _) in expected.items() if g is not None}
    if not named:
        return saved.backend
    backend = array_backend(named)
    if backend != saved.backend:
        raise TypeError(f"lltm_cupy: gradients are {backend} arrays but the forward ran on "
                        f"{saved.backend} arrays")
    for name, g in named.items():
        if g.dtype != dtype:
            raise TypeError(f"lltm_cupy: {name} must have the forward's dtype {dtype}, got {g.dtype}")
        _, shape, meaning = expected[name]
        _expect_shape(name, g, shape, meaning)
    if backend == "cupy":
        _check_device({**named, "saved": reference})
    return backend


def check_forward(input, weights, bias, old_h, old_cell) -> str:
    """Validate forward arguments; return the backend name."""
    return _check_arguments(_FORWARD_NAMES, (input, weights, bias, old_h, old_cell), check_shapes)


_NO_SAVED = (" (a forward with return_saved=False keeps nothing for a backward: run it with "
             "return_saved=True)")


def _check_saved(saved, saved_type: type, forward: str, none_hint: str = _NO_SAVED) -> None:
    """TypeError unless ``saved`` is the ``saved_type`` that ``lltm_cupy.<forward>`` returns;
    for ``None``, the message adds ``none_hint`` (by default: what return_saved=False does)."""
    if not isinstance(saved, saved_type):
        raise TypeError(f"lltm_cupy: saved must be the {saved_type.__name__} returned by "
                        f"lltm_cupy.{forward}, got {type(saved).__qualname__}"
                        f"{none_hint if saved is None else ''}")


def _check_step_gradients(grad_h, grad_cell, saved) -> str:
    """grad_h and grad_cell (either may be None) of one step's backward: (batch, state) and
    the dtype of ``saved.new_cell``; returns the backend name."""
    shape = tuple(saved.new_cell.shape)
    return _check_gradients({"grad_h": (grad_h, shape, "(batch, state) like new_cell"),
                             "grad_cell": (grad_cell, shape, "(batch, state) like new_cell")},
                            saved, saved.new_cell.dtype, saved.new_cell)


def check_backward(grad_h, grad_cell, saved):
    """Validate backward arguments; return the backend name. Either gradient may be None."""
    _check_saved(saved, LLTMSaved, "forward")
    return _check_step_gradients(grad_h, grad_cell, saved)


_SEQUENCE_NAMES = ("inputs", "weights", "bias", "h0", "c0")


def check_sequence_shapes(inputs, weights, bias, h0, c0) -> None:
    """Shape checks of forward_sequence (anything with .ndim and .shape)."""
    if inputs.ndim != 3:
        raise ValueError(f"lltm_cupy: inputs must be 3-D (steps, batch, features), got shape "
                         f"{tuple(inputs.shape)}")
    steps, batch, features = inputs.shape
    state = _check_state("h0", "c0", h0, c0, batch, "inputs")
    _check_weights_and_bias(weights, bias, state, features, "h0", "inputs")


def check_packed_shapes(data, weights, bias, h0, c0) -> None:
    """Shape checks of a PackedSequence's data (rows, features) with (batch, state) states."""
    if data.ndim != 2:
        raise ValueError(f"lltm_cupy: packed data must be 2-D (rows, features), got shape "
                         f"{tuple(data.shape)}")
    state = _check_state("h0", "c0", h0, c0, h0.shape[0] if h0.ndim else 0, "h0")
    _check_weights_and_bias(weights, bias, state, data.shape[1], "h0", "inputs")


def check_forward_sequence(inputs, weights, bias, h0, c0) -> str:
    """Validate forward_sequence arguments; return the backend name."""
    return _check_arguments(_SEQUENCE_NAMES, (inputs, weights, bias, h0, c0),
                            check_sequence_shapes)


def check_backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved):
    """Validate backward_sequence arguments; return the backend name. Any gradient may be None."""
    _check_saved(saved, LLTMSequenceSaved, "forward_sequence")
    state = saved.cells.shape[-1]
    steps, batch = ((saved.plan.steps, len(saved.plan.perm)) if saved.plan is not None
                    else saved.cells.shape[:2])
    return _check_gradients(
        {"grad_outputs": (grad_outputs, (steps, batch, state), "(steps, batch, state)"),
         "grad_h_n": (grad_h_n, (batch, state), "(batch, state)"),
         "grad_c_n": (grad_c_n, (batch, state), "(batch, state)")},
        saved, saved.dtype, saved.cells)


def check_forward_layers(inputs, parameters: dict, h0, c0, structure) -> str:
    """Validate forward_layers' arrays (the parameters' shapes were read by
    ``_parameters.read_structure``); h0 / c0 may be None. Returns the backend name."""
    named = {"inputs": inputs, **{f"parameters[{k!r}]": v for k, v in parameters.items()}}
    named.update({n: a for n, a in (("h0", h0), ("c0", c0)) if a is not None})
    backend = array_backend(named)
    _check_dtypes(named, backend)
    if inputs.ndim != 3:
        raise ValueError(f"lltm_cupy: inputs must be 3-D (steps, batch, features), got shape "
                         f"{tuple(inputs.shape)}")
    if inputs.shape[2] != structure.input_size:
        raise ValueError(f"lltm_cupy: inputs has {inputs.shape[2]} features, the parameters "
                         f"take {structure.input_size} (weights_l0's columns minus hidden)")
    count = structure.num_layers * structure.directions
    expected = (count, inputs.shape[1], structure.hidden_size)
    for name, a in (("h0", h0), ("c0", c0)):
        if a is not None:
            _expect_shape(name, a, expected, "(layers * directions, batch, hidden)")
    if backend == "cupy":
        _check_device(named)
    return backend


def check_backward_layers(grad_outputs, grad_h_n, grad_c_n, saved):
    """Validate backward_layers' gradients; any may be None. Returns the backend name."""
    _check_saved(saved, LLTMLayersSaved, "forward_layers")
    s = saved.structure
    steps, batch = saved.shape[:2]
    states = (s.num_layers * s.directions, batch, s.hidden_size)
    return _check_gradients(
        {"grad_outputs": (grad_outputs, (steps, batch, s.directions * s.hidden_size),
                          "(steps, batch, directions * hidden)"),
         "grad_h_n": (grad_h_n, states, "(layers * directions, batch, hidden)"),
         "grad_c_n": (grad_c_n, states, "(layers * directions, batch, hidden)")},
        saved, saved.layers[0].dtype, saved.layers[0].cells)


def check_cell_forward(gates, old_cell) -> str:
    """Validate cell_forward's arrays; return the backend name."""
    named = {"gates": gates, "old_cell": old_cell}
    backend = array_backend(named)
    _check_dtypes(named, backend)
    if old_cell.ndim != 2:
        raise ValueError(f"lltm_cupy: old_cell must be 2-D (batch, state), got shape "
                         f"{tuple(old_cell.shape)}")
    batch, state = old_cell.shape
    _expect_shape("gates", gates, (batch, 3 * state),
                  "(batch, 3 * state): the input, output and candidate pre-activations, with "
                  "batch and state from old_cell")
    if backend == "cupy":
        _check_device(named)
    return backend


def check_cell_backward(grad_h, grad_cell, saved) -> str:
    """Validate cell_backward's arguments; either gradient may be None."""
    # cell_forward always returns its saved: no return_saved hint for None
    _check_saved(saved, LLTMCellSaved, "cell_forward", none_hint="")
    return _check_step_gradients(grad_h, grad_cell, saved)
