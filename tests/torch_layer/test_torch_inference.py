"""The torch layer runs the forward only (the backends' ``keep=False``) exactly when autograd
will not need a backward: under ``torch.no_grad``, ``torch.inference_mode``, or with nothing
requiring grad; eager and under ``torch.compile(fullgraph=True)``; with the same bits as the
training forward. What is kept is asserted on the backend calls themselves (the ``keep`` each
received) and on the memory they took, not on timing.
"""
from __future__ import annotations

import contextlib
import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

from torch.nn.utils.rnn import pack_padded_sequence  # noqa: E402

from lltm_cupy import _cuda, _numpy  # noqa: E402
from lltm_cupy._cuda import sequence as _sequence
from lltm_cupy.torch import LLTM, LLTMCell, lltm_sequence  # noqa: E402
from helpers.memory import peak_traced_bytes  # noqa: E402
from helpers.torch_cuda import CUDA_REASON, needs_cuda  # noqa: E402


@pytest.fixture
def kept(monkeypatch):
    """Whether each forward of a step or sequence (both backends) keeps what a backward reads,
    in call order: the sequences' ``keep`` (the backends', and the torch layer's CUDA
    sequences of one length), the CPU step's ``factors`` (None: forward only), the CUDA
    step's ``keep``."""
    from lltm_cupy.torch import _cuda_sequence, _functions

    seen = []
    for backend in (_numpy, _cuda):
        real = backend.forward_sequence

        def spy(*args, _real=real, keep=True, **kw):
            seen.append(keep)
            return _real(*args, keep=keep, **kw)
        monkeypatch.setattr(backend, "forward_sequence", spy)
    real_rows = _numpy.step.gate_rows

    def rows_spy(*args):
        z, real_run = real_rows(*args)

        def run(old_cell, new_h, new_cell, factors=None):
            seen.append(factors is not None)
            return real_run(old_cell, new_h, new_cell, factors)
        return z, run
    monkeypatch.setattr(_numpy.step, "gate_rows", rows_spy)
    real_array_step = _numpy.forward        # (the compiled path's custom operators)

    def array_step_spy(*args, keep=True, **kw):
        seen.append(keep)
        return real_array_step(*args, keep=keep, **kw)
    monkeypatch.setattr(_numpy, "forward", array_step_spy)
    for module, name in ((_functions, "cuda_step_forward"), (_cuda_sequence, "forward")):
        real = getattr(module, name)

        def spy(*args, _real=real, keep=True, **kw):
            seen.append(keep)
            return _real(*args, keep=keep, **kw)
        monkeypatch.setattr(module, name, spy)
    return seen


def _cell(device="cpu"):
    cell = LLTMCell(5, 7, device=device, dtype=torch.float64)
    xs = torch.randn(4, 3, 5, device=device, dtype=torch.float64)

    def run(model, x):
        state = None
        outs = []
        for step in x:
            state = model(step, state)
            outs.append(state[0])
        return torch.stack(outs), state[1]
    return cell, xs, run, 4


def _layers(device="cpu"):
    model = LLTM(5, 6, num_layers=2, bidirectional=True, device=device, dtype=torch.float64)
    xs = torch.randn(7, 3, 5, device=device, dtype=torch.float64)
    return model, xs, lambda m, x: (lambda o: (o[0], *o[1]))(m(x)), 4


