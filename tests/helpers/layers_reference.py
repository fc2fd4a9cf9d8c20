"""The float64 reference of a whole model over ONE sequence alone: every layer and direction
stepped with ``lltm_cupy.reference`` over the sequence's own length, dropout as the masks given,
and the backward written out by hand from the reference's per-step backward."""
from __future__ import annotations

import numpy as np

from lltm_cupy import reference


def _direction_forward(x, W, bias, h, c, length, reverse):
    """x (T, F): outputs (T, H) zero past length, h_n, c_n (H,), and the per-step caches."""
    T = x.shape[0]
    outputs = np.zeros((T, h.shape[0]))
    h, c = h[None], c[None]
    caches = []
    for t in (range(length - 1, -1, -1) if reverse else range(length)):
        fwd = reference.lltm_forward(x[t:t + 1], W, bias, h, c)
        caches.append((t, fwd))
        h, c = fwd[0], fwd[1]
        outputs[t] = h[0]
    return outputs, h[0], c[0], caches


def _direction_backward(caches, W, g_out, g_h, g_c, T, F):
    dh, dc = g_h[None].copy(), g_c[None].copy()
    d_w, d_b, d_x = np.zeros_like(W), np.zeros(W.shape[0]), np.zeros((T, F))
    for t, fwd in reversed(caches):
        d_old_h, d_input, dw, db, d_old_c = reference.lltm_backward(dh + g_out[t:t + 1], dc,
                                                                    *fwd[1:], W)
        d_w, d_b, d_x[t] = d_w + dw, d_b + db, d_input[0]
        dh, dc = d_old_h, d_old_c
    return d_x, d_w, d_b, dh[0], dc[0]


def model_one_sequence(x, params, h0, c0, length, masks, g_out, g_h, g_c):
    """One sequence b: x (T, F); params {name: float64 array} in the torch LLTM's names;
    h0, c0, g_h, g_c (L * D, H); masks: per layer above the first, (T, D * H) or None;
    g_out (T, D * H). Returns outputs (T, D * H), h_n, c_n, d_x (T, F), d_params (dict, biases
    flat), d_h0, d_c0."""
    D = 2 if "weights_l0_reverse" in params else 1
    L = sum(1 for k in params if k.startswith("weights_l") and not k.endswith("_reverse"))
    H = params["weights_l0"].shape[0] // 3
    T = x.shape[0]
    names = [(f"weights_l{k}{s}", f"bias_l{k}{s}") for k in range(L)
             for s in ("", "_reverse")[:D]]
    h_n, c_n = np.zeros((L * D, H)), np.zeros((L * D, H))
    inp, per_layer = x, []
    for k in range(L):
        if k and masks[k - 1] is not None:
            inp = inp * masks[k - 1]
        outs = []
        for d in range(D):
            w, b = names[k * D + d]
            bias = params.get(b, np.zeros(3 * H)).reshape(-1)
            out, h, c, caches = _direction_forward(inp, params[w], bias, h0[k * D + d],
                                                   c0[k * D + d], length, d == 1)
            outs.append(out)
            h_n[k * D + d], c_n[k * D + d] = h, c
            per_layer.append((caches, inp.shape[1]))
        inp = np.concatenate(outs, axis=1)
    outputs = inp
    d_params, d_h0, d_c0 = {}, np.zeros((L * D, H)), np.zeros((L * D, H))
    grad = g_out
    for k in range(L - 1, -1, -1):
        d_x = 0
        for d in range(D):
            i = k * D + d
            caches, F = per_layer[i]
            w, b = names[i]
            dx, dw, db, dh, dc = _direction_backward(caches, params[w], grad[:, d * H:(d + 1) * H],
                                                     g_h[i], g_c[i], T, F)
            d_params[w], d_params[b] = dw, db
            d_h0[i], d_c0[i] = dh, dc
            d_x = d_x + dx
        if k and masks[k - 1] is not None:
            d_x = d_x * masks[k - 1]
        grad = d_x
    return outputs, h_n, c_n, grad, d_params, d_h0, d_c0
