"""The float64 reference of variable-length sequences (``forward_sequence(..., lengths,
reverse)`` and its backward): each sequence stepped alone at its own length with
lltm_cupy.reference, reversed for reverse=True; a random case and a run of the array API.
Shared by the array API's, the kernels' and the torch layer's tests."""
from __future__ import annotations

import numpy as np

import lltm_cupy
from lltm_cupy import reference

NAMES = ("inputs", "weights", "bias", "h0", "c0")


def _case(T, B, F, S, dtype, seed=0, bias_2d=False):
    """A random sequence case (the inputs, the parameters, h0, c0 and the incoming gradients),
    in ``dtype``."""
    rng = np.random.default_rng(seed)
    k = S + F
    case = dict(inputs=rng.standard_normal((T, B, F)),
                weights=rng.uniform(-1, 1, (3 * S, k)) / np.sqrt(k),
                bias=rng.uniform(-1, 1, (1, 3 * S) if bias_2d else 3 * S),
                h0=rng.uniform(-1, 1, (B, S)), c0=rng.standard_normal((B, S)),
                grad_outputs=rng.standard_normal((T, B, S)),
                grad_h_n=rng.standard_normal((B, S)), grad_c_n=rng.standard_normal((B, S)))
    return {k: v.astype(dtype) for k, v in case.items()}


def _one_sequence(case, b, length, reverse, grads):
    """The float64 reference stepped over sequence b alone: outputs (T, S), h_n, c_n and the
    gradients of its inputs (T, F), the weights, the bias, h0 and c0."""
    T = case["inputs"].shape[0]
    W = case["weights"].astype(np.float64)
    bias = case["bias"].astype(np.float64).reshape(-1)
    times = list(range(length))[::-1] if reverse else list(range(length))
    h, c = case["h0"][b:b + 1].astype(np.float64), case["c0"][b:b + 1].astype(np.float64)
    outputs = np.zeros((T, h.shape[1]))
    caches = []
    for t in times:
        fwd = reference.lltm_forward(case["inputs"][t, b:b + 1], W, bias, h, c)
        caches.append((t, fwd))
        h, c = fwd[0], fwd[1]
        outputs[t] = h[0]
    g_out, g_h, g_c = grads
    dh = np.zeros_like(h) if g_h is None else g_h[b:b + 1].astype(np.float64)
    dc = np.zeros_like(c) if g_c is None else g_c[b:b + 1].astype(np.float64)
    d_w, d_b = np.zeros_like(W), np.zeros_like(bias)
    d_x = np.zeros((T, case["inputs"].shape[2]))
    for t, fwd in reversed(caches):
        gh = dh + (0 if g_out is None else g_out[t, b:b + 1])
        d_old_h, d_input, dw, db, d_old_c = reference.lltm_backward(gh, dc, *fwd[1:], W)
        d_w, d_b = d_w + dw, d_b + db
        d_x[t] = d_input[0]
        dh, dc = d_old_h, d_old_c
    return outputs, h[0], c[0], d_x, d_w, d_b, dh[0], dc[0]


def _reference(case, lengths, reverse, grads):
    per = [_one_sequence(case, b, int(n), reverse, grads) for b, n in enumerate(lengths)]
    outputs = np.stack([p[0] for p in per], axis=1)
    d_inputs = np.stack([p[3] for p in per], axis=1)
    stack = [np.stack([p[i] for p in per]) for i in (1, 2, 6, 7)]
    d_w = sum(p[4] for p in per)
    d_b = sum(p[5] for p in per).reshape(case["bias"].shape)
    return [outputs, stack[0], stack[1], d_inputs, d_w, d_b, stack[2], stack[3]]


OUT = ("outputs", "h_n", "c_n", "d_inputs", "d_weights", "d_bias", "d_h0", "d_c0")


def _run(xp, case, lengths, reverse, grads):
    a = {k: xp.asarray(v) for k, v in case.items()}
    outputs, h_n, c_n, saved = lltm_cupy.forward_sequence(*(a[n] for n in NAMES),
                                                          lengths=lengths, reverse=reverse)
    g = lltm_cupy.backward_sequence(*(None if v is None else xp.asarray(v) for v in grads),
                                    saved)
    return [outputs, h_n, c_n, *g]
