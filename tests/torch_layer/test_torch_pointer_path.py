"""The torch layer's one way to the CUDA kernels for variable lengths and the fused kernels'
group variant: pointer launches into ``torch.empty`` buffers, torch's GEMMs, a packing plan's
index arrays and the group variant's exchange buffer and counters as torch tensors
(lltm_cupy/torch/_cuda_packed.py, _cuda_sequence.py). On the emulated CUDA path (conftest's
``emulated_cuda_torch``; the group kernels' host build on an emulated sm_80 device): every
result and gradient within ``ENGINES_AGREE`` of the array API's (the CuPy backend's own arrays
and cuBLAS: the same algorithm, another GEMM engine and bias reduction) and as close to the
float64 reference; the group variant within the fused tolerance of the stepped path and bit for
bit the cluster variant's; nothing allocated through CuPy, no CuPy array, no DLPack; under
CUDA-graph capture the eager bits with no host-device copy, no driver query and torch's GEMMs
only; on a side stream every launch there; in-place changes of what the backward reads
refused. The GPU tests at the end run the group variant on a real GPU (reported as sm_80) and
variable lengths on a side stream (scripts/gpu_check.sh runs them first).
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy.torch as lt  # noqa: E402
from lltm_cupy import _packing  # noqa: E402
from lltm_cupy._cuda import fused as _fused, fused_cluster as _cluster  # noqa: E402
from lltm_cupy._cuda import group_kernels as _group_kernels, kernels as _kernels  # noqa: E402
from conftest import TOLERANCE, assert_engines_agree, max_error  # noqa: E402
from helpers.fused_cases import AGREE, make  # noqa: E402
from helpers.fused_devices import use_cluster as _use_cluster, use_group as _use_group  # noqa: E402
from helpers.lengths_reference import OUT, _case, _reference, _run  # noqa: E402
from helpers.torch_cuda import CUDA_REASON  # noqa: E402

NAMES = ("inputs", "weights", "bias", "h0", "c0")
GRADS = ("grad_outputs", "grad_h_n", "grad_c_n")
BF16 = _kernels.BFLOAT16


def _tensors(case, dtype=None):
    """The case's arrays as torch tensors (bfloat16 bits as bfloat16), arguments requiring
    grad."""
    found = {}
    for k, v in case.items():
        t = (torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if v.dtype == BF16
             else torch.from_numpy(v.copy()))
        found[k] = t.requires_grad_() if k in NAMES else t
    return found


def _torch_lengths(t, lengths, reverse, fused=False):
    """lltm_sequence with ``lengths`` (None: every sequence full) forward and backward: the 8
    results in OUT's order, detached."""
    out, h_n, c_n = lt.lltm_sequence(*(t[n] for n in NAMES), lengths=lengths, reverse=reverse,
                                     fused=fused)
    torch.autograd.backward((out, h_n, c_n), tuple(t[g] for g in GRADS))
    found = [out.detach(), h_n.detach(), c_n.detach()] + [t[n].grad for n in NAMES]
    for n in NAMES:
        t[n].grad = None
    return found


def _values(a):
    """float64 values of a torch tensor or an array (bfloat16 bits as bfloat16)."""
    if hasattr(a, "detach"):
        return a.detach().double().numpy()
    a = np.asarray(a)
    if a.dtype == BF16:
        import ml_dtypes

        return a.view(ml_dtypes.bfloat16).astype(np.float64)
    return a.astype(np.float64)


LENGTHS = {"unsorted with 0, 1, T and ties": [3, 0, 6, 1, 6, 3], "all full": [6] * 6,
           "one long, rest 1": [1, 1, 6, 1, 1, 1]}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=["f32", "f64", "f16"])
