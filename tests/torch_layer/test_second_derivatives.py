"""Second derivatives through the torch layer (a backward run with ``create_graph=True``, and
``torch.func`` over it): Hessian-vector products, gradient penalties, gradgradcheck, each
against a float64 plain-torch twin with the same parameters, on the CPU and on the emulated
CUDA path; and the first-order backward untouched by it.

The layer's backward, with grad mode on, computes the gradients by docs/derivation.md's
formulas in differentiable torch operations (``lltm_cupy.torch.reference``); with grad mode
off, the backends' fast backward."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy.torch as lt  # noqa: E402
from lltm_cupy.torch import reference  # noqa: E402
from torch.nn.utils.rnn import pack_padded_sequence  # noqa: E402
from conftest import max_error  # noqa: E402
from helpers.torch_models import PATHS, _path, reference_lltm  # noqa: E402

B, F, S, T = 3, 4, 5, 6
f64 = torch.float64


def _assert_close(got, want, name, tol=1e-10):
    assert got is not None, f"{name}: missing (None)"
    err = max_error(got, want)
    assert err <= tol, f"{name}: max normalised error {err:.2e} > {tol:.0e}"


def _step_args(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, F, generator=g, dtype=f64),
            torch.randn(3 * S, S + F, generator=g, dtype=f64) * scale / 2,
            torch.randn(3 * S, generator=g, dtype=f64),
            torch.randn(B, S, generator=g, dtype=f64),
            torch.randn(B, S, generator=g, dtype=f64)]


def _hvp(fn, args, weights_h, weights_c, vectors):
    """sum_i <d/d args (<grad L, v>)> for L = <h, weights_h> + <c, weights_c>: a
    Hessian-vector product in every argument, by reverse over reverse."""
    args = [a.detach().clone().requires_grad_() for a in args]
    h, c = fn(*args)[:2]
    loss = (h * weights_h).sum() + (c * weights_c).sum()
    grads = torch.autograd.grad(loss, args, create_graph=True)
    inner = sum((g * v).sum() for g, v in zip(grads, vectors))
    return [g.detach() for g in grads], torch.autograd.grad(inner, args)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale", [1.0, 6.0], ids=["moderate", "saturated"])
def test_hessian_vector_products_of_a_step_equal_the_reference(request, path, scale):
    """Every second derivative of one step (each argument against each), in a Hessian-vector
    product, against autograd's through the pure-torch reference; saturated gates included."""
    _path(request, path)
    args = _step_args(1, scale)
    g = torch.Generator().manual_seed(2)
    w_h, w_c = torch.randn(B, S, generator=g, dtype=f64), torch.randn(B, S, generator=g,
                                                                      dtype=f64)
    vectors = [torch.randn(a.shape, generator=g, dtype=f64) for a in args]
    got_g, got = _hvp(lt.lltm, args, w_h, w_c, vectors)
    want_g, want = _hvp(reference.lltm_reference, args, w_h, w_c, vectors)
    for name, a, b in zip(("input", "weights", "bias", "old_h", "old_cell"), got, want):
        _assert_close(a, b, f"Hessian-vector product, {name}")
    for name, a, b in zip(("input", "weights", "bias", "old_h", "old_cell"), got_g, want_g):
        _assert_close(a, b, f"gradient under create_graph, {name}")
    assert max(float(v.abs().max()) for v in want) > 1e-3     # (the test can fail)


@pytest.mark.parametrize("path", PATHS)
def test_hessian_of_a_cell_is_the_references(request, path):
    """torch.autograd.functional.hessian of a cell's loss in its input (zeros before the layer
    supported second derivatives)."""
    _path(request, path)
    x, w, b, h, c = _step_args(3)
    cell = lt.LLTMCell(F, S, dtype=f64)
    with torch.no_grad():
        cell.weights.copy_(w)
        cell.bias.copy_(b)

    def loss(fn):
        return lambda x: sum(t.pow(2).sum() for t in fn(x))

    got = torch.autograd.functional.hessian(loss(lambda x: cell(x, (h, c))), x)
    want = torch.autograd.functional.hessian(
        loss(lambda x: reference.lltm_reference(x, cell.weights, cell.bias, h, c)), x)
    _assert_close(got, want, "Hessian in the input")
    assert float(want.abs().max()) > 1e-2


