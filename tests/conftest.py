"""Shared fixtures: the array module under test, input factories, the tolerance table."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest

# The test modules live in folders by what they test (tests/array_api, tests/torch_layer, ...)
# and import shared code from tests/helpers only (tests/, this file's folder, is on sys.path);
# the benchmark harness beside the scripts (scripts/lltm_bench) is imported from scripts/.
_TESTS = Path(__file__).resolve().parent
if str(_TESTS.parent / "scripts") not in sys.path:
    sys.path.append(str(_TESTS.parent / "scripts"))

from lltm_cupy import reference, verify  # noqa: E402
from helpers import host_kernels
from helpers import skip_gate
from helpers.workers import pytest_configure  # noqa: F401 (a hook)
from helpers.skip_gate import (GPU_PHRASE, pytest_collectreport,  # noqa: F401
                               pytest_runtest_logreport, pytest_sessionfinish,
                               pytest_terminal_summary)

from lltm_cupy.verify import TOLERANCE, to_numpy, normalised_error as max_error  # noqa: F401 (re-exported)

#: the fused kernels' emulated devices (fused_cupy, cluster_cupy, group_cupy, mma_cupy and their
#: host builds) for the tests of every folder
pytest_plugins = ("helpers.fused_devices",)

GRAD_NAMES = ("d_old_h", "d_input", "d_weights", "d_bias", "d_old_cell")


gpu_unavailable_reason = functools.lru_cache(maxsize=None)(verify.gpu_unavailable_reason)


def pytest_addoption(parser):
    skip_gate.pytest_addoption(parser)
    parser.addoption("--shuffle", type=int, default=None, metavar="SEED",
                     help="run the collected tests in an order shuffled with SEED (across "
                          "modules), to show that no test depends on another's leftovers")


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle")
    if seed is not None:
        import random

        random.Random(seed).shuffle(items)


def pytest_report_header(config):
    seed = config.getoption("--shuffle")
    return None if seed is None else f"tests shuffled with --shuffle {seed}"


def _cupy_param():
    reason = gpu_unavailable_reason()
    marks = [pytest.mark.gpu] + ([pytest.mark.skip(reason=f"{GPU_PHRASE} {reason}")] if reason else [])
    return pytest.param("cupy", marks=marks, id="cupy")


BACKENDS = [pytest.param("numpy", id="numpy"), pytest.param("emulated", id="cupy-emulated"),
            _cupy_param()]


@pytest.fixture(params=BACKENDS)
def xp(request):
    """The array module of the backend under test: numpy; the GPU backend on an emulated CuPy
    (NumPy arrays, kernels compiled as host C++; runs everywhere); cupy when a GPU is present."""
    if request.param == "numpy":
        return np
    if request.param == "emulated":
        return request.getfixturevalue("emulated_cupy")
    import cupy

    return cupy


@pytest.fixture
def emulated_cupy(monkeypatch, host_lib):
    """Install tests/helpers/emulated_cupy as ``cupy`` for one test (see its docstring)."""
    from helpers import emulated_cupy as emu, emulated_torch

    return emulated_torch.install_cupy(monkeypatch, emu.host_get_kernels(host_lib))


@pytest.fixture
def emulated_cuda_torch(emulated_cupy, monkeypatch):
    """lltm_cupy.torch's CUDA path run on CPU tensors: the kernels launched on the tensors'
    pointers into torch's buffers, with torch's GEMMs, on the emulated CuPy. ``emulator.capturing = True`` makes
    the stream report a CUDA-graph capture (and cuBLAS refuse, as CuPy does).

    torch's streams are emulated too: ``torch.cuda.current_stream()`` (handle 0, the default
    stream, until ``with torch.cuda.stream(torch.cuda.Stream()):`` enters a side stream), and
    the emulated CuPy raises on any launch or cuBLAS call that is not on torch's current stream.
    The torch layer's own ``_stream`` runs unchanged (tests/helpers/emulated_torch.py)."""
    from helpers import emulated_torch

    return emulated_torch.install_torch(monkeypatch, emulated_cupy)


def dtypes_for(xp):
    return (np.float32, np.float64) + ((np.float16,) if xp is not np else ())


def assert_close(actual, expected, dtype, name):
    expected = np.asarray(expected)
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{name}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}"
    assert not np.isnan(to_numpy(actual)).any(), f"{name}: NaN in result"
    err = max_error(actual, expected)
    tol = TOLERANCE[np.dtype(dtype)]
    assert err <= tol, f"{name}: max normalised error {err:.3e} > {tol:.0e} ({np.dtype(dtype)})"


#: The largest normalised error (``max_error``) allowed between two runs of the same step whose
#: GEMMs go through different engines: eager (CuPy's cuBLAS handle; emulated: NumPy's BLAS)
#: against captured (torch's handle; emulated: ``torch.mm``, i.e. MKL), the CPU against the GPU.
#: The engines may sum a product's terms in another order (MKL's code path depends on the CPU
#: and on operand layout; cuBLAS picks an algorithm per handle and workspace), so the results
#: differ by a few ulps of each tensor's largest element, never more: a step that reads a wrong
#: offset, a stale buffer or drops a term is off by far more than these bounds.
ENGINES_AGREE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5,
                 np.dtype(np.float16): 1e-2, "bfloat16": 2e-2}


