"""What the torch layer keeps for its backward goes through autograd's saved-tensor mechanism
(lltm_cupy/torch/_functions.py), on the CPU and the emulated CUDA path:

- torch.utils.checkpoint (both modes) frees it, as it frees nn.LSTM's, and the gradients are
  the uncheckpointed run's;
- saved_tensors_hooks (and save_on_cpu, built on them) see every array the backend keeps, and
  the backward computes from what the hooks give back;
- torch.func.grad, vjp, jacrev and functional_call compose with the layer; vmap and
  forward-mode AD are refused with the library's errors (second derivatives:
  tests/torch_layer/test_second_derivatives.py);
- in-place changes of outputs follow docs/api.md's table: allowed where the backward does not
  read the output, refused (never wrong gradients) where it does.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy.torch as lt  # noqa: E402
from lltm_cupy.torch.reference import lltm_reference  # noqa: E402
from torch.nn.utils.rnn import pack_padded_sequence  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402
from conftest import max_error  # noqa: E402
from helpers.memory import held_bytes  # noqa: E402
from helpers.torch_models import PATHS, _path  # noqa: E402

T, B, F, H = 6, 3, 4, 5


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def _assert_same(got, want, name, tol=1e-12):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None and w is not None, f"{name} {i}: a gradient is missing"
        err = max_error(g, w)
        assert err <= tol, f"{name} {i}: {err:.2e}"


# ----------------------------------------------------------------------------- checkpoint

MEM_T, MEM_B, MEM_F, MEM_H = 30, 32, 32, 64


def _stepped(cell):
    def run(xs):
        h = c = xs.new_zeros(xs.shape[1], MEM_H)
        for x in xs:
            h, c = cell(x, (h, c))
        return h + c
    return run


MEMORY_MODELS = {
    "LLTM 2 layers": (lambda: lt.LLTM(MEM_F, MEM_H, num_layers=2, dtype=torch.float64),
                      lambda: torch.nn.LSTM(MEM_F, MEM_H, num_layers=2, dtype=torch.float64),
                      lambda m: lambda xs: m(xs)[0]),
    "LLTMCell stepped": (lambda: lt.LLTMCell(MEM_F, MEM_H, dtype=torch.float64),
                         lambda: torch.nn.LSTMCell(MEM_F, MEM_H, dtype=torch.float64),
                         _stepped),
}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", MEMORY_MODELS)
@pytest.mark.slow
def test_checkpoint_frees_what_the_layer_keeps(kind, reentrant):
    """The memory held after the forward under torch.utils.checkpoint is about nn.LSTM's under
    the same checkpoint (little beyond the output), far below the unchecked forward's; the
    gradients are those of the unchecked run (NumPy backend: every array it makes is NumPy's,
    which tracemalloc sees; torch's allocations through torch's profiler)."""
    make_ours, make_torch, wrap = MEMORY_MODELS[kind]
    torch.manual_seed(0)
    xs = torch.randn(MEM_T, MEM_B, MEM_F, dtype=torch.float64)
    held, grads = {}, {}
    for name, model in (("ours", make_ours()), ("torch", make_torch())):
        fn = wrap(model)
        for mode in ("plain", "checkpoint")[name == "torch":]:     # (torch's profiler is slow)
            x = xs.clone().requires_grad_()
            run = (lambda: fn(x)) if mode == "plain" else (
                lambda: checkpoint(fn, x, use_reentrant=reentrant))
            run()                           # first-call work (imports, caches) done
            model.zero_grad()
            held[name, mode], out = held_bytes(run)
            out.pow(2).sum().backward()     # (reentrant checkpoint refuses autograd.grad)
            grads[name, mode] = [t.grad.clone() for t in (x, *model.parameters())]
            del out
    figures = {k: f"{v / 1e3:.0f} kB" for k, v in held.items()}
    print(kind, "reentrant" if reentrant else "non-reentrant", figures)
    assert held["ours", "checkpoint"] <= 1.1 * held["torch", "checkpoint"] + 16e3, figures
    assert held["ours", "plain"] >= 5 * held["ours", "checkpoint"], figures
    _assert_same(grads["ours", "checkpoint"], grads["ours", "plain"], "checkpointed gradient")


# ------------------------------------------------------------------------ saved tensor hooks

def _bidirectional_case():
    torch.manual_seed(1)
    model = lt.LLTM(F, H, num_layers=2, bidirectional=True, dtype=torch.float64)
    x = torch.randn(T, B, F, dtype=torch.float64)
    return model, x


def _loss_and_leaves(model, x, packed):
    x = x.clone().requires_grad_()
    inp = pack_padded_sequence(x, torch.tensor([6, 2, 4]), enforce_sorted=False) if packed else x
    out, (h, c) = model(inp)
    out = out.data if packed else out
    return out.pow(2).sum() + h.sum() + c.pow(2).sum(), [x, *model.parameters()]


def _gates_shape(path, packed):
    """The shape of one layer and direction's gate values as the backend keeps them (CPU: the
    four backward factors, flat for packed rows; GPU: the pre-activations), for
    _bidirectional_case with lengths [6, 2, 4] (12 rows) or without."""
    if packed:
        return (12, 3 * H) if path == "cuda-emulated" else (12 * 4 * H,)
    return (T, B, 3 * H) if path == "cuda-emulated" else (T, 4, B, H)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("path", PATHS)
def test_saved_tensor_hooks_see_the_backends_arrays(request, path, packed):
    """A counting hook sees, per layer and direction, the backend's gate values (CPU: the four
    backward factors (T, 4, B, H) per step; GPU: the pre-activations (T, B, 3H)), and the
    backward computes from what the hooks hand back: NaN given back gives NaN gradients."""
    _path(request, path)
    model, x = _bidirectional_case()
    seen = []

    def pack(t):
        seen.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, leaves = _loss_and_leaves(model, x, packed)
    want = _grads(*_loss_and_leaves(model, x, packed))
    _assert_same(_grads(loss, leaves), want, "gradient through the hooks")
    gates = _gates_shape(path, packed)
    assert seen.count(gates) == 4, (gates, seen)

    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: torch.full_like(t, float("nan")) if t.is_floating_point() else t):
        loss, leaves = _loss_and_leaves(model, x, packed)
    got = _grads(loss, leaves)
    assert all(torch.isnan(g).any() for g in got[1:]), "the backward ignored the hooks"


@pytest.mark.parametrize("path", PATHS)
def test_save_on_cpu_packs_the_saved_state(request, path):
    """torch.autograd.graph.save_on_cpu moves every saved tensor (here from the emulated device,
    whose tensors are CPU ones), the layer's state included; the gradients are unchanged."""
    _path(request, path)
    model, x = _bidirectional_case()
    offload = torch.autograd.graph.save_on_cpu(pin_memory=False)
    seen = []
    pack = offload.pack_hook
    offload.pack_hook = lambda t: (seen.append(tuple(t.shape)), pack(t))[1]
    with offload:
        loss, leaves = _loss_and_leaves(model, x, False)
    _assert_same(_grads(loss, leaves), _grads(*_loss_and_leaves(model, x, False)),
                 "gradient under save_on_cpu")
    assert seen.count(_gates_shape(path, False)) == 4, seen