@pytest.mark.parametrize("path", PATHS)
def test_gradient_penalty_with_frozen_cell_weights_reaches_the_encoder(request, path):
    """A gradient penalty on the cell's input with the cell frozen: the encoder before the cell
    gets the gradient the pure-torch twin gives (a constant penalty, and no gradient for the
    encoder, before)."""
    _path(request, path)
    torch.manual_seed(4)
    encoder = torch.nn.Linear(F, F, dtype=f64)
    cell = lt.LLTMCell(F, S, dtype=f64).requires_grad_(False)
    raw = torch.randn(B, F, dtype=f64)
    h, c = torch.randn(B, S, dtype=f64), torch.randn(B, S, dtype=f64)

    def penalty(step):
        x = encoder(raw)
        new_h, new_cell = step(x)
        (gx,) = torch.autograd.grad((new_h.pow(2) + new_cell).sum(), x, create_graph=True)
        return gx.pow(2).sum()

    got = torch.autograd.grad(penalty(lambda x: cell(x, (h, c))), list(encoder.parameters()))
    want = torch.autograd.grad(
        penalty(lambda x: reference.lltm_reference(x, cell.weights, cell.bias, h, c)),
        list(encoder.parameters()))
    for a, b in zip(got, want):
        _assert_close(a, b, "encoder gradient of the penalty")
        assert float(b.abs().max()) > 1e-3


def _sequence_cases():
    """(name, our model's call, the twin's call): padded, reverse (bidirectional), unsorted
    lengths and an unsorted PackedSequence, through a 2-layer bidirectional LLTM and
    lltm_sequence."""
    lengths = [6, 2, 4]
    return {
        "lltm_sequence": (lambda m, x, h0, c0: lt.lltm_sequence(x, m.weights, m.bias, h0[0], c0[0])[:1],
                          lambda m, x, h0, c0: reference.lltm_sequence_reference(
                              x, m.weights, m.bias, h0[0], c0[0])[:1]),
        "lltm_sequence lengths reverse": (
            lambda m, x, h0, c0: lt.lltm_sequence(x, m.weights, m.bias, h0[0], c0[0],
                                                  lengths=lengths, reverse=True)[:1],
            None),
        "LLTM 2 layers bidirectional": (lambda m, x, h0, c0: (m(x, (h0, c0))[0],),
                                        lambda m, x, h0, c0: (reference_lltm(m, x, [T] * B,
                                                                             h0, c0)[0],)),
        "LLTM packed": (lambda m, x, h0, c0: (_unpacked(m(pack_padded_sequence(
                            x, torch.tensor(lengths), enforce_sorted=False), (h0, c0))[0]),),
                        lambda m, x, h0, c0: (reference_lltm(m, x, lengths, h0, c0)[0],)),
    }


def _unpacked(packed):
    from torch.nn.utils.rnn import pad_packed_sequence

    return pad_packed_sequence(packed, total_length=T)[0]


def _reverse_twin(m, x, h0, c0, lengths=(6, 2, 4)):
    """Each sequence alone, time-reversed within its length, outputs zero past it."""
    out = x.new_zeros(T, B, S)
    for b, n in enumerate(lengths):
        o, _, _ = reference.lltm_sequence_reference(x[:n, b:b + 1].flip(0), m.weights, m.bias,
                                                    h0[0, b:b + 1], c0[0, b:b + 1])
        out = out.index_put((torch.arange(n), torch.tensor([b])), o.flip(0)[:, 0])
    return (out,)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(_sequence_cases()))
