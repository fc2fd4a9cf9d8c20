"""Whole models in the array API (forward_layers / backward_layers / init_parameters): every
output, final state and gradient against the float64 reference stepped over each sequence
alone (tests/helpers/layers_reference.py), for 1 and 3 layers, one and two directions, dropout
0 and 0.4 from a seeded generator, full and ragged lengths, given and omitted states, on the
NumPy backend and the emulated CuPy; finite differences of a tiny model; argument errors."""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from conftest import TOLERANCE, max_error, to_numpy
from helpers.layers_reference import model_one_sequence

T, B, F, H = 5, 4, 3, 4


def _case(layers, bidirectional, dtype, seed):
    rng = np.random.default_rng(seed)
    params = lltm_cupy.init_parameters(F, H, layers, bidirectional=bidirectional, rng=rng,
                                       dtype=np.float64)
    params = {k: v * 2 for k, v in params.items()}          # livelier than +-1/sqrt(H)
    D = 2 if bidirectional else 1
    states = (layers * D, B, H)
    arrays = dict(x=rng.standard_normal((T, B, F)), h0=rng.uniform(-1, 1, states),
                  c0=rng.standard_normal(states), g_out=rng.standard_normal((T, B, D * H)),
                  g_h=rng.standard_normal(states), g_c=rng.standard_normal(states))
    return ({k: v.astype(dtype) for k, v in params.items()},
            {k: v.astype(dtype) for k, v in arrays.items()})


def _masks(seed, p, layers, D):
    """The masks forward_layers draws: one rng.random((T, B, D * H)) per layer above the first."""
    if not p or layers == 1:
        return [None] * (layers - 1)
    rng = np.random.default_rng(seed)
    return [(rng.random((T, B, D * H)) >= p) / (1 - p) for _ in range(layers - 1)]


def _reference(params, a, lengths, masks, states_given):
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    zeros = np.zeros(a["h0"].shape)
    h0 = a["h0"].astype(np.float64) if states_given else zeros
    c0 = a["c0"].astype(np.float64) if states_given else zeros
    per = [model_one_sequence(a["x"][:, b].astype(np.float64), p64, h0[:, b], c0[:, b],
                              lengths[b], [None if m is None else m[:, b] for m in masks],
                              a["g_out"][:, b].astype(np.float64), a["g_h"][:, b],
                              a["g_c"][:, b]) for b in range(B)]
    d_params = {k: sum(p[4][k] for p in per).reshape(params[k].shape) for k in params}
    return dict(outputs=np.stack([p[0] for p in per], 1), h_n=np.stack([p[1] for p in per], 1),
                c_n=np.stack([p[2] for p in per], 1), d_inputs=np.stack([p[3] for p in per], 1),
                d_h0=np.stack([p[5] for p in per], 1), d_c0=np.stack([p[6] for p in per], 1),
                **{f"d_{k}": v for k, v in d_params.items()})


def _run(xp, params, a, lengths, dropout, seed, states_given):
    p = {k: xp.asarray(v) for k, v in params.items()}
    x = xp.asarray(a["x"])
    h0, c0 = (xp.asarray(a["h0"]), xp.asarray(a["c0"])) if states_given else (None, None)
    outputs, h_n, c_n, saved = lltm_cupy.forward_layers(
        x, p, h0, c0, lengths=lengths, dropout=dropout, rng=np.random.default_rng(seed))
    g = lltm_cupy.backward_layers(*(xp.asarray(a[k]) for k in ("g_out", "g_h", "g_c")), saved)
    assert list(g.d_parameters) == list(params), "d_parameters in the parameters' order"
    return dict(outputs=outputs, h_n=h_n, c_n=c_n, d_inputs=g.d_inputs, d_h0=g.d_h0,
                d_c0=g.d_c0, **{f"d_{k}": v for k, v in g.d_parameters.items()})


LENGTHS = {"full": None, "ragged": [5, 0, 2, 5]}


