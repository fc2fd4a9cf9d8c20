"""The GEMM engines of the torch layer's CPU sequences: torch's BLAS (``TORCH_GEMM``) and oneDNN
on packed weights (``ONEDNN_GEMM``, float32 from ``ONEDNN_MIN`` rows * state^2 on). Each engine,
forced, against the float64 twin, forward and every gradient, for every kind of sequence (one
length, lengths, packed, reversed, stacked bidirectional, forward only); which engine a call
takes; the same bits with one and two threads, and after a fork.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

from torch.nn.utils.rnn import pack_padded_sequence  # noqa: E402

from lltm_cupy import _numpy  # noqa: E402
from lltm_cupy.torch import LLTM, LLTMCell, lltm_sequence  # noqa: E402
from lltm_cupy.torch import _torch_gemm  # noqa: E402
from lltm_cupy.verify import TOLERANCE, normalised_error  # noqa: E402
from helpers.forking import in_parent_and_child, same  # noqa: E402

import numpy as np  # noqa: E402

ONEDNN = pytest.mark.skipif(_torch_gemm.ONEDNN_GEMM is None,
                            reason="this torch has no oneDNN (mkldnn) on an x86-64 CPU")
F32 = TOLERANCE[np.dtype(np.float32)]


@pytest.fixture(params=["torch", "onednn"])
def engine(request, monkeypatch):
    """Every CPU sequence call of the test on the engine named (the size gate set so)."""
    if request.param == "onednn":
        if _torch_gemm.ONEDNN_GEMM is None:
            pytest.skip("this torch has no oneDNN (mkldnn) on an x86-64 CPU")
        monkeypatch.setattr(_torch_gemm, "ONEDNN_MIN", 0)
    else:
        monkeypatch.setattr(_torch_gemm, "ONEDNN_MIN", 1 << 62)
    return request.param


@pytest.fixture
def engines_used(monkeypatch):
    """The engine each CPU sequence forward and backward received, in call order."""
    seen = []
    for name in ("forward_sequence", "backward_sequence"):
        real = getattr(_numpy, name)

        def spy(*args, _real=real, mm, **kw):
            seen.append(mm)
            return _real(*args, mm=mm, **kw)
        monkeypatch.setattr(_numpy, name, spy)
    return seen


def _twins(make):
    torch.manual_seed(0)
    model = make()
    twin = make().double()
    twin.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return model, twin


def _train(model, x, lengths=None):
    """Outputs, then the gradients of the input and of every parameter, of one training call
    (a weighted sum of the outputs and final states as the loss)."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    arg = x if lengths is None else pack_padded_sequence(x, lengths, enforce_sorted=False)
    out, (h, c) = model(arg)
    out = out if lengths is None else out.data
    (out.sum() + 2 * h.sum() + 3 * c.sum()).backward()
    return [out, h, c, x.grad, *(p.grad for p in model.parameters())]


LENGTHS = torch.tensor([3, 7, 1, 5, 7, 2])
MODELS = {
    "one layer": (lambda: LLTM(5, 12), None),
    "two layers bidirectional": (lambda: LLTM(5, 12, num_layers=2, bidirectional=True), None),
    "packed": (lambda: LLTM(5, 12), LENGTHS),
    "packed two layers bidirectional":
        (lambda: LLTM(5, 12, num_layers=2, bidirectional=True), LENGTHS),
}


@pytest.mark.parametrize("case", MODELS)
def test_each_engine_against_the_float64_twin(engine, engines_used, case):
    make, lengths = MODELS[case]
    model, twin = _twins(make)
    x = torch.randn(7, 6, 5)
    got = _train(model, x, lengths)
    wanted = _torch_gemm.ONEDNN_GEMM if engine == "onednn" else _torch_gemm.TORCH_GEMM
    assert engines_used and all(mm is wanted for mm in engines_used), engines_used
    want = _train(twin, x.double(), lengths)
    names = ["output", "h_n", "c_n", "d_input"] + [n for n, _ in model.named_parameters()]
    for name, g, w in zip(names, got, want):
        assert g.dtype == torch.float32
        err = normalised_error(g, w)
        assert err <= F32, f"{engine}: {name} off by {err:.2e} (normalised) > {F32:.0e}"


