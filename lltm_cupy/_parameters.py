"""A whole model's parameters: their names, shapes and order, shared by the array API's
:func:`lltm_cupy.forward_layers` and the torch ``LLTM``, so that a state dict moves between the
two unchanged; and :func:`init_parameters`, which draws them as ``LLTM.reset_parameters`` does.

Layer k, direction d (0 forward, 1 reverse) has ``weights_l{k}`` (3H, H + in_k) and
``bias_l{k}`` (1, 3H), ``_reverse`` appended for d = 1; in_0 = input_size, in_k = H * directions
(layer k reads the previous layer's outputs, both directions concatenated, forward first).
The order is layer by layer, forward before reverse, weights before bias: the order in which the
torch module registers them, hence of its ``state_dict()`` and ``parameters()``.
"""
from __future__ import annotations

import math
import sys
from typing import Mapping, NamedTuple

import numpy as np

__all__ = ["Layer", "layer_plan", "read_structure", "init_parameters"]


class Layer(NamedTuple):
    """One layer and direction of a model."""

    index: int          # k * directions + d: its row of h_0 / h_n, (layers * directions, B, H)
    layer: int          # k
    reverse: bool       # d == 1
    weights: str        # parameter names
    bias: str
    width: int          # in_k, the features it reads


def layer_plan(input_size: int, hidden_size: int, num_layers: int,
               bidirectional: bool) -> list[Layer]:
    """Every layer and direction in the parameters' order."""
    directions = 2 if bidirectional else 1
    plan = []
    for k in range(num_layers):
        width = input_size if k == 0 else hidden_size * directions
        for d in range(directions):
            suffix = "_reverse" if d else ""
            plan.append(Layer(k * directions + d, k, bool(d), f"weights_l{k}{suffix}",
                              f"bias_l{k}{suffix}", width))
    return plan


class Structure(NamedTuple):
    input_size: int
    hidden_size: int
    num_layers: int
    bidirectional: bool
    bias: bool
    plan: list

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1


def read_structure(parameters) -> Structure:
    """The model a parameter mapping describes (layers, directions, sizes, bias), checked: every
    name of :func:`layer_plan` present with its shape, nothing else; ValueError / TypeError
    naming the parameter otherwise."""
    if not isinstance(parameters, Mapping):
        raise TypeError(f"lltm_cupy: parameters must be a mapping of names to arrays (e.g. "
                        f"init_parameters(...) or a torch LLTM's state_dict as arrays), got "
                        f"{type(parameters).__qualname__}")
    if "weights_l0" not in parameters:
        raise ValueError(f"lltm_cupy: parameters has no 'weights_l0' (names are weights_l{{k}}, "
                         f"bias_l{{k}}, with _reverse for the reverse direction), got keys "
                         f"{sorted(parameters)[:6]}")
    first = parameters["weights_l0"]
    if getattr(first, "ndim", None) != 2 or first.shape[0] % 3 or first.shape[0] == 0:
        raise ValueError(f"lltm_cupy: parameters['weights_l0'] must have shape (3 * hidden, "
                         f"hidden + input_size), got {tuple(getattr(first, 'shape', ()))}")
    hidden = first.shape[0] // 3
    input_size = first.shape[1] - hidden
    if input_size < 0:
        raise ValueError(f"lltm_cupy: parameters['weights_l0'] of shape {tuple(first.shape)} "
                         f"has fewer than hidden = {hidden} columns")
    num_layers = 0
    while f"weights_l{num_layers}" in parameters:
        num_layers += 1
    bidirectional = "weights_l0_reverse" in parameters
    bias = "bias_l0" in parameters
    plan = layer_plan(input_size, hidden, num_layers, bidirectional)
    expected = [n for layer in plan for n in ((layer.weights, layer.bias) if bias
                                             else (layer.weights,))]
    missing = [n for n in expected if n not in parameters]
    extra = [n for n in parameters if n not in expected]
    if missing or extra:
        raise ValueError(f"lltm_cupy: parameters of a {num_layers}-layer "
                         f"{'bidirectional ' if bidirectional else ''}model "
                         f"{'with' if bias else 'without'} bias: missing {missing}, "
                         f"unexpected {extra}")
    for layer in plan:
        shape = (3 * hidden, hidden + layer.width)
        got = tuple(getattr(parameters[layer.weights], "shape", ()))
        if got != shape:
            raise ValueError(f"lltm_cupy: parameters[{layer.weights!r}] must have shape {shape} "
                             f"(3 * hidden, hidden + {layer.width}), got {got}")
        if bias:
            got = tuple(getattr(parameters[layer.bias], "shape", ()))
            if got not in ((1, 3 * hidden), (3 * hidden,)):
                raise ValueError(f"lltm_cupy: parameters[{layer.bias!r}] must have shape "
                                 f"(1, {3 * hidden}) or ({3 * hidden},), got {got}")
    return Structure(input_size, hidden, num_layers, bidirectional, bias, plan)