@pytest.mark.parametrize("states", ["given", "omitted"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=LENGTHS.keys())
@pytest.mark.parametrize("dropout", [0.0, 0.4])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_layers_match_each_sequence_alone(xp, dtype, layers, bidirectional, dropout, lengths,
                                          states):
    """xp: NumPy, the emulated CuPy, and CuPy on a GPU (conftest's fixture)."""
    seed = 7 * layers + 3 * bidirectional + int(10 * dropout)
    params, a = _case(layers, bidirectional, dtype, seed)
    masks = _masks(seed + 1, dropout, layers, 2 if bidirectional else 1)
    given = LENGTHS[lengths]
    got = _run(xp, params, a, given, dropout, seed + 1, states == "given")
    want = _reference(params, a, [T] * B if given is None else given, masks, states == "given")
    tol = TOLERANCE[np.dtype(dtype)]
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert tuple(g.shape) == w.shape and g.dtype == dtype, name
        err = max_error(to_numpy(g), w)
        assert err <= tol, f"{name}: {err:.2e} > {tol:.0e}"
    if given is not None:
        padded = np.arange(T)[:, None] >= np.array(given)[None, :]
        assert not to_numpy(got["outputs"])[padded].any(), "outputs past a length are zero"


def test_dropout_repeats_with_the_seed_and_differs_without():
    params, a = _case(2, True, np.float64, 0)
    run = lambda seed: lltm_cupy.forward_layers(a["x"], params, dropout=0.5,   # noqa: E731
                                                rng=np.random.default_rng(seed))[0]
    np.testing.assert_array_equal(run(1), run(1))
    assert not np.array_equal(run(1), run(2))
    plain = lltm_cupy.forward_layers(a["x"], params)[0]
    assert not np.array_equal(run(1), plain)
    full = lltm_cupy.forward_layers(a["x"], params, dropout=1.0, rng=np.random.default_rng(0))
    one = {k: v for k, v in params.items() if k.endswith("l1") or k.endswith("l1_reverse")}
    assert full[0].shape == plain.shape and one   # dropout 1: layer 1 reads zeros only
    zeros_in = lltm_cupy.forward_layers(np.zeros((T, B, 2 * H)), {
        k.replace("l1", "l0"): v for k, v in one.items()})[0]
    np.testing.assert_allclose(full[0], zeros_in, rtol=1e-14, atol=1e-14)


def test_finite_differences_of_a_tiny_model():
    """Directional derivatives of every argument against central differences (float64, two
    bidirectional layers, dropout 0.5 from a fixed seed, ragged lengths, given states)."""
    params, a = _case(2, True, np.float64, 11)
    lengths = [5, 3, 0, 1]
    rng = np.random.default_rng(5)

    def loss(x, p, h0, c0):
        out, h_n, c_n, _ = lltm_cupy.forward_layers(x, p, h0, c0, lengths=lengths, dropout=0.5,
                                                    rng=np.random.default_rng(3))
        return (out * a["g_out"]).sum() + (h_n * a["g_h"]).sum() + (c_n * a["g_c"]).sum()

    *_, saved = lltm_cupy.forward_layers(a["x"], params, a["h0"], a["c0"], lengths=lengths,
                                         dropout=0.5, rng=np.random.default_rng(3))
    g = lltm_cupy.backward_layers(a["g_out"], a["g_h"], a["g_c"], saved)
    args = dict(x=a["x"], h0=a["h0"], c0=a["c0"], **params)
    grads = dict(x=g.d_inputs, h0=g.d_h0, c0=g.d_c0, **g.d_parameters)
    eps = 1e-6
    for name, value in args.items():
        direction = rng.standard_normal(value.shape)

        def at(step):
            moved = dict(args, **{name: value + step * direction})
            p = {k: moved[k] for k in params}
            return loss(moved["x"], p, moved["h0"], moved["c0"])

        numeric = (at(eps) - at(-eps)) / (2 * eps)
        analytic = float((grads[name] * direction).sum())
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), \
            f"{name}: finite differences {numeric:.10g}, backward {analytic:.10g}"


def test_init_parameters_as_reset_parameters():
    p = lltm_cupy.init_parameters(3, 16, 2, bidirectional=True, rng=np.random.default_rng(0))
    assert list(p) == ["weights_l0", "bias_l0", "weights_l0_reverse", "bias_l0_reverse",
                       "weights_l1", "bias_l1", "weights_l1_reverse", "bias_l1_reverse"]
    assert p["weights_l0"].shape == (48, 19) and p["weights_l1"].shape == (48, 48)
    assert p["bias_l1"].shape == (1, 48) and all(v.dtype == np.float32 for v in p.values())
    values = np.concatenate([v.ravel() for v in p.values()])
    assert values.min() >= -0.25 and values.max() < 0.25 and values.max() > 0.24
    again = lltm_cupy.init_parameters(3, 16, 2, bidirectional=True, rng=np.random.default_rng(0))
    assert all(np.array_equal(p[k], again[k]) for k in p)
    nobias = lltm_cupy.init_parameters(3, 16, bias=False, rng=np.random.default_rng(0),
                                       dtype="float64")
    assert list(nobias) == ["weights_l0"] and nobias["weights_l0"].dtype == np.float64


