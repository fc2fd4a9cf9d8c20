"""Compiled and eager calls compute with the same code: under ``torch.compile`` the layer runs
its custom operators, which run the autograd Functions' own forward and backward bodies, so the
outputs and every gradient are the eager call's bit for bit, on the CPU and the emulated CUDA
path, one step and a whole sequence, training and forward only. (``aot_eager``: the graph the
compiler captures, with its autograd, without code generation for the rest of the model.)"""
from __future__ import annotations

import pytest
import torch

from lltm_cupy.torch import LLTM, LLTMCell

PATHS = ["cpu", "emulated-cuda"]


def _path(request, path):
    if path == "emulated-cuda":
        request.getfixturevalue("emulated_cuda_torch")


def _cell_run(model):
    def run(x, h, c):
        outputs = []
        for t in range(x.shape[0]):
            h, c = model(x[t], (h, c))
            outputs += [h, c]
        return outputs
    return run


def _sequence_run(model):
    def run(x, h, c):
        out, (h_n, c_n) = model(x, (h[None], c[None]))
        return [out, h_n, c_n]
    return run


def _results(fn, model, args, grad: bool):
    model.zero_grad(set_to_none=True)
    args = [a.detach().clone().requires_grad_(grad) for a in args]
    with torch.set_grad_enabled(grad):
        outputs = fn(*args)
    if not grad:
        return [o.detach() for o in outputs]
    weights = [torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)
               for o in outputs]
    torch.autograd.backward(outputs, weights)      # exact incoming gradients
    return ([o.detach() for o in outputs] + [a.grad for a in args]
            + [p.grad for p in model.parameters()])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["cell", "sequence"])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
def test_compiled_calls_give_the_eager_bits(request, path, case, grad):
    _path(request, path)
    torch._dynamo.reset()
    torch.manual_seed(0)
    if case == "cell":
        model = LLTMCell(5, 7)
        fn = _cell_run(model)
    else:
        model = LLTM(5, 7)
        fn = _sequence_run(model)
    args = [torch.randn(3, 4, 5), torch.randn(4, 7), torch.randn(4, 7)]
    eager = _results(fn, model, args, grad)
    compiled = _results(torch.compile(fn, backend="aot_eager", fullgraph=True), model, args,
                        grad)
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert a.shape == b.shape and torch.equal(a, b), \
            f"{case}, result {i}: compiled differs by {(a - b).abs().max().item():.3g}"
