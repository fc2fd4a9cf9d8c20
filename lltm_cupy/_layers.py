"""Whole models in one call: layers, directions, dropout between layers, variable lengths.

This layer sits above the backends' per-layer, per-direction sequence calls, as the torch
``LLTM`` sits above the torch ops. The two share the plan of layers and directions and the
parameters' names, shapes and order (``lltm_cupy._parameters``). Their loops stay two short
loops rather than one: the torch layer's is differentiated by autograd (``torch.cat`` and
``nn.functional.dropout`` record their own backward), while this one writes out the backward
itself (split the gradient between the directions, add their input gradients, apply the
dropout mask), and draws dropout from the caller's NumPy/CuPy generator rather than torch's.
"""
from __future__ import annotations

import numpy as np

from ._dispatch import _backend, _flag, _forward_sequence, sequence_plan
from ._aliasing import private_sequence
from ._checks import check_backward_layers, check_forward_layers
from ._parameters import array_module, read_structure
from ._types import LLTMLayersGrads, LLTMLayersSaved

__all__ = ["forward_layers", "backward_layers"]


def _dropout_mask(rng, p: float, shape, dtype, xp):
    """torch's dropout: keep with probability 1 - p, scaled by 1 / (1 - p); all zero at p = 1.
    One ``rng.random(shape)`` per call."""
    u = rng.random(shape)
    if type(u).__module__.split(".")[0] != xp.__name__.split(".")[0]:
        if xp is np:
            raise TypeError("lltm_cupy: rng makes CuPy arrays but the inputs are NumPy arrays; "
                            "pass a numpy.random.Generator")
        u = xp.asarray(u)
    keep = u >= p
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return (keep * scale).astype(dtype)


def forward_layers(inputs, parameters, h0=None, c0=None, *, lengths=None, dropout=0.0,
                   rng=None, return_saved=True, fused=False):
    """Run a whole model: every layer, both directions if bidirectional. Returns
    ``(outputs, h_n, c_n, saved)``.

    inputs: (steps, batch, input_size)
    parameters: a mapping in the torch ``LLTM``'s names and shapes (``init_parameters``, or a
        torch ``LLTM``'s ``state_dict()`` as arrays): ``weights_l{k}`` (3H, H + in_k),
        ``bias_l{k}`` (1, 3H) or (3H,) (all absent: no bias), ``_reverse`` for the reverse
        direction; the number of layers and directions is read from the names
    h0, c0: (layers * directions, batch, H), or None for zeros (each independently)
    lengths: optional (batch,) integers in [0, steps], as for :func:`forward_sequence`
    dropout: probability of zeroing each input of the layers above the first (as ``nn.LSTM``:
        kept values are scaled by 1 / (1 - dropout)); needs ``rng``
    rng: a ``numpy.random.Generator`` (or ``cupy.random.Generator`` for CuPy arrays): one
        ``rng.random((steps, batch, directions * H))`` per layer above the first, in order, so a
        seeded generator repeats a run
    return_saved: False for inference: every layer runs forward_sequence's forward-only mode
        (nothing computed or kept for a backward, memory beyond each layer's outputs
        independent of ``steps``) and ``saved`` is None; the outputs and states are bit for bit
        those of ``return_saved=True``
    fused: on the GPU, every layer and direction in the fused sequence kernels, as
        :func:`forward_sequence`'s ``fused`` (the backward follows)

    ``outputs`` (steps, batch, directions * H): the last layer's hidden states, forward
    direction first, zero past each sequence's length; ``h_n``, ``c_n`` (layers * directions,
    batch, H): each layer's and direction's final state, at each sequence's own last step, rows
    in the parameters' order (the torch ``LLTM``'s layout). ``saved`` (an ``LLTMLayersSaved``)
    goes to :func:`backward_layers`. No argument is modified, and no array returned or passed in
    is read by the backward (modify or refill them freely); the parameters are referenced, not
    copied: update them after the backward.
    """
    keep = _flag("return_saved", return_saved)
    fused = _flag("fused", fused)
    structure = read_structure(parameters)
    backend = check_forward_layers(inputs, parameters, h0, c0, structure)
    dropout = _check_dropout(dropout, rng, structure.num_layers)
    xp = array_module(backend)
    steps, batch, _ = inputs.shape
    H, count = structure.hidden_size, structure.num_layers * structure.directions
    dtype = inputs.dtype
    if h0 is None or c0 is None:
        zeros = xp.zeros((count, batch, H), dtype)
        h0, c0 = (zeros if h0 is None else h0), (zeros if c0 is None else c0)
    # one packing plan per direction serves every layer (lengths checked once)
    plans = [sequence_plan(inputs, lengths, reverse) for reverse in (False, True)]
    x, layers, masks = inputs, [], []
    h_n = xp.empty((count, batch, H), dtype)
    c_n = xp.empty((count, batch, H), dtype)
    outs = []
    for layer in structure.plan:
        if layer.reverse is False:
            if layer.layer:
                x = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=-1)
                mask = (_dropout_mask(rng, dropout, x.shape, dtype, xp) if dropout else None)
                masks.append(mask)
                if mask is not None:
                    x = x * mask
            outs = []
        weights = parameters[layer.weights]
        bias = (parameters[layer.bias] if structure.bias else xp.zeros(3 * H, dtype))
        out, h, c, saved = _forward_sequence(backend, x, weights, bias, h0[layer.index],
                                             c0[layer.index], plans[layer.reverse], keep,
                                             fused)
        if layer.layer == 0 and keep:
            private_sequence(inputs, out, saved, copy_outputs=False)
        outs.append(out)
        h_n[layer.index], c_n[layer.index] = h, c
        layers.append(saved)
    outputs = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=-1)
    if not keep:
        return outputs, h_n, c_n, None
    if len(outs) == 1 and plans[0] is None:
        outputs = outputs.copy()      # the saved hidden states' memory: the caller gets its own
    saved = LLTMLayersSaved(backend, structure, layers, masks, tuple(inputs.shape))
    return outputs, h_n, c_n, saved


