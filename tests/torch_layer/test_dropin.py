"""LLTM / LLTMCell in the place of nn.LSTM / nn.LSTMCell, as real training code uses them.

Each behaviour is checked against torch's own module run beside ours where torch has one (the
same exception type for the same bad argument, the same attributes), and the usage patterns of
real scripts (whole-model save and reload, state carried and detached across batches, tied
weights, a float64 cell stepped under LBFGS) run here on data made in the test.
"""
from __future__ import annotations

import copy
import io
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import lltm_cupy  # noqa: E402
from lltm_cupy.torch import LLTM, LLTMCell, lltm_sequence  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
F, H, T, B = 3, 5, 4, 2

# ---------------------------------------------------------------- whole-model save and reload

CONFIGS = {
    "cell": lambda: LLTMCell(F, H),
    "cell-no-bias": lambda: LLTMCell(F, H, bias=False),
    "one-layer": lambda: LLTM(F, H),
    "layers": lambda: LLTM(F, H, num_layers=3),
    "bidirectional": lambda: LLTM(F, H, num_layers=2, bidirectional=True),
    "dropout": lambda: LLTM(F, H, num_layers=2, dropout=0.5),
    "batch_first": lambda: LLTM(F, H, batch_first=True, bias=False),
}


def _outputs(module, train: bool):
    """Outputs of ``module`` on fixed data, in train mode (dropout drawn from seed 3) or eval."""
    module.train(train)
    torch.manual_seed(2)
    if isinstance(module, LLTMCell):
        x = torch.randn(B, F)
        torch.manual_seed(3)
        return module(x, None)
    x = torch.randn(B, T, F) if module.batch_first else torch.randn(T, B, F)
    torch.manual_seed(3)
    out, (h, c) = module(x)
    return out, h, c


def _torch_save_load(module, weights_only: bool):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    if not weights_only:
        return torch.load(buffer, weights_only=False)
    # docs/api.md: allowlist our classes for weights_only=True
    with torch.serialization.safe_globals([LLTM, LLTMCell]):
        return torch.load(buffer, weights_only=True)


ROUND_TRIPS = {
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "deepcopy": copy.deepcopy,
    "torch.save": lambda m: _torch_save_load(m, weights_only=False),
    "torch.save-weights_only": lambda m: _torch_save_load(m, weights_only=True),
}


@pytest.mark.parametrize("trip", ROUND_TRIPS)
@pytest.mark.parametrize("config", CONFIGS)
def test_whole_module_round_trip_gives_identical_outputs(config, trip):
    torch.manual_seed(1)
    module = CONFIGS[config]()
    copy_ = ROUND_TRIPS[trip](module)
    assert type(copy_) is type(module) and copy_ is not module
    assert repr(copy_) == repr(module)
    for name, p in module.named_parameters():
        q = dict(copy_.named_parameters())[name]
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name
    for train in (False, True):
        for a, b in zip(_outputs(module, train), _outputs(copy_, train)):
            assert torch.equal(a, b), (config, trip, train)


def test_round_tripped_modules_still_load_the_older_state_dicts():
    """The renaming of older keys (the tutorial's / a cell's weights, bias into a one-layer
    LLTM, and back) survives pickling: it is a method, not a hook held by the instance."""
    torch.manual_seed(4)
    cell, layer = LLTMCell(F, H), LLTM(F, H)
    layer2 = pickle.loads(pickle.dumps(layer))
    layer2.load_state_dict(cell.state_dict())
    assert torch.equal(layer2.weights_l0, cell.weights) and torch.equal(layer2.bias_l0, cell.bias)
    cell2 = copy.deepcopy(cell)
    cell2.load_state_dict(LLTM(F, H).state_dict())
    assert not torch.equal(cell2.weights, cell.weights)
    with pytest.raises(RuntimeError, match="weights_l0"):   # not for a two-layer LLTM
        pickle.loads(pickle.dumps(LLTM(F, H, num_layers=2))).load_state_dict(cell.state_dict())


class _Tagger(nn.Module):
    """A model holding a recurrent cell under a name, as a checkpoint's keys nest it
    (``rnn.weights``, ``rnn.bias``)."""

    def __init__(self, rnn):
        super().__init__()
        self.embed = nn.Linear(F, F)
        self.rnn = rnn


def _final_h(rnn, x):
    """The hidden state after the steps of ``x`` (T, B, F): a cell stepped, an LLTM at once."""
    if isinstance(rnn, LLTM):
        return rnn(x)[1][0][0]
    state = None
    for step in x:
        state = rnn(step, state)
    return state[0]


def _tutorial_cell(f, h):
    from lltm_cupy.torch import ReferenceLLTMCell

    return ReferenceLLTMCell(f, h)


