"""lltm_cupy.torch.LLTM / lltm_sequence against stepping the pure-torch reference cell."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy.torch as lt  # noqa: E402
from helpers.torch_cuda import DEVICES, needs_cuda  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def models(device, dtype, batch_first=False, seed=0):
    torch.manual_seed(seed)
    seq = lt.LLTM(4, 6, batch_first=batch_first, device=device, dtype=dtype)
    ref = lt.ReferenceLLTMCell(4, 6, device=device, dtype=dtype)
    ref.load_state_dict(seq.state_dict())  # the same parameters: a cell's state_dict fits
    return seq, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("steps", [0, 1, 7])
@pytest.mark.parametrize("batch_first", [False, True])
def test_sequence_module_equals_stepped_reference(device, dtype, steps, batch_first):
    seq, ref = models(device, dtype, batch_first, seed=steps)
    x = torch.randn(steps, 3, 4, device=device, dtype=dtype)
    state = tuple(torch.randn(3, 6, device=device, dtype=dtype) for _ in range(2))
    gx = torch.randn(steps, 3, 6, device=device, dtype=dtype)
    gh, gc = torch.randn(3, 6, device=device, dtype=dtype), torch.randn(3, 6, device=device, dtype=dtype)

    xs = (x.transpose(0, 1) if batch_first else x).clone().requires_grad_()
    s1 = tuple(t.clone().requires_grad_() for t in state)
    out, (h_n, c_n) = seq(xs, s1)
    out_tm = out.transpose(0, 1) if batch_first else out
    torch.autograd.backward((out_tm, h_n, c_n), (gx, gh, gc))

    xr = x.clone().requires_grad_()
    s2 = tuple(t.clone().requires_grad_() for t in state)
    h, c = s2
    outs = []
    for t in range(steps):
        h, c = ref(xr[t], (h, c))
        outs.append(h)
    ref_out = torch.stack(outs) if outs else x.new_zeros(0, 3, 6)
    if steps:
        torch.autograd.backward((ref_out, h, c), (gx, gh, gc))
    tol = TOL[dtype]
    torch.testing.assert_close(out_tm, ref_out, **tol)
    torch.testing.assert_close(h_n, h, **tol)
    torch.testing.assert_close(c_n, c, **tol)
    if steps:
        gxs = xs.grad.transpose(0, 1) if batch_first else xs.grad
        torch.testing.assert_close(gxs, xr.grad, **tol)
        for a, b in zip(s1, s2):
            torch.testing.assert_close(a.grad, b.grad, **tol)
        for a, b in zip(seq.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, **tol)
    else:
        torch.testing.assert_close(s1[0].grad, gh, rtol=0, atol=0)
        torch.testing.assert_close(s1[1].grad, gc, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sequence_gradcheck_float64(device):
    torch.manual_seed(3)
    args = [torch.randn(4, 2, 3), torch.rand(15, 8) - 0.5, torch.rand(15) - 0.5,
            torch.randn(2, 5), torch.randn(2, 5)]
    args = [a.to(device, torch.float64).requires_grad_() for a in args]
    assert torch.autograd.gradcheck(lt.lltm_sequence, args, eps=1e-6, atol=1e-7)


def test_sequence_custom_ops_pass_opcheck():
    torch.manual_seed(4)
    args = [torch.randn(3, 2, 4, dtype=torch.float64), torch.rand(15, 9, dtype=torch.float64),
            torch.rand(1, 15, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64),
            torch.randn(2, 5, dtype=torch.float64)]
    torch.library.opcheck(torch.ops.lltm_cupy.sequence.default, args)
    torch.library.opcheck(torch.ops.lltm_cupy.sequence_inference.default, args)
    hs, h_n, c_n, *kept = torch.ops.lltm_cupy.sequence(*args)
    go, gh, gc = torch.randn(3, 2, 5, dtype=torch.float64), torch.randn_like(h_n), torch.randn_like(c_n)
    torch.library.opcheck(torch.ops.lltm_cupy.sequence_backward.default,
                          (go, gh, gc, *args, hs, *kept))
    torch.library.opcheck(torch.ops.lltm_cupy.sequence_backward.default,
                          (None, None, gc, *args, hs, *kept))
    # inputs that are not contiguous: their contiguous copy is kept too
    strided = [args[0].transpose(0, 1).contiguous().transpose(0, 1), *args[1:]]
    torch.library.opcheck(torch.ops.lltm_cupy.sequence.default, strided)


@needs_cuda
def test_sequence_custom_ops_pass_opcheck_cuda():
    args = [torch.randn(3, 2, 4), torch.rand(15, 9), torch.rand(15), torch.randn(2, 5), torch.randn(2, 5)]
    torch.library.opcheck(torch.ops.lltm_cupy.sequence.default,
                          [a.cuda().double() for a in args])


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_sequence_model_matches_eager(device):
    seq, _ = models(device, torch.float64, batch_first=True, seed=5)
    x = torch.randn(2, 6, 4, device=device, dtype=torch.float64)
    compiled = torch.compile(seq, fullgraph=True)
    results = []
    for m in (seq, compiled):
        seq.zero_grad()
        out, (h, c) = m(x)
        (out.pow(2).sum() + h.sum() + c.sum()).backward()
        results.append([out.detach(), h.detach(), c.detach()] + [p.grad.clone() for p in seq.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_sequence_errors_and_in_place_outputs():
    seq, _ = models("cpu", torch.float64)
    with pytest.raises(ValueError, match=r"LLTM: input must be 3-D \(steps, batch, input_size\)"):
        seq(torch.randn(3, 4, 2, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="same dtype"):
        seq(torch.randn(2, 3, 4))
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    out, _ = seq(x)
    with torch.no_grad():
        out.mul_(2)  # the outputs are the saved hidden states: in-place change is detected
    with pytest.raises(RuntimeError, match="modified inplace"):
        out.sum().backward()
    assert "batch_first=False" in repr(seq)


def test_sequence_module_accepts_lstm_shaped_state():
    seq, _ = models("cpu", torch.float64, seed=6)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    h0, c0 = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    out2, (h2, c2) = seq(x, (h0, c0))
    out3, (h3, c3) = seq(x, (h0[None], c0[None]))
    assert h3.shape == (1, 3, 6) and c3.shape == (1, 3, 6) and h2.shape == (3, 6)
    torch.testing.assert_close(out3, out2, rtol=0, atol=0)
    torch.testing.assert_close(h3[0], h2, rtol=0, atol=0)
    torch.testing.assert_close(c3[0], c2, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"h_0 must have shape \(1, 3, 6\) or \(3, 6\)"):
        seq(x, (torch.randn(2, 3, 6, dtype=torch.float64), c0[None]))
    with pytest.raises(ValueError, match=r"h_0 must have shape \(1, 3, 6\) or \(3, 6\)"):
        seq(x, (h0, c0[None]))


@pytest.mark.parametrize("recycle", [False, True], ids=["fresh arrays", "reused arrays"])
def test_one_thread_and_two_agree(monkeypatch, recycle):
    """torch's thread count changes only who runs torch's GEMMs (the NumPy element-wise work is
    the same code on one core): a training call and a forward under no_grad at one thread and
    at two give results within float32's accuracy bound of each other (normalised), and the
    forward under no_grad equals the training forward bit for bit at each count (the same
    blocks and order); with the CPU backend's large arrays reused too (its size gate lowered
    to 0), as at the sizes where it applies."""
    import numpy as np

    from lltm_cupy._numpy import memory
    from lltm_cupy.verify import TOLERANCE, normalised_error

    if recycle:
        monkeypatch.setattr(memory, "RECYCLE_BYTES", 0)
    before = torch.get_num_threads()
    torch.manual_seed(5)
    model = lt.LLTM(32, 96)
    xs = torch.randn(6, 48, 32)
    results = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for _ in range(2):              # (the second call on reused memory, where gated in)
                model.zero_grad()
                out, (h, c) = model(xs)
                (out.sum() + h.sum() + c.sum()).backward()
                with torch.no_grad():
                    forward_only = model(xs)[0]
            assert torch.equal(forward_only, out.detach()), threads
            results[threads] = [out.detach(), h.detach(), c.detach(),
                                *(p.grad.clone() for p in model.parameters())]
    finally:
        torch.set_num_threads(before)
        memory.forget()
    bound = TOLERANCE[np.dtype(np.float32)]
    for i, (a, b) in enumerate(zip(results[1], results[2])):
        error = normalised_error(a.numpy(), b.numpy())
        assert error <= bound, (i, error)
