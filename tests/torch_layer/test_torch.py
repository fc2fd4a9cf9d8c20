"""lltm_cupy.torch against the pure-torch reference LLTM (autograd through torch ops)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy  # noqa: E402
import lltm_cupy._numpy  # noqa: E402
import lltm_cupy.torch as lt  # noqa: E402
from conftest import TOLERANCE, make_case, max_error  # noqa: E402
from helpers.torch_cuda import CUDA_REASON, DEVICES, needs_cuda  # noqa: E402,F401

NAMES = ("input", "weights", "bias", "old_h", "old_cell")
TORCH_TO_NP = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def tensors(case, device, requires_grad=True):
    return [torch.tensor(case[n], device=device).requires_grad_(requires_grad) for n in NAMES]


def run_both(case, device, dtype):
    """Forward + backward through ours and through the reference (in float64) on the same values."""
    results = []
    for fn, dt in ((lt.lltm, dtype), (lt.lltm_reference, torch.float64)):
        args = [t.detach().to(dt).requires_grad_() for t in tensors(case, device)]
        h, c = fn(*args)
        gh = torch.tensor(case["grad_h"], device=device, dtype=dt)
        gc = torch.tensor(case["grad_cell"], device=device, dtype=dt)
        torch.autograd.backward((h, c), (gh, gc))
        results.append((h, c, [a.grad for a in args]))
    return results


def assert_close(actual, expected, dtype, name):
    assert actual.shape == expected.shape, f"{name}: {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == dtype, f"{name}: dtype {actual.dtype} != {dtype}"
    err = max_error(actual.detach().cpu().double().numpy(), expected.detach().cpu().double().numpy())
    tol = TOLERANCE[np.dtype(TORCH_TO_NP[dtype])]
    assert err <= tol, f"{name}: max normalised error {err:.3e} > {tol:.0e}"


def dtypes(device):
    return (torch.float32, torch.float64) + ((torch.float16,) if device == "cuda" else ())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,features,state", [(0, 3, 4), (1, 1, 1), (3, 17, 5), (16, 17, 129)])
@pytest.mark.parametrize("bias_2d", [False, True], ids=["bias_1d", "bias_2d"])
def test_matches_torch_reference(device, batch, features, state, bias_2d):
    for dtype in dtypes(device):
        case = make_case(batch, features, state, TORCH_TO_NP[dtype], seed=state, bias_2d=bias_2d,
                         zeros_at=(0,))
        (h, c, g), (rh, rc, rg) = run_both(case, device, dtype)
        assert_close(h, rh, dtype, "new_h")
        assert_close(c, rc, dtype, "new_cell")
        for name, a, b in zip(NAMES, g, rg):
            assert_close(a, b, dtype, f"grad of {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_saturated_preactivations(device):
    for dtype in (torch.float32, torch.float64):
        case = make_case(4, 5, 6, TORCH_TO_NP[dtype], seed=3, scale=1e4)
        (h, c, g), (rh, rc, rg) = run_both(case, device, dtype)
        for name, a, b in zip(("new_h", "new_cell", *NAMES), (h, c, *g), (rh, rc, *rg)):
            assert torch.isfinite(a).all(), name
            assert_close(a, b, dtype, name)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_float64(device):
    case = make_case(3, 4, 5, np.float64, seed=41)
    assert torch.autograd.gradcheck(lt.lltm, tensors(case, device), eps=1e-6, atol=1e-7)


def test_zero_copy_in_and_out(monkeypatch):
    """On the CPU the NumPy backend's element-wise step reads the tensors' memory (old_cell;
    the GEMM is torch's on the tensors themselves) and writes the results' (no copy either
    way), and its backward reads the incoming gradients' memory and returns the array
    d_old_cell is. (CUDA: the kernels take the tensors' device pointers,
    tests/torch_layer/test_torch_cuda_path.py.)"""
    seen = {}
    step = lltm_cupy._numpy.step
    real_rows, real_backward = step.gate_rows, step.cell_backward_into

    def ptr(a):
        return a.ctypes.data

    def gate_rows(*args):
        z, real_run = real_rows(*args)

        def run(old_cell, new_h, new_cell, factors=None):
            seen["in"] = ptr(old_cell)
            seen["out"] = [ptr(new_h), ptr(new_cell)]
            return real_run(old_cell, new_h, new_cell, factors)
        return z, run

    def backward(gh, gc, factors, d_gates=None, bias=False, **out):
        seen["grad_in"] = [ptr(gh), ptr(gc)]
        d_gates, d_old_cell, d_bias = real_backward(gh, gc, factors, d_gates, bias, **out)
        seen["d_old_cell"] = ptr(d_old_cell)
        return d_gates, d_old_cell, d_bias

    monkeypatch.setattr(step, "gate_rows", gate_rows)
    monkeypatch.setattr(step, "cell_backward_into", backward)
    args = tensors(make_case(3, 4, 5, np.float32), "cpu")
    h, c = lt.lltm(*args)
    assert seen["in"] == args[4].data_ptr()
    assert seen["out"] == [h.data_ptr(), c.data_ptr()]
    gh, gc = torch.randn_like(h), torch.randn_like(c)
    torch.autograd.backward((h, c), (gh, gc))
    assert seen["grad_in"] == [gh.data_ptr(), gc.data_ptr()]
    # autograd accumulates a leaf's first gradient by stealing the tensor when it can.
    assert args[4].grad.data_ptr() == seen["d_old_cell"]


def test_only_needed_gradients_are_computed(monkeypatch):
    from lltm_cupy.torch import _functions

    calls = []
    real = _functions.cpu_step_backward

    def spy(*args, **kw):
        calls.append(args[5])
        return real(*args, **kw)

    monkeypatch.setattr(_functions, "cpu_step_backward", spy)
    case = make_case(3, 4, 5, np.float64)
    args = tensors(case, "cpu", requires_grad=False)
    args[1].requires_grad_()  # weights only
    h, c = lt.lltm(*args)
    h.sum().backward()
    assert calls == [(False, True, False, False, False)]     # (the arguments' order)
    assert args[1].grad is not None and all(a.grad is None for i, a in enumerate(args) if i != 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["h", "c"])
def test_one_output_and_non_contiguous_gradients(device, which):
    """A gradient for one output only, arriving expanded (stride 0) or transposed."""
    case = make_case(4, 3, 5, np.float64, seed=43)
    ours = tensors(case, device)
    ref = tensors(case, device)
    weight = torch.randn(5, 4, dtype=torch.float64, device=device)
    for fn, args in ((lt.lltm, ours), (lt.lltm_reference, ref)):
        h, c = fn(*args)
        out = h if which == "h" else c
        (out.sum() + (out * weight.t()).sum()).backward()  # expanded ones + a transposed tensor
    for name, a, b in zip(NAMES, ours, ref):
        assert_close(a.grad, b.grad, torch.float64, name)


def test_in_place_change_of_the_weights_is_detected():
    """The backward reads the weights: changing them between forward and backward raises, with
    the library's advice (the outputs' cases: tests/torch_layer/test_saved_tensors.py)."""
    args = tensors(make_case(2, 3, 4, np.float64), "cpu")
    h, c = lt.lltm(*args)
    with torch.no_grad():
        args[1].add_(1.0)
    with pytest.raises(RuntimeError, match="(?s)modified by an inplace operation.*lltm_cupy"):
        h.sum().backward()


@pytest.mark.parametrize("bad,error,pattern", [
    (dict(input=lambda t: t.to(torch.int64)), TypeError, "same dtype"),
    (dict(all=lambda t: t.to(torch.int32)), TypeError, "unsupported dtype torch.int32"),
    (dict(weights=lambda t: t.to(torch.bfloat16)), TypeError, "same dtype"),
    (dict(all=lambda t: t.to(torch.float16)), TypeError, "float16 runs on CUDA only"),
    (dict(weights=lambda t: t.to("meta")), ValueError, "one device.*weights on meta"),
    (dict(old_cell=lambda t: t[:, :3]), ValueError, r"old_cell must have shape \(3, 5\)"),
    (dict(bias=lambda t: t[:7]), ValueError, r"bias must have shape"),
    (dict(input=lambda t: t.tolist()), TypeError, "input must be a torch.Tensor"),
    # (a NumPy array has a .device too, a string: not mistaken for a tensor's)
    (dict(old_h=lambda t: t.numpy()), TypeError, "old_h must be a torch.Tensor, got ndarray"),
    (dict(input=lambda t: t.numpy()), TypeError, "input must be a torch.Tensor, got ndarray"),
])
def test_bad_input(bad, error, pattern, monkeypatch):
    monkeypatch.setattr(lltm_cupy._numpy, "forward", lambda *a, **k: pytest.fail("backend reached"))
    args = dict(zip(NAMES, tensors(make_case(3, 4, 5, np.float32), "cpu", requires_grad=False)))
    for name, fix in bad.items():
        for n in (NAMES if name == "all" else (name,)):
            args[n] = fix(args[n])
    with pytest.raises(error, match=pattern):
        lt.lltm(*args.values())


# --------------------------------------------------------------------------------- modules

def test_cell_parameters_and_state_dict_compatibility():
    torch.manual_seed(0)
    ref = lt.ReferenceLLTMCell(7, 5)
    cell = lt.LLTMCell(7, 5)
    assert dict((n, p.shape) for n, p in cell.named_parameters()) == {
        "weights": (15, 12), "bias": (1, 15)}
    bound = 1 / np.sqrt(5)
    assert all(p.abs().max() <= bound for p in cell.parameters())
    assert all(p.std() > bound / 4 for p in cell.parameters())  # not all zeros/constant
    cell.load_state_dict(ref.state_dict())
    x = torch.randn(4, 7)
    state = (torch.randn(4, 5), torch.randn(4, 5))
    for a, b in zip(cell(x, state), ref(x, state)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # A missing state is zeros, as in nn.LSTMCell.
    zeros = (torch.zeros(4, 5), torch.zeros(4, 5))
    for a, b in zip(cell(x), cell(x, zeros)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert repr(cell) == "LLTMCell(7, 5, bias=True)"   # as nn.LSTMCell prints itself
    assert (cell.input_features, cell.state_size) == (7, 5)   # the tutorial's names


def test_cell_without_bias_and_factory_kwargs():
    cell = lt.LLTMCell(3, 4, bias=False, dtype=torch.float64)
    assert cell.bias is None and cell.weights.dtype == torch.float64
    ref = lt.ReferenceLLTMCell(3, 4, bias=False, dtype=torch.float64)
    ref.load_state_dict(cell.state_dict())
    x = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(cell(x), ref(x))
    with pytest.raises(ValueError, match="hidden_size must be >= 1"):
        lt.LLTMCell(3, 0)


def test_training_parity_with_reference():
    torch.manual_seed(1)
    ref = lt.ReferenceLLTMCell(8, 16)
    cell = lt.LLTMCell(8, 16)
    cell.load_state_dict(ref.state_dict())
    data = [(torch.randn(5, 8), torch.randn(5, 16)) for _ in range(6)]
    losses = {}
    for name, model in (("ours", cell), ("ref", ref)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses[name] = []
        for step in range(36):
            x, target = data[step % len(data)]
            h, c = model(x)
            h, c = model(x, (h, c))  # two steps, so gradients flow through the state
            loss = torch.nn.functional.mse_loss(h, target) + 0.1 * c.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    np.testing.assert_allclose(losses["ours"], losses["ref"], rtol=1e-5)
    # It trained: the last pass over the 6 batches has a lower mean loss than the first.
    assert np.mean(losses["ours"][-6:]) < 0.9 * np.mean(losses["ours"][:6])


# ------------------------------------------------------------------------- torch.compile

def test_custom_ops_pass_opcheck():
    case = make_case(3, 4, 5, np.float64, seed=47)
    args = [t.detach() for t in tensors(case, "cpu")]
    torch.library.opcheck(torch.ops.lltm_cupy.step.default, args)
    torch.library.opcheck(torch.ops.lltm_cupy.step_inference.default, args)
    _, new_cell, first, second = torch.ops.lltm_cupy.step(*args)
    gh, gc = torch.randn_like(new_cell), torch.randn_like(new_cell)
    for bias in (args[2], args[2].reshape(1, -1)):
        torch.library.opcheck(torch.ops.lltm_cupy.step_backward.default,
                              (gh, gc, args[0], args[1], bias, *args[3:], new_cell, first,
                               second))
    torch.library.opcheck(torch.ops.lltm_cupy.step_backward.default,
                          (None, gc, *args, new_cell, first, second))


@needs_cuda
def test_custom_ops_pass_opcheck_cuda():
    case = make_case(3, 4, 5, np.float64, seed=47)
    args = [t.detach() for t in tensors(case, "cuda")]
    torch.library.opcheck(torch.ops.lltm_cupy.step.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_matches_eager(device):
    """fullgraph=True fails on any graph break; the compiled path uses the custom ops."""
    torch.manual_seed(2)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = lt.LLTMCell(6, 8, device=device, dtype=torch.float64)
            self.head = torch.nn.Linear(8, 1, device=device, dtype=torch.float64)

        def forward(self, xs):
            h, c = self.cell(xs[0])
            for x in xs[1:]:
                h, c = self.cell(x, (h, c))
            return self.head(torch.tanh(h)).sum() + c.sum()

    model = Model()
    xs = torch.randn(3, 4, 6, device=device, dtype=torch.float64)
    compiled = torch.compile(model, fullgraph=True)
    results = []
    for m in (model, compiled):
        m.zero_grad()
        loss = m(xs)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ GPU only

@needs_cuda
def test_side_stream_and_no_default_stream():
    """Forward and backward on a side stream while the default stream sleeps: the results are
    read back on the side stream alone (pinned buffers, no device-wide synchronisation), so
    work queued on the default stream, behind the sleep, would be read unfinished."""
    case = make_case(64, 32, 128, np.float32, seed=53)
    expected = run_both(case, "cuda", torch.float32)[0]
    expected = [t.detach().cpu() for t in (expected[0], expected[1], *expected[2])]
    got = [torch.empty_like(e, pin_memory=True) for e in expected]
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)                 # the default stream busy for ~1 s
    with torch.cuda.stream(side):
        args = [t.detach().requires_grad_() for t in tensors(case, "cuda")]
        h, c = lt.lltm(*args)
        torch.autograd.backward((h, c), (torch.tensor(case["grad_h"], device="cuda"),
                                         torch.tensor(case["grad_cell"], device="cuda")))
        for buffer, t in zip(got, (h.detach(), c.detach(), *(a.grad for a in args))):
            buffer.copy_(t, non_blocking=True)
    side.synchronize()
    default_still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert default_still_busy, "the sleep ended before the side stream's work: nothing shown"
    for name, a, b in zip(("new_h", "new_cell", *NAMES), got, expected):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_REASON is not None or torch.cuda.device_count() < 2,
                    reason="GPU test: needs two CUDA devices")
def test_second_device():
    case = make_case(8, 4, 16, np.float32, seed=59)
    expected = run_both(case, "cuda:0", torch.float32)[0]
    got = run_both(case, "cuda:1", torch.float32)[0]
    assert got[0].device == torch.device("cuda:1")
    torch.testing.assert_close(got[0].cpu(), expected[0].cpu())
    for a, b in zip(got[2], expected[2]):
        assert a.device == torch.device("cuda:1")
        torch.testing.assert_close(a.cpu(), b.cpu())