NESTED_LOADS = {  # the older checkpoint's module -> the module that loads it
    "tutorial cell -> LLTM": (_tutorial_cell, LLTM),
    "LLTMCell -> LLTM": (LLTMCell, LLTM),
    "LLTM -> LLTMCell": (LLTM, LLTMCell),
}


@pytest.mark.parametrize("source, target", NESTED_LOADS.values(), ids=NESTED_LOADS.keys())
def test_older_state_dicts_load_inside_a_parent_module(source, target):
    """The older keys are renamed under the module's own prefix, not only at the top level: a
    checkpoint of a model holding the tutorial's cell (keys ``rnn.weights``, ``rnn.bias``) loads
    strictly into the same model holding a one-layer LLTM (``rnn.weights_l0``, ...), and back
    into one holding an LLTMCell; the values arrive where they belong, the caller's dict is left
    as it was."""
    torch.manual_seed(6)
    old = _Tagger(source(F, H))
    state = old.state_dict()
    keys = list(state)
    new = _Tagger(target(F, H))
    new.load_state_dict(state)
    assert list(state) == keys
    pairs = list(zip(new.rnn.named_parameters(), old.rnn.named_parameters()))
    assert len(pairs) == 2
    for (name, p), (old_name, q) in pairs:     # weights, bias: under either name
        assert name.replace("_l0", "") == old_name.replace("_l0", "") and torch.equal(p, q), name
    assert torch.equal(new.embed.weight, old.embed.weight)
    x = torch.randn(T, B, F)
    torch.testing.assert_close(_final_h(new.rnn, x), _final_h(old.rnn, x), rtol=1e-5, atol=1e-6)


def test_module_holding_an_lltm_saves_whole():
    """torch.save(model) of a model holding our modules (word_language_model's pattern)."""
    model = nn.Sequential(nn.Linear(F, F), LLTMCell(F, H))
    again = ROUND_TRIPS["torch.save"](model)
    x = torch.randn(B, F)
    for a, b in zip(model(x), again(x)):
        assert torch.equal(a, b)


def test_pickles_name_the_public_module():
    """A saved model refers to lltm_cupy.torch.LLTM, not to the file that defines it."""
    for cls in (LLTM, LLTMCell):
        data = pickle.dumps(cls(F, H))
        assert b"lltm_cupy.torch" in data and b"lltm_cupy.torch._" not in data


# ------------------------------------------------------------- constructor arguments

def _raised(fn):
    try:
        fn()
    except Exception as e:   # noqa: BLE001 -- the type is what is compared
        return type(e)
    return None


# (keyword arguments, the argument named in our message); nn.LSTM runs beside ours
LSTM_REFUSES = [
    (dict(hidden_size=2.5), "hidden_size"),
    (dict(input_size=2.5), "input_size"),
    (dict(input_size="3"), "input_size"),
    (dict(input_size=np.int64(3)), "input_size"),
    (dict(input_size=0), "input_size"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(hidden_size=-2), "hidden_size"),
    (dict(num_layers=0), "num_layers"),
    (dict(num_layers=2.0), "num_layers"),
    (dict(num_layers="2"), "num_layers"),
    (dict(dropout="a"), "dropout"),
    (dict(dropout=1.5), "dropout"),
    (dict(dropout=-0.1), "dropout"),
    (dict(dropout=True), "dropout"),
    (dict(batch_first="no"), "batch_first"),
    (dict(batch_first=1), "batch_first"),
    (dict(bias="no"), "bias"),
    (dict(bias=0), "bias"),
    (dict(proj_size=-1), "proj_size"),
    (dict(proj_size="a"), "proj_size"),
]


@pytest.mark.parametrize("kwargs,name", LSTM_REFUSES, ids=[repr(k) for k, _ in LSTM_REFUSES])
def test_lltm_refuses_what_nn_lstm_refuses(kwargs, name):
    args = dict(input_size=F, hidden_size=H, num_layers=2)
    args.update(kwargs)
    expected = _raised(lambda: nn.LSTM(**args))
    assert expected is not None, f"nn.LSTM accepts {kwargs}: not a case for this test"
    with pytest.raises(expected, match=name):
        LLTM(**args)


# nn.LSTM takes these (bool(x) or int(x) of them); LLTM refuses them, naming the argument
LLTM_STRICTER = [
    (dict(bidirectional="no"), TypeError, "bidirectional"),
    (dict(bidirectional=1), TypeError, "bidirectional"),
    (dict(num_layers=True), TypeError, "num_layers"),
    (dict(hidden_size=True), TypeError, "hidden_size"),
    (dict(proj_size=2), ValueError, "proj_size=2 is not supported"),
]


@pytest.mark.parametrize("kwargs,error,words", LLTM_STRICTER,
                         ids=[repr(k) for k, _, _ in LLTM_STRICTER])
