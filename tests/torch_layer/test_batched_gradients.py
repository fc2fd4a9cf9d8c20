"""Batched gradients through the torch layer: ``torch.autograd.grad(..., is_grads_batched=True)``,
``jacobian(..., vectorize=True)`` and ``hessian(..., vectorize=True)`` (torch's vmap over the
backward). The backends cannot read a batch of gradients (it has no memory of its own), so the
backwards run the derivation's formulas as torch operations there; each result is checked
against the tutorial's pure-torch cell (``lltm_reference``) through the same torch function,
float64, on the CPU and the emulated CUDA path."""
from __future__ import annotations

import pytest
import torch
from torch.autograd.functional import hessian, jacobian
from torch.nn.utils.rnn import pack_padded_sequence

from lltm_cupy.torch import LLTM, LLTMCell, lltm_sequence
from lltm_cupy.torch.reference import lltm_reference

PATHS = ["cpu", "emulated-cuda"]
TOL = dict(rtol=1e-10, atol=1e-12)


def _path(request, path):
    if path == "emulated-cuda":
        request.getfixturevalue("emulated_cuda_torch")


def _sequence_twin(inputs, weights, bias, h, c, lengths=None):
    """The pure-torch sequence: the reference cell stepped; with ``lengths``, each sequence's
    outputs past its length zero and its final state the one at its last step."""
    outputs = []
    h_n, c_n = h, c
    for t in range(inputs.shape[0]):
        h, c = lltm_reference(inputs[t], weights, bias, h, c)
        if lengths is None:
            h_n, c_n = h, c
            outputs.append(h)
        else:
            alive = (torch.as_tensor(lengths) > t).to(h.dtype)[:, None]
            h_n = alive * h + (1 - alive) * h_n
            c_n = alive * c + (1 - alive) * c_n
            h, c = h_n, c_n
            outputs.append(alive * h)
    return torch.stack(outputs), h_n, c_n


def _models():
    torch.manual_seed(0)
    cell = LLTMCell(3, 4, dtype=torch.float64)
    w, b = cell.weights.detach(), cell.bias.detach()
    h0 = torch.randn(2, 4, dtype=torch.float64)
    c0 = torch.randn(2, 4, dtype=torch.float64)
    return cell, w, b, h0, c0


@pytest.mark.parametrize("path", PATHS)
def test_is_grads_batched_through_a_cell(request, path):
    _path(request, path)
    cell, w, b, h0, c0 = _models()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    h, c = cell(x, (h0, c0))
    v = torch.randn(5, 2, 4, dtype=torch.float64)
    got = torch.autograd.grad((h, c), x, (v, 2 * v), is_grads_batched=True)[0]
    hr, cr = lltm_reference(x, w, b, h0, c0)
    want = torch.autograd.grad((hr, cr), x, (v, 2 * v), is_grads_batched=True)[0]
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("path", PATHS)
def test_vectorized_jacobian_and_hessian_of_a_cell(request, path):
    _path(request, path)
    cell, w, b, h0, c0 = _models()
    x = torch.randn(2, 3, dtype=torch.float64)

    def ours(x):
        return cell(x, (h0, c0))[0]

    def twin(x):
        return lltm_reference(x, w, b, h0, c0)[0]

    torch.testing.assert_close(jacobian(ours, x, vectorize=True), jacobian(twin, x), **TOL)
    torch.testing.assert_close(hessian(lambda x: ours(x).pow(2).sum(), x, vectorize=True),
                               hessian(lambda x: twin(x).pow(2).sum(), x), **TOL)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["padded", "lengths", "packed"])
def test_vectorized_jacobian_and_hessian_of_a_sequence(request, path, case):
    _path(request, path)
    _, w, b, h0, c0 = _models()
    model = LLTM(3, 4, dtype=torch.float64)
    with torch.no_grad():
        model.weights_l0.copy_(w)
        model.bias_l0.copy_(b.reshape(model.bias_l0.shape))
    lengths = [5, 2]
    xs = torch.randn(5, 2, 3, dtype=torch.float64)

    def ours(xs):
        if case == "padded":
            out, (h_n, c_n) = model(xs, (h0[None], c0[None]))
            return torch.cat([out.reshape(-1), h_n.reshape(-1), c_n.reshape(-1)])
        if case == "lengths":
            out, h_n, c_n = lltm_sequence(xs, model.weights_l0, model.bias_l0, h0, c0,
                                          lengths=lengths)
            return torch.cat([out.reshape(-1), h_n.reshape(-1), c_n.reshape(-1)])
        out, (h_n, c_n) = model(pack_padded_sequence(xs, torch.tensor(lengths)),
                                (h0[None], c0[None]))
        padded = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=5)[0]
        return torch.cat([padded.reshape(-1), h_n.reshape(-1), c_n.reshape(-1)])

    def twin(xs):
        out, h_n, c_n = _sequence_twin(xs, w, b, h0, c0, None if case == "padded" else lengths)
        return torch.cat([out.reshape(-1), h_n.reshape(-1), c_n.reshape(-1)])

    torch.testing.assert_close(ours(xs), twin(xs), **TOL)
    torch.testing.assert_close(jacobian(ours, xs, vectorize=True), jacobian(twin, xs), **TOL)
    torch.testing.assert_close(hessian(lambda a: ours(a).pow(2).sum(), xs, vectorize=True),
                               hessian(lambda a: twin(a).pow(2).sum(), xs), **TOL)


def test_a_backend_error_that_is_not_a_batch_is_raised(monkeypatch):
    """Only a batch of gradients takes the formulas: any other error of the backend's backward
    is the caller's to see."""
    from lltm_cupy.torch import _functions

    def broken(*args, **kwargs):
        raise RuntimeError("the backend failed")

    monkeypatch.setattr(_functions, "cpu_step_backward", broken)
    cell, _, _, h0, c0 = _models()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    h, _ = cell(x, (h0, c0))
    with pytest.raises(RuntimeError, match="the backend failed"):
        h.sum().backward()
