"""The torch layer's host work per call, counted in Python calls (tests/helpers/calls.py: calls
of functions defined in lltm_cupy/, plus calls from lltm_cupy code into CuPy), deterministic,
no clock: what a call costs the host before any arithmetic or GPU work, on the CPU and on the
emulated CUDA path (the CuPy backend on the emulated CuPy, kernels and GEMMs no-ops). On a GPU
host a Python call costs microseconds (its Python runs 3-4x slower than the development
machines'), so these counts are its host time's proxy; ``scripts/profile_step.py --calls``
prints them.

The budgets (each fails on the layer before its thin eager path: 119 / 173 calls on the CPU,
about 270 per cell step and 400 per LLTM call on the emulated CUDA path):

- CPU: an ``LLTMCell`` forward + backward at most :data:`CPU_CELL`, an ``LLTM`` call of one
  step at most :data:`CPU_LLTM`;
- emulated CUDA: an ``LLTMCell`` step at most :data:`CUDA_CELL`, an ``LLTM`` call at most
  :data:`CUDA_LLTM` beyond its steps and a sequence step at most :data:`CUDA_STEP` (the
  difference of two lengths, divided by the steps between them), with ``fused=True`` a call
  at most :data:`CUDA_LLTM` whatever its steps (about 300 before the fused kernels ran on
  torch's buffers).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

from lltm_cupy.torch import LLTM, LLTMCell  # noqa: E402
from helpers.calls import counted  # noqa: E402

CPU_CELL = 29
#: (57 while the CPU results were ``torch.from_numpy`` tensors, non-resizable; 85 since they are
#: torch's own: a call of ``lltm_cupy.torch._cpu_arrays`` per tensor crossing each way)
CPU_LLTM = 88
CUDA_CELL = 60
CUDA_LLTM = 100
CUDA_STEP = 4

B, F, S = 16, 32, 128


def _cell_step():
    torch.manual_seed(0)
    cell = LLTMCell(F, S)
    x, h, c = torch.randn(B, F), torch.randn(B, S), torch.randn(B, S)
    ones = torch.ones(B, S)
    return lambda: torch.autograd.backward(cell(x, (h, c)), (ones, ones))


def _lltm_call(steps, **kw):
    torch.manual_seed(0)
    model = LLTM(F, S, **kw)
    xs = torch.randn(steps, B, F)
    count = model.num_layers * model.num_directions
    h, c = torch.randn(count, B, S), torch.randn(count, B, S)

    def call():
        out, (_, c_n) = model(xs, (h, c))
        torch.autograd.backward((out, c_n), (torch.ones_like(out), torch.ones_like(c_n)))
    return call


def _calls(run):
    run()                   # the first call makes what later calls reuse
    run()
    return counted(run)[1]


def test_cpu_cell_and_lltm_calls():
    cell = _calls(_cell_step())
    assert cell.library <= CPU_CELL, cell
    lltm = _calls(_lltm_call(1))
    assert lltm.library <= CPU_LLTM, lltm
    assert cell.cupy == lltm.cupy == 0


def test_emulated_cuda_cell_calls(emulated_cuda_torch):
    cell = _calls(_cell_step())
    assert cell.total <= CUDA_CELL, cell
    assert cell.cupy > 0            # (the path under test: the CUDA backend's launches)


@pytest.mark.parametrize("layers", [1, 2], ids=["one layer", "two layers"])
def test_emulated_cuda_lltm_calls(emulated_cuda_torch, layers):
    """Per layer and direction: a call beyond its steps, and a step."""
    short, long = (_calls(_lltm_call(steps, num_layers=layers)) for steps in (4, 8))
    per_step = (long.total - short.total) / 4 / layers
    fixed = (short.total - 4 * layers * per_step) / layers
    assert per_step <= CUDA_STEP, (per_step, short, long)
    assert fixed <= CUDA_LLTM, (fixed, short)



def test_emulated_cuda_fused_lltm_calls(fused_cupy, emulated_cuda_torch):
    """``fused=True`` (the fused sequence kernels, one launch each way): a call, whatever its
    steps."""
    emulator = fused_cupy.emulator
    short, long = (_calls(_lltm_call(steps, fused=True)) for steps in (4, 8))
    emulator.reset()
    _lltm_call(4, fused=True)()
    assert emulator.log.count("kernel:seq_fwd") == emulator.log.count("kernel:seq_bwd") == 1
    assert long.total == short.total, (short, long)
    assert short.total <= CUDA_LLTM, short