def test_lltm_refuses_what_nn_lstm_quietly_coerces(kwargs, error, words):
    args = dict(input_size=F, hidden_size=H, num_layers=2)
    args.update(kwargs)
    nn.LSTM(**args)   # accepted there
    with pytest.raises(error, match=words):
        LLTM(**args)


def test_lltm_takes_nn_lstm_arguments_positionally():
    """nn.LSTM's positional order, proj_size (0) included, then device and dtype."""
    args = (F, H, 2, False, True, 0.25, True, 0, "cpu", torch.float64)
    lstm, ours = nn.LSTM(*args), LLTM(*args)
    for name in ("input_size", "hidden_size", "num_layers", "batch_first", "dropout",
                 "bidirectional", "proj_size"):
        assert getattr(ours, name) == getattr(lstm, name), name
    assert ours.weights_l1_reverse.dtype == torch.float64 and ours.bias_l0 is None
    LLTM(F, H, proj_size=0, dropout=np.float64(0.5), num_layers=2)   # numbers.Real is a number


CELL_REFUSES = [
    (dict(hidden_size=2.5), "hidden_size"),
    (dict(input_size=2.5), "input_size"),
    (dict(input_size="3"), "input_size"),
]


@pytest.mark.parametrize("kwargs,name", CELL_REFUSES, ids=[repr(k) for k, _ in CELL_REFUSES])
def test_cell_refuses_what_nn_lstmcell_refuses(kwargs, name):
    args = dict(input_size=F, hidden_size=H)
    args.update(kwargs)
    expected = _raised(lambda: nn.LSTMCell(**args))
    assert expected is not None, f"nn.LSTMCell accepts {kwargs}"
    with pytest.raises(expected, match=name):
        LLTMCell(**args)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(bias="no"), TypeError, "bias"),
    (dict(hidden_size=np.int32(4)), TypeError, "hidden_size"),   # as nn.LSTM, unlike the cell
    (dict(hidden_size=0), ValueError, "hidden_size"),
    (dict(input_size=-1), ValueError, "input_size"),
    (dict(state_size=2.5, hidden_size=None), TypeError, "hidden_size"),
])
def test_cell_stricter_than_nn_lstmcell(kwargs, error, words):
    args = dict(input_size=F, hidden_size=H)
    args.update(kwargs)
    with pytest.raises(error, match=words):
        LLTMCell(**args)


@pytest.mark.parametrize("reverse", ["no", 1, 0, None, [True]])
def test_reverse_must_be_a_bool(reverse):
    rng = np.random.default_rng(0)
    xs, w, b = rng.standard_normal((T, B, F)), rng.standard_normal((3 * H, H + F)), np.zeros(3 * H)
    h = np.zeros((B, H))
    with pytest.raises(TypeError, match="reverse must be True or False"):
        lltm_cupy.forward_sequence(xs, w, b, h, h, reverse=reverse)
    t = [torch.from_numpy(a) for a in (xs, w, b, h, h)]
    with pytest.raises(TypeError, match="reverse must be True or False"):
        lltm_sequence(*t, reverse=reverse)
    # bools, NumPy's too, run
    forward = lltm_cupy.forward_sequence(xs, w, b, h, h, reverse=np.True_)[0]
    assert np.array_equal(forward, lltm_cupy.forward_sequence(xs, w, b, h, h, reverse=True)[0])


def _documented_flags():
    """docs/api.md's TypeError list, as written: the functions' flags (which take NumPy's bool
    too), the modules' flags per class (which take a Python bool only) and those of them that
    nn.LSTM refuses as a NumPy bool too."""
    text = " ".join((ROOT / "docs" / "api.md").read_text().split())
    functions = re.search(r"a function's flag \(([^)]*)\) that is not a `bool` or `numpy\.bool_`",
                          text)
    modules = re.search(r"a module's flag \(([^)]*)\) that is not a Python `bool` \(`numpy\.bool_` "
                        r"too, as `nn\.LSTM` refuses it for ([^)]*)\)", text)
    assert functions and modules, "docs/api.md should say which bools each kind of flag takes"
    per_class = [(cls, name) for part in modules.group(1).split(";")
                 for names, cls in [part.rsplit(" of ", 1)]
                 for name in re.findall(r"`(\w+)`", names)]
    return (re.findall(r"`(\w+)`", functions.group(1)),
            [(cls.strip(" `"), name) for cls, name in per_class],
            re.findall(r"`(\w+)`", modules.group(2)))