def assert_engines_agree(actual, expected, name, dtype=None):
    """``actual`` within ``ENGINES_AGREE`` of ``expected`` (torch tensors or arrays, same dtype
    and shape): the comparison of two paths that may use different GEMM engines. ``dtype``: the
    one whose rounding the results carry, if not theirs (a float32 loss of a 16-bit model)."""
    dtype = expected.dtype if dtype is None else dtype
    key = "bfloat16" if str(dtype) in ("torch.bfloat16", "bfloat16") else np.dtype(
        str(dtype).replace("torch.", ""))
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = max_error(actual, expected)
    assert err <= ENGINES_AGREE[key], \
        f"{name}: max normalised error {err:.3e} > {ENGINES_AGREE[key]:.0e} ({key})"


def make_case(batch, features, state, dtype, seed=0, bias_2d=False, zeros_at=(), scale=None):
    """Random NumPy inputs of one LLTM step plus incoming gradients, in ``dtype``.

    zeros_at: state indices whose three gate pre-activations are made exactly 0 (zero weight rows
    and bias). scale: if given, the bias is +-scale, so pre-activations are of that magnitude.
    """
    rng = np.random.default_rng(seed)
    k = state + features
    w = rng.uniform(-1, 1, (3 * state, k)) / np.sqrt(k)
    b = rng.uniform(-1, 1, 3 * state)
    if scale is not None:
        b = np.where(rng.random(3 * state) < 0.5, -scale, scale)
    for s in zeros_at:
        for g in range(3):
            w[g * state + s] = 0.0
            b[g * state + s] = 0.0
    case = dict(
        input=rng.standard_normal((batch, features)),
        weights=w,
        bias=b.reshape(1, -1) if bias_2d else b,
        old_h=rng.uniform(-1, 1, (batch, state)),
        old_cell=rng.standard_normal((batch, state)),
    )
    grads = dict(grad_h=rng.standard_normal((batch, state)),
                 grad_cell=rng.standard_normal((batch, state)))
    cast = {name: a.astype(dtype) for name, a in {**case, **grads}.items()}
    return cast


def reference_results(case):
    """Reference forward (new_h, new_cell) and the five gradients, from the case's exact values."""
    names = ("input", "weights", "bias", "old_h", "old_cell")
    fwd = reference.lltm_forward(*(case[n] for n in names))
    grads = reference.lltm_backward(case["grad_h"], case["grad_cell"], *fwd[1:], case["weights"])
    d_bias = grads[3].reshape(case["bias"].shape)
    return fwd[0], fwd[1], (grads[0], grads[1], grads[2], d_bias, grads[4])


@pytest.fixture(autouse=True)
def _no_compile_state_between_tests():
    """Each test compiles from scratch: torch.compile's in-memory state (Dynamo's compiled code
    and guards, AOTAutograd's graphs) is reset after every test, so no test reuses a graph an
    earlier one compiled under other conditions (the emulated CUDA path's monkeypatches, other
    dtypes or autocast) and the suite passes in any order."""
    yield
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


@pytest.fixture(scope="session", autouse=True)
def _host_build_cache(tmp_path_factory, request):
    """The run's cache of host builds (tests/helpers/host_build.py): one folder for the whole
    run, under pytest's base temporary folder, which pytest-xdist's workers share (a worker's
    own base folder is ``popen-gwN`` inside the run's)."""
    from helpers import host_build

    base = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):      # a pytest-xdist worker
        base = base.parent
    host_build.configure(base / "host-builds")
    yield
    host_build.configure(None)


@pytest.fixture(scope="session")
def host_lib(tmp_path_factory):
    """The kernels of cuda_src/lltm.cu compiled as host C++ (ctypes library)."""
    return host_kernels.build(tmp_path_factory.mktemp("host_kernels"))


@pytest.fixture
def ieee_arithmetic(host_lib):
    """IEEE arithmetic (subnormals kept) for one test, whatever a library loaded earlier set:
    torch 2.5's compiled CPU kernels switch flush-to-zero / denormals-are-zero on for the
    process, which would flush the subnormal cases of the accuracy tests."""
    import ctypes

    host_lib.lltm_host_ieee_mode.restype = ctypes.c_uint
    previous = host_lib.lltm_host_ieee_mode()
    yield
    if previous & 0x8040:
        host_lib.lltm_host_set_mxcsr(ctypes.c_uint(previous))


@pytest.fixture(autouse=True)
def _no_packing_plans_between_tests():
    """Each test starts with no cached packing plan (lltm_cupy._packing keeps the last 64 with
    their device arrays): a test that counts uploads or expects lengths unseen before a capture
    is not changed by the lengths an earlier test ran."""
    yield
    from lltm_cupy import _packing

    _packing.clear_caches()
