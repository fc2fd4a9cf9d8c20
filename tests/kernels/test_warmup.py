"""lltm_cupy.warmup: after it, no call compiles or loads a kernel (on the emulated CuPy, which
records every first use of a kernel as CuPy and lltm_cupy._cuda's kernel modules would compile it), so that a
CUDA-graph capture never runs NVRTC or a module load. Also the cuBLAS math mode of 16-bit GEMMs.
"""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from lltm_cupy import _cuda
from lltm_cupy._cuda import kernels as _kernels

DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
          "bfloat16": _kernels.BFLOAT16}


def _every_call(cupy, dtype, batch=16, features=32, state=128, steps=5):
    """Every code path of the backend's four calls at a size other than warmup's."""
    rng = np.random.default_rng(0)

    def arr(*shape):
        values = rng.standard_normal(shape) / 4
        if dtype == _kernels.BFLOAT16:
            import ml_dtypes

            return cupy.asarray(values.astype(np.float32).astype(ml_dtypes.bfloat16)
                                .view(np.uint16))
        return cupy.asarray(values.astype(dtype))

    w, b = arr(3 * state, state + features), arr(1, 3 * state)
    h, c = arr(batch, state), arr(batch, state)
    _cuda.forward(arr(batch, features), w, b, h, c, keep=False)      # forward only
    _, _, saved = _cuda.forward(arr(batch, features), w, b, h, c)
    for gh, gc in ((h, c), (h, None), (None, c), (None, None)):
        _cuda.backward(gh, gc, saved)
    _cuda.backward(h, None, saved, needed=(False, True, False, True, False))
    for t in (steps, 1, 0):
        _cuda.forward_sequence(arr(t, batch, features), w, b.reshape(-1), h, c, keep=False)
        *_, saved = _cuda.forward_sequence(arr(t, batch, features), w, b.reshape(-1), h, c)
        for grads in ((arr(t, batch, state), h, c), (None, None, None), (None, h, None),
                      (arr(t, batch, state), None, c)):
            _cuda.backward_sequence(*grads, saved)
    from lltm_cupy import _packing

    lengths = np.arange(batch) % (steps + 1)
    for reverse in (False, True):
        plan = _packing.plan(lengths, steps, reverse)
        _cuda.forward_sequence(arr(steps, batch, features), w, b, h, c, plan=plan, keep=False)
        *_, saved = _cuda.forward_sequence(arr(steps, batch, features), w, b, h, c, plan=plan)
        for grads in ((arr(steps, batch, state), h, c), (None, None, None), (None, h, None)):
            _cuda.backward_sequence(*grads, saved)
        # a PackedSequence's data in and out, as the torch layer runs packed input
        sizes = [batch] + [max(batch - 1, 1)] * (steps - 1)
        rows = sum(sizes)
        plan = _packing.packed_plan(sizes, reverse)
        _cuda.forward_sequence(arr(rows, features), w, b, h, c, plan=plan, keep=False)
        *_, saved = _cuda.forward_sequence(arr(rows, features), w, b, h, c, plan=plan)
        for grads in ((arr(rows, state), h, c), (None, None, None), (None, h, None)):
            _cuda.backward_sequence(*grads, saved)


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.slow
def test_after_warmup_no_call_compiles_anything(emulated_cupy, name):
    emu = emulated_cupy.emulator
    lltm_cupy.warmup(name)
    assert ("lltm.cu", np.dtype(DTYPES[name]).str) in emu.compiles
    emu.reset()
    _every_call(emulated_cupy, DTYPES[name])
    _every_call(emulated_cupy, DTYPES[name], batch=1, steps=1)
    assert emu.compiles == [], f"compiled after warmup: {emu.compiles}"


def test_without_warmup_the_first_calls_compile(emulated_cupy):
    """The control: the same calls compile our module and CuPy kernels when not warmed up, and
    a warmup of another dtype does not cover them."""
    emu = emulated_cupy.emulator
    lltm_cupy.warmup(np.float32)
    emu.reset()
    _every_call(emulated_cupy, np.float16)
    assert ("lltm.cu", np.dtype(np.float16).str) in emu.compiles
    assert any(key[0] != "lltm.cu" for key in emu.compiles)   # CuPy's own kernels too