def _packed(device="cpu"):
    model = LLTM(5, 6, num_layers=2, bidirectional=True, device=device, dtype=torch.float64)
    xs = torch.randn(7, 4, 5, device=device, dtype=torch.float64)
    lengths = torch.tensor([3, 7, 1, 5])

    def run(m, x):
        out, (h, c) = m(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return out.data, h, c
    return model, xs, run, 4


def _functional(device="cpu", lengths=True):
    model = LLTMCell(5, 6, device=device, dtype=torch.float64)
    xs = torch.randn(6, 3, 5, device=device, dtype=torch.float64)
    h0 = torch.randn(3, 6, device=device, dtype=torch.float64)

    def run(m, x):
        bias = m.bias.reshape(-1)
        a = lltm_sequence(x, m.weights, bias, h0, h0, lengths=[6, 2, 0]) if lengths else ()
        b = lltm_sequence(x, m.weights, bias, h0, h0, reverse=True)
        c = lltm_sequence(x, m.weights, bias, h0, h0)
        return (*a, *b, *c)
    return model, xs, run, 2 + lengths


def _functional_fixed(device="cpu"):
    """lltm_sequence without lengths (lengths= runs eagerly: a graph break of its own)."""
    return _functional(device, lengths=False)


MODELS = {"LLTMCell stepped": _cell, "LLTM 2 layers bidirectional": _layers,
          "LLTM packed 2 layers bidirectional": _packed,
          "lltm_sequence lengths, reverse, plain": _functional}

#: context -> (what to do to model and input, whether the backward is needed)
CONTEXTS = {
    "no_grad": (torch.no_grad, False, False),
    "inference_mode": (torch.inference_mode, False, False),
    "nothing requires grad": (contextlib.nullcontext, True, False),
    "grad": (contextlib.nullcontext, False, True),
    "only the input requires grad": (contextlib.nullcontext, True, True),
}


def _prepare(model, xs, context):
    _, frozen, _ = CONTEXTS[context]
    model.eval()
    model.requires_grad_(not frozen)
    return xs.clone().requires_grad_(context == "only the input requires grad")


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_forward_only_exactly_when_no_backward_is_needed(kept, make, context):
    torch.manual_seed(0)
    model, xs, run, calls = make()
    with torch.enable_grad():
        want = [t.detach() for t in run(model, xs.clone().requires_grad_())]
    kept.clear()
    x = _prepare(model, xs, context)
    with CONTEXTS[context][0]():
        got = run(model, x)
    needed = CONTEXTS[context][2]
    assert len(kept) >= calls and kept == [needed] * len(kept), kept
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.detach(), w), f"result {i} differs from the training forward"
        assert (g.grad_fn is not None) == needed


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "grad"])
@pytest.mark.parametrize("make", [_cell, _layers, _functional_fixed],
                         ids=["LLTMCell stepped", "LLTM 2 layers bidirectional",
                              "lltm_sequence plain and reverse"])
def test_compiled_fullgraph_chooses_the_same(kept, make, context):
    """fullgraph=True fails on any graph break; the forward-only custom operators run under
    no_grad and inference_mode, the training ones with grad, each with the eager results."""
    torch.manual_seed(1)
    model, xs, run, calls = make()
    x = _prepare(model, xs, context)
    with CONTEXTS[context][0]():
        want = [t.detach().clone() for t in run(model, x)]
        compiled = torch.compile(lambda x: run(model, x), fullgraph=True, backend="eager")
        kept.clear()
        got = compiled(x)
    needed = CONTEXTS[context][2]
    assert kept and kept == [needed] * len(kept), kept
    for g, w in zip(got, want):
        assert torch.equal(g.detach(), w)


def test_inference_ops_pass_opcheck():
    rng = np.random.default_rng(3)
    B, F, S, T = 3, 4, 5, 6
    w = torch.tensor(rng.standard_normal((3 * S, S + F)) / 3)
    b, h, c = (torch.tensor(rng.standard_normal(s)) for s in (3 * S, (B, S), (B, S)))
    torch.library.opcheck(torch.ops.lltm_cupy.step_inference.default,
                          (torch.tensor(rng.standard_normal((B, F))), w, b, h, c))
    torch.library.opcheck(torch.ops.lltm_cupy.sequence_inference.default,
                          (torch.tensor(rng.standard_normal((T, B, F))), w, b, h, c))