def test_hessian_vector_products_of_sequences_equal_the_twins(request, path, case):
    """Through whole sequences (every way a sequence runs): the Hessian-vector product in the
    inputs and the gradient in the weights of the input gradient's penalty, against the
    float64 pure-torch twin with the same parameters."""
    _path(request, path)
    torch.manual_seed(5)
    layers, bidirectional = (2, True) if case.startswith("LLTM") else (1, False)
    model = lt.LLTM(F, S, num_layers=layers, bidirectional=bidirectional, dtype=f64)
    count = layers * (2 if bidirectional else 1)
    ours, twin = _sequence_cases()[case]
    twin = twin or _reverse_twin
    x0 = torch.randn(T, B, F, dtype=f64)
    h0, c0 = torch.randn(count, B, S, dtype=f64), torch.randn(count, B, S, dtype=f64)
    v = torch.randn(T, B, F, dtype=f64)
    params = list(model.parameters())

    def second(fn):
        x = x0.clone().requires_grad_()
        (out,) = fn(model, x, h0, c0)
        (gx,) = torch.autograd.grad(out.pow(2).sum() + out.sum(), x, create_graph=True)
        hvp = torch.autograd.grad((gx * v).sum(), x, retain_graph=True)[0]
        penalty = torch.autograd.grad(gx.pow(2).sum(), params, allow_unused=True)
        return [hvp, *penalty]

    got, want = second(ours), second(twin)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None or float(a.abs().max()) == 0, f"{case}: item {i}"
            continue
        _assert_close(a, b, f"{case}: {'Hessian-vector product' if i == 0 else f'penalty gradient {i}'}")
    assert float(want[0].abs().max()) > 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_gradgradcheck_of_a_step_and_a_sequence(request, path):
    _path(request, path)
    args = [a.requires_grad_() for a in _step_args(6)]
    assert torch.autograd.gradgradcheck(lt.lltm, args, eps=1e-6, atol=1e-6)
    g = torch.Generator().manual_seed(7)
    seq = [torch.randn(3, 2, 2, generator=g, dtype=f64),
           torch.randn(9, 5, generator=g, dtype=f64) / 2,
           torch.randn(9, generator=g, dtype=f64),
           torch.randn(2, 3, generator=g, dtype=f64),
           torch.randn(2, 3, generator=g, dtype=f64)]
    seq = [a.requires_grad_() for a in seq]
    assert torch.autograd.gradgradcheck(lambda *a: lt.lltm_sequence(*a, lengths=[3, 1]), seq,
                                        eps=1e-6, atol=1e-6)


def test_torch_func_grad_of_grad_equals_the_reference():
    """torch.func.grad over torch.func.grad (the backward, under the transform, in torch
    operations)."""
    x, w, b, h, c = _step_args(8)

    def loss(fn):
        return lambda x: sum(t.pow(2).sum() for t in fn(x, w, b, h, c))

    got = torch.func.grad(lambda x: torch.func.grad(loss(lt.lltm))(x).pow(2).sum())(x)
    want = torch.func.grad(lambda x: torch.func.grad(
        loss(reference.lltm_reference))(x).pow(2).sum())(x)
    _assert_close(got, want, "grad of grad")


def test_first_order_backward_runs_the_backend_not_the_formulas(monkeypatch):
    """With grad mode off in the backward (every backward() without create_graph), the
    backend's backward runs and the torch formulas do not; with create_graph=True the
    formulas do."""
    calls = []
    for name in ("lltm_backward_reference", "lltm_sequence_backward_reference"):
        real = getattr(reference, name)
        monkeypatch.setattr(reference, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or
                            _real(*a, **k))
    args = [a.requires_grad_() for a in _step_args(9)]
    xs = torch.randn(T, B, F, dtype=f64, requires_grad=True)
    h, c = lt.lltm(*args)
    out, _, _ = lt.lltm_sequence(xs, *args[1:])
    (h.sum() + c.sum() + out.sum()).backward()
    assert calls == []
    h, c = lt.lltm(*args)
    out, _, _ = lt.lltm_sequence(xs, *args[1:])
    torch.autograd.grad(h.sum() + c.sum() + out.sum(), args, create_graph=True)
    assert sorted(calls) == ["lltm_backward_reference", "lltm_sequence_backward_reference"]


