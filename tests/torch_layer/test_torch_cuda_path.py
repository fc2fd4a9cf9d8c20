"""lltm_cupy.torch's CUDA path, run in CI without a GPU: CPU tensors whose device pointers the
kernels are launched on, torch's buffers, streams and GEMMs, on the emulated CuPy (conftest's
``emulated_cuda_torch``). What it shows: the results, where every byte comes from, the device
work per step, that no tensor crosses into CuPy, and the GEMM engine under CUDA-graph capture.
The same properties on a real GPU: tests/torch_layer/test_gpu_training.py.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy  # noqa: E402
import lltm_cupy.torch as lt  # noqa: E402
from conftest import make_case  # noqa: E402
from helpers.launch_counts import BACKWARD, FORWARD  # noqa: E402

NAMES = ("input", "weights", "bias", "old_h", "old_cell")


#: dtype under test -> (rtol, atol) against the float64 reference on the same rounded values
DTYPES = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5),
          torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}
DTYPE_IDS = ["f64", "f32", "f16", "bf16"]


def _tensors(case, names=NAMES, dtype=torch.float64):
    return [torch.tensor(case[n]).to(dtype).requires_grad_() for n in names]


def _run(fn, args, grads):
    outs = fn(*args)
    torch.autograd.backward(outs[:2], grads)
    return [o.detach() for o in outs[:2]] + [a.grad for a in args]


def _reference(case, dtype):
    """The pure-torch float64 reference on the case's values rounded to ``dtype``."""
    args = [t.detach().double().requires_grad_() for t in _tensors(case, dtype=dtype)]
    grads = [torch.tensor(case[n]).to(dtype).double() for n in ("grad_h", "grad_cell")]
    return _run(lt.lltm_reference, args, grads)


def _side_stream(enter=True):
    """A side stream made torch's current stream (the emulated one: conftest's fixture)."""
    return torch.cuda.stream(torch.cuda.Stream()) if enter else contextlib.nullcontext()


def _assert_close(got, want, dtype, name):
    assert got.dtype == dtype, f"{name}: {got.dtype}, expected {dtype}"
    rtol, atol = DTYPES[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, msg=name)


def _torch_blas_handle_made_before_capture():
    """What any eager CUDA call of the layer does on this thread (a capture needs it first)."""
    from lltm_cupy.torch import _interop

    _interop._torch_blas_ready(0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "captured"])
def test_cell_matches_reference(emulated_cuda_torch, compiled, capturing, dtype):
    """Every dtype, eager and compiled, outside and under capture (on a side stream, as torch
    captures), the GEMMs by torch on torch views of the imported tensors (weights.T and slices
    of it) and of the backend's allocations."""
    _torch_blas_handle_made_before_capture()
    emulated_cuda_torch.emulator.capturing = capturing
    case = make_case(5, 7, 9, np.float64, seed=71)
    fn = torch.compile(lt.lltm, backend="aot_eager", fullgraph=True) if compiled else lt.lltm
    grads = [torch.tensor(case[n]).to(dtype) for n in ("grad_h", "grad_cell")]
    with _side_stream(capturing):
        got = _run(fn, _tensors(case, dtype=dtype), grads)
    for name, a, b in zip(("new_h", "new_cell", *NAMES), got, _reference(case, dtype)):
        _assert_close(a, b, dtype, name)
    _assert_torch_did_the_gemms(emulated_cuda_torch.emulator)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "captured"])
