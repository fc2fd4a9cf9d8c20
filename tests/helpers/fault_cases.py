"""What the fault-injection tests of both paths (tests/processes/test_faults_cpu.py and
test_faults_cuda.py) share: the array API's operations under test, their arrays, and the check
of an exploration's report, and the torch cell's steps."""
from __future__ import annotations

import numpy as np

import lltm_cupy


def check(report) -> None:
    """Every injection point reached raised a clear error or took a documented fallback."""
    print(report.line())
    assert report.injected, report.line()
    assert not report.problems, "\n".join(report.problems[:40]) + (
        f"\n... {len(report.problems)} problems" if len(report.problems) > 40 else "")


def arrays(T, B, F, S, dtype=np.float32, seed=0, xp=np) -> dict:
    """A sequence's arguments and output gradients, as ``xp`` arrays."""
    rng = np.random.default_rng(seed)
    k = S + F
    shapes = {"x": (T, B, F), "w": (3 * S, k), "b": (3 * S,), "h0": (B, S), "c0": (B, S),
              "go": (T, B, S), "gh": (B, S), "gc": (B, S)}
    return {n: xp.asarray((rng.uniform(-1, 1, s) / (np.sqrt(k) if n == "w" else 1))
                          .astype(dtype)) for n, s in shapes.items()}


def sequence_op(a, lengths=None, fused=False, forward_only=True):
    """A sequence forward only (``forward_only``), then forward and backward: every result."""
    def op():
        found = {}
        if forward_only:
            out, h_n, c_n, _ = lltm_cupy.forward_sequence(
                a["x"], a["w"], a["b"], a["h0"], a["c0"], lengths=lengths, fused=fused,
                return_saved=False)
            found.update(fo_out=out, fo_h=h_n, fo_c=c_n)
        out, h_n, c_n, saved = lltm_cupy.forward_sequence(
            a["x"], a["w"], a["b"], a["h0"], a["c0"], lengths=lengths, fused=fused)
        grads = lltm_cupy.backward_sequence(a["go"], a["gh"], a["gc"], saved)
        found.update(out=out, h_n=h_n, c_n=c_n, **grads._asdict())
        return found
    return op


def cell_op(a):
    """One step (the first of ``a``'s inputs), forward and backward: every result."""
    def op():
        h, c, saved = lltm_cupy.forward(a["x"][0], a["w"], a["b"], a["h0"], a["c0"])
        grads = lltm_cupy.backward(a["gh"], a["gc"], saved)
        return dict(h=h, c=c, **grads._asdict())
    return op


def cell_module_op(cell, x, grad):
    """Two steps of the torch module ``cell`` (after a forward-only one) and their backward:
    every result and gradient; with the tensors whose gradients it fills."""
    import torch

    def op():
        with torch.no_grad():
            h0, c0 = cell(x[0])
        h, c = cell(x[0])
        h, c = cell(x[1], (h, c))
        torch.autograd.backward((h, c), (grad[0], grad[1]))
        return dict(fo_h=h0, fo_c=c0, h=h, c=c, dx=x.grad,
                    **{f"d{i}": p.grad for i, p in enumerate(cell.parameters())})
    return op, [x, *cell.parameters()]
