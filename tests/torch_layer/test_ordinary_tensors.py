"""What the torch layer returns, and what it was given, stay ordinary torch tensors: outputs and
gradients resize, serve as ``out=`` of an operation that resizes, move into shared memory and
cross to another process as ``nn.LSTM``'s do; arguments, states and parameters are left as
they were (``Tensor.numpy()`` would make their storage non-resizable for good). CPU and the
emulated CUDA path, every entry point."""
from __future__ import annotations

import pytest
import torch

from lltm_cupy.torch import LLTM, LLTMCell, lltm_sequence

PATHS = ["cpu", "emulated-cuda"]


def _path(request, path):
    if path == "emulated-cuda":
        request.getfixturevalue("emulated_cuda_torch")


def _ordinary(name, t):
    """``t`` behaves as a tensor torch made: it resizes, and is the ``out=`` of a cat."""
    assert t.untyped_storage().resizable(), f"{name}: storage not resizable"
    t = t.detach()
    before = t.clone().reshape(-1)
    t.resize_(0)                                # (as torch asks of an out= to be resized)
    torch.cat([before, before], out=t)          # grows t's storage
    assert t.shape == (2 * before.numel(),) and torch.equal(t[:before.numel()], before)


def _runs():
    torch.manual_seed(0)
    cell = LLTMCell(5, 7, dtype=torch.float64)
    one = LLTM(5, 7, dtype=torch.float64)
    two = LLTM(5, 7, num_layers=2, bidirectional=True, dtype=torch.float64)

    def cell_step():
        x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
        h = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
        c = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
        new_h, new_c = cell(x, (h, c))
        return (new_h, new_c), (x, h, c, *cell.parameters())

    def sequence(model, packed=False, lengths=None):
        def run():
            x = torch.randn(6, 3, 5, dtype=torch.float64, requires_grad=True)
            if lengths is not None:
                h0 = torch.zeros(3, 7, dtype=torch.float64, requires_grad=True)
                c0 = torch.zeros(3, 7, dtype=torch.float64, requires_grad=True)
                out, h_n, c_n = lltm_sequence(x, model.weights_l0, model.bias_l0, h0, c0,
                                              lengths=lengths)
                return (out, h_n, c_n), (x, h0, c0, model.weights_l0, model.bias_l0)
            if packed:
                data = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 2, 4]),
                                                              enforce_sorted=False)
                out, (h_n, c_n) = model(data)
                return (out.data, h_n, c_n), (x, *model.parameters())
            out, (h_n, c_n) = model(x)
            return (out, h_n, c_n), (x, *model.parameters())
        return run

    return {"cell": cell_step, "padded": sequence(one), "packed": sequence(one, packed=True),
            "lengths": sequence(one, lengths=[6, 1, 3]),
            "two layers, bidirectional": sequence(two)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["cell", "padded", "packed", "lengths",
                                  "two layers, bidirectional"])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
def test_outputs_gradients_and_arguments_stay_ordinary(request, path, case, grad):
    _path(request, path)
    run = _runs()[case]
    with torch.set_grad_enabled(grad):
        outputs, leaves = run()
    if grad:
        sum((o * (i + 1)).sum() for i, o in enumerate(outputs)).backward()
        for i, leaf in enumerate(leaves):
            assert leaf.grad is not None
            _ordinary(f"{case}: gradient {i}", leaf.grad)
    for i, leaf in enumerate(leaves):
        assert leaf.untyped_storage().resizable(), f"{case}: argument {i} made non-resizable"
    for i, out in enumerate(outputs):
        _ordinary(f"{case}: output {i}", out)


def _receive(queue, results):
    tensors = queue.get(timeout=60)
    results.put([float(t.sum()) for t in tensors])


@pytest.mark.parametrize("path", PATHS)
def test_outputs_move_to_shared_memory_and_cross_processes(request, path):
    _path(request, path)
    with torch.no_grad():
        outputs, _ = _runs()["padded"]()
    cell_outputs, _ = _runs()["cell"]()
    tensors = [t.detach() for t in (*outputs, *cell_outputs)]
    for t in tensors:
        assert t.share_memory_().is_shared()
    context = torch.multiprocessing.get_context("fork")
    queue, results = context.Queue(), context.Queue()
    child = context.Process(target=_receive, args=(queue, results))
    child.start()
    queue.put(tensors)
    sums = results.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0
    assert sums == [float(t.sum()) for t in tensors]