def _check_dropout(dropout, rng, num_layers) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.floating)) \
            or not 0 <= dropout <= 1:
        raise ValueError(f"lltm_cupy: dropout must be a number in [0, 1], got {dropout!r}")
    if dropout and num_layers > 1 and not hasattr(rng, "random"):
        raise TypeError(f"lltm_cupy: dropout={dropout} needs rng, a numpy.random.Generator or "
                        f"cupy.random.Generator (e.g. numpy.random.default_rng(0)), got "
                        f"{type(rng).__qualname__}")
    return float(dropout) if num_layers > 1 else 0.0


def backward_layers(grad_outputs, grad_h_n, grad_c_n, saved):
    """Gradients of a whole model (backpropagation through every layer, direction and step).
    Returns ``LLTMLayersGrads(d_inputs, d_parameters, d_h0, d_c0)``.

    grad_outputs: (steps, batch, directions * H) gradient w.r.t. outputs, or None for zero
    grad_h_n, grad_c_n: (layers * directions, batch, H) gradients w.r.t. h_n, c_n, or None
    saved: what :func:`forward_layers` returned (usable for several backward calls)

    ``d_inputs`` (steps, batch, input_size), zero past each sequence's length;
    ``d_parameters`` a dict with the parameters' names, order and shapes (ready for an optimiser
    or a torch ``state_dict``); ``d_h0``, ``d_c0`` (layers * directions, batch, H), also when
    the states were omitted (the gradient of the zeros used).
    """
    backend = check_backward_layers(grad_outputs, grad_h_n, grad_c_n, saved)
    xp = array_module(backend)
    structure = saved.structure
    H, D = structure.hidden_size, structure.directions
    steps, batch, _ = saved.shape
    count = structure.num_layers * D
    dtype = saved.layers[0].dtype
    d_h0 = xp.empty((count, batch, H), dtype)
    d_c0 = xp.empty((count, batch, H), dtype)
    grads = {}
    grad_x = grad_outputs
    needed = (True, True, structure.bias, True, True)
    for k in range(structure.num_layers - 1, -1, -1):
        d_x = None
        for layer in structure.plan[k * D: (k + 1) * D]:
            g_out = (None if grad_x is None else grad_x if D == 1
                     else grad_x[..., layer.reverse * H: (layer.reverse + 1) * H])
            g = _backend(backend).backward_sequence(
                g_out, None if grad_h_n is None else grad_h_n[layer.index],
                None if grad_c_n is None else grad_c_n[layer.index],
                saved.layers[layer.index], needed)
            grads[layer.index] = g
            d_h0[layer.index], d_c0[layer.index] = g.d_h0, g.d_c0
            d_x = g.d_inputs if d_x is None else d_x + g.d_inputs
        if k and saved.masks[k - 1] is not None:
            d_x = d_x * saved.masks[k - 1]
        grad_x = d_x
    d_parameters = {}
    for layer in structure.plan:
        d_parameters[layer.weights] = grads[layer.index].d_weights
        if structure.bias:
            d_parameters[layer.bias] = grads[layer.index].d_bias
    return LLTMLayersGrads(grad_x, d_parameters, d_h0, d_c0)
