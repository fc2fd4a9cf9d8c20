"""Autocast: the cell and the sequence layer under torch.autocast, eager and compiled.

CPU autocast (bfloat16 or float16) computes the cell in float32 (NumPy has no bfloat16); CUDA
autocast in its dtype, float16 or bfloat16.
Gradients reach float32 parameters in float32. The CUDA cases are GPU tests.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy.torch as lt  # noqa: E402
from helpers.torch_cuda import needs_cuda  # noqa: E402
from helpers.torch_models import _fresh_compile  # noqa: E402


class Model(torch.nn.Module):
    """Linear -> LLTMCell (two steps) or LLTM -> Linear."""

    def __init__(self, sequence=False, device="cpu"):
        super().__init__()
        self.sequence = sequence
        self.inp = torch.nn.Linear(8, 6, device=device)
        self.rnn = (lt.LLTM if sequence else lt.LLTMCell)(6, 16, device=device)
        self.head = torch.nn.Linear(16, 3, device=device)

    def forward(self, xs):                          # xs: (T, B, 8)
        z = self.inp(xs)
        if self.sequence:
            out, (h, c) = self.rnn(z)
            h = h[-1]                               # (num_layers, batch, S) as nn.LSTM
            self.cell_dtype = out.dtype
        else:
            state = None
            for x in z:
                state = self.rnn(x, state)
            h = state[0]
            self.cell_dtype = h.dtype
        return self.head(h)


def _step(model, run, xs, target, autocast, device):
    model.zero_grad()
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = run(xs)
    loss = torch.nn.functional.mse_loss(out.float(), target)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compare(device, sequence, compiled, autocast, expect_cell_dtype, rtol):
    if compiled:
        with _fresh_compile():
            return _compare_once(device, sequence, compiled, autocast, expect_cell_dtype, rtol)
    return _compare_once(device, sequence, compiled, autocast, expect_cell_dtype, rtol)


def _compare_once(device, sequence, compiled, autocast, expect_cell_dtype, rtol):
    torch.manual_seed(7)
    model = Model(sequence, device)
    run = torch.compile(model, fullgraph=True) if compiled else model
    xs = torch.randn(3, 5, 8, device=device)
    target = torch.randn(5, 3, device=device)
    loss32, grads32 = _step(model, model, xs, target, None, device)
    loss, grads = _step(model, run, xs, target, autocast, device)
    assert model.cell_dtype == expect_cell_dtype
    torch.testing.assert_close(loss, loss32, rtol=rtol, atol=0)
    for name, g in grads.items():
        assert g.dtype == torch.float32, f"{name}: gradient in {g.dtype}"
        assert torch.isfinite(g).all(), name
        # relative to the gradient's scale: bfloat16 layers round their outputs to 2^-9
        err = (g - grads32[name]).abs().max() / grads32[name].abs().max()
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol}"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("sequence", [False, True], ids=["cell", "sequence"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.slow
def test_cpu_autocast_computes_the_cell_in_float32(compiled, sequence, dtype):
    # the Linear layers run in the autocast dtype; the cell in float32
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    _compare("cpu", sequence, compiled, dtype, torch.float32, tol)


def test_cpu_autocast_trains():
    torch.manual_seed(3)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, target = torch.randn(3, 16, 8), torch.randn(16, 3)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(xs).float(), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(lambda v: v == v, losses)) and losses[-1] < 0.9 * losses[0], losses


def test_float64_is_left_alone_under_autocast():
    x = torch.randn(2, 3, dtype=torch.float64)
    cell = lt.LLTMCell(3, 4, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, c = cell(x)
    assert h.dtype == c.dtype == torch.float64


@needs_cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("sequence", [False, True], ids=["cell", "sequence"])
def test_cuda_float16_autocast_runs_the_cell_in_float16(compiled, sequence):
    _compare("cuda", sequence, compiled, torch.float16, torch.float16, 1e-2)


@needs_cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("sequence", [False, True], ids=["cell", "sequence"])
def test_cuda_bfloat16_autocast_runs_the_cell_in_bfloat16(compiled, sequence):
    # bfloat16 keeps 8 significant bits (u = 2^-9): losses and gradients within a few percent
    _compare("cuda", sequence, compiled, torch.bfloat16, torch.bfloat16, 5e-2)