def test_lltm_sequence_lengths_and_reverse(engine):
    """The functional form: lengths (one of them 0) and reverse, gradients of every argument."""
    torch.manual_seed(1)
    cell = LLTMCell(4, 10)
    args = [torch.randn(6, 5, 4), cell.weights.detach(), cell.bias.detach(),
            torch.randn(5, 10), torch.randn(5, 10)]

    def results(leaves, kw):
        out, h, c = lltm_sequence(*leaves, **kw)
        (out.sum() + 2 * h.sum() + 3 * c.sum()).backward()
        return [out.detach(), h.detach(), c.detach()] + [a.grad for a in leaves]

    for kw in ({"lengths": [6, 2, 0, 5, 1]}, {"reverse": True}):
        got = results([a.clone().requires_grad_() for a in args], kw)
        want = results([a.double().requires_grad_() for a in args], kw)
        for i, (g, w) in enumerate(zip(got, want)):
            err = normalised_error(g, w)
            assert err <= F32, f"{engine} {kw}: result {i} off by {err:.2e}"


def test_forward_only_is_the_training_forward(engine):
    """Under no_grad the forward only runs (nothing kept), with the training forward's bits."""
    model, _ = _twins(lambda: LLTM(5, 12, num_layers=2, bidirectional=True))
    x = torch.randn(7, 6, 5)
    for lengths in (None, LENGTHS):
        arg = x if lengths is None else pack_padded_sequence(x, lengths, enforce_sorted=False)
        train = model(arg)
        with torch.no_grad():
            only = model(arg)
        for a, b in zip(_flat(train), _flat(only)):
            assert torch.equal(a.detach(), b)


def _flat(out):
    data, (h, c) = out
    return [getattr(data, "data", data), h, c]


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_the_size_gate_and_dtype_choose_the_engine(engines_used):
    """Below ONEDNN_MIN rows * state^2, in float64, or with torch.backends.mkldnn disabled, a
    call stays on torch's BLAS; from it on (float32) it takes oneDNN where torch has it."""
    gate = _torch_gemm.ONEDNN_MIN
    small, large = (16, 128), (16, 256)
    assert small[0] * small[1] ** 2 < gate <= large[0] * large[1] ** 2
    onednn = _torch_gemm.ONEDNN_GEMM or _torch_gemm.TORCH_GEMM
    for (batch, state), dtype, enabled, want in [
            (small, torch.float32, True, _torch_gemm.TORCH_GEMM),
            (large, torch.float32, True, onednn),
            (large, torch.float64, True, _torch_gemm.TORCH_GEMM),
            (large, torch.float32, False, _torch_gemm.TORCH_GEMM)]:
        model = LLTM(3, state, dtype=dtype)
        x = torch.randn(2, batch, 3, dtype=dtype)
        engines_used.clear()
        with torch.backends.mkldnn.flags(enabled=enabled):
            out, _ = model(x)
            out.sum().backward()
        assert engines_used == [want, want], (batch, state, dtype, enabled)


@ONEDNN
def test_onednn_with_one_and_two_threads(monkeypatch):
    """The same call on one and on two of torch's threads: within float32 rounding of each
    other and of the float64 twin. Not bit for bit: how oneDNN splits a product between threads
    (a reduction split over rows, on some CPUs) may change its order of additions."""
    monkeypatch.setattr(_torch_gemm, "ONEDNN_MIN", 0)
    model, twin = _twins(lambda: LLTM(24, 64, num_layers=2, bidirectional=True))
    x = torch.randn(5, 32, 24)
    want = _train(twin, x.double(), None)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_train(model, x, None))
    finally:
        torch.set_num_threads(before)
    for i, (a, b, w) in enumerate(zip(*results, want)):
        assert normalised_error(a, w) <= F32 and normalised_error(b, w) <= F32, f"result {i}"
        assert normalised_error(a, b) <= F32, f"result {i}: one and two threads differ"