def test_sequence_matches_stepped_reference(emulated_cuda_torch, capturing, dtype):
    """outputs, h_n, c_n and the gradients of the inputs, h_0, c_0 and the parameters."""
    _torch_blas_handle_made_before_capture()
    emulated_cuda_torch.emulator.capturing = capturing
    rng = np.random.default_rng(5)
    T, B, F, S = 4, 3, 5, 6
    xs = torch.tensor(rng.standard_normal((T, B, F))).to(dtype).requires_grad_()
    h0, c0 = (torch.tensor(rng.standard_normal((1, B, S))).to(dtype).requires_grad_()
              for _ in range(2))
    model = lt.LLTM(F, S, dtype=dtype)
    ref = lt.ReferenceLLTMCell(F, S, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    with _side_stream(capturing):
        out, (h_n, c_n) = model(xs, (h0, c0))
        (out.float().sum() + 3 * h_n.float().sum() + 2 * c_n.float().sum()).backward()
    xr, hr, cr = (t.detach().double().requires_grad_() for t in (xs, h0[0], c0[0]))
    state, outs = (hr, cr), []
    for x in xr:
        state = ref(x, state)
        outs.append(state[0])
    (torch.stack(outs).sum() + 3 * state[0].sum() + 2 * state[1].sum()).backward()
    _assert_close(out.detach(), torch.stack(outs).detach(), dtype, "outputs")
    assert h_n.shape == c_n.shape == (1, *state[1].shape)   # as nn.LSTM: (num_layers, batch, S)
    _assert_close(h_n[0].detach(), state[0].detach(), dtype, "h_n")
    _assert_close(c_n[0].detach(), state[1].detach(), dtype, "c_n")
    _assert_close(xs.grad, xr.grad, dtype, "d_inputs")
    _assert_close(h0.grad[0], hr.grad, dtype, "d_h0")
    _assert_close(c0.grad[0], cr.grad, dtype, "d_c0")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _assert_close(p.grad, q.grad, dtype, name)
    _assert_torch_did_the_gemms(emulated_cuda_torch.emulator)


def _assert_torch_did_the_gemms(emulator):
    """Every GEMM by torch's engine, eager or captured (CuPy's cuBLAS would raise in a
    capture, and one engine for both keeps a replay equal to the eager call)."""
    assert emulator.gemm_engines and set(emulator.gemm_engines) == {"torch"}, \
        emulator.gemm_engines


class _TrainModel(torch.nn.Module):
    """Linear -> LLTMCell stepped 3 times, or LLTM -> Linear: a training step to capture."""

    def __init__(self, sequence, dtype):
        super().__init__()
        self.sequence = sequence
        self.inp = torch.nn.Linear(5, 6, dtype=dtype)
        self.rnn = (lt.LLTM if sequence else lt.LLTMCell)(6, 8, dtype=dtype)
        self.head = torch.nn.Linear(8, 3, dtype=dtype)

    def forward(self, xs):
        z = self.inp(xs)
        if self.sequence:
            return self.head(self.rnn(z)[1][0][-1])
        state = None
        for x in z:
            state = self.rnn(x, state)
        return self.head(state[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("sequence", [False, True], ids=["cell", "sequence"])
def test_captured_training_step_equals_the_eager_one_bit_for_bit(emulated_cuda_torch, sequence,
                                                                 dtype):
    """A whole training step (forward and backward) with the stream reported as capturing,
    against the same step run eagerly: the same bits in every dtype, since both run the same
    kernels and the same GEMM engine (torch's)."""
    emu = emulated_cuda_torch.emulator
    _torch_blas_handle_made_before_capture()
    torch.manual_seed(0)
    model = _TrainModel(sequence, dtype)
    xs = torch.randn(3, 4, 5).to(dtype)
    target = torch.randn(4, 3)
    results = []
    for capturing in (False, True):
        emu.capturing = capturing
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(xs).float(), target)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for i, (eager, captured) in enumerate(zip(*results)):
        assert torch.equal(captured, eager), f"result {i}"


def test_memory_comes_from_torch(emulated_cuda_torch, monkeypatch):
    """A step, a sequence of one length and one of variable lengths (and their first call,
    which uploads the packing plan) allocate nothing through CuPy: their buffers, and the plan's
    index arrays, are torch tensors whose pointers the kernels take; nothing comes back through
    DLPack."""
    emu = emulated_cuda_torch.emulator
    from lltm_cupy import _packing

    monkeypatch.setattr(torch, "from_dlpack",
                        lambda *a, **k: pytest.fail("a result came back through DLPack"))
    case = make_case(4, 3, 5, np.float32, seed=73)
    args = _tensors(case, dtype=torch.float32)
    xs = torch.randn(6, 4, 3, requires_grad=True)
    emu.reset()
    h, c = lt.lltm(*args)
    (h.sum() + c.pow(2).sum()).backward()
    out, h_n, c_n = lt.lltm_sequence(xs, *args[1:])
    (out.sum() + c_n.pow(2).sum()).backward()
    out, h_n, c_n = lt.lltm_sequence(xs, *args[1:], lengths=[6, 3, 6, 1])
    (out.sum() + c_n.pow(2).sum()).backward()
    assert emu.pool_allocations == 0 and emu.allocations == [], "CuPy allocated"
    plan = _packing.cached_plan(np.array([6, 3, 6, 1]), 6, False, "torch")
    assert _plan_arrays_owned_by_torch(plan)
    uploaded = [a for a in vars(plan._device[0]).values() if a is not None]
    assert emu.transfers == [("h2d", a.nbytes) for a in uploaded]   # the plan's, once each


def test_torch_layer_adds_no_device_work(emulated_cuda_torch):
    """Through the torch layer, a step costs what the array API's does, less the copy of new_cell
    that the array API makes for its caller (no conversion copies); the bias gradient is
    torch's reduction (not CuPy's, which the log shows)."""
    emu = emulated_cuda_torch.emulator
    case = make_case(16, 32, 128, np.float32, seed=79)
    args = _tensors(case, dtype=torch.float32)
    grads = [torch.tensor(case[n]) for n in ("grad_h", "grad_cell")]
    emu.reset()
    h, c = lt.lltm(*args)
    # the array API's forward ends with a copy of new_cell for its caller (its backward reads
    # new_cell); the torch layer's autograd version counters protect it instead: no copy
    assert FORWARD[-1] == "copy" and emu.log == FORWARD[:-1]
    emu.reset()
    torch.autograd.backward((h, c), grads)
    assert BACKWARD[-1] == "reduce" and emu.log == BACKWARD[:-1]


# ---------------------------------------------------------------------------------- streams

def _step_everything(kind, dtype=torch.float32):
    """Forward and backward of a cell step, a sequence or a packed bidirectional sequence."""
    torch.manual_seed(3)
    x = torch.randn(4, 3, 5, dtype=dtype, requires_grad=True)
    if kind == "cell":
        out = lt.LLTMCell(5, 6, dtype=dtype)(x[0])[0]
    elif kind == "sequence":
        out = lt.LLTM(5, 6, num_layers=2, dtype=dtype)(x)[0]
    else:
        from torch.nn.utils.rnn import pack_padded_sequence

        packed = pack_padded_sequence(x, torch.tensor([2, 4, 1]), enforce_sorted=False)
        out = lt.LLTM(5, 6, bidirectional=True, dtype=dtype)(packed)[0].data
    out.sum().backward()
    return x.grad


@pytest.mark.parametrize("kind", ["cell", "sequence", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_every_launch_and_gemm_runs_on_torchs_current_stream(emulated_cuda_torch, kind, dtype):
    """Every kernel launch, cuBLAS call and CuPy operation of forward and backward runs on
    torch's current stream: the default one, then a side stream, then another (the stream is
    read on every call, never cached), then the default again."""
    emulator = emulated_cuda_torch.emulator
    for stream in (None, torch.cuda.Stream(), torch.cuda.Stream(), None):
        emulator.reset()
        with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
            handle = torch.cuda.current_stream().cuda_stream
            _step_everything(kind, dtype)
        assert handle == (0 if stream is None else stream.cuda_stream)
        assert "gemm" in emulator.log and any(e.startswith("kernel:") for e in emulator.log)
        assert len(emulator.streams) == len(emulator.log)
        assert set(emulator.streams) == {handle}, (handle, set(emulator.streams))


def test_the_emulator_refuses_work_off_torchs_stream(emulated_cuda_torch):
    """The check the tests above rely on: a launch on CuPy's null stream while torch is on a
    side stream raises."""
    cupy = emulated_cuda_torch
    a = cupy.zeros((2, 2), np.float32)
    with torch.cuda.stream(torch.cuda.Stream()):
        with pytest.raises(AssertionError, match="torch's current stream"):
            a + a
        with cupy.cuda.Stream.from_external(_interop_ref(torch.cuda.current_stream())):
            a + a
    assert len(cupy.emulator.streams) == len(cupy.emulator.log)


def _interop_ref(stream):
    from lltm_cupy.torch._interop import _StreamRef

    return _StreamRef(stream.cuda_stream)


@pytest.mark.parametrize("how", ["packed-sequence", "lengths"])
def test_plan_index_arrays_record_each_other_stream_they_are_read_on(emulated_cuda_torch,
                                                                     monkeypatch, how):
    """A packing plan's index arrays are torch allocations made on the stream of their upload;
    read on another stream, that stream is recorded on each of them once (so that their memory
    is not handed out again before that stream's work has read it), and never the upload's."""
    from torch.nn.utils.rnn import pack_padded_sequence

    from lltm_cupy.torch import _interop

    recorded = []
    monkeypatch.setattr(_interop, "record_stream",
                        lambda t, index, stream: recorded.append((t.data_ptr(), stream)))
    torch.manual_seed(5)
    model = lt.LLTM(3, 4)
    x = torch.randn(5, 3, 3)
    lengths = torch.tensor([3, 5, 2])
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)

    def run():
        if how == "packed-sequence":
            return model(packed)[0].data
        h0 = torch.zeros(3, 4)
        return lt.lltm_sequence(x, model.weights_l0, model.bias_l0, h0, h0, lengths=lengths)[0]

    first = run()                   # uploads the plan's arrays on the default stream
    assert recorded == []
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        again = run()
        run()
    assert recorded, "nothing recorded for the side stream"
    assert {stream for _, stream in recorded} == {side.cuda_stream}
    assert len({ptr for ptr, _ in recorded}) == len(recorded)     # once per array
    count = len(recorded)
    run()                           # the default stream again: the upload's, nothing to record
    assert len(recorded) == count
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_torchs_matmul_defaults_are_what_the_docs_say():
    """docs/gpu-training.md: the torch layer's GEMMs follow torch's matmul switches, whose
    defaults are no TF32 for float32 and reduced-precision reductions allowed in float16 and
    bfloat16 (so the docs tell how to turn those off). Read from this torch, not restated."""
    matmul = torch.backends.cuda.matmul
    assert matmul.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "highest"
    assert matmul.allow_fp16_reduced_precision_reduction is True
    assert matmul.allow_bf16_reduced_precision_reduction is True


def test_launching_on_another_device_leaves_it_again_when_torchs_stream_cannot_be_read(
        emulated_cuda_torch):
    """The pointer launches' context where the tensors' device is not the current one
    (_interop._OnDevice) enters that device, then reads torch's stream: if the read fails, the
    thread is back on its own device, not left on the tensors'."""
    from lltm_cupy.torch import _interop

    emu = emulated_cuda_torch.emulator
    cupy = emulated_cuda_torch
    with cupy.cuda.Device(1):
        def unreadable(index):
            assert emu.device == 0, "the tensors' device is entered first"
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_interop, "_torch_stream", unreadable)
            with pytest.raises(RuntimeError, match="illegal memory access"):
                with _interop.launching(torch.device("cpu")):       # device index 0 here
                    pass
        assert (emu.device, emu.device_stack) == (1, [0]), (emu.device, emu.device_stack)
        with _interop.launching(torch.device("cpu")):
            assert emu.device == 0
        assert emu.device == 1
    assert emu.device == 0 and emu.device_stack == []


def test_a_cell_on_another_device_than_the_current_one(emulated_cuda_torch):
    """An LLTMCell step and its backward while another device is current: the same bits as with
    the tensors' device current, and the current device is the caller's again after each."""
    from lltm_cupy.torch import LLTMCell

    emu = emulated_cuda_torch.emulator
    torch.manual_seed(0)
    cell = LLTMCell(3, 4)
    x = torch.randn(2, 3, requires_grad=True)

    def step():
        h, c = cell(x)
        (h.sum() + c.pow(2).sum()).backward()
        found = [h.detach(), c.detach(), x.grad] + [p.grad for p in cell.parameters()]
        x.grad = None
        cell.zero_grad(set_to_none=True)
        return found

    want = step()
    with emulated_cuda_torch.cuda.Device(1):
        got = step()
        assert emu.device == 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _plan_arrays_owned_by_torch(plan):
    arrays = [a for ns in plan._device.values() for a in vars(ns).values() if a is not None]
    assert arrays, "the plan's index arrays never went to the device"
    return all(isinstance(a, torch.Tensor) and a.dtype == torch.int64 for a in arrays)


def test_after_warmup_the_layers_packed_layouts_are_torch_allocations(emulated_cuda_torch):
    """lltm_cupy.warmup runs variable-length calls of every kind (lengths, PackedSequence data,
    both directions) on tiny batches, in CuPy's pool: it keeps none of their layouts, so that the
    torch layer meeting the same lengths afterwards (here batch_sizes (2, 1), warmup's own)
    uploads its index arrays as torch tensors, never reading CuPy's pool."""
    from torch.nn.utils.rnn import pack_padded_sequence

    from lltm_cupy import _packing

    emu = emulated_cuda_torch.emulator
    lltm_cupy.warmup(["float32"])
    emu.reset()
    torch.manual_seed(0)
    model = lt.LLTM(3, 4, bidirectional=True)
    packed = pack_padded_sequence(torch.randn(2, 2, 3), [2, 1])
    out, (h, c) = model(packed)
    (out.data.sum() + h.sum() + c.sum()).backward()
    assert emu.pool_allocations == 0
    for reverse in (False, True):
        assert _plan_arrays_owned_by_torch(_packing.packed_plan((2, 1), reverse, "torch"))


def test_the_layer_reads_no_layout_the_array_api_uploaded(emulated_cuda_torch):
    """The array API uploads a layout's index arrays into CuPy's pool (no torch there); the torch
    layer's calls with the same lengths use layouts of their own, torch tensors."""
    from lltm_cupy import _packing

    cupy = emulated_cuda_torch
    rng = np.random.default_rng(0)
    T, B, F, S = 3, 3, 2, 4
    lengths = [3, 1, 2]
    arrays = [cupy.asarray(rng.standard_normal(shape).astype(np.float32))
              for shape in ((T, B, F), (3 * S, S + F), (3 * S,), (B, S), (B, S))]
    lltm_cupy.forward_sequence(*arrays, lengths=lengths)
    ours = _packing.cached_plan(np.array(lengths), T)
    assert ours.on_device(0) and not _plan_arrays_owned_by_torch(ours)
    args = [torch.from_numpy(np.asarray(a).copy()).requires_grad_() for a in arrays]
    out, h, c = lt.lltm_sequence(*args, lengths=lengths)
    (out.sum() + h.sum()).backward()
    assert _plan_arrays_owned_by_torch(_packing.cached_plan(np.array(lengths), T, False, "torch"))


def _crossings(emu, call) -> dict:
    """The DLPack conversions (imports into CuPy and exports from it) and CuPy arrays of one
    ``call()`` after a first one (what a first call makes once, later calls reuse)."""
    call()
    emu.reset()
    call()
    counts = emu.tally()
    return {"dlpack": counts["dlpack"], "arrays": counts["arrays"]}


def test_tensors_cross_by_pointer_only(emulated_cuda_torch):
    """How tensors cross on CUDA (docs/api.md, the README's first table): a plain ``LLTMCell``
    step, an ``LLTM`` call of one length and of variable lengths (a PackedSequence), and a
    ``lengths=`` call, forward + backward and forward only, reach the kernels as device
    pointers (``torch.empty`` buffers, torch's GEMMs): no DLPack import, no CuPy array
    (the fused kernels: tests/torch_layer/test_torch_pointer_path.py)."""
    from torch.nn.utils.rnn import pack_padded_sequence

    emu = emulated_cuda_torch.emulator
    torch.manual_seed(0)
    cell, layer = lt.LLTMCell(3, 6), lt.LLTM(3, 6)
    x, h, c = torch.randn(4, 3), torch.randn(4, 6), torch.randn(4, 6)
    xs = torch.randn(5, 4, 3)

    def cell_step():
        new_h, new_c = cell(x, (h, c))
        (new_h.sum() + new_c.sum()).backward()

    def layer_call(inputs=xs):
        out, (h_n, c_n) = layer(inputs)
        data = out.data if hasattr(out, "batch_sizes") else out
        (data.sum() + h_n.sum() + c_n.sum()).backward()

    def forward_only(inputs=xs):
        with torch.no_grad():
            layer(inputs)

    def lengths_call():
        out, h_n, c_n = lt.lltm_sequence(xs, layer.weights, layer.bias, h, c,
                                         lengths=[5, 2, 4, 0])
        (out.sum() + h_n.sum() + c_n.sum()).backward()

    packed = pack_padded_sequence(xs, [5, 3, 4, 2], enforce_sorted=False)
    none = {"dlpack": 0, "arrays": 0}
    assert _crossings(emu, cell_step) == none, "LLTMCell step"
    assert _crossings(emu, layer_call) == none, "LLTM call"
    assert _crossings(emu, forward_only) == none, "LLTM call under no_grad"
    assert _crossings(emu, lambda: layer_call(packed)) == none, "LLTM, PackedSequence"
    assert _crossings(emu, lambda: forward_only(packed)) == none, "PackedSequence, no_grad"
    assert _crossings(emu, lengths_call) == none, "lltm_sequence lengths="


def test_compiled_calls_cross_as_the_docs_say(emulated_cuda_torch):
    """Under torch.compile (docs/api.md): the custom operators run the eager calls' code, so
    the step's and a sequence's, training and forward only, on device pointers: no DLPack, no
    CuPy array."""
    emu = emulated_cuda_torch.emulator
    torch.manual_seed(0)
    cell = torch.compile(lt.LLTMCell(3, 6), backend="aot_eager", fullgraph=True)
    layer = torch.compile(lt.LLTM(3, 6), backend="aot_eager", fullgraph=True)
    x, h = torch.randn(4, 3), torch.randn(4, 6)
    xs = torch.randn(5, 4, 3)

    def cell_step():
        new_h, new_c = cell(x, (h, h))
        (new_h.sum() + new_c.sum()).backward()

    def training():
        out, (h_n, c_n) = layer(xs)
        (out.sum() + h_n.sum() + c_n.sum()).backward()

    def forward_only():
        with torch.no_grad():
            layer(xs)

    none = {"dlpack": 0, "arrays": 0}
    assert _crossings(emu, cell_step) == none, "compiled LLTMCell step"
    assert _crossings(emu, forward_only) == none, "compiled LLTM under no_grad"
    assert _crossings(emu, training) == none, "compiled LLTM training"


def test_sequence_function_apply_returns_what_the_docs_name(request):
    """docs/api.md: ``LLTMSequenceFunction.apply`` returns (outputs, h_n, c_n), then whether
    the fused kernels ran, then what it keeps."""
    from lltm_cupy.torch._sequence_function import LLTMSequenceFunction

    torch.manual_seed(0)
    args = (torch.randn(5, 4, 3), torch.randn(18, 9) / 3, torch.randn(18), torch.randn(4, 6),
            torch.randn(4, 6))
    found = LLTMSequenceFunction.apply(*args)
    assert found[3] is False and found[0].shape == (5, 4, 6), found[3]   # the CPU
    request.getfixturevalue("emulated_cuda_torch")
    found = LLTMSequenceFunction.apply(*args)
    assert found[3] is False and len(found) == 7, found[3]       # hs, gates, cells kept