def test_lengths_agree_with_the_array_api_and_the_reference(emulated_cuda_torch, dtype, lengths,
                                                            reverse):
    """``lltm_sequence(..., lengths=)``: every result within ENGINES_AGREE of the array API's on
    the same emulated device, as close to the float64 reference as that (float16: within twice
    its error and the float16 tolerance), zero past each sequence's length."""
    case = _case(6, 6, 4, 5, dtype, seed=sum(lengths) + reverse)
    grads = tuple(case[g] for g in GRADS)
    got = _torch_lengths(_tensors(case), lengths, reverse)
    array = _run(emulated_cuda_torch, case, lengths, reverse, grads)
    want = _reference(case, lengths, reverse, grads)
    tol = TOLERANCE[np.dtype(dtype)]
    for name, g, a, w in zip(OUT, got, array, want):
        assert_engines_agree(g, torch.from_numpy(np.asarray(a)), name)
        err, err_array = max_error(_values(g), w), max_error(_values(a), w)
        assert err <= max(tol, 2 * err_array), f"{name}: {err:.2e} (array API: {err_array:.2e})"
    padded = np.arange(6)[:, None] >= np.array(lengths)[None, :]
    assert not got[0].numpy()[padded].any(), "outputs past a sequence's length are zero"


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_packed_sequence_data_agree_with_the_array_api(emulated_cuda_torch, reverse):
    """``lltm_packed`` (what LLTM runs for a PackedSequence) on its data (rows of lengths 5, 3,
    3, 1 in the data's own layout) against the CuPy backend run by the same packed plan (its
    arrays and cuBLAS), float64: every result within ENGINES_AGREE."""
    from lltm_cupy import _cuda
    from lltm_cupy.torch._ops import lltm_packed

    lengths = [5, 3, 3, 1]
    sizes = [sum(n > t for n in lengths) for t in range(max(lengths))]
    rows = sum(lengths)
    case = _case(1, 4, 4, 6, np.float64, seed=3 + reverse)
    rng = np.random.default_rng(11)
    case["inputs"] = rng.standard_normal((rows, 4))
    case["grad_outputs"] = rng.standard_normal((rows, 6))
    t = _tensors(case)
    out, h_n, c_n = lltm_packed(*(t[n] for n in NAMES),
                                _packing.packed_plan(sizes, reverse, "torch"))
    torch.autograd.backward((out, h_n, c_n), tuple(t[g] for g in GRADS))
    got = [out.detach(), h_n.detach(), c_n.detach()] + [t[n].grad for n in NAMES]
    cupy = emulated_cuda_torch
    a = {k: cupy.asarray(v) for k, v in case.items()}
    outputs, h, c, saved = _cuda.forward_sequence(*(a[n] for n in NAMES),
                                                  plan=_packing.packed_plan(sizes, reverse))
    want = [outputs, h, c, *_cuda.backward_sequence(*(a[g] for g in GRADS), saved)]
    for name, g, w in zip(OUT, got, want):
        assert_engines_agree(g, torch.from_numpy(np.asarray(w)), name)


def _group_device(monkeypatch, size=2, resident=None):
    """The emulated sm_80 device ``group_cupy`` (tests/helpers/fused_devices.py) running ``size``
    blocks per tile on 4 SMs; ``resident``: the blocks it holds at once (fewer: launches in
    waves)."""
    monkeypatch.setattr(_cluster, "FORCED_SIZE", size)
    monkeypatch.setattr(_kernels, "_sm_count", lambda device_id: 4)
    if resident is not None:
        monkeypatch.setattr(_group_kernels, "resident_blocks",
                            lambda kernel, threads, shared: resident)


GROUP_CASES = {"full": None, "zeros and ties": [3, 0, 5, 1, 5, 0, 2]}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lengths", GROUP_CASES.values(), ids=GROUP_CASES.keys())
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64), BF16],
                         ids=["f32", "f64", "bf16"])
def test_group_variant_on_torch_buffers(group_cupy, emulated_cuda_torch, monkeypatch, group_lib,
                                        one_block_lib80, dtype, lengths, reverse):
    """``lltm_sequence(fused=True)`` in groups of 2 blocks on an sm_80 device that holds one
    tile at a time (7 rows in 2 tiles: two launches each way): nothing allocated through CuPy,
    no CuPy array or DLPack crossing; within the fused tolerance of the stepped path, as close
    to the float64 reference, and bit for bit the cluster variant's (one kernel source)."""
    _group_device(monkeypatch, resident=2)
    emu = group_cupy.emulator
    stored, case = make(5, 7, 3, 13, dtype, seed=7 + reverse)
    emu.reset()
    fused = _torch_lengths(_tensors(stored), lengths, reverse, fused=True)
    assert emu.log.count("kernel:seq_fwd_group2") == 2, emu.log
    assert emu.log.count("kernel:seq_bwd_group2") == 2, emu.log
    counts = emu.tally()
    assert (counts["allocations"], counts["arrays"], counts["dlpack"]) == (0, 0, 0), counts
    stepped = _torch_lengths(_tensors(stored), lengths, reverse)
    want = _reference(case, [5] * 7 if lengths is None else lengths, reverse,
                      tuple(case[g] for g in GRADS))
    for name, f, s, w in zip(OUT, fused, stepped, want):
        err = max_error(_values(f), _values(s))
        assert err <= AGREE[dtype], f"{name}: fused vs stepped {err:.2e}"
        ref_f, ref_s = max_error(_values(f), w), max_error(_values(s), w)
        assert ref_f <= 2 * ref_s + AGREE[dtype] / 4, f"{name}: {ref_f:.2e} ({ref_s:.2e})"
    # the cluster variant (sm_90) and the group variant with the same shared memory per block
    # (so the same tiles)
    _use_cluster(monkeypatch, group_lib, one_block_lib80)
    emu.reset()
    cluster = _torch_lengths(_tensors(stored), lengths, reverse, fused=True)
    assert emu.log.count("kernel:seq_fwd_cluster2") == 1, emu.log
    _use_group(monkeypatch, group_lib, one_block_lib80, limit=_fused.ARCH_SHARED_MEMORY[90])
    _group_device(monkeypatch, resident=2)
    group = _torch_lengths(_tensors(stored), lengths, reverse, fused=True)
    for name, g, c in zip(OUT, group, cluster):
        assert torch.equal(g, c), f"{name}: group != cluster"