def test_flags_take_the_bools_docs_api_says():
    """Each flag docs/api.md names, run: a function's flag takes NumPy's bool (same results as
    the Python bool) and refuses 1; a module's flag refuses NumPy's bool, as nn.LSTM does for
    the flags the page says it does."""
    functions, module_flags, lstm_refuses = _documented_flags()
    rng = np.random.default_rng(0)
    xs, w, b = rng.standard_normal((T, B, F)), rng.standard_normal((3 * H, H + F)), np.zeros(3 * H)
    h = np.zeros((B, H))
    t = [torch.from_numpy(a) for a in (xs, w, b, h, h)]
    params = lltm_cupy.init_parameters(F, H, rng=rng, dtype=np.float64)
    calls = {   # every call that takes the flag: (what runs, the flag's value to try)
        "reverse": [(lambda v: lltm_cupy.forward_sequence(xs, w, b, h, h, reverse=v), True),
                    (lambda v: lltm_sequence(*t, reverse=v), True)],
        "return_saved": [(lambda v: lltm_cupy.forward(xs[0], w, b, h, h, return_saved=v), False),
                         (lambda v: lltm_cupy.forward_sequence(xs, w, b, h, h, return_saved=v),
                          False),
                         (lambda v: lltm_cupy.forward_layers(xs, params, return_saved=v), False)],
        "fused": [(lambda v: lltm_cupy.forward_sequence(xs, w, b, h, h, fused=v), False),
                  (lambda v: lltm_cupy.forward_layers(xs, params, fused=v), False),
                  (lambda v: lltm_sequence(*t, fused=v), False)],
    }
    assert sorted(functions) == sorted(calls), functions
    for name in functions:
        for call, value in calls[name]:
            with pytest.raises(TypeError, match=f"{name} must be True or False"):
                call(1)
            got, want = call(np.bool_(value)), call(value)
            assert all(np.array_equal(np.asarray(g), np.asarray(e))
                       for g, e in zip(got[:3], want[:3])), name
    classes = {"LLTM": LLTM, "LLTMCell": LLTMCell}
    assert {name for _, name in module_flags} >= {"bias", "batch_first", "bidirectional", "fused"}
    for cls, name in module_flags:
        with pytest.raises(TypeError, match=name):
            classes[cls](F, H, **{name: np.True_})
    for name in lstm_refuses:
        with pytest.raises(TypeError, match=name):
            nn.LSTM(F, H, **{name: np.True_})


# ------------------------------------------------------------------------------ import cost

