"""The torch LLTM and the array API's whole model are one model: a state dict moves both ways
unchanged, and from the same parameters they give the same outputs, final states and gradients
(of the inputs, every parameter, h_0 and c_0), fixed and ragged lengths, 1 and 3 layers, one and
two directions, with and without bias (float64, CPU)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

import lltm_cupy  # noqa: E402
from lltm_cupy.torch import LLTM  # noqa: E402

T, B, F, H = 6, 4, 3, 5


def _arrays(module):
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def _torch_run(layer, x, h0, c0, lengths, g_out, g_h, g_c):
    x, h0, c0 = (t.clone().requires_grad_() for t in (x, h0, c0))
    if lengths is None:
        out, (h_n, c_n) = layer(x, (h0, c0))
    else:
        packed = pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False)
        out, (h_n, c_n) = layer(packed, (h0, c0))
        out, _ = pad_packed_sequence(out, total_length=T)
    ((out * g_out).sum() + (h_n * g_h).sum() + (c_n * g_c).sum()).backward()
    grads = {name: p.grad.numpy() for name, p in layer.named_parameters()}
    return out.detach().numpy(), h_n.detach().numpy(), c_n.detach().numpy(), \
        x.grad.numpy(), grads, h0.grad.numpy(), c0.grad.numpy()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("lengths", [None, [6, 2, 1, 4]], ids=["full", "ragged"])   # torch: > 0
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("layers", [1, 3])
def test_torch_lltm_and_array_model_agree(layers, bidirectional, lengths, bias):
    torch.manual_seed(layers + 2 * bidirectional)
    layer = LLTM(F, H, layers, bias=bias, bidirectional=bidirectional, dtype=torch.float64)
    D = 2 if bidirectional else 1
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, B, F, generator=g, dtype=torch.float64)
    h0, c0, g_h, g_c = (torch.randn(layers * D, B, H, generator=g, dtype=torch.float64)
                        for _ in range(4))
    g_out = torch.randn(T, B, D * H, generator=g, dtype=torch.float64)
    want = _torch_run(layer, x, h0, c0, lengths, g_out, g_h, g_c)
    params = _arrays(layer)
    assert list(params) == [name for name, _ in layer.named_parameters()]
    out, h_n, c_n, saved = lltm_cupy.forward_layers(x.numpy(), params, h0.numpy(), c0.numpy(),
                                                    lengths=lengths)
    grads = lltm_cupy.backward_layers(g_out.numpy(), g_h.numpy(), g_c.numpy(), saved)
    got = (out, h_n, c_n, grads.d_inputs, grads.d_parameters, grads.d_h0, grads.d_c0)
    names = ("outputs", "h_n", "c_n", "d_inputs", "d_parameters", "d_h0", "d_c0")
    for name, u, v in zip(names, got, want):
        if name == "d_parameters":
            assert list(u) == list(v), "the same names in the same order"
            for k in v:
                assert u[k].shape == v[k].shape, k
                np.testing.assert_allclose(u[k], v[k], rtol=1e-12, atol=1e-12, err_msg=k)
        else:
            assert u.shape == v.shape, name
            np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_state_dicts_move_both_ways(bidirectional):
    """init_parameters -> torch LLTM -> state_dict -> array model: the same numbers each way,
    and the same outputs from both."""
    params = lltm_cupy.init_parameters(F, H, 2, bidirectional=bidirectional,
                                       rng=np.random.default_rng(4), dtype="float64")
    layer = LLTM(F, H, 2, bidirectional=bidirectional, dtype=torch.float64)
    layer.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})   # strict
    back = _arrays(layer)
    assert list(back) == list(params)
    for k in params:
        np.testing.assert_array_equal(back[k], params[k], err_msg=k)
    x = np.random.default_rng(5).standard_normal((T, B, F))
    out_t, (h_t, c_t) = layer(torch.from_numpy(x))
    out_a, h_a, c_a, _ = lltm_cupy.forward_layers(x, back)
    for name, u, v in (("outputs", out_a, out_t), ("h_n", h_a, h_t), ("c_n", c_a, c_t)):
        np.testing.assert_allclose(u, v.detach().numpy(), rtol=1e-12, atol=1e-12, err_msg=name)


def test_init_parameters_draw_the_torch_initialisation_range():
    """The same distribution as LLTM.reset_parameters: U(-1/sqrt(H), 1/sqrt(H)) for every
    parameter (Kolmogorov-Smirnov distance of 20k values each against the uniform CDF)."""
    hidden = 100
    params = lltm_cupy.init_parameters(50, hidden, rng=np.random.default_rng(0), dtype="float64")
    layer = LLTM(50, hidden, dtype=torch.float64)
    bound = 1 / np.sqrt(hidden)
    for values in (np.concatenate([v.ravel() for v in params.values()]),
                   np.concatenate([v.detach().numpy().ravel() for v in layer.parameters()])):
        u = np.sort((values + bound) / (2 * bound))
        ks = np.abs(u - np.arange(1, u.size + 1) / u.size).max()
        assert values.min() >= -bound and values.max() <= bound and ks < 0.02, ks
