"""lltm_cupy.torch.LLTM with nn.LSTM's interface: layers, both directions, dropout, packed
variable-length input, batch_first, unbatched input, bias=False, state dicts.

The reference: the tutorial's pure-torch cell (``lltm_reference``, autograd for the gradients)
stepped over each sequence alone at its own length, per layer and direction, in float64. Every
output, h_n, c_n and the gradients of the inputs, every layer's parameters, h_0 and c_0 are
compared, on the CPU (NumPy backend) and on the CUDA path over the emulated CuPy.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

import lltm_cupy.torch as lt  # noqa: E402
from helpers.torch_models import PATHS, _path, reference_lltm  # noqa: E402

T, B, F, S = 5, 4, 3, 4


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


def _compare(model, x, lengths, h0, c0, packed, enforce_sorted=True, seed=0):
    """Run ``model`` (padded x (T, B, F) or packed), then the reference; compare everything."""
    g = torch.Generator().manual_seed(seed)
    H = model.num_directions * model.hidden_size
    g_out = torch.randn(x.shape[0], x.shape[1], H, generator=g, dtype=x.dtype)
    g_h = torch.randn(h0.shape, generator=g, dtype=x.dtype)
    g_c = torch.randn(h0.shape, generator=g, dtype=x.dtype)
    params = list(model.parameters())
    leaves = [x, h0, c0]
    if packed:
        inp = pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=enforce_sorted)
        out, (h_n, c_n) = model(inp, (h0, c0))
        assert torch.equal(out.batch_sizes, inp.batch_sizes)
        if not enforce_sorted:
            assert torch.equal(out.sorted_indices, inp.sorted_indices)
            assert torch.equal(out.unsorted_indices, inp.unsorted_indices)
        out, out_lengths = pad_packed_sequence(out, total_length=x.shape[0])
        assert out_lengths.tolist() == list(lengths)
    else:
        out, (h_n, c_n) = model(x, (h0, c0))
    loss = (out * g_out).sum() + (h_n * g_h).sum() + (c_n * g_c).sum()
    got = [out, h_n, c_n, *_grads(loss, leaves + params)]
    r_out, r_h, r_c = reference_lltm(model, x, lengths, h0, c0)
    r_loss = (r_out * g_out).sum() + (r_h * g_h).sum() + (r_c * g_c).sum()
    want = [r_out, r_h, r_c, *_grads(r_loss, leaves + params)]
    names = ["output", "h_n", "c_n", "d_input", "d_h0", "d_c0",
             *(n for n, _ in model.named_parameters())]
    for name, a, b in zip(names, got, want):
        if b is None:
            b = torch.zeros_like(a)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def _model(layers, bidirectional, bias=True, seed=0):
    torch.manual_seed(seed)
    return lt.LLTM(F, S, num_layers=layers, bias=bias, bidirectional=bidirectional,
                   dtype=torch.float64)


def _inputs(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    count = model.num_layers * model.num_directions
    x = torch.randn(T, B, F, generator=g, dtype=torch.float64).requires_grad_()
    h0 = torch.randn(count, B, S, generator=g, dtype=torch.float64).requires_grad_()
    c0 = torch.randn(count, B, S, generator=g, dtype=torch.float64).requires_grad_()
    return x, h0, c0


def _training_with_dropout(layers, bidirectional, p):
    """A model of :func:`_model` in training mode with dropout ``p`` between its layers, and
    its inputs x, h0, c0 of :func:`_inputs`, detached."""
    model = _model(layers, bidirectional)
    model.dropout = p
    model.train()
    return (model, *(t.detach() for t in _inputs(model)))


#: "unsorted": sorted_indices (2, 0, 3, 1) or (2, 0, 1, 3), neither its own inverse, so that
#: permuting h_0 by unsorted_indices instead of sorted_indices gives other numbers
LENGTHS = {"sorted with T and 1": [5, 3, 3, 1], "unsorted with ties": [3, 1, 5, 1]}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bidir"])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_padded_input_equals_the_reference(request, path, layers, bidirectional):
    _path(request, path)
    model = _model(layers, bidirectional)
    x, h0, c0 = _inputs(model)
    _compare(model, x, [T] * B, h0, c0, packed=False)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bidir"])
@pytest.mark.parametrize("layers", [1, 2])
def test_packed_input_equals_each_sequence_alone(request, path, layers, bidirectional, lengths):
    _path(request, path)
    model = _model(layers, bidirectional, seed=layers)
    x, h0, c0 = _inputs(model, seed=sum(lengths))
    sorted_ = list(lengths) == sorted(lengths, reverse=True)
    _compare(model, x, lengths, h0, c0, packed=True, enforce_sorted=sorted_)


@pytest.mark.parametrize("path", PATHS)
def test_zero_length_sequences_through_lltm_sequence(request, path):
    """Length 0 through the functional layer (a PackedSequence cannot hold one): outputs zero,
    the state passes through, its gradients too."""
    _path(request, path)
    model = _model(1, True)
    x, h0, c0 = _inputs(model)
    lengths = [2, 5, 0, 2]
    outs, hs, cs = [], [], []
    for d in range(2):
        out, h, c = lt.lltm_sequence(x, *model._layer_parameters(0, d), h0[d], c0[d],
                                     lengths=torch.tensor(lengths), reverse=d == 1)
        outs.append(out), hs.append(h), cs.append(c)
    out, h_n, c_n = torch.cat(outs, 2), torch.stack(hs), torch.stack(cs)
    r_out, r_h, r_c = reference_lltm(model, x, lengths, h0, c0)
    for a, b in ((out, r_out), (h_n, r_h), (c_n, r_c)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    loss = out.sum() + h_n.pow(2).sum() + c_n.sum()
    r_loss = r_out.sum() + r_h.pow(2).sum() + r_c.sum()
    leaves = [x, h0, c0, *model.parameters()]
    for a, b in zip(_grads(loss, leaves), _grads(r_loss, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_batch_first_unbatched_and_bias_false(request, path):
    _path(request, path)
    model = _model(2, True, bias=False)
    assert model.bias_l0 is None and model.bias_l1_reverse is None
    x, h0, c0 = _inputs(model)
    model.batch_first = True
    out, (h_n, c_n) = model(x.transpose(0, 1), (h0, c0))
    model.batch_first = False
    ref_out, (ref_h, ref_c) = model(x, (h0, c0))
    torch.testing.assert_close(out, ref_out.transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(h_n, ref_h, rtol=0, atol=0)
    # unbatched (T, F) with (L * D, S) states: the batch of one, squeezed
    u_out, (u_h, u_c) = model(x[:, 1], (h0[:, 1], c0[:, 1]))
    assert u_out.shape == (T, 2 * S) and u_h.shape == (4, S)
    torch.testing.assert_close(u_out, ref_out[:, 1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(u_c, ref_c[:, 1], rtol=1e-12, atol=1e-12)
    _compare(model, x, [T] * B, h0, c0, packed=False)


def test_shapes_and_names_as_nn_lstm():
    for kw in ({}, {"num_layers": 2}, {"bidirectional": True}, {"num_layers": 3, "bidirectional": True},
               {"batch_first": True}):
        ours = lt.LLTM(F, S, **kw)
        theirs = torch.nn.LSTM(F, S, **kw)
        x = torch.randn(B, T, F) if kw.get("batch_first") else torch.randn(T, B, F)
        (o1, (h1, c1)), (o2, (h2, c2)) = ours(x), theirs(x)
        assert o1.shape == o2.shape and h1.shape == h2.shape and c1.shape == c2.shape, kw
        (o1, (h1, _)), (o2, (h2, _)) = ours(x[0] if kw.get("batch_first") else x[:, 0]), \
            theirs(x[0] if kw.get("batch_first") else x[:, 0])
        assert o1.shape == o2.shape and h1.shape == h2.shape, kw
    model = lt.LLTM(input_size=F, hidden_size=S, num_layers=2, bidirectional=True, dropout=0.1)
    assert (model.input_size, model.hidden_size, model.num_layers, model.bidirectional,
            model.batch_first, model.dropout) == (F, S, 2, True, False, 0.1)
    assert (model.input_features, model.state_size) == (F, S)
    names = [n for n, _ in model.named_parameters()]
    assert names == ["weights_l0", "bias_l0", "weights_l0_reverse", "bias_l0_reverse",
                     "weights_l1", "bias_l1", "weights_l1_reverse", "bias_l1_reverse"]
    assert model.weights_l1.shape == (3 * S, S + 2 * S) and model.bias_l1.shape == (1, 3 * S)
    x = torch.randn(T, B, F)
    out, _ = model(x, hx=None)
    assert out.shape == (T, B, 2 * S)


@pytest.mark.parametrize("source", ["tutorial", "cell", "old-lltm"])
def test_old_state_dicts_load_into_a_one_layer_lltm(source):
    torch.manual_seed(3)
    cell = (lt.ReferenceLLTMCell if source == "tutorial" else lt.LLTMCell)(F, S)
    state = cell.state_dict()          # keys weights, bias: the tutorial's and the old LLTM's
    assert set(state) == {"weights", "bias"}
    model = lt.LLTM(F, S)
    model.load_state_dict(state)
    assert torch.equal(model.weights_l0, cell.weights) and torch.equal(model.bias, cell.bias)
    x = torch.randn(T, B, F)
    out, (h_n, _) = model(x)
    state_, outs = None, []
    for t in range(T):
        state_ = cell(x[t], state_)
        outs.append(state_[0])
    torch.testing.assert_close(out, torch.stack(outs), rtol=1e-5, atol=1e-6)
    back = lt.LLTMCell(F, S)
    back.load_state_dict(model.state_dict())   # and a one-layer LLTM's into a cell
    assert torch.equal(back.weights, cell.weights)


# ------------------------------------------------------------------------------- dropout

def test_dropout_eval_equals_no_dropout_and_training_is_reproducible():
    torch.manual_seed(0)
    model = lt.LLTM(F, S, num_layers=3, dropout=0.5, dtype=torch.float64)
    plain = lt.LLTM(F, S, num_layers=3, dtype=torch.float64)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(T, B, F, dtype=torch.float64)
    model.eval()
    torch.testing.assert_close(model(x)[0], plain(x)[0], rtol=0, atol=0)
    model.train()
    torch.manual_seed(5)
    a = model(x)[0]
    torch.manual_seed(5)
    b = model(x)[0]
    c = model(x)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.allclose(a, plain(x)[0])


def test_compiled_dropout_draws_inductors_masks_unless_fallback_random():
    """As docs/api.md says: under torch.compile (inductor) a seed repeats a compiled run, but
    its dropout masks are not the eager run's; inductor's fallback_random=True draws the eager
    masks."""
    import torch._inductor.config as inductor
    from helpers.torch_models import _fresh_compile

    torch.manual_seed(0)
    model = lt.LLTM(F, S, num_layers=2, dropout=0.5)
    x = torch.randn(T, B, F)

    def run(fn):
        torch.manual_seed(7)
        return fn(x)[0]

    eager = run(model)
    with _fresh_compile():
        compiled = torch.compile(model)
        first = run(compiled)
        assert torch.equal(first, run(compiled)) and not torch.equal(first, eager)
    with _fresh_compile(), inductor.patch(fallback_random=True):
        assert torch.equal(run(torch.compile(model)), eager)


def test_dropout_mean_over_masks_is_close_to_eval():
    """Dropout scales kept values by 1 / (1 - p): the mean of the first layer's output fed to
    the second is the eval value; the model's output mean over many masks is near eval's."""
    torch.manual_seed(1)
    model = lt.LLTM(F, S, num_layers=2, dropout=0.3, dtype=torch.float64)
    x = torch.randn(T, B, F, dtype=torch.float64) * 0.3
    model.eval()
    want = model(x)[0]
    model.train()
    runs = torch.stack([model(x)[0] for _ in range(2000)])
    err = (runs.mean(0) - want).abs().max().item()
    spread = runs.std(0).max().item() / 2000 ** 0.5
    assert err < 6 * spread + 0.02, (err, spread)   # the cell is near linear at these inputs


def test_dropout_backward_reaches_every_layer():
    torch.manual_seed(2)
    model = lt.LLTM(F, S, num_layers=2, dropout=0.5, bidirectional=True, dtype=torch.float64)
    x = torch.randn(T, B, F, dtype=torch.float64, requires_grad=True)
    model(x)[0].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert x.grad.abs().sum() > 0


@pytest.mark.parametrize("path", PATHS)
def test_dropout_goes_between_layers_only(request, path):
    """Training output, h_n and c_n equal the layers run by hand with F.dropout between them
    (and none after the last) under the same seed: pins where dropout goes and which RNG
    draws it makes, not only its mean."""
    _path(request, path)
    model, x, h0, c0 = _training_with_dropout(3, True, 0.4)
    torch.manual_seed(7)
    out, (h_n, c_n) = model(x, (h0, c0))
    torch.manual_seed(7)
    layer_in, hs, cs = x, [], []
    for k in range(model.num_layers):
        if k:
            layer_in = torch.nn.functional.dropout(layer_in, 0.4, training=True)
        outs = []
        for d in range(2):
            o, h, c = lt.lltm_sequence(layer_in, *model._layer_parameters(k, d), h0[2 * k + d],
                                       c0[2 * k + d], reverse=d == 1)
            outs.append(o)
            hs.append(h)
            cs.append(c)
        layer_in = torch.cat(outs, dim=-1)
    for name, a, b in (("output", out, layer_in), ("h_n", h_n, torch.stack(hs)),
                       ("c_n", c_n, torch.stack(cs))):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_no_dropout_on_the_last_layers_output(request, path, packed):
    """At p close to 1 nearly every element of a dropped-out tensor is 0; the last layer's
    output must have none (an LLTM's h is never exactly 0 here), and the last step of the
    output must equal the last layer's h_n, as in eval mode; while dropout between the layers
    is active (the same model in eval mode gives another output)."""
    _path(request, path)
    model, x, h0, c0 = _training_with_dropout(2, False, 0.99)

    def run():
        torch.manual_seed(3)
        if packed:
            packed_out, (h_n, _) = model(pack_padded_sequence(x, torch.tensor([T] * B)),
                                         (h0, c0))
            return pad_packed_sequence(packed_out)[0], h_n
        out, (h_n, _) = model(x, (h0, c0))
        return out, h_n

    out, h_n = run()
    assert int((out == 0).sum()) == 0, f"{int((out == 0).sum())} zeros of {out.numel()}"
    torch.testing.assert_close(out[-1], h_n[-1], rtol=0, atol=0)
    model.eval()
    assert not torch.equal(out, run()[0]), "the training-mode output is the eval one: no dropout"


# ------------------------------------------------------------------------- gradcheck, compile

def test_gradcheck_on_a_packed_bidirectional_two_layer_lltm():
    torch.manual_seed(4)
    model = lt.LLTM(2, 3, num_layers=2, bidirectional=True, dtype=torch.float64)
    x = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(4, 3, 3, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(4, 3, 3, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([2, 4, 1])

    def fn(x, h0, c0, *params):
        out, (h, c) = torch.func.functional_call(
            model, dict(zip([n for n, _ in model.named_parameters()], params)),
            (pack_padded_sequence(x, lengths, enforce_sorted=False), (h0, c0)))
        return pad_packed_sequence(out)[0], h, c

    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    assert torch.autograd.gradcheck(fn, (x, h0, c0, *params), eps=1e-6, atol=1e-6)


def test_compiled_padded_lltm_matches_eager():
    torch.manual_seed(6)
    model = lt.LLTM(F, S, num_layers=2, bidirectional=True, dtype=torch.float64)
    x = torch.randn(T, B, F, dtype=torch.float64)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    results = []
    for run in (model, compiled):
        model.zero_grad()
        out, (h, c) = run(x)
        (out.sum() + h.sum() + c.pow(2).sum()).backward()
        results.append([out.detach(), h.detach(), c.detach()]
                       + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_packed_input_under_compile_runs_eagerly():
    """torch.compile of a model fed a PackedSequence: the packed part runs eagerly (graph
    breaks), with the eager results."""
    torch.manual_seed(7)
    model = lt.LLTM(F, S, num_layers=2, bidirectional=True, dtype=torch.float64)
    packed = pack_padded_sequence(torch.randn(T, B, F, dtype=torch.float64),
                                  torch.tensor([2, 5, 1, 3]), enforce_sorted=False)
    eager_out, (eager_h, _) = model(packed)
    out, (h, _) = torch.compile(model, backend="aot_eager")(packed)
    torch.testing.assert_close(out.data, eager_out.data, rtol=0, atol=0)
    torch.testing.assert_close(h, eager_h, rtol=0, atol=0)


# ----------------------------------------------------------------------------------- GPU

from helpers.torch_cuda import needs_cuda  # noqa: E402


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gpu_layers_equal_the_cpu_layers(dtype, packed):
    """2-layer bidirectional LLTM on CUDA (CuPy kernels, cuBLAS, the packed layout on the
    device) against the same on the CPU, forward and every gradient."""
    torch.manual_seed(8)
    cpu = lt.LLTM(F, S, num_layers=2, bidirectional=True, dtype=dtype)
    gpu = lt.LLTM(F, S, num_layers=2, bidirectional=True, dtype=dtype, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(T, B, F, dtype=dtype)
    lengths = torch.tensor([2, 5, 1, 3])
    results = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        xd = x.to(device).clone().requires_grad_()     # a leaf on each device (for the CPU,
        # x.to("cpu") is x itself, which would make the CUDA copy a non-leaf without .grad)
        inp = pack_padded_sequence(xd, lengths, enforce_sorted=False) if packed else xd
        out, (h, c) = model(inp)
        data = out.data if packed else out
        (data.sum() + h.pow(2).sum() + c.sum()).backward()
        results.append([data, h, c, xd.grad, *(p.grad for p in model.parameters())])
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    assert all(t is not None for r in results for t in r), "a gradient is missing"
    for a, b in zip(*results):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), **tol)


@needs_cuda
@pytest.mark.gpu
def test_gpu_dropout_reproducible_under_a_seed():
    model = lt.LLTM(F, S, num_layers=3, dropout=0.5, device="cuda")
    x = torch.randn(T, B, F, device="cuda")
    torch.manual_seed(3)
    a = model(x)[0]
    torch.manual_seed(3)
    b = model(x)[0]
    assert torch.equal(a, b) and not torch.equal(a, model(x)[0])


def test_torch_func_vmap_is_refused_clearly():
    """torch.func.vmap over the cell: refused with the library's error rather than computed
    wrong (torch.func.grad and the rest: tests/torch_layer/test_saved_tensors.py)."""
    x, w, b = torch.randn(2, 3), torch.randn(12, 7), torch.randn(12)
    h, c = torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="lltm_cupy.torch: torch.func.vmap over the LLTM"):
        torch.func.vmap(lambda x: lt.lltm(x[None], w, b, h[:1], c[:1])[0])(x)