def test_import_loads_no_compiler_machinery():
    """import lltm_cupy.torch adds only lltm_cupy's own modules to what import torch loaded:
    no torch._dynamo, torch._inductor or sympy (torch.compiler.disable imports them), also after
    eager calls of every module path."""
    code = textwrap.dedent("""
        import sys
        import torch
        from torch.nn.utils.rnn import pack_sequence
        before = set(sys.modules)
        import lltm_cupy.torch as lt
        added = sorted(set(sys.modules) - before)
        assert all(m.split(".")[0] == "lltm_cupy" for m in added), added
        lt.LLTMCell(3, 4)(torch.randn(2, 3))
        lt.LLTM(3, 4, bidirectional=True)(torch.randn(5, 2, 3))
        lt.LLTM(3, 4, num_layers=2)(pack_sequence([torch.randn(3, 3), torch.randn(2, 3)]))
        w, b, h = torch.randn(12, 7), torch.zeros(12), torch.zeros(2, 4)
        lt.lltm_sequence(torch.randn(5, 2, 3), w, b, h, h, lengths=[5, 2], reverse=True)
        heavy = [m for m in sys.modules
                 if m.startswith(("torch._dynamo", "torch._inductor", "sympy")) and m not in before]
        assert not heavy, heavy[:10]
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# --------------------------------------------------------------------- nn.LSTM's surface

def test_nn_lstm_attributes_and_methods():
    """What code written for nn.LSTM reads or calls: the same values where the LLTM has the
    same thing, LLTM's own parameters where nn.LSTM lists its own, a no-op flatten_parameters."""
    for kwargs in (dict(), dict(num_layers=3), dict(num_layers=2, bidirectional=True),
                   dict(num_layers=2, bias=False, batch_first=True, dropout=0.5)):
        lstm, ours = nn.LSTM(F, H, **kwargs), LLTM(F, H, **kwargs)
        for name in ("input_size", "hidden_size", "num_layers", "batch_first", "dropout",
                     "bidirectional", "proj_size"):
            assert getattr(ours, name) == getattr(lstm, name), (kwargs, name)
        assert (lstm.mode, ours.mode) == ("LSTM", "LLTM")
        names = [n for n, _ in ours.named_parameters()]
        assert ours._flat_weights_names == names
        assert [id(p) for p in ours._flat_weights] == [id(p) for p in ours.parameters()]
        # one list per layer and direction, as nn.LSTM's: [weights, bias] (no bias: [weights])
        assert len(ours.all_weights) == len(lstm.all_weights) == len(ours._all_weights)
        per = 2 if kwargs.get("bias", True) else 1
        assert all(len(group) == per for group in ours.all_weights)
        assert [id(p) for group in ours.all_weights for p in group] == [id(p) for p in
                                                                         ours.parameters()]
        assert ours._all_weights[-1][0].startswith(f"weights_l{ours.num_layers - 1}")


def test_flatten_parameters_is_a_harmless_no_op():
    torch.manual_seed(5)
    model = LLTM(F, H, num_layers=2, bidirectional=True)
    x = torch.randn(T, B, F)
    before = model(x)[0]
    pointers = [p.data_ptr() for p in model.parameters()]
    assert model.flatten_parameters() is None
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert torch.equal(model(x)[0], before)
    model.double().flatten_parameters()   # after moving, as scripts do
    assert model(x.double())[0].dtype == torch.float64


# ------------------------------------------------------------------------------ zero steps

@pytest.mark.parametrize("kwargs", [dict(), dict(num_layers=2, bidirectional=True),
                                    dict(batch_first=True)], ids=["1", "2-bidir", "batch_first"])
def test_zero_steps_return_empty_output_and_the_initial_state(kwargs):
    """nn.LSTM raises on a sequence of 0 steps (checked here); LLTM returns an empty output and
    h_n, c_n equal to (and differentiable in, but not the same tensors as) h_0, c_0."""
    x = torch.randn(B, 0, F) if kwargs.get("batch_first") else torch.randn(0, B, F)
    with pytest.raises(RuntimeError, match="sequence length"):
        nn.LSTM(F, H, **kwargs)(x)
    model = LLTM(F, H, **kwargs)
    count = model.num_layers * model.num_directions
    h0, c0 = (torch.randn(count, B, H, requires_grad=True) for _ in range(2))
    out, (h, c) = model(x, (h0, c0))
    assert out.shape == ((B, 0, H * model.num_directions) if model.batch_first
                         else (0, B, H * model.num_directions))
    assert torch.equal(h, h0) and torch.equal(c, c0)
    assert h is not h0 and h.data_ptr() != h0.data_ptr()
    (h.sum() + 2 * c.sum()).backward()
    assert torch.equal(h0.grad, torch.ones_like(h0)) and torch.equal(c0.grad, 2 * torch.ones_like(c0))
    out, (h, c) = model(torch.randn(0, F))          # unbatched
    assert out.shape == (0, H * model.num_directions) and h.shape == (count, H)


def test_zero_batch_as_nn_lstm():
    x = torch.randn(T, 0, F)
    want_out, (want_h, _) = nn.LSTM(F, H, num_layers=2, bidirectional=True)(x)
    out, (h, c) = LLTM(F, H, num_layers=2, bidirectional=True)(x)
    assert out.shape == want_out.shape and h.shape == c.shape == want_h.shape


# ------------------------------------------------ torch.compile(fullgraph=True), as README.md says

def _readme_row(label: str) -> dict:
    """README.md's comparison table: the row whose first cell is ``label``, {column header: cell}."""
    lines = (ROOT / "README.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| | lltm_cupy |"))
    row = next(line for line in lines if line.startswith(f"| {label} |"))
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    return dict(zip([c.strip() for c in header.strip().strip("|").split("|")], cells))


def _compiles_fullgraph(module, x) -> str:
    """"yes" if torch.compile(module, fullgraph=True) runs (the outputs equal the eager
    module's), "graph break" if Dynamo refuses it. Dynamo alone decides graph breaks: the
    "eager" backend keeps the test to tracing, without inductor's code generation."""
    try:
        got = torch.compile(module, fullgraph=True, backend="eager")(x)
    except torch._dynamo.exc.Unsupported:
        return "graph break"
    want = module(x)
    assert torch.equal(_flat(got)[0], _flat(want)[0]), type(module).__name__
    return "yes"


def _flat(out):
    return [out] if isinstance(out, torch.Tensor) else [t for part in out for t in _flat(part)]


def test_compile_fullgraph_as_the_readme_table_says():
    """README.md's row `torch.compile(fullgraph=True)`, run: our modules compile without a graph
    break (custom operators); the nn column names each of torch's modules with its verdict, or
    one verdict for both, and each is checked (torch 2.13: nn.LSTMCell compiles, Dynamo refuses
    nn.LSTM)."""
    row = _readme_row("`torch.compile(fullgraph=True)`")
    torch.manual_seed(0)
    ours = {"LLTMCell": (LLTMCell(F, H), torch.randn(B, F)),
            "LLTM": (LLTM(F, H, num_layers=2, bidirectional=True), torch.randn(T, B, F))}
    assert row["lltm_cupy"].startswith("yes"), row
    for name, (module, x) in ours.items():
        assert _compiles_fullgraph(module, x) == "yes", name
    cell = row["`nn.LSTMCell` / `nn.LSTM`"]
    theirs = {"LSTMCell": (nn.LSTMCell(F, H), torch.randn(B, F)),
              "LSTM": (nn.LSTM(F, H, num_layers=2, bidirectional=True), torch.randn(T, B, F))}
    for name, (module, x) in theirs.items():
        said = re.search(rf"`nn\.{name}`:? (yes|graph break)", cell)
        verdict = said.group(1) if said else cell.split(" (")[0]
        assert _compiles_fullgraph(module, x) == verdict, (
            f"README.md says {verdict!r} for nn.{name} under torch.compile(fullgraph=True) "
            f"({cell!r}); torch {torch.__version__} does otherwise")