# --------------------------------------------------------------------------------- torch.func

def test_torch_func_grad_equals_autograd():
    """torch.func.grad of a loss through a 2-layer bidirectional LLTM (functional_call over its
    parameters, padded and packed input) equals autograd's gradients; the same for the cell.
    (Packed: in the parameters only; torch's pack_padded_sequence has no torch.func support
    for the gradient of its input, with nn.LSTM too.)"""
    model, x = _bidirectional_case()
    params = dict(model.named_parameters())
    for packed in (False, True):
        def loss_fn(p, x, packed=packed):
            inp = (pack_padded_sequence(x, torch.tensor([6, 2, 4]), enforce_sorted=False)
                   if packed else x)
            out, (h, c) = torch.func.functional_call(model, p, (inp,))
            out = out.data if packed else out
            return out.pow(2).sum() + h.sum() + c.pow(2).sum()

        got_p, got_x = torch.func.grad(loss_fn, argnums=(0, 1))(params, x) if not packed else (
            torch.func.grad(loss_fn)(params, x), None)
        loss, leaves = _loss_and_leaves(model, x, packed)
        want = _grads(loss, leaves)
        got = [*(got_p[k] for k in params)] if packed else [got_x, *(got_p[k] for k in params)]
        _assert_same(got, want[1:] if packed else want, f"torch.func.grad {packed=}")
    cell = lt.LLTMCell(F, H, dtype=torch.float64)
    xs = torch.randn(B, F, dtype=torch.float64)
    got = torch.func.grad(lambda p: torch.func.functional_call(cell, p, (xs,))[1].sum())(
        dict(cell.named_parameters()))
    want = _grads(cell(xs)[1].sum(), list(cell.parameters()))
    _assert_same([got[k] for k, _ in cell.named_parameters()], want, "cell")