def test_warmup_of_several_dtypes_and_devices_given_as_torch_and_cupy_objects(emulated_cupy):
    torch = pytest.importorskip("torch")
    emu = emulated_cupy.emulator
    lltm_cupy.warmup((torch.bfloat16, "float64"), device=torch.device("cuda:0"))
    lltm_cupy.warmup([np.dtype(np.float32)], device=emulated_cupy.cuda.Device(0))
    compiled = {key[1] for key in emu.compiles if key[0] == "lltm.cu"}
    assert compiled == {np.dtype(d).str for d in (np.uint16, np.float64, np.float32)}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sequence", [False, True], ids=["cell", "sequence"])
def test_torch_layer_under_capture_compiles_nothing_after_warmup(emulated_cuda_torch, dtype,
                                                                  sequence):
    torch = pytest.importorskip("torch")
    import lltm_cupy.torch as lt

    emu = emulated_cuda_torch.emulator
    tdtype = getattr(torch, dtype)
    lltm_cupy.warmup(tdtype)
    emu.reset()
    emu.capturing = True
    module = (lt.LLTM if sequence else lt.LLTMCell)(6, 8, dtype=tdtype)
    x = torch.randn(*((4, 3, 6) if sequence else (3, 6))).to(tdtype).requires_grad_()
    out = module(x)
    h, c = out[1] if sequence else out
    (h.float().sum() + c.float().sum()).backward()
    assert emu.compiles == [], f"compiled during capture: {emu.compiles}"


@pytest.mark.parametrize("bad,error,words", [
    ("int8", TypeError, "unsupported dtype 'int8'"),
    (np.int32, TypeError, "expected float16, bfloat16, float32 or float64"),
    (object(), TypeError, "unsupported dtype"),
])
def test_warmup_refuses_unsupported_dtypes(bad, error, words):
    with pytest.raises(error, match=words):
        lltm_cupy.warmup(bad)


def test_warmup_refuses_a_cpu_device():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="must be a CUDA device"):
        lltm_cupy.warmup("float32", device=torch.device("cpu"))


def test_warmup_without_a_gpu_says_so():
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install .[test])")
    from conftest import gpu_unavailable_reason

    if not gpu_unavailable_reason():
        pytest.skip("GPU test: runs only without a GPU (with one, "
                    "tests/torch_layer/test_gpu_training.py runs warmup)")
    with pytest.raises(RuntimeError, match="no usable GPU"):
        lltm_cupy.warmup()


# ------------------------------------------------------------------- cuBLAS math mode

@pytest.mark.parametrize("dtype", [np.float16, _kernels.BFLOAT16, np.float32, np.float64],
                         ids=["f16", "bf16", "f32", "f64"])
def test_16_bit_gemms_disallow_reduced_precision_reduction_and_restore_the_mode(
        emulated_cupy, monkeypatch, dtype):
    """The emulated gemmEx refuses 16-bit data without the flag; the handle's mode (here TF32
    math, a user's choice) is set for our call and restored after it; float32/float64 GEMMs
    leave it alone."""
    emu = emulated_cupy.emulator
    cublas = emulated_cupy.cuda.cublas
    user_mode = 3                                   # CUBLAS_TF32_TENSOR_OP_MATH
    emu.math_mode = user_mode
    modes = []
    real_set = cublas.setMathMode
    monkeypatch.setattr(cublas, "setMathMode",
                        lambda handle, mode: (modes.append(mode), real_set(handle, mode)))
    a = emulated_cupy.asarray(np.ones((3, 4), dtype))
    b = emulated_cupy.asarray(np.ones((4, 2), dtype))
    _cuda.gemm(a, b, emulated_cupy.empty((3, 2), dtype))
    assert emu.math_mode == user_mode
    if np.dtype(dtype).itemsize == 2:
        assert modes == [user_mode | 16, user_mode]
    else:
        assert modes == []