def _array_module(xp, rng):
    if xp is None:
        xp = "cupy" if type(rng).__module__.startswith("cupy") else "numpy"
    if isinstance(xp, str):
        if xp not in ("numpy", "cupy"):
            raise ValueError(f"lltm_cupy: xp must be numpy, cupy or their names, got {xp!r}")
        xp = np if xp == "numpy" else None
    if xp is None or getattr(xp, "__name__", None) == "cupy":
        # CuPy without a usable GPU fails in its first allocation with a driver error: the
        # library's message instead (RuntimeError)
        from ._cuda.kernels import cupy_module

        cupy = cupy_module()
        return cupy if xp is None else xp
    return xp


def init_parameters(input_size: int, hidden_size: int, num_layers: int = 1, *,
                    bidirectional: bool = False, bias: bool = True, rng, xp=None,
                    dtype="float32") -> dict:
    """A model's parameters, drawn as the torch ``LLTM.reset_parameters`` draws them: every
    value uniform in [-1/sqrt(hidden_size), 1/sqrt(hidden_size)).

    rng: a ``numpy.random.Generator`` or ``cupy.random.Generator`` (its ``random``); the draws
        run in the parameters' order, one array each, so a seed repeats the model
    xp: the array module of the result: numpy or cupy (or their names); default the
        generator's (numpy for a NumPy generator)
    dtype: float32, float64 (float16 on CuPy too)

    Returns a dict in the torch ``LLTM``'s order and shapes: ``weights_l{k}``
    (3 * hidden_size, hidden_size + in_k), ``bias_l{k}`` (1, 3 * hidden_size) (none when
    ``bias=False``), ``_reverse`` twins when bidirectional; see :func:`lltm_cupy.forward_layers`.
    """
    for name, value, low in (("input_size", input_size, 0), ("hidden_size", hidden_size, 1),
                             ("num_layers", num_layers, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"lltm_cupy: {name} must be an integer >= {low}, got {value!r}")
    if not hasattr(rng, "random"):
        raise TypeError(f"lltm_cupy: rng must be a numpy.random.Generator or a "
                        f"cupy.random.Generator (e.g. numpy.random.default_rng(0)), got "
                        f"{type(rng).__qualname__}")
    xp = _array_module(xp, rng)
    stdv = 1.0 / math.sqrt(hidden_size)
    parameters = {}
    for layer in layer_plan(int(input_size), int(hidden_size), int(num_layers), bidirectional):
        shapes = {layer.weights: (3 * hidden_size, hidden_size + layer.width)}
        if bias:
            shapes[layer.bias] = (1, 3 * hidden_size)
        for name, shape in shapes.items():
            u = rng.random(shape)
            if xp is np and "numpy" not in type(u).__module__:
                raise TypeError("lltm_cupy: rng makes CuPy arrays; pass xp=cupy or a NumPy "
                                "generator")
            parameters[name] = xp.asarray((2.0 * u - 1.0) * stdv).astype(dtype)
    return parameters


def array_module(kind: str):
    """numpy or cupy (the module the running process imported) for a backend name."""
    return np if kind == "numpy" else sys.modules.get("cupy") or __import__("cupy")
