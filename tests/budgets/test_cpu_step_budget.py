"""The CPU backend's sequence loops, counted without a clock (tests/helpers/calls.py's
``counted_numpy``: every NumPy function, ufunc and array method, torch function and library
Python function that lltm_cupy code calls): what a sequence step and a call cost beyond their
arithmetic. A step is the difference of two lengths divided by the steps between them; a call's
fixed part is the shorter call less its steps. Small sizes (what is counted does not depend on
them), float32.

The budgets, per step (each fails on the backend before its sequence loops were rewritten,
whose steps made 2 library calls forward and 5 NumPy calls backward, and whose variable-length
steps 40 NumPy calls):

- forward: one GEMM (torch's ``bmm``, or NumPy's ``matmul``), the projection's add and the
  twelve element-wise calls of ``lltm_cupy._numpy.elementwise.forward_step``: :data:`FORWARD`;
- backward: one GEMM (torch's ``addmm_``, or NumPy's ``matmul`` and ``add``) and four
  element-wise calls (``backward_step``): :data:`BACKWARD`;
- no array method (no view made) and at most one library call (the step function) per step,
  beside the NumPy engine's GEMM functions;

and per call (the torch layer, one layer and direction): no d_h0 GEMM when h0 needs no gradient,
two copies of the weights (the forward's gate-major operands), and at most :data:`CALL_TORCH`
torch calls.
"""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from helpers.calls import counted_numpy

#: (NumPy, torch, library) calls per step through the torch layer
FORWARD = (13, 1, 1)
BACKWARD = (4, 1, 1)
#: the same through the array API (NumPy's GEMMs: a library function each)
ARRAY_FORWARD = (14, 0, 2)
ARRAY_BACKWARD = (6, 0, 2)
#: torch calls of an LLTM training call beyond its steps (module, Function, GEMMs, loss, and
#: the conversions that keep every tensor torch's own: 56 with ``Tensor.numpy()`` and
#: ``torch.from_numpy``, which left the results non-resizable; 84 with
#: ``lltm_cupy.torch._cpu_arrays``, two calls a tensor: ``is_contiguous``, ``data_ptr``)
CALL_TORCH = 87

B, F, S = 3, 4, 5
SHORT, LONG = 4, 8


def _per_step(short, long) -> tuple:
    steps = LONG - SHORT
    return tuple((getattr(long, k) - getattr(short, k)) / steps
                 for k in ("numpy", "torch", "library"))


def _no_views(short, long) -> None:
    """No array method (reshape, view, copy...) per step."""
    methods = {k: long.names.get(k, 0) - short.names.get(k, 0)
               for k in set(long.names) | set(short.names) if k.startswith("ndarray.")}
    assert not any(methods.values()), methods


def _layer(steps, grad=True, h0_grad=False):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    from lltm_cupy.torch import LLTM

    torch.manual_seed(0)
    model = LLTM(F, S)
    x = torch.randn(steps, B, F)
    h0 = torch.randn(1, B, S, requires_grad=h0_grad)
    c0 = torch.randn(1, B, S)
    holder = {}

    def forward():
        with torch.set_grad_enabled(grad):
            out, (h, c) = model(x, (h0, c0))
        holder["loss"] = out.sum() + h.sum() + c.sum() if grad else None

    def backward():
        holder["loss"].backward()
    return forward, backward


def _counts(steps, grad=True, h0_grad=False):
    forward, backward = _layer(steps, grad, h0_grad)
    forward()
    if grad:
        backward()
    f = counted_numpy(forward)[1] if not grad else None
    if not grad:
        return f, None
    # counted_numpy runs the call twice: a forward before each backward
    fwd = counted_numpy(lambda: forward())[1]

    def both():
        forward()
        backward()
    total = counted_numpy(both)[1]
    return fwd, total


def test_torch_layer_step_budget():
    """Training through LLTM: per forward step and per backward step."""
    (f_short, t_short), (f_long, t_long) = _counts(SHORT), _counts(LONG)
    forward = _per_step(f_short, f_long)
    total = _per_step(t_short, t_long)
    backward = tuple(a - b for a, b in zip(total, forward))
    assert all(a <= b for a, b in zip(forward, FORWARD)), (
        forward, f_short, f_long)
    assert all(a <= b for a, b in zip(backward, BACKWARD)), (backward, t_short, t_long)
    _no_views(t_short, t_long)


