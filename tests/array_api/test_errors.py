"""Bad input gets a clear TypeError or ValueError at the public boundary, never a crash."""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from conftest import make_case

NAMES = ("input", "weights", "bias", "old_h", "old_cell")


def args(dtype=np.float32, **override):
    case = make_case(3, 4, 5, dtype)
    return [override.get(n, case[n]) for n in NAMES]


@pytest.mark.parametrize("name,shape,pattern", [
    ("input", (3,), r"input must be 2-D \(batch, features\)"),
    ("old_h", (3, 5, 1), r"old_h must be 2-D"),
    ("old_h", (2, 5), r"old_h must have shape \(3, 5\).*got \(2, 5\)"),
    ("old_cell", (3, 6), r"old_cell must have shape \(3, 5\).*got \(3, 6\)"),
    ("weights", (15, 8), r"weights must have shape \(15, 9\).*got \(15, 8\)"),
    ("weights", (9, 15), r"weights must have shape \(15, 9\).*got \(9, 15\)"),
    ("bias", (14,), r"bias must have shape \(15,\) or \(1, 15\).*got \(14,\)"),
    ("bias", (15, 1), r"bias must have shape \(15,\) or \(1, 15\).*got \(15, 1\)"),
])
def test_shape_errors_name_the_argument(name, shape, pattern):
    a = args(**{name: np.zeros(shape, np.float32)})
    with pytest.raises(ValueError, match=pattern):
        lltm_cupy.forward(*a)


@pytest.mark.parametrize("dtype,pattern", [
    (np.int64, "unsupported dtype int64"),
    (np.complex128, "unsupported dtype complex128"),
    (np.float16, "float16 runs on the GPU backend only"),
    (np.dtype(">f8"), r"unsupported dtype >f8 .*non-native byte order: convert first, e.g. "
                      r"a.astype\(a.dtype.newbyteorder\('='\)\) gives float64"),
    (np.dtype(">f4"), r"unsupported dtype >f4 .*non-native byte order.* gives float32"),
])
def test_unsupported_dtypes(dtype, pattern):
    a = [x.astype(dtype) for x in args(np.float64)]
    with pytest.raises(TypeError, match=pattern):
        lltm_cupy.forward(*a)


def test_mixed_dtypes():
    a = args()
    a[1] = a[1].astype(np.float64)
    with pytest.raises(TypeError, match="same dtype.*weights=float64"):
        lltm_cupy.forward(*a)


@pytest.mark.parametrize("bad", [[[1.0]], 1.0, None])
def test_non_arrays(bad):
    a = args()
    a[2] = bad
    with pytest.raises(TypeError, match="bias must be a numpy.ndarray or a cupy.ndarray"):
        lltm_cupy.forward(*a)


def test_torch_tensors_point_to_the_torch_layer():
    torch = pytest.importorskip("torch", reason="torch not installed")
    a = args()
    a[0] = torch.from_numpy(a[0])
    with pytest.raises(TypeError, match="lltm_cupy.torch"):
        lltm_cupy.forward(*a)


def test_backward_errors():
    case = make_case(3, 4, 5, np.float32)
    _, _, saved = lltm_cupy.forward(*(case[n] for n in NAMES))
    gh, gc = case["grad_h"], case["grad_cell"]
    with pytest.raises(TypeError, match="saved must be the LLTMSaved"):
        lltm_cupy.backward(gh, gc, (1, 2, 3))
    with pytest.raises(ValueError, match=r"grad_h must have shape \(3, 5\).*got \(3, 4\)"):
        lltm_cupy.backward(gh[:, :4], gc, saved)
    with pytest.raises(TypeError, match="grad_cell must have the forward's dtype float32"):
        lltm_cupy.backward(gh, gc.astype(np.float64), saved)
    with pytest.raises(TypeError, match="grad_h must be a numpy.ndarray"):
        lltm_cupy.backward(gh.tolist(), gc, saved)


_NO_SAVED = (" (a forward with return_saved=False keeps nothing for a backward: run it with "
             "return_saved=True)")


@pytest.mark.parametrize("backward,saved_type,forward", [
    (lambda s: lltm_cupy.backward(None, None, s), "LLTMSaved", "forward"),
    (lambda s: lltm_cupy.backward_sequence(None, None, None, s), "LLTMSequenceSaved",
     "forward_sequence"),
    (lambda s: lltm_cupy.backward_layers(None, None, None, s), "LLTMLayersSaved",
     "forward_layers"),
    (lambda s: lltm_cupy.cell_backward(None, None, s), "LLTMCellSaved", "cell_forward"),
], ids=["backward", "backward_sequence", "backward_layers", "cell_backward"])
@pytest.mark.parametrize("saved", [(1, 2, 3), None], ids=["tuple", "None"])
def test_saved_of_another_kind_names_the_forward_that_makes_it(backward, saved_type, forward,
                                                               saved):
    """The whole message: the saved type and the forward that returns it, what was given, and
    for None the return_saved hint, except for cell_forward, which has no return_saved."""
    got = "tuple" if saved is not None else "NoneType"
    hint = _NO_SAVED if saved is None and forward != "cell_forward" else ""
    message = (f"lltm_cupy: saved must be the {saved_type} returned by lltm_cupy.{forward}, "
               f"got {got}{hint}")
    with pytest.raises(TypeError) as info:
        backward(saved)
    assert str(info.value) == message


def test_cell_backward_gradient_errors():
    batch, state = 3, 5
    gates = np.zeros((batch, 3 * state), np.float32)
    old_cell = np.zeros((batch, state), np.float32)
    _, _, saved = lltm_cupy.cell_forward(gates, old_cell)
    with pytest.raises(ValueError, match=r"^lltm_cupy: grad_cell must have shape \(3, 5\) "
                                         r"\(batch, state\) like new_cell, got \(3, 4\)$"):
        lltm_cupy.cell_backward(None, old_cell[:, :4], saved)
    with pytest.raises(TypeError, match="^lltm_cupy: grad_h must have the forward's dtype "
                                        "float32, got float64$"):
        lltm_cupy.cell_backward(old_cell.astype(np.float64), None, saved)


@pytest.mark.gpu
def test_mixed_numpy_and_cupy():
    reason = __import__("conftest").gpu_unavailable_reason()
    if reason:
        pytest.skip(f"GPU test: {reason}")
    import cupy

    a = args()
    a[3] = cupy.asarray(a[3])
    with pytest.raises(TypeError, match="all NumPy or all CuPy.*cupy: old_h"):
        lltm_cupy.forward(*a)


@pytest.mark.parametrize("xp", ["cupy", "module"])
def test_init_parameters_on_cupy_without_a_gpu_says_so(xp):
    """init_parameters(..., xp=cupy) where CuPy finds no usable GPU: the library's message, not
    CuPy's driver error from its first allocation."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install .[test])")
    from conftest import gpu_unavailable_reason

    if not gpu_unavailable_reason():
        pytest.skip("GPU test: runs only without a GPU")
    with pytest.raises(RuntimeError, match="lltm_cupy: the GPU backend needs a GPU, and CuPy "
                                           "finds no usable GPU"):
        lltm_cupy.init_parameters(3, 4, rng=np.random.default_rng(0),
                                  xp=cupy if xp == "module" else xp)