# ---------------------------------------------------------------- meta device, TorchScript

META_CONFIGS = [dict(), dict(num_layers=2, bidirectional=True, dropout=0.5),
                dict(batch_first=True, bias=False)]


@pytest.mark.parametrize("kwargs", META_CONFIGS, ids=["1", "2-bidir-dropout", "bf-nobias"])
def test_meta_device_forward_infers_shapes_as_nn_lstm(kwargs):
    from torch.nn.utils.rnn import pack_padded_sequence

    lstm = nn.LSTM(F, H, device="meta", **kwargs)
    ours = LLTM(F, H, device="meta", **kwargs)
    x = torch.empty(B, T, F, device="meta") if ours.batch_first else torch.empty(T, B, F,
                                                                                device="meta")
    inputs = [x, x[0] if ours.batch_first else x[:, 0],
              pack_padded_sequence(x, torch.tensor([T, 2]), batch_first=ours.batch_first),
              pack_padded_sequence(x, torch.tensor([2, T]), batch_first=ours.batch_first,
                                   enforce_sorted=False)]
    for inp in inputs:
        want_out, (want_h, want_c) = lstm(inp)
        out, (h, c) = ours(inp)
        if isinstance(inp, torch.Tensor):
            assert out.shape == want_out.shape
        else:
            assert out.data.shape == want_out.data.shape
            assert out.sorted_indices is inp.sorted_indices
            out = out.data
        assert h.shape == want_h.shape and c.shape == want_c.shape
        assert out.device.type == "meta" and out.requires_grad
        (out.sum() + h.sum() + c.sum()).backward()
        assert all(p.grad.shape == p.shape for p in ours.parameters())
    with torch.inference_mode():             # the forward-only path infers shapes too
        for inp in inputs:
            out = ours(inp)[0]
            assert (out if isinstance(inp, torch.Tensor) else out.data).device.type == "meta"
    # deferred initialisation: built on meta, materialised on the CPU
    ours.to_empty(device="cpu").reset_parameters()
    assert ours(torch.randn(T, B, F))[0].isfinite().all()


def test_meta_packed_sequence_is_checked_as_on_the_cpu():
    """Shape inference checks a PackedSequence as a real call does: indices of the wrong
    length raise the same ValueError on meta as on the CPU."""
    from torch.nn.utils.rnn import PackedSequence

    for device in ("cpu", "meta"):
        bad = PackedSequence(torch.zeros(8, F, device=device), torch.tensor([3, 2, 2, 1]),
                             torch.tensor([0, 1]), torch.tensor([0, 1]))
        with pytest.raises(ValueError, match="sorted_indices must have shape \\(3,\\)"):
            LLTM(F, H, device=device)(bad)


def test_meta_device_cell():
    cell = LLTMCell(F, H, device="meta", dtype=torch.float64)
    h, c = cell(torch.empty(B, F, device="meta", dtype=torch.float64))
    assert h.shape == c.shape == (B, H) and h.dtype == torch.float64 and h.device.type == "meta"
    h.sum().backward()
    assert cell.weights.grad.shape == cell.weights.shape
    h, c = cell(torch.empty(F, device="meta", dtype=torch.float64))
    assert h.shape == (H,)
    with torch.no_grad():
        assert cell(torch.empty(B, F, device="meta", dtype=torch.float64))[1].shape == (B, H)


@pytest.mark.parametrize("make", [lambda: LLTM(F, H), lambda: LLTMCell(F, H),
                                  lambda: nn.Sequential(nn.Linear(F, F), LLTMCell(F, H))],
                         ids=["LLTM", "LLTMCell", "nested"])
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_is_refused_clearly(make):
    with pytest.raises(RuntimeError, match="does not support TorchScript"):
        torch.jit.script(make())


# -------------------------------------------------------------------------- clear errors

def _packed(data, sizes, sorted_indices=None):
    from torch.nn.utils.rnn import PackedSequence

    return PackedSequence(data, torch.tensor(sizes), sorted_indices, None if sorted_indices is None
                          else torch.argsort(sorted_indices))