# ------------------------------------------------- capture, side streams, in-place changes

def _scenario(form, monkeypatch, dtype=torch.float64):
    """``step()`` -> the results and gradients of one training step of ``form``: ``lengths=``
    (lltm_sequence, unsorted lengths with a 0), ``packed`` (a bidirectional 2-layer LLTM on a
    PackedSequence) or ``group`` (LLTM(fused=True), bidirectional, on a PackedSequence, in
    groups of 2 blocks on the emulated sm_80 device)."""
    from torch.nn.utils.rnn import pack_padded_sequence

    torch.manual_seed(5)
    T, B, F, S = 5, 4, 3, 13
    if form == "group":
        _group_device(monkeypatch)
        model = lt.LLTM(F, S, bidirectional=True, fused=True, dtype=dtype)
    else:
        model = lt.LLTM(F, S, num_layers=2, bidirectional=True, dtype=dtype)
    x = torch.randn(T, B, F, dtype=dtype)
    hx = [torch.randn(2 * model.num_layers, B, S, dtype=dtype) for _ in range(2)]
    lengths = torch.tensor([3, 5, 0, 2] if form == "lengths=" else [3, 5, 1, 2])

    def step():
        model.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        if form == "lengths=":
            out, h, c = lt.lltm_sequence(xg, model.weights_l0, model.bias_l0, hx[0][0], hx[1][0],
                                         lengths=lengths)
        else:
            out, (h, c) = model(pack_padded_sequence(xg, lengths, enforce_sorted=False), hx)
            out = out.data
        (out.sum() + h.pow(2).sum() + c.sum()).backward()
        return [out.detach(), h.detach(), c.detach(), xg.grad] + [
            p.grad.clone() for p in model.parameters() if p.grad is not None]
    return step


FORMS = ["lengths=", "packed", "group"]


@pytest.mark.parametrize("form", FORMS)
def test_a_captured_step_replays_the_eager_bits(group_cupy, emulated_cuda_torch, monkeypatch,
                                                form):
    """A training step captured (the stream reported as capturing) after one eager step with the
    same lengths (which uploads the plan and asks the driver what it needs): the eager bits,
    with no host-device copy or wait, no driver query, torch's GEMMs only, and the plan kept for
    the graph's replays."""
    emu = group_cupy.emulator
    step = _scenario(form, monkeypatch)
    eager = step()
    emu.reset()
    with emu.capture():
        captured = step()
    assert emu.transfers == [] and emu.syncs == 0, emu.transfers
    assert emu.capture_queries == [], emu.capture_queries
    assert set(emu.gemm_engines) == {"torch"}, set(emu.gemm_engines)
    assert any(e.startswith("kernel:seq_fwd_group") for e in emu.log) == (form == "group")
    assert _packing._pinned, "no plan kept for the graph's replays"
    for i, (a, b) in enumerate(zip(eager, captured)):
        assert torch.equal(a, b), f"result {i}"


@pytest.mark.parametrize("form", FORMS)
def test_every_launch_runs_on_the_side_stream_and_the_plan_records_it(
        group_cupy, emulated_cuda_torch, monkeypatch, form):
    """After a step on the default stream (which uploads the plan's index tensors there), a
    step on a side stream: every launch, GEMM and copy on the side stream, each index tensor
    recorded on it once (record_stream), the default stream's bits."""
    emu = group_cupy.emulator
    step = _scenario(form, monkeypatch)
    want = step()
    emu.reset()
    emu.recorded_streams.clear()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = step()
    assert emu.log and set(emu.streams) == {side.cuda_stream}, set(emu.streams)
    plans = ([_packing.cached_plan(np.array([3, 5, 0, 2]), 5, False, "torch")] if
             form == "lengths=" else [_packing.packed_plan([4, 3, 2, 1, 1], r, "torch")
                                      for r in (False, True)])     # (lengths 3, 5, 1, 2)
    arrays = sum(sum(a is not None for a in vars(p._device[0]).values()) for p in plans)
    assert emu.recorded_streams == [side.cuda_stream] * arrays, emu.recorded_streams
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"result {i}"


