"""Faults survived, one at a time, on the emulated CUDA path (tests/helpers/faults.py: a failure
at each allocation, kernel compile, launch, occupancy query and GEMM of a call in turn, as
SQLite's anomaly tests fail each allocation): through the array API (a cell step, sequences
stepped and fused, forward and backward, padded and with lengths, in thread-block clusters and
in cooperative groups, and ``warmup``) and through the torch layer (``LLTMCell``, ``LLTM``).
For each injection point: a clear error or the documented fallback, the next call the bits of a
run that never faulted, no half-built cache entry, nothing left allocated, the device and the
streams as they were.

The count of points of every scenario is printed (``pytest -s``).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import max_error
from helpers.fault_benches import bench  # noqa: F401 (a fixture)
from helpers.fault_cases import arrays, cell_module_op, cell_op, check, sequence_op
from helpers.faults import explore

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy  # noqa: E402

#: shared memory per block of the device of the cluster and group scenarios: small, so that
#: small states need several blocks (float32: one block runs S <= 9; S = 10 takes 2 blocks,
#: S = 32 takes 16, past every portable cluster size)
SMALL = 1200
#: fused against stepped results: they differ in the order of the recurrent products' sums
AGREE = 1e-5


def _close(got, want):
    err = max_error(got, want)
    return None if err <= AGREE else f"max normalised error {err:.2e} > {AGREE:.0e}"


# ------------------------------------------------------------------------------- the array API

ARRAY = {
    # name: (bench keywords, shape (T, B, F, S), dtype, op maker keywords)
    "cell": (dict(), (1, 2, 3, 4), np.float32, "cell"),
    "cell-float16": (dict(), (1, 2, 3, 4), np.float16, "cell"),
    "sequence": (dict(), (2, 2, 3, 4), np.float32, dict()),
    "sequence-lengths": (dict(), (3, 3, 3, 4), np.float32, dict(lengths=[3, 0, 2])),
    "fused": (dict(), (2, 2, 3, 4), np.float32, dict(fused=True)),
    "fused-lengths": (dict(), (3, 3, 3, 4), np.float32, dict(lengths=[3, 0, 2], fused=True)),
    "cluster": (dict(limit=SMALL, sm_count=4), (2, 2, 3, 10), np.float32,
                dict(fused=True, lengths=[2, 1])),
    "cluster-16": (dict(limit=SMALL, sm_count=32), (2, 2, 3, 32), np.float32,
                   dict(fused=True, forward_only=False)),
    "group": (dict(limit=SMALL, sm_count=4, arch=80), (2, 2, 3, 10), np.float32,
              dict(fused=True)),
}


@pytest.mark.parametrize("name", ARRAY)
def test_array_api_survives_every_fault(emulated_cupy, bench, name):
    bench_kw, (T, B, F, S), dtype, how = ARRAY[name]
    bench = bench(emulated_cupy, **bench_kw)
    a = arrays(T, B, F, S, dtype, xp=emulated_cupy)
    if how == "cell":
        op, also = cell_op(a), ()
    else:
        op = sequence_op(a, **how)
        also = [sequence_op(a, **{**how, "fused": False})] if how.get("fused") else ()
    check(explore(bench, name, op, close=_close, also=also))


# ------------------------------------------------------------------------------- the torch layer

def _torch_inputs(T, B, F, S, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(T, B, F, generator=g) * 2 - 1
    return x.requires_grad_(), torch.rand(T, B, S, generator=g) * 2 - 1


def _module_op(model, x, grad, packed_lengths=None, forward_only=True):
    """Forward only (no_grad), then forward and backward, of ``model`` (an LLTM) on ``x``
    (steps, batch, features), padded or (``packed_lengths``) as a PackedSequence."""
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

    params = list(model.parameters())

    def run():
        return pack_padded_sequence(x, packed_lengths, enforce_sorted=False) \
            if packed_lengths is not None else x

    def op():
        found = {}
        if forward_only:
            with torch.no_grad():
                out, (h, c) = model(run())
            found.update(fo_out=out.data if isinstance(out, PackedSequence) else out, fo_h=h,
                         fo_c=c)
        out, (h, c) = model(run())
        out = out.data if isinstance(out, PackedSequence) else out
        torch.autograd.backward((out, h, c), (grad[: out.shape[0]] if packed_lengths is None
                                              else torch.ones_like(out), torch.ones_like(h),
                                              torch.ones_like(c)))
        found.update(out=out, h=h, c=c, dx=x.grad,
                     **{f"d{i}": p.grad for i, p in enumerate(params)})
        return found
    return op, [x, *params]


def _lengths_op(model, x, grad, lengths):
    """lltm_sequence on padded input with lengths (the CuPy backend's arrays in torch's
    allocator)."""
    import lltm_cupy.torch as lt

    def op():
        w, b = model.weights, model.bias
        h0 = c0 = torch.zeros(x.shape[1], model.hidden_size)
        out, h, c = lt.lltm_sequence(x, w, b, h0, c0, lengths=lengths)
        torch.autograd.backward((out, h, c), (grad, torch.ones_like(h), torch.ones_like(c)))
        return dict(out=out, h=h, c=c, dx=x.grad, dw=w.grad, db=b.grad)
    return op, [x, model.weights, model.bias]


TORCH = {
    # name: (bench keywords, (T, B, F, S), what, keywords)
    "LLTMCell": (dict(), (2, 2, 3, 4), "cell", {}),
    "LLTMCell-other-device": (dict(device=1), (2, 2, 3, 4), "cell", {}),
    "LLTM": (dict(), (2, 2, 3, 4), "module", {}),
    "LLTM-packed": (dict(), (3, 3, 3, 4), "module", dict(packed_lengths=[3, 1, 2])),
    "lltm_sequence-lengths": (dict(), (3, 3, 3, 4), "lengths", dict(lengths=[3, 0, 2])),
    "LLTM-fused": (dict(), (2, 2, 3, 4), "module", dict(fused=True)),
    "LLTM-fused-packed": (dict(), (3, 3, 3, 4), "module", dict(fused=True,
                                                               packed_lengths=[3, 1, 2])),
    # one fault per distinct site (kind and the library's stack): the two directions pass the
    # same sites, each launch of 16 host blocks costs milliseconds
    "LLTM-fused-bidirectional-16": (dict(limit=SMALL, sm_count=32), (2, 1, 3, 32), "module",
                                    dict(fused=True, bidirectional=True, forward_only=False,
                                         dedupe=True)),
    "LLTM-fused-group": (dict(limit=SMALL, sm_count=4, arch=80), (2, 2, 3, 10), "module",
                         dict(fused=True)),
}


def _torch_scenario(what, T, B, F, S, kw):
    x, grad = _torch_inputs(T, B, F, S)
    torch.manual_seed(0)
    if what == "cell":
        from lltm_cupy.torch import LLTMCell

        return cell_module_op(LLTMCell(F, S), x, grad)
    from lltm_cupy.torch import LLTM

    kw = dict(kw)
    forward_only = kw.pop("forward_only", True)
    kw.pop("dedupe", None)
    packed = kw.pop("packed_lengths", None)
    lengths = kw.pop("lengths", None)
    model = LLTM(F, S, **kw)
    if what == "lengths":
        return _lengths_op(model, x, grad, lengths)
    if kw.get("bidirectional"):
        grad = torch.cat([grad, grad], -1)
    return _module_op(model, x, grad, packed, forward_only)


@pytest.mark.parametrize("name", TORCH)
def test_torch_layer_survives_every_fault(emulated_cuda_torch, bench, name):
    bench_kw, (T, B, F, S), what, kw = TORCH[name]
    bench = bench(emulated_cuda_torch, torch_layer=True, **bench_kw)
    op, grads = _torch_scenario(what, T, B, F, S, kw)
    also = ()
    if kw.get("fused"):
        also = [_torch_scenario(what, T, B, F, S, {**kw, "fused": False})[0]]
    bench.dropping = grads
    dedupe = kw.get("dedupe", False)
    check(explore(bench, name, op, close=_close, also=also, dedupe=dedupe))


# ------------------------------------------------------------------------------------- warmup

WARMUP = {
    # sm_90 whose shared memory makes S = 32 need 16 blocks: warmup launches them. Every code
    # path of the four calls: one fault per kind and innermost library frame (the same
    # allocation, GEMM or launch reached from another of warmup's calls is the same code, which
    # the scenarios above fault at every point)
    "warmup-sm90": (dict(limit=SMALL, sm_count=32), dict(dedupe="innermost")),
    # sm_80: what differs is the group kernels' module, compiled and not launched
    "warmup-sm80": (dict(limit=SMALL, sm_count=4, arch=80), dict(kinds=("compile",))),
}


@pytest.mark.parametrize("name", WARMUP)
def test_warmup_survives_every_fault(emulated_cupy, bench, name):
    """``lltm_cupy.warmup(fused=True)``: a fault leaves the kernel caches with whole entries
    only, nothing allocated, and the next warmup completes them."""
    bench_kw, how = WARMUP[name]
    bench = bench(emulated_cupy, **bench_kw)
    emulated_cupy.emulator.noop = True      # warmup's results are not looked at: no arithmetic

    def op():
        lltm_cupy.warmup(["float32"], fused=True)
        return {}

    check(explore(bench, name, op, **how))