@pytest.mark.parametrize("packed,words", [
    (lambda: _packed(torch.randn(0, F), [1, 1, 1]), "has 0 rows, but its batch_sizes [1, 1, 1]"),
    (lambda: _packed(torch.randn(5, F), [2, 2, 2]), "has 5 rows, but its batch_sizes"),
    (lambda: _packed(torch.randn(5, F), [2, 3]), "non-increasing"),
    (lambda: _packed(torch.randn(3, F), [3, 0]), "positive"),
    (lambda: _packed(torch.randn(5, F), [3, 2], torch.tensor([1, 0])), "sorted_indices must have "
                                                                        "shape (3,)"),
], ids=["no-rows", "too-few-sizes", "increasing", "zero", "indices"])
def test_inconsistent_packed_sequence_is_named(packed, words):
    with pytest.raises(ValueError) as info:
        LLTM(F, H)(packed())
    assert words in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_input_is_named_as_the_input(dtype):
    x = torch.zeros(T, B, F, dtype=dtype)
    if dtype == torch.int64:   # nn.LSTM: a ValueError about the weights' dtype (docs/api.md)
        with pytest.raises(ValueError, match="does not match weight dtype"):
            nn.LSTM(F, H)(x)
    for module, inp in ((LLTM(F, H), x), (LLTM(F, H, num_layers=2), x), (LLTMCell(F, H), x[0])):
        with pytest.raises(TypeError) as info:
            module(inp)
        message = str(info.value)
        assert f"input must be a floating-point tensor, got {dtype}" in message
        assert "h0" not in message and "c0" not in message
    from torch.nn.utils.rnn import pack_sequence

    with pytest.raises(TypeError, match="floating-point"):
        LLTM(F, H)(pack_sequence([x[:, 0], x[:2, 1]]))


@pytest.mark.parametrize("needed", ["abcde", (2, 0, 0, 0, 0), (True,) * 4, (True,) * 6,
                                    [1.0] * 5, [torch.tensor(True)] * 5])
def test_needed_must_be_exactly_five_booleans(needed):
    rng = np.random.default_rng(1)
    xs, w, b = rng.standard_normal((T, B, F)), rng.standard_normal((3 * H, H + F)), np.zeros(3 * H)
    h = np.zeros((B, H))
    outputs, _, _, saved = lltm_cupy.forward_sequence(xs, w, b, h, h)
    with pytest.raises(TypeError, match="needed must hold 5 booleans"):
        lltm_cupy.backward_sequence(outputs, None, None, saved, needed=needed)
    grads = lltm_cupy.backward_sequence(outputs, None, None, saved,
                                        needed=np.array([0, 1, 0, 0, 1], bool))
    assert grads.d_inputs is None and grads.d_weights is not None and grads.d_c0 is not None


# ----------------------------------------------- usage patterns of real nn.LSTM scripts
# (pytorch/examples' word_language_model and time_sequence_prediction, on data made here)

V, E = 11, 8     # vocabulary, embedding = hidden size (tied weights need them equal)


class TinyLM(nn.Module):
    """word_language_model's RNNModel with LLTM in nn.LSTM's place: embedding, dropout, a
    2-layer LLTM with dropout, a decoder whose weight is the embedding's (tied)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(V, E)
        self.rnn = LLTM(E, E, 2, dropout=0.2)
        self.decoder = nn.Linear(E, V)
        self.decoder.weight = self.encoder.weight

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)).view(-1, V), hidden

    def init_hidden(self, batch):
        weight = next(self.parameters())
        return (weight.new_zeros(2, batch, E), weight.new_zeros(2, batch, E))


def _corpus(batch=4, length=241):
    """Token columns (length, batch) of a learnable pattern: each column counts up mod V from
    its own start, with a few random tokens."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(V, (batch,), generator=g)
    data = (start + torch.arange(length)[:, None]) % V
    noise = torch.rand(length, batch, generator=g) < 0.05
    return torch.where(noise, torch.randint(V, (length, batch), generator=g), data)


def _train(model, data, batches, bptt=10, lr=1.0, seed=0):
    """main.py's train(): state carried across batches and detached, clipped SGD; the losses."""
    torch.manual_seed(seed)
    model.train()
    hidden, losses = model.init_hidden(data.shape[1]), []
    for i in range(0, bptt * batches, bptt):
        x, y = data[i:i + bptt], data[i + 1:i + 1 + bptt].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)       # repackage_hidden
        model.zero_grad()
        output, hidden = model(x, hidden)
        loss = nn.functional.cross_entropy(output, y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return losses


def test_carried_state_equals_one_long_sequence():
    """Two batches with the state carried (detached) give the outputs of one call on their
    concatenation (eval mode); without the detach the second backward would reach the first
    batch's freed graph."""
    torch.manual_seed(6)
    model = TinyLM().eval()
    data = _corpus()
    whole, whole_state = model(data[:20], model.init_hidden(4))
    first, state = model(data[:10], model.init_hidden(4))
    second, state = model(data[10:20], tuple(h.detach() for h in state))
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-6, atol=1e-6)
    for a, b in zip(state, whole_state):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    second.sum().backward()                               # only the second batch's graph
    model.zero_grad()
    third, _ = model(data[20:30], state)                  # not detached: reaches batch 2's graph
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        third.sum().backward()