def test_an_in_place_change_of_the_packed_outputs_is_refused(emulated_cuda_torch):
    """A PackedSequence's outputs are the hidden states the backward reads (its data, forward
    direction): changed in place before the backward, the backward refuses, saying what to
    do."""
    from torch.nn.utils.rnn import pack_padded_sequence

    from lltm_cupy.torch._functions import INPLACE_MESSAGE

    torch.manual_seed(0)
    model = lt.LLTM(3, 4)
    out, _ = model(pack_padded_sequence(torch.randn(4, 3, 3), [4, 2, 1]))
    with torch.no_grad():
        out.data.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as error:
        out.data.sum().backward()
    assert INPLACE_MESSAGE in str(error.value)


# ---------------------------------------------------------------------------- on a GPU

gpu = pytest.mark.skipif(CUDA_REASON is not None, reason=f"GPU test: {CUDA_REASON}")


def _gpu_step(model, packed, hx=None):
    model.zero_grad(set_to_none=True)
    out, (h, c) = model(packed, hx)
    loss = out.data.sum() + h.pow(2).sum() + c.sum()
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.gpu
@gpu
def test_gpu_group_variant_in_the_torch_layer(monkeypatch):
    """On a GPU reported as compute capability 8.0, a state size one block cannot hold runs the
    group variant (a cooperative launch; its exchange buffer and counters torch tensors):
    LLTM(fused=True, bidirectional) on a PackedSequence within 1e-5 of the stepped path,
    nothing taken from CuPy's pool, and a CUDA graph of the step, captured after eager warm-up
    steps on a side stream, replays the eager results."""
    import cupy
    from torch.nn.utils.rnn import pack_padded_sequence

    monkeypatch.setattr(_kernels, "compute_capability", lambda device_id: 80)
    launched = []
    real_launch = _group_kernels.group_launch

    def group_launch(*args, **kw):
        launched.append(args[-1] if len(args) > 5 else kw.get("buffers"))
        return real_launch(*args, **kw)

    monkeypatch.setattr(_group_kernels, "group_launch", group_launch)
    limit = _kernels.shared_memory_limit(0)
    S = _fused.max_state(limit, np.dtype(np.float32)) + 8
    assert _fused.usable(S, np.float32) and _fused.cluster_size(S, np.float32) is not None
    T, B, F = 6, 5, 8
    torch.manual_seed(2)
    fused = lt.LLTM(F, S, bidirectional=True, fused=True, device="cuda")
    stepped = lt.LLTM(F, S, bidirectional=True, device="cuda")
    stepped.load_state_dict(fused.state_dict())
    x = torch.randn(T, B, F, device="cuda")
    packed = pack_padded_sequence(x, torch.tensor([2, 6, 1, 4, 4]), enforce_sorted=False)
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    got = _gpu_step(fused, packed)
    torch.cuda.synchronize()
    assert pool.used_bytes() == before, "the group variant took memory from CuPy's pool"
    assert launched and None not in launched, "the group kernels did not run on torch's buffers"
    want = _gpu_step(stepped, packed)
    for i, (a, b) in enumerate(zip(got, want)):
        assert max_error(a.cpu(), b.cpu()) <= 1e-5, f"result {i}"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            eager = _gpu_step(fused, packed)
    torch.cuda.current_stream().wait_stream(side)
    fused.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, (h, c) = fused(packed)
        loss = out.data.sum() + h.pow(2).sum() + c.sum()
        loss.backward()
    graph.replay()
    replayed = [loss.detach()] + [p.grad for p in fused.parameters()]
    for i, (a, b) in enumerate(zip(replayed, eager)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"result {i}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("form", ["lengths=", "packed"])
def test_gpu_variable_lengths_on_side_streams_equal_the_default_stream(form):
    """The first call uploads the plan's index tensors on the default stream; calls on two side
    streams (each recorded on the index tensors: real ``record_stream`` of an external stream)
    give the default stream's results; the plan dropped afterwards, the device is fine."""
    from torch.nn.utils.rnn import pack_padded_sequence

    torch.manual_seed(3)
    T, B, F, S = 6, 5, 8, 16
    model = lt.LLTM(F, S, device="cuda")
    x = torch.randn(T, B, F, device="cuda")
    lengths = torch.tensor([2, 6, 0 if form == "lengths=" else 1, 4, 4])

    def step():
        model.zero_grad(set_to_none=True)
        if form == "lengths=":
            h0 = x.new_zeros(B, S)
            out, h, c = lt.lltm_sequence(x, model.weights, model.bias, h0, h0, lengths=lengths)
        else:
            out, (h, c) = model(pack_padded_sequence(x, lengths, enforce_sorted=False))
            out = out.data
        (out.sum() + h.pow(2).sum() + c.sum()).backward()
        return [out.detach(), h.detach(), c.detach()] + [p.grad.clone()
                                                         for p in model.parameters()]

    want = step()
    for _ in range(2):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = step()
        torch.cuda.current_stream().wait_stream(side)
        for i, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"result {i}")
    _packing.clear_caches()
    torch.cuda.synchronize()