def test_reference_backward_formulas_equal_autograd_of_the_reference():
    """The formulas the differentiable backward runs, against autograd of the forward they
    differentiate, over a spread of pre-activations."""
    for seed, scale in ((10, 1.0), (11, 8.0)):
        args = [a.requires_grad_() for a in _step_args(seed, scale)]
        g = torch.Generator().manual_seed(seed)
        gh, gc = torch.randn(B, S, generator=g, dtype=f64), torch.randn(B, S, generator=g,
                                                                        dtype=f64)
        got = reference.lltm_backward_reference(gh, gc, *args)
        want = torch.autograd.grad(reference.lltm_reference(*args), args, (gh, gc))
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_close(a, b, f"formula {i} at scale {scale}", 1e-12)


@pytest.mark.parametrize("model", ["LLTMCell", "LLTM 2 layers bidirectional"])
def test_compiled_second_derivatives_are_torchs_error_at_the_second_differentiation(model):
    """Under torch.compile, as docs/api.md says: ``create_graph=True`` is accepted, and
    differentiating the gradients raises torch's own RuntimeError (AOTAutograd has no double
    backward), for the cell and a layered model alike; eagerly the same gradient penalty
    works."""
    torch.manual_seed(11)
    if model == "LLTMCell":
        module, x = lt.LLTMCell(F, S, dtype=f64), torch.randn(B, F, dtype=f64)
        weight = module.weights
    else:
        module = lt.LLTM(F, S, num_layers=2, bidirectional=True, dtype=f64)
        x, weight = torch.randn(T, B, F, dtype=f64), module.weights_l0

    def penalty(m):
        out = m(x)[0]
        (g,) = torch.autograd.grad(out.pow(2).sum(), weight, create_graph=True)
        return g.pow(2).sum()

    penalty(module).backward()                                   # eagerly: works
    assert weight.grad is not None and float(weight.grad.abs().max()) > 0
    weight.grad = None
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    loss = penalty(compiled)                                     # create_graph=True: accepted
    with pytest.raises(RuntimeError, match="torch.compile with aot_autograd does not currently "
                                           "support double backward"):
        loss.backward()


def test_nn_lstm_on_the_cpu_has_second_derivatives_as_the_layer_does():
    """What docs/api.md's table says of nn.LSTM on the CPU, run beside the layer: a gradient
    penalty through it backpropagates."""
    torch.manual_seed(12)
    for module in (torch.nn.LSTM(F, S, dtype=f64), lt.LLTM(F, S, dtype=f64)):
        x = torch.randn(T, B, F, dtype=f64, requires_grad=True)
        (g,) = torch.autograd.grad(module(x)[0].pow(2).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
        assert all(float(p.grad.abs().max()) > 0 for p in module.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, f64], ids=["f32", "f64"])
def test_compiled_nn_lstm_differentiates_twice_and_nn_lstmcell_does_not(dtype):
    """What docs/api.md says of torch's own modules under torch.compile (default backend), run
    beside ours: a compiled nn.LSTM on the CPU is not compiled (Dynamo breaks the graph at RNN
    modules and runs it eagerly), so a gradient penalty through it differentiates twice without
    error; a compiled nn.LSTMCell raises AOTAutograd's error at the second differentiation, as
    our compiled LLTM does."""
    def penalty(module, x):
        out = module(x)[0]
        (g,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        g.pow(2).sum().backward()

    torch.manual_seed(13)
    xs = torch.randn(T, B, F, dtype=dtype, requires_grad=True)
    x = torch.randn(B, F, dtype=dtype, requires_grad=True)
    lstm = torch.nn.LSTM(F, S, dtype=dtype)
    torch._dynamo.reset()
    penalty(torch.compile(lstm), xs)
    assert all(float(p.grad.abs().max()) > 0 for p in lstm.parameters())
    for module, inputs in ((torch.nn.LSTMCell(F, S, dtype=dtype), x),
                           (lt.LLTM(F, S, dtype=dtype), xs)):
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match="torch.compile with aot_autograd does not "
                                               "currently support double backward"):
            penalty(torch.compile(module), inputs)