@ONEDNN
def test_onednn_after_a_fork(monkeypatch):
    """Parent and child, both having run oneDNN before the fork, compute the same bits as one
    process (the packed weights are made per call: nothing of ours is kept)."""
    monkeypatch.setattr(_torch_gemm, "ONEDNN_MIN", 0)
    model, _ = _twins(lambda: LLTM(8, 24, num_layers=2, bidirectional=True))
    x = torch.randn(6, 10, 8)
    lengths = torch.tensor([6, 3, 1, 6, 2, 5, 4, 6, 1, 2])

    def run():
        return _train(model, x, lengths)
    before = torch.get_num_threads()
    torch.set_num_threads(1)    # (as the child runs: the same code in both, so the same bits)
    try:
        expected = run()
        assert same(run(), expected)
        wrong = in_parent_and_child(run, expected, 20)
    finally:
        torch.set_num_threads(before)
    assert wrong == (0, 0), wrong


@ONEDNN
def test_onednn_from_several_threads_at_once(monkeypatch):
    """Three Python threads, each training its own model on the oneDNN engine at the same
    time, get the bits each gets alone (nothing of the engine's is shared between calls)."""
    import threading

    monkeypatch.setattr(_torch_gemm, "ONEDNN_MIN", 0)
    torch.manual_seed(0)
    models = [LLTM(8, 24, num_layers=2, bidirectional=True) for _ in range(3)]
    xs = [torch.randn(6, 10, 8) for _ in range(3)]
    want = [_train(m, x) for m, x in zip(models, xs)]
    wrong = []

    def worker(i):
        for _ in range(15):
            got = _train(models[i], xs[i])
            wrong.extend(i for a, b in zip(got, want[i]) if not torch.equal(a, b))
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, f"results differing from one thread's, by model: {wrong}"


# ------------------------------------------------------------- one step a call: LLTMCell

@pytest.fixture(autouse=True)
def onednn_calls(monkeypatch):
    """The products oneDNN's operator computed in the test (none where this torch has no
    oneDNN); afterwards, that every weight operand was dense (C-contiguous, or the transpose
    of a C-contiguous matrix): a column slice such as ``weights[:, :S]`` runs on oneDNN's
    reference loop, thousands of times slower (120 ms against 0.06 ms for a (64, 256) x
    (256, 384) product), which no result shows."""
    calls = []
    real = getattr(_torch_gemm, "_linear", None)
    if real is not None:
        def spy(x, w, *args):
            calls.append((tuple(x.shape), w.is_mkldnn or w.is_contiguous()
                          or w.t().is_contiguous()))
            return real(x, w, *args)
        monkeypatch.setattr(_torch_gemm, "_linear", spy)
    yield calls
    sparse = [shape for shape, dense in calls if not dense]
    assert not sparse, f"oneDNN products on a sliced weight (inputs of shapes {sparse})"


@pytest.mark.parametrize("batch, features, state", [(5, 6, 9), (2, 3, 16)])
def test_lltm_cell_on_each_engine(engine, onednn_calls, batch, features, state):
    """A step of LLTMCell (forward, every gradient, the forward-only bits) against the
    float64 twin; the forward's and backward's products on oneDNN exactly when the engine is."""
    torch.manual_seed(2)
    cell = LLTMCell(features, state)
    twin = LLTMCell(features, state, dtype=torch.float64)
    twin.load_state_dict({k: v.double() for k, v in cell.state_dict().items()})
    x, h, c = (torch.randn(batch, features), torch.randn(batch, state),
               torch.randn(batch, state))

    def step(m, dtype):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (x, h, c)]
        m.zero_grad(set_to_none=True)
        new_h, new_c = m(leaves[0], (leaves[1], leaves[2]))
        (new_h.sum() + 2 * new_c.sum()).backward()
        return [new_h.detach(), new_c.detach(), *(t.grad for t in leaves),
                *(p.grad for p in m.parameters())]

    got = step(cell, torch.float32)
    assert (len(onednn_calls) > 0) == (engine == "onednn"), onednn_calls
    want = step(twin, torch.float64)
    for i, (g, w) in enumerate(zip(got, want)):
        err = normalised_error(g, w)
        assert err <= F32, f"{engine}: result {i} off by {err:.2e} (normalised) > {F32:.0e}"
    with torch.no_grad():
        only = cell(x, (h, c))
    assert torch.equal(only[0], got[0]) and torch.equal(only[1], got[1])