@pytest.mark.parametrize("path", PATHS)
def test_jacrev_and_vjp_equal_the_reference(request, path):
    """jacrev (a vmap over the backward) and vjp of one step equal those of the pure-torch
    reference, in every argument."""
    _path(request, path)
    g = torch.Generator().manual_seed(2)
    args = (torch.randn(B, F, generator=g, dtype=torch.float64),
            torch.randn(3 * H, H + F, generator=g, dtype=torch.float64) / 3,
            torch.randn(3 * H, generator=g, dtype=torch.float64),
            torch.randn(B, H, generator=g, dtype=torch.float64),
            torch.randn(B, H, generator=g, dtype=torch.float64))
    argnums = tuple(range(5))
    got = torch.func.jacrev(lambda *a: lt.lltm(*a), argnums=argnums)(*args)
    want = torch.func.jacrev(lambda *a: lltm_reference(*a), argnums=argnums)(*args)
    for i in range(2):
        _assert_same(got[i], want[i], f"jacobian of output {i}", 1e-10)
    cot = (torch.randn(B, H, generator=g, dtype=torch.float64),) * 2
    _assert_same(torch.func.vjp(lt.lltm, *args)[1](cot),
                 torch.func.vjp(lltm_reference, *args)[1](cot), "vjp", 1e-10)


def test_forward_mode_and_vmap_are_refused():
    model, x = _bidirectional_case()
    params = dict(model.named_parameters())
    tangent = {k: torch.ones_like(v) for k, v in params.items()}
    with pytest.raises(RuntimeError, match="lltm_cupy.torch: forward-mode AD .* LLTM"):
        torch.func.jvp(lambda p: torch.func.functional_call(model, p, (x,))[0], (params,),
                       (tangent,))
    with pytest.raises(RuntimeError, match="lltm_cupy.torch: torch.func.vmap over the LLTM"):
        torch.func.vmap(lambda x: model(x)[0])(x[None].expand(2, -1, -1, -1))


# ------------------------------------------------------------------------------- in-place

def _cell_case():
    torch.manual_seed(3)
    cell = lt.LLTMCell(F, H, dtype=torch.float64)
    return cell, torch.randn(B, F, dtype=torch.float64)


@pytest.mark.parametrize("path", PATHS)
def test_cell_outputs_changed_in_place(request, path):
    """h.relu_() after LLTMCell is allowed everywhere (no backward reads new_h); c.clamp_()
    on the CPU, whose backward never reads new_cell, as nn.LSTMCell allows it, with the
    gradients of the out-of-place clamp; on CUDA, whose backward reads new_cell, refused with
    the library's advice."""
    _path(request, path)
    cell, x = _cell_case()
    h, c = cell(x)
    want = _grads(h.relu().sum() + c.clamp(-0.5, 0.5).pow(2).sum(), list(cell.parameters()))
    h, c = cell(x)
    h.relu_()
    got = _grads(h.sum() + c.clamp(-0.5, 0.5).pow(2).sum(), list(cell.parameters()))
    _assert_same(got, want, "h.relu_()")
    h, c = cell(x)
    c.clamp_(-0.5, 0.5)
    loss = h.relu().sum() + c.pow(2).sum()
    if path == "cpu":
        _assert_same(_grads(loss, list(cell.parameters())), want, "c.clamp_()")
    else:
        with pytest.raises(RuntimeError, match="(?s)modified by an inplace.*out = out.clone"):
            loss.backward()


@pytest.mark.parametrize("path", PATHS)
def test_sequence_outputs_changed_in_place(request, path):
    """A one-layer LLTM's output is the memory its backward reads: output.relu_() is refused
    at once (padded) or at the backward (a PackedSequence's data), never a wrong gradient;
    h_n.clamp_() and c_n.clamp_() are allowed, and so is output.relu_() where the output is a
    new tensor (bidirectional: the directions concatenated)."""
    _path(request, path)
    torch.manual_seed(4)
    x = torch.randn(T, B, F, dtype=torch.float64)
    one = lt.LLTM(F, H, dtype=torch.float64)
    out, _ = one(x)
    # (torch 2.13 names the Function, torch 2.11 its backward node)
    with pytest.raises(RuntimeError,
                       match=r"LLTMSequenceFunction(Backward)? is a view and is being modified"):
        out.relu_()
    packed = pack_padded_sequence(x, torch.tensor([6, 2, 4]), enforce_sorted=False)
    out, _ = one(packed)
    try:
        out.data.relu_()
    except RuntimeError as error:   # refused at once: the data is a view of the kept states
        assert re.search(r"LLTMSequenceFunction(Backward)? is a view and is being modified",
                         str(error)), error
    else:                           # refused at the backward
        with pytest.raises(RuntimeError, match="(?s)modified by an inplace.*out = out.clone"):
            out.data.sum().backward()
    for model in (one, lt.LLTM(F, H, bidirectional=True, dtype=torch.float64)):
        params = list(model.parameters())
        out, (h, c) = model(x)
        want = _grads(out.relu().sum() + h.clamp(-0.2, 0.2).sum() + c.clamp(-0.2, 0.2).sum(),
                      params)
        out, (h, c) = model(x)
        h.clamp_(-0.2, 0.2)
        c.clamp_(-0.2, 0.2)
        if model.bidirectional:
            out.relu_()
        else:
            out = out.relu()
        _assert_same(_grads(out.sum() + h.sum() + c.sum(), params), want, "in place")