@pytest.mark.slow
def test_language_model_trains_saves_whole_and_resumes_identically(tmp_path):
    """Training lowers the loss; torch.save(model) and torch.load(weights_only=True) with the
    classes allowlisted, flatten_parameters() after loading (as main.py does), the tied weight
    still one tensor, and training resumed from the reloaded model gives the same losses."""
    torch.manual_seed(7)
    model, data = TinyLM(), _corpus()
    losses = _train(model, data, batches=24, lr=5.0)
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
    assert model.decoder.weight is model.encoder.weight
    path = tmp_path / "model.pt"
    torch.save(model, path)
    with torch.serialization.safe_globals([TinyLM, LLTM, nn.Dropout, nn.Embedding, nn.Linear]):
        again = torch.load(path, weights_only=True)
    again.rnn.flatten_parameters()
    assert again.decoder.weight is again.encoder.weight
    assert _train(again, data[200:], batches=3, seed=1) == _train(model, data[200:], batches=3,
                                                                   seed=1)
    # the saved model's state_dict into a fresh model, as well
    saved, fresh = torch.load(path, weights_only=False).eval(), TinyLM().eval()
    fresh.load_state_dict(saved.state_dict())
    fresh.rnn.flatten_parameters()
    x = data[:10]
    assert torch.equal(fresh(x, fresh.init_hidden(4))[0], saved(x, saved.init_hidden(4))[0])


class SineSequence(nn.Module):
    """time_sequence_prediction's Sequence: two float64 cells stepped from Python, a linear
    read-out, and free-running prediction of ``future`` steps."""

    def __init__(self, cell, hidden=6):
        super().__init__()
        self.hidden = hidden
        self.lstm1, self.lstm2 = cell(1, hidden), cell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t, c_t, h_t2, c_t2 = (torch.zeros(input.size(0), self.hidden, dtype=torch.double)
                                for _ in range(4))
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


def _lbfgs(cell, steps=3):
    rng = np.random.default_rng(2)
    x = np.arange(40) + rng.integers(-80, 80, 8)[:, None]
    data = torch.from_numpy(np.sin(x / 20.0))
    input, target = data[2:, :-1], data[2:, 1:]
    torch.manual_seed(0)
    seq = SineSequence(cell).double()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8)
    losses = []

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(seq(input), target)
        losses.append(loss.item())
        loss.backward()
        return loss

    for _ in range(steps):
        optimizer.step(closure)
    with torch.no_grad():
        pred = seq(data[:2, :-1], future=10)
    return losses, pred


@pytest.mark.slow
def test_float64_cells_trained_with_lbfgs():
    """The LBFGS closure pattern in float64 (many closure calls per step) lowers the loss as
    nn.LSTMCell's run does, and the free-running prediction runs."""
    ours, pred = _lbfgs(LLTMCell)
    theirs, _ = _lbfgs(nn.LSTMCell)
    assert pred.dtype == torch.float64 and pred.shape == (2, 39 + 10)
    assert len(ours) > 10 and all(np.isfinite(ours))
    assert ours[-1] < 0.2 * ours[0], (ours[0], ours[-1])
    assert theirs[-1] < 0.2 * theirs[0]   # the same pattern with nn.LSTMCell, for scale


def test_unbatched_cell_input_takes_unbatched_state_as_nn_lstmcell():
    """An unbatched input (features,) with a batched (1, hidden) state: nn.LSTMCell refuses
    it, and so does LLTMCell (it returned (hidden,) states before); (hidden,) states work for
    both and come back (hidden,)."""
    x = torch.randn(F)
    for cell in (nn.LSTMCell(F, H), LLTMCell(F, H)):
        for state in ((torch.randn(1, H), torch.randn(1, H)), (torch.randn(H), torch.randn(1, H))):
            with pytest.raises((RuntimeError, ValueError)):
                cell(x, state)
        h, c = cell(x, (torch.randn(H), torch.randn(H)))
        assert h.shape == c.shape == (H,)
    with pytest.raises(ValueError, match=r"LLTMCell: an unbatched input .* h must have shape"):
        LLTMCell(F, H)(x, (torch.randn(1, H), torch.randn(1, H)))
