"""Bad input, as a table: each case, where it is tried, the error type and the words the message
must contain (naming the argument the user most likely got wrong). What extreme values give
(infinities, NaN) is tabled in tests/array_api/test_infinities.py.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import lltm_cupy
from conftest import make_case

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

NAMES = ("input", "weights", "bias", "old_h", "old_cell")
B, F, S = 3, 4, 5


def _case(**override):
    case = make_case(B, F, S, np.float32)
    return [override.get(n, case[n]) for n in NAMES]


def _zeros(*shape):
    return np.zeros(shape, np.float32)


def _matrix(a):
    with warnings.catch_warnings():     # NumPy discourages np.matrix: that is the point here
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.asmatrix(a)


# (case, arguments of lltm_cupy.forward, error, words)
ARRAY_CASES = [
    ("input one feature too wide", dict(input=_zeros(B, F + 1)), ValueError,
     "input has 5 features, but weights of shape (15, 9) with state 5 (from old_h) take 4"),
    ("old_h with another state size", dict(old_h=_zeros(B, S + 1), old_cell=_zeros(B, S + 1)),
     ValueError, "old_h has 6 state columns, but weights of shape (15, 9) are for state 5"),
    ("old_h with another batch", dict(old_h=_zeros(B - 1, S)), ValueError,
     "old_h has batch 2 but input has batch 3"),
    ("old_cell unlike old_h", dict(old_cell=_zeros(B, S + 1)), ValueError,
     "old_cell must have shape (3, 5) (batch, state) like old_h, got (3, 6)"),
    ("weights neither for the input nor the state", dict(weights=_zeros(16, 9)), ValueError,
     "weights must have shape (15, 9)"),
    ("weights 1-D", dict(weights=_zeros(15 * 9)), ValueError, "weights must be 2-D"),
    ("bias of the wrong length", dict(bias=_zeros(14)), ValueError,
     "bias must have shape (15,) or (1, 15)"),
    ("input 1-D", dict(input=_zeros(F)), ValueError, "input must be 2-D (batch, features)"),
    ("a list for input", dict(input=[[0.0] * F] * B), TypeError,
     "input must be a numpy.ndarray or a cupy.ndarray, got builtins.list"),
    ("np.matrix for old_h", dict(old_h=_matrix(_zeros(B, S))), TypeError,
     "old_h is a numpy.matrix; pass np.asarray(old_h)"),
    ("masked array for input", dict(input=np.ma.masked_array(_zeros(B, F), mask=False)),
     TypeError, "input is a masked array, and the mask would be ignored"),
    ("int64 arrays", {n: np.zeros((1,), np.int64) for n in ("bias",)}, TypeError,
     "all arrays must have the same dtype"),
]


@pytest.mark.parametrize("label,override,error,words", ARRAY_CASES,
                         ids=[c[0] for c in ARRAY_CASES])
def test_array_api_forward(label, override, error, words):
    with pytest.raises(error) as info:
        lltm_cupy.forward(*_case(**override))
    assert words in str(info.value)


SEQUENCE_CASES = [
    ("inputs one feature too wide", dict(inputs=_zeros(2, B, F + 1)), ValueError,
     "inputs has 5 features, but weights of shape (15, 9) with state 5 (from h0) take 4"),
    ("h0 with another batch", dict(h0=_zeros(B + 1, S)), ValueError,
     "h0 has batch 4 but inputs has batch 3"),
    ("inputs 2-D", dict(inputs=_zeros(B, F)), ValueError, "inputs must be 3-D"),
]


@pytest.mark.parametrize("label,override,error,words", SEQUENCE_CASES,
                         ids=[c[0] for c in SEQUENCE_CASES])
def test_array_api_forward_sequence(label, override, error, words):
    case = make_case(B, F, S, np.float32)
    args = dict(inputs=_zeros(2, B, F), weights=case["weights"], bias=case["bias"],
                h0=case["old_h"], c0=case["old_cell"])
    args.update(override)
    with pytest.raises(error) as info:
        lltm_cupy.forward_sequence(*args.values())
    assert words in str(info.value)


NEEDED_CASES = [
    ("a generator of 5", (v for v in (True, False, True, True, False)), None, None),
    ("a NumPy array of 5", np.array([1, 0, 1, 1, 0], bool), None, None),
    ("4 values", (True,) * 4, TypeError, "needed must hold 5 booleans"),
    ("5 characters", "abcde", TypeError, "needed must hold 5 booleans"),
    ("5 integers", (2, 0, 0, 0, 0), TypeError, "needed must hold 5 booleans"),
    ("an int", 5, TypeError, "needed must be an iterable of 5 booleans"),
]


@pytest.mark.parametrize("label,needed,error,words", NEEDED_CASES,
                         ids=[c[0] for c in NEEDED_CASES])
def test_backward_needed(label, needed, error, words):
    case = make_case(B, F, S, np.float32)
    _, _, saved = lltm_cupy.forward(*(case[n] for n in NAMES))
    if error is None:
        grads = lltm_cupy.backward(case["grad_h"], None, saved, needed=needed)
        assert grads.d_input is None and grads.d_old_cell is None
        assert grads.d_weights is not None and grads.d_bias is not None
        return
    with pytest.raises(error, match=words):
        lltm_cupy.backward(case["grad_h"], None, saved, needed=needed)


# ------------------------------------------------------------------------------ torch layer

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
import lltm_cupy.torch as lt  # noqa: E402

h4, c4 = torch.zeros(4, 16), torch.zeros(4, 16)
# (case, module, call arguments, error, words)
TORCH_CASES = [
    ("input one feature too wide", "cell", (torch.randn(4, 9),), ValueError,
     "LLTMCell: input has 9 features, the module expects 8 (input_size)"),
    ("state as one tensor", "cell", (torch.randn(4, 8), h4), TypeError,
     "LLTMCell: state must be a tuple (h, c) of two tensors or None, got a single Tensor"),
    ("state as a 1-tuple", "cell", (torch.randn(4, 8), (h4,)), ValueError,
     "LLTMCell: state must hold two tensors (h, c), got 1"),
    ("h of another state size", "cell", (torch.randn(4, 8), (torch.zeros(4, 15), c4)),
     ValueError, "LLTMCell: h of state must have shape (4, 16) (batch, hidden_size), got (4, 15)"),
    ("c of another batch", "cell", (torch.randn(4, 8), (h4, torch.zeros(3, 16))), ValueError,
     "LLTMCell: c of state must have shape (4, 16)"),
    ("a NumPy array in the state", "cell", (torch.randn(4, 8), (h4, np.zeros((4, 16)))),
     TypeError, "LLTMCell: c of state must be a torch.Tensor, got ndarray"),
    ("a list for input", "cell", ([[0.0] * 8] * 4,), TypeError,
     "LLTMCell: input must be a torch.Tensor (batch, input_size), got builtins.list"),
    ("a NumPy array for input", "cell", (np.zeros((4, 8), np.float32),), TypeError,
     "LLTMCell: input must be a torch.Tensor"),
    ("input 3-D to the cell", "cell", (torch.randn(2, 4, 8),), ValueError,
     "LLTMCell: input must be 2-D (batch, input_size)"),
    ("sequence input one feature too wide", "seq", (torch.randn(5, 4, 9),), ValueError,
     "LLTM: input has 9 features, the module expects 8"),
    ("sequence input 4-D", "seq", (torch.randn(5, 4, 2, 8),), ValueError,
     "LLTM: input must be 3-D (steps, batch, input_size)"),
    ("a PackedSequence to the cell", "cell", ("packed",), TypeError,
     "PackedSequence goes to LLTM, not to a cell"),
    ("h_0 of the wrong layer count", "seq2", (torch.randn(5, 4, 8), (torch.zeros(1, 4, 16),
                                                                    torch.zeros(1, 4, 16))),
     ValueError, "LLTM: h_0 must have shape (2, 4, 16) (num_layers * num_directions, batch, "
                 "hidden_size), got (1, 4, 16)"),
    ("num_layers 0", "bad-layers", (), ValueError, "num_layers must be an integer >= 1"),
    ("dropout 1.5", "bad-dropout", (), ValueError, "dropout must be a number in [0, 1]"),
    ("sequence state as one tensor", "seq", (torch.randn(5, 4, 8), h4), TypeError,
     "LLTM: state must be a tuple (h, c)"),
    ("functional lltm, input too wide", "lltm",
     (torch.randn(4, 9), torch.zeros(48, 24), torch.zeros(48), h4, c4), ValueError,
     "input has 9 features, but weights of shape (48, 24) with state 16 (from old_h) take 8"),
    ("functional lltm, a list", "lltm",
     ([[0.0]], torch.zeros(48, 24), torch.zeros(48), h4, c4), TypeError,
     "input must be a torch.Tensor, got list"),
]


@pytest.mark.parametrize("label,target,call,error,words", TORCH_CASES,
                         ids=[c[0] for c in TORCH_CASES])
def test_torch_layer(label, target, call, error, words):
    if call and isinstance(call[0], str):   # built here, not at collection
        from torch.nn.utils.rnn import pack_sequence

        call = (pack_sequence([torch.randn(3, 8), torch.randn(2, 8)]),)
    fn = {"cell": lambda: lt.LLTMCell(8, 16), "seq": lambda: lt.LLTM(8, 16),
          "seq2": lambda: lt.LLTM(8, 16, num_layers=2), "lltm": lambda: lt.lltm,
          "bad-layers": lambda: lt.LLTM(8, 16, num_layers=0),
          "bad-dropout": lambda: lt.LLTM(8, 16, 2, dropout=1.5)}
    if target.startswith("bad-"):
        with pytest.raises(error) as info:
            fn[target]()
        assert words in str(info.value)
        return
    fn = fn[target]()
    with pytest.raises(error) as info:
        fn(*call)
    assert words in str(info.value)


def test_no_warning_reaches_the_torch_user_at_infinities():
    """NumPy's floating-point warnings stay inside (this module turns them into errors)."""
    cell = lt.LLTMCell(8, 16)
    x = torch.randn(4, 8)
    x[0, 0] = float("inf")
    h, c = cell(x, (torch.full((4, 16), float("inf")), torch.full((4, 16), -float("inf"))))
    (h.sum() + c.sum()).backward()
    assert torch.isnan(cell.weights.grad).any()    # inf - inf in the gradients, as the reference