def test_torch_layer_forward_only_step_budget():
    """Under no_grad: a step as the training forward's, no factors."""
    (short, _), (long, _) = _counts(SHORT, grad=False), _counts(LONG, grad=False)
    per = _per_step(short, long)
    assert all(a <= b for a, b in zip(per, FORWARD)), (per, short, long)
    _no_views(short, long)


def test_torch_layer_call_budget():
    """A training call's fixed part: no d_h0 GEMM unless h0 needs a gradient (one more torch
    GEMM where it does), two copies of the weights, torch calls within CALL_TORCH."""
    (_, short), (_, long) = _counts(SHORT), _counts(LONG)
    torch_per_step = (long.torch - short.torch) / (LONG - SHORT)
    fixed_torch = short.torch - SHORT * torch_per_step
    assert fixed_torch <= CALL_TORCH, (fixed_torch, short)
    assert short.names.get("ascontiguousarray", 0) <= 2, short
    (_, with_h0) = _counts(SHORT, h0_grad=True)
    gemms = ("mm", "bmm", "baddbmm", "addmm", "addmm_")
    count = {k: sum(c.torch_names.get(g, 0) for g in gemms) for k, c in (("without", short),
                                                                          ("with", with_h0))}
    assert count["with"] == count["without"] + 1, (count, short.torch_names, with_h0.torch_names)


def _array_counts(steps, lengths=None, reverse=False):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((steps, B, F), dtype=np.float32)
    w = rng.standard_normal((3 * S, S + F), dtype=np.float32)
    b = np.zeros(3 * S, np.float32)
    h = c = np.zeros((B, S), np.float32)
    ones = np.ones((steps, B, S), np.float32)
    kw = {"lengths": lengths, "reverse": reverse}
    fwd = counted_numpy(lambda: lltm_cupy.forward_sequence(xs, w, b, h, c, **kw))[1]
    saved = lltm_cupy.forward_sequence(xs, w, b, h, c, **kw)[3]
    bwd = counted_numpy(lambda: lltm_cupy.backward_sequence(ones, None, None, saved))[1]
    return fwd, bwd


@pytest.mark.parametrize("case", ["fixed", "reverse", "lengths"])
def test_array_api_step_budget(case):
    """forward_sequence / backward_sequence (NumPy's GEMMs), fixed lengths, reverse, and
    variable lengths (every sequence but the first ending early: steps of fewer rows)."""
    def run(steps):
        lengths = [steps] + [steps // 2] * (B - 1) if case == "lengths" else None
        return _array_counts(steps, lengths, case == "reverse")
    (fs, bs), (fl, bl) = run(SHORT), run(LONG)
    forward, backward = _per_step(fs, fl), _per_step(bs, bl)
    assert all(a <= b for a, b in zip(forward, ARRAY_FORWARD)), (forward, fs, fl)
    assert all(a <= b for a, b in zip(backward, ARRAY_BACKWARD)), (backward, bs, bl)
    if case != "lengths":       # (with lengths, a row count's first step makes its views)
        _no_views(fs, fl)
        _no_views(bs, bl)


#: NumPy calls of one LLTMCell forward + backward (torch's GEMMs aside): the concatenation's
#: and the product's views, the twelve element-wise forward calls, the four factors, the
#: backward's element-wise calls, its layout copy and the bias gradient's sum
CELL_NUMPY = 33


def test_cell_step_counts_the_element_wise_step_kept_per_thread():
    """An LLTMCell step run before the count (its element-wise step made and kept for the
    thread, over real NumPy) is counted whole: counted_numpy makes the kept step again under
    the counting stand-in, so every ufunc of the forward shows (not only the backward's)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    from lltm_cupy.torch import LLTMCell

    torch.manual_seed(0)
    cell = LLTMCell(F, S)
    x, h, c = torch.randn(B, F), torch.randn(B, S), torch.randn(B, S)

    def step():
        new_h, new_cell = cell(x, (h, c))
        (new_h.sum() + new_cell.sum()).backward()
    step()                                  # made and kept over the real NumPy
    counts = counted_numpy(step)[1]
    for name in ("minimum", "maximum", "negative", "expm1", "exp", "tanh"):
        assert counts.names.get(name, 0) >= 1, (name, counts.names)
    assert counts.numpy <= CELL_NUMPY, counts.names
