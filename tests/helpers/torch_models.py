"""Shared by the torch layer's tests: the two paths a model runs on here (``PATHS``: the CPU,
and the CUDA path over the emulated CuPy, which ``_path`` installs), the pure-torch reference of
a whole model (each sequence alone, layer by layer, both directions) and torch.compile with
nothing reused from an earlier test (``_fresh_compile``)."""
from __future__ import annotations

import contextlib
import importlib

import torch

import lltm_cupy.torch as lt

PATHS = ["cpu", "cuda-emulated"]


def _path(request, path):
    if path == "cuda-emulated":
        request.getfixturevalue("emulated_cuda_torch")


def reference_lltm(model, x, lengths, h0, c0):
    """Each sequence alone at its own length, layer by layer, both directions (pure torch)."""
    D, L = model.num_directions, model.num_layers
    outputs = x.new_zeros(x.shape[0], x.shape[1], D * model.hidden_size)
    h_n, c_n = [[None] * x.shape[1] for _ in range(L * D)], [[None] * x.shape[1] for _ in range(L * D)]
    for b, n in enumerate(lengths):
        layer_in = x[:n, b]
        for k in range(L):
            outs = []
            for d in range(D):
                w, bias = model._layer_parameters(k, d)
                h, c = h0[k * D + d, b:b + 1], c0[k * D + d, b:b + 1]
                out = [None] * n
                for t in (range(n) if d == 0 else reversed(range(n))):
                    h, c = lt.lltm_reference(layer_in[t:t + 1], w, bias, h, c)
                    out[t] = h[0]
                outs.append(torch.stack(out) if n else layer_in.new_zeros(0, model.hidden_size))
                h_n[k * D + d][b], c_n[k * D + d][b] = h[0], c[0]
            layer_in = torch.cat(outs, dim=1)
        if n:
            outputs[:n, b] = layer_in
    stack = lambda rows: torch.stack([torch.stack(r) for r in rows])  # noqa: E731
    return outputs, stack(h_n), stack(c_n)


@contextlib.contextmanager
def _fresh_compile():
    """torch.compile with nothing reused from an earlier test: Dynamo reset, and torch's
    compile caches kept out. On torch < 2.13 the AOTAutograd cache (on by default, on disk)
    keys on whether autocast is on but not on its dtype, so a graph compiled under bfloat16
    autocast is silently reused under float16 autocast (and Dynamo 2.5 does not recompile when
    only the autocast dtype changes)."""
    import torch._dynamo

    patches = contextlib.ExitStack()
    for module, name in (("torch._functorch.config", "enable_autograd_cache"),
                         ("torch._inductor.config", "fx_graph_cache")):
        config = importlib.import_module(module)
        if hasattr(config, name):
            patches.enter_context(config.patch(**{name: False}))
    torch._dynamo.reset()
    with patches:
        yield
    torch._dynamo.reset()