def test_no_bias_model_runs_and_has_no_bias_gradients():
    p = lltm_cupy.init_parameters(F, H, 2, bias=False, rng=np.random.default_rng(0),
                                  dtype="float64")
    x = np.random.default_rng(1).standard_normal((T, B, F))
    out, h_n, c_n, saved = lltm_cupy.forward_layers(x, p)
    g = lltm_cupy.backward_layers(np.ones_like(out), None, None, saved)
    assert list(g.d_parameters) == ["weights_l0", "weights_l1"]
    with_zero_bias = dict(weights_l0=p["weights_l0"], bias_l0=np.zeros((1, 3 * H)),
                          weights_l1=p["weights_l1"], bias_l1=np.zeros((1, 3 * H)))
    np.testing.assert_array_equal(out, lltm_cupy.forward_layers(x, with_zero_bias)[0])


@pytest.mark.parametrize("change,error,words", [
    (lambda p, x: ({**p, "weights_l5": p["weights_l0"]}, x), ValueError, "unexpected ['weights_l5']"),
    (lambda p, x: ({k: v for k, v in p.items() if k != "bias_l1"}, x), ValueError,
     "missing ['bias_l1']"),
    (lambda p, x: ({**p, "weights_l1": p["weights_l1"][:, 1:]}, x), ValueError,
     "parameters['weights_l1'] must have shape (12, 8)"),
    (lambda p, x: (p, x[..., :2]), ValueError, "inputs has 2 features, the parameters take 3"),
    (lambda p, x: (p, x.astype(np.float32)), TypeError, "same dtype"),
    (lambda p, x: ([*p.values()], x), TypeError, "parameters must be a mapping"),
])
def test_bad_arguments_name_what_is_wrong(change, error, words):
    p = lltm_cupy.init_parameters(F, H, 2, rng=np.random.default_rng(0), dtype="float64")
    x = np.zeros((T, B, F))
    p, x = change(p, x)
    with pytest.raises(error) as info:
        lltm_cupy.forward_layers(x, p)
    assert words in str(info.value)


def test_bad_states_dropout_and_gradients():
    p = lltm_cupy.init_parameters(F, H, 2, rng=np.random.default_rng(0), dtype="float64")
    x = np.zeros((T, B, F))
    with pytest.raises(ValueError, match=r"h0 must have shape \(2, 4, 4\)"):
        lltm_cupy.forward_layers(x, p, np.zeros((B, H)))
    with pytest.raises(TypeError, match="dropout=0.5 needs rng"):
        lltm_cupy.forward_layers(x, p, dropout=0.5)
    with pytest.raises(ValueError, match="dropout must be a number in"):
        lltm_cupy.forward_layers(x, p, dropout=1.5, rng=np.random.default_rng(0))
    out, *_, saved = lltm_cupy.forward_layers(x, p)
    with pytest.raises(ValueError, match=r"grad_h_n must have shape \(2, 4, 4\)"):
        lltm_cupy.backward_layers(None, np.zeros((1, B, H)), None, saved)
    with pytest.raises(TypeError, match="LLTMLayersSaved"):
        lltm_cupy.backward_layers(None, None, None, object())


@pytest.mark.parametrize("lengths", LENGTHS, ids=LENGTHS.keys())
def test_forward_only_gives_the_same_numbers(xp, lengths):
    """return_saved=False: saved is None, outputs and states bit for bit the training
    forward's (3 layers, bidirectional, dropout from the same seed), and a backward on the
    None says why."""
    params, a = _case(3, True, np.float32, 4)
    p = {k: xp.asarray(v) for k, v in params.items()}
    x = xp.asarray(a["x"])
    kw = dict(lengths=LENGTHS[lengths], dropout=0.3)
    train = lltm_cupy.forward_layers(x, p, rng=np.random.default_rng(9), **kw)
    infer = lltm_cupy.forward_layers(x, p, rng=np.random.default_rng(9), return_saved=False, **kw)
    assert infer[3] is None
    for name, u, v in zip(("outputs", "h_n", "c_n"), infer[:3], train[:3]):
        np.testing.assert_array_equal(to_numpy(u), to_numpy(v), err_msg=name)
    with pytest.raises(TypeError, match="return_saved"):
        lltm_cupy.backward_layers(None, None, None, infer[3])
    with pytest.raises(TypeError, match="return_saved"):
        lltm_cupy.forward_layers(x, p, return_saved="no")
