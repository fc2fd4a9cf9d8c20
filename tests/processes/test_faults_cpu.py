"""Faults survived, one at a time, on the CPU (tests/helpers/faults.py): a MemoryError at each
allocation of the NumPy backend (every buffer NumPy allocates, through the data-memory handler
of tests/helpers/numpy_faults.cpp; every scratch and workspace mapping; every torch allocation
of the torch layer's CPU path) and a KeyboardInterrupt between two steps of a sequence (at the
GEMM that starts each step), through the array API and the torch layer. For each: the call
raises it, the next call returns the bits of a run that never faulted, the backend's kept
buffers, workspaces and step closures hold no half-built entry, nothing else is left allocated,
NumPy's error state is what it was.

The count of points of every scenario is printed (``pytest -s``).
"""
from __future__ import annotations

import pytest

from helpers.fault_benches import Cpu, build_numpy_faults
from helpers.fault_cases import arrays, cell_module_op, cell_op, check, sequence_op
from helpers.faults import explore

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")


@pytest.fixture(scope="session")
def numpy_faults(tmp_path_factory):
    return build_numpy_faults(tmp_path_factory.mktemp("numpy_faults"))


ARRAY = {
    "cell": ((1, 2, 3, 4), None),
    "sequence": ((3, 2, 3, 4), None),
    "sequence-lengths": ((3, 3, 3, 4), [3, 0, 2]),
}


@pytest.mark.parametrize("name", ARRAY)
def test_array_api_survives_every_fault(monkeypatch, numpy_faults, name):
    (T, B, F, S), lengths = ARRAY[name]
    bench = Cpu(monkeypatch, numpy_faults)
    a = arrays(T, B, F, S)
    op = cell_op(a) if name == "cell" else sequence_op(a, lengths)
    check(explore(bench, name, op))


def _torch_scenario(what, T, B, F, S, packed=None, lengths=None):
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

    from lltm_cupy.torch import LLTM, LLTMCell, lltm_sequence

    g = torch.Generator().manual_seed(1)
    x = (torch.rand(T, B, F, generator=g) * 2 - 1).requires_grad_()
    grad = torch.rand(T, B, S, generator=g) * 2 - 1
    torch.manual_seed(0)
    if what == "cell":
        return cell_module_op(LLTMCell(F, S), x, grad)
    model = LLTM(F, S)
    params = list(model.parameters())
    if what == "lengths":
        def op():
            h0 = c0 = torch.zeros(B, S)
            out, h, c = lltm_sequence(x, model.weights, model.bias, h0, c0, lengths=lengths)
            torch.autograd.backward((out, h, c), (grad, torch.ones_like(h), torch.ones_like(c)))
            return dict(out=out, h=h, c=c, dx=x.grad, dw=model.weights.grad,
                        db=model.bias.grad)
        return op, [x, *params]

    def run():
        return pack_padded_sequence(x, packed, enforce_sorted=False) if packed else x

    def op():
        with torch.no_grad():
            out, (h, c) = model(run())
        found = dict(fo_out=out.data if isinstance(out, PackedSequence) else out, fo_h=h,
                     fo_c=c)
        out, (h, c) = model(run())
        out = out.data if isinstance(out, PackedSequence) else out
        torch.autograd.backward((out, h, c), (torch.ones_like(out), torch.ones_like(h),
                                              torch.ones_like(c)))
        found.update(out=out, h=h, c=c, dx=x.grad,
                     **{f"d{i}": p.grad for i, p in enumerate(params)})
        return found
    return op, [x, *params]


TORCH = {
    "LLTMCell": ("cell", (2, 2, 3, 4), {}),
    "LLTM": ("module", (3, 2, 3, 4), {}),
    "LLTM-packed": ("module", (3, 3, 3, 4), dict(packed=[3, 1, 2])),
    "lltm_sequence-lengths": ("lengths", (3, 3, 3, 4), dict(lengths=[3, 0, 2])),
    # the sequences' GEMMs by oneDNN (ONEDNN_GEMM, the size gate lowered to these sizes)
    "LLTMCell-oneDNN": ("cell", (2, 2, 3, 4), dict(onednn=True)),
    "LLTM-oneDNN": ("module", (3, 2, 3, 4), dict(onednn=True)),
    "LLTM-packed-oneDNN": ("module", (3, 3, 3, 4), dict(packed=[3, 1, 2], onednn=True)),
}


@pytest.mark.parametrize("name", TORCH)
def test_torch_layer_survives_every_fault(monkeypatch, numpy_faults, name):
    what, (T, B, F, S), kw = TORCH[name]
    kw = dict(kw)
    if kw.pop("onednn", False):
        from lltm_cupy.torch import _torch_gemm

        if _torch_gemm.ONEDNN_GEMM is None:
            pytest.skip("this torch has no oneDNN (mkldnn) on an x86-64 CPU")
        monkeypatch.setattr(_torch_gemm, "ONEDNN_MIN", 0)
    bench = Cpu(monkeypatch, numpy_faults)
    op, grads = _torch_scenario(what, T, B, F, S, **kw)
    bench.dropping = grads
    check(explore(bench, name, op))