@pytest.mark.slow
def test_cpu_memory_beyond_the_output_does_not_grow_with_steps(monkeypatch):
    """With the NumPy backend's arrays NumPy's, tracemalloc sees all it makes:
    under no_grad the peak beyond the output is the same at 50 and 200 steps; with grad the
    layer keeps 5 * B * S values per step for the backward."""
    monkeypatch.setattr(_numpy.sequence, "_BLOCK_ROWS", 64)     # blocks of 8 steps: full at 50 too
    # the results and what the backward keeps as NumPy's arrays, which tracemalloc sees (the
    # torch layer takes them as they are; its own are torch.empty tensors, which it does not)
    from lltm_cupy.torch._torch_gemm import TorchGemm
    monkeypatch.setattr(TorchGemm, "empty", staticmethod(np.empty))
    monkeypatch.setattr(TorchGemm, "zeros", staticmethod(np.zeros))
    torch.manual_seed(2)
    B, F, S = 8, 4, 32
    model = LLTM(F, S)
    model(torch.randn(2, B, F))             # imports and first-call work done
    extra = {}
    for steps in (50, 200):
        xs = torch.randn(steps, B, F)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                model(xs)                   # anything a first call at this size caches
                gc.collect()
                peak, (out, _) = peak_traced_bytes(lambda: model(xs))
            extra[steps, grad] = peak - out.numel() * out.element_size()
            del out
    # (one array per step would add 150 KB here; the slack is the interpreter's and NumPy's own
    # caches of small objects, whose filling depends on what ran before: up to 2 KB seen)
    assert extra[200, False] - extra[50, False] <= 4096, extra
    assert (extra[200, True] - extra[50, True]) / 150 >= 0.9 * 5 * B * S * 4, extra


def test_emulated_cuda_path_forward_only(emulated_cuda_torch, kept, monkeypatch):
    """The CUDA path (torch's buffers and GEMMs, the kernels on the emulated CuPy): forward
    only under no_grad, the same bits as the training forward, nothing allocated through CuPy,
    and no buffer that grows with steps beyond each layer's [h0, outputs]."""
    monkeypatch.setattr(_sequence, "_BLOCK_ROWS", 12)      # blocks of 4 steps
    emu = emulated_cuda_torch.emulator
    made = []
    real_new_empty = torch.Tensor.new_empty

    def new_empty(t, *args, **kw):
        out = real_new_empty(t, *args, **kw)
        made.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    torch.manual_seed(3)
    B, F, S = 3, 4, 6
    model = LLTM(F, S, num_layers=2, dtype=torch.float32)
    extra = {}
    for steps in (20, 40):
        xs = torch.randn(steps, B, F)
        want, _ = model(xs)
        emu.reset()
        kept.clear()
        made.clear()
        with torch.no_grad():
            got, _ = model(xs)
        assert kept == [False, False]
        assert torch.equal(got, want.detach())
        assert emu.allocations == []
        extra[steps] = sum(made) - 2 * (steps + 1) * B * S * 4
    assert extra[40] == extra[20], extra


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_REASON is not None, reason=f"GPU test: {CUDA_REASON}")
def test_gpu_forward_only_memory_and_bits():
    """On a GPU: under no_grad the peak of torch's allocator beyond the output stays within a
    few (batch, state) buffers plus one block of gates, and the bits equal the training
    forward's."""
    torch.manual_seed(4)
    T, B, F, S = 500, 64, 16, 512
    model = LLTM(F, S, device="cuda")
    xs = torch.randn(T, B, F, device="cuda")
    want, (h_want, c_want) = model(xs)
    want, h_want, c_want = want.detach(), h_want.detach(), c_want.detach()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        got, (h, c) = model(xs)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    outputs = (T + 1) * B * S * 4
    block = _sequence._BLOCK_ROWS * 3 * S * 4
    assert grown <= outputs + block + 16 * B * S * 4, (grown, outputs, block)
    assert torch.equal(got, want) and torch.equal(h, h_want) and torch.equal(c, c_want)


FORMS = ["PackedSequence", "lengths= unsorted", "lengths= sorted"]