def test_unread_fields_are_not_kept():
    """The CPU backward reads neither a step's new_cell nor a sequence's cells (only their
    shapes): neither is saved through autograd."""
    cell, x = _cell_case()
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        h, c = cell(x)
    assert seen and not any(t.data_ptr() == c.data_ptr() for t in seen)
    assert np.isfinite(_grads(h.sum() + c.sum(), list(cell.parameters()))[0].numpy()).all()
    model = lt.LLTM(F, H, dtype=torch.float64)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.shape) or t,
                                                  lambda t: t):
        model(torch.randn(T, B, F, dtype=torch.float64))
    assert (T, B, H) not in sizes, sizes        # cells: (T, B, H); hs: (T + 1, B, H)


def _changed_in_place(make, sequence: bool, which: str, dtype) -> bool:
    """Whether the backward raises after ``which`` argument (input, weights, bias, h0, c0) of
    a module ``make(dtype)`` made was changed in place between its forward and its backward."""
    torch.manual_seed(4)
    module = make(dtype)
    x = torch.randn(*((T,) if sequence else ()), B, F, dtype=dtype, requires_grad=True)
    state = [torch.randn(*((1,) if sequence else ()), B, H, dtype=dtype, requires_grad=True)
             for _ in range(2)]
    weights, bias = ([p for n, p in module.named_parameters() if n.startswith(k)][0]
                     for k in ("weight", "bias"))
    if sequence:
        out, (h, c) = module(x, tuple(state))
        loss = out.sum() + h.sum() + c.sum()
    else:
        h, c = module(x, tuple(state))
        loss = h.sum() + c.sum()
    with torch.no_grad():
        dict(input=x, weights=weights, bias=bias, h0=state[0], c0=state[1])[which].add_(0.5)
    try:
        loss.backward()
    except RuntimeError as exc:
        assert "inplace" in str(exc), exc     # (a saved tensor, or a view of one)
        return True
    return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_arguments_changed_in_place_beside_nn_lstm_and_nn_lstmcell(dtype):
    """An argument changed in place between forward and backward: ours raises for every one
    (it saves them all); nn.LSTMCell and nn.LSTM raise for their input, weights and state, and
    for their bias only where their backward reads it: nn.LSTMCell never, nn.LSTM on oneDNN's
    float32 path (the CHANGELOG and docs/api.md say so)."""
    arguments = ("input", "weights", "bias", "h0", "c0")
    made = {"LLTMCell": (lambda d: lt.LLTMCell(F, H, dtype=d), False),
            "LLTM": (lambda d: lt.LLTM(F, H, dtype=d), True),
            "nn.LSTMCell": (lambda d: torch.nn.LSTMCell(F, H, dtype=d), False),
            "nn.LSTM": (lambda d: torch.nn.LSTM(F, H, dtype=d), True)}
    raised = {name: {a for a in arguments if _changed_in_place(*made[name], a, dtype)}
              for name in made}
    every = set(arguments)
    onednn = dtype == torch.float32 and torch.backends.mkldnn.is_available()
    assert raised == {"LLTMCell": every, "LLTM": every, "nn.LSTMCell": every - {"bias"},
                      "nn.LSTM": every if onednn else every - {"bias"}}, raised


def test_nn_lstm_beside_it_in_place():
    """What docs/api.md's table says nn.LSTMCell / nn.LSTM allow, run beside the LLTM cases above:
    c.clamp_() after nn.LSTMCell backpropagates as the out-of-place clamp does, h_n / c_n of
    nn.LSTM may be changed in place, and changing nn.LSTM's weights in place before the backward
    raises."""
    torch.manual_seed(3)
    cell = torch.nn.LSTMCell(F, H, dtype=torch.float64)
    x = torch.randn(B, F, dtype=torch.float64)
    h, c = cell(x)
    want = _grads(h.relu().sum() + c.clamp(-0.5, 0.5).pow(2).sum(), list(cell.parameters()))
    h, c = cell(x)
    c.clamp_(-0.5, 0.5)
    _assert_same(_grads(h.relu().sum() + c.pow(2).sum(), list(cell.parameters())), want,
                 "nn.LSTMCell c.clamp_()")
    lstm = torch.nn.LSTM(F, H, dtype=torch.float64)
    xs = torch.randn(T, B, F, dtype=torch.float64)
    out, (h_n, c_n) = lstm(xs)
    h_n.clamp_(-0.5, 0.5)
    c_n.clamp_(-0.5, 0.5)
    (out.sum() + h_n.sum() + c_n.sum()).backward()
    out, _ = lstm(xs)
    with torch.no_grad():
        lstm.weight_hh_l0.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