def _variable_lengths_case(form, T, B, F, S, device):
    """(run, bytes the outputs and the packed inputs take, packed rows): ``run()`` gives
    (outputs, h_n, c_n) of an LLTM(F, S) over (T, B, F) inputs of lengths in [T / 2, T]."""
    torch.manual_seed(5)
    model = LLTM(F, S, device=device)
    xs = torch.randn(T, B, F, device=device)
    lengths = torch.randint(T // 2, T + 1, (B,))
    if form.endswith(" sorted"):
        lengths = lengths.sort(descending=True).values
    rows = int(lengths.sum())
    if form == "PackedSequence":
        packed = pack_padded_sequence(xs, lengths, enforce_sorted=False)

        def run():
            out, (h, c) = model(packed)
            return out.data, h, c
        return run, rows * S * 4, rows                  # the outputs: the packed rows
    h0 = xs.new_zeros(B, S)

    def run():
        return lltm_sequence(xs, model.weights, model.bias, h0, h0, lengths=lengths)
    return run, T * B * S * 4 + rows * F * 4, rows     # padded outputs, packed inputs


@pytest.mark.parametrize("form", FORMS)
def test_emulated_cuda_variable_lengths_forward_only_memory(emulated_cuda_torch, monkeypatch,
                                                            form):
    """The bound of the GPU test below on the emulated CUDA path, where every torch allocation
    of the call is counted (their sum bounds their peak; CuPy allocates nothing)."""
    from helpers.faults import torch_allocations

    class Every:        # (an injector that counts every allocation and fails none)
        counting = True

        def __call__(self, kind, detail=None):
            return None

    monkeypatch.setattr(_sequence, "_BLOCK_ROWS", 16)
    emu = emulated_cuda_torch.emulator
    T, B, F, S = 40, 4, 2, 16
    run, beyond, rows = _variable_lengths_case(form, T, B, F, S, "cpu")
    want = [t.detach() for t in run()]
    emu.reset()
    with torch.no_grad(), torch_allocations(Every()) as made:
        got = run()
    allocated = sum(n for _, _, n in made.made)
    block = _sequence._BLOCK_ROWS * 3 * S * 4
    assert emu.allocations == []
    assert allocated <= beyond + block + 16 * B * S * 4, (allocated, beyond, block, rows * S * 4)
    for name, g, w in zip(("outputs", "h_n", "c_n"), got, want):
        assert torch.equal(g, w), name


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_REASON is not None, reason=f"GPU test: {CUDA_REASON}")
@pytest.mark.parametrize("form", FORMS)
def test_gpu_variable_lengths_forward_only_memory_and_bits(form):
    """On a GPU, variable lengths at (500, 64, 16, 512): under no_grad the peak of torch's
    allocator beyond the outputs stays within the packed copy of the inputs (none for a
    PackedSequence), one block of gates and a few (batch, state) buffers: no hidden state per
    packed row besides the outputs. The bits equal the training forward's."""
    T, B, F, S = 500, 64, 16, 512
    run, beyond, rows = _variable_lengths_case(form, T, B, F, S, "cuda")
    want = [t.detach() for t in run()]               # also puts the plan on the device
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        got = run()
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    block = _sequence._BLOCK_ROWS * 3 * S * 4
    assert grown <= beyond + block + 16 * B * S * 4, (grown, beyond, block, rows * S * 4)
    for name, g, w in zip(("outputs", "h_n", "c_n"), got, want):
        assert torch.equal(g, w), name


def _after(model, xs, run, first):
    """On a fresh thread workspace, after ``first`` (a context, or None) ran the model once on
    it: the outputs under ``no_grad`` (the forward only, as under inference_mode), then the
    outputs and every gradient of a training call."""
    from lltm_cupy._numpy import memory

    memory.forget()
    if first is not None:
        with first():
            run(model, xs)
    with torch.no_grad():
        plain = run(model, xs)
    model.zero_grad(set_to_none=True)
    x = xs.clone().requires_grad_()
    outs = run(model, x)
    sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    return [*plain, *(o.detach() for o in outs), *(p.grad for p in model.parameters()), x.grad]


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_no_grad_and_training_after_inference_mode(make):
    """What a workspace keeps between calls is made by whichever call comes first: one under
    ``inference_mode`` must not leave inference tensors that a later call outside it writes
    into (torch refuses that: "Inplace update to inference tensor outside InferenceMode").
    The later calls give the same bits as on a workspace that no inference_mode call made."""
    torch.manual_seed(0)
    model, xs, run, _ = make()
    want = _after(model, xs, run, None)
    got = _after(model, xs, run, torch.inference_mode)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"result {i}"


@pytest.mark.parametrize("make", [_cell, _layers, _packed], ids=["LLTMCell stepped",
                         "LLTM 2 layers bidirectional", "LLTM packed 2 layers bidirectional"])
def test_emulated_cuda_no_grad_and_training_after_inference_mode(emulated_cuda_torch, make):
    """The same on the CUDA path (torch's buffers, the kernels on the emulated CuPy)."""
    torch.manual_seed(0)
    model, xs, run, _ = make()
    model, xs = model.float(), xs.float()
    want = _after(model, xs, run, None)
    got = _after(model, xs, run, torch.inference_mode)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"result {i}"
