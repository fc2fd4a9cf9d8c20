"""Host-device copies, synchronisations and CUDA-graph capture on the GPU path, on the emulated
CuPy (which records every transfer and sync and refuses them while capturing, as the driver
does; see tests/helpers/emulated_cupy.py):

- every public GPU path, forward and backward, in steady state (after the first call): no
  transfer and no sync at all (the array API and the torch layer, one step, a sequence,
  ``lengths=``, a packed 2-layer bidirectional LLTM);
- variable-length input under capture: after one eager call with the same lengths it runs with
  no transfer and gives the eager results; before one, it is refused with CaptureError before
  any device work is queued;
- torch's cuBLAS handle: a bare LLTMCell / LLTM captured after its eager warm-up iterations
  (the torch GEMM that runs under capture must find the thread's handle made before).
The same on a real GPU: tests/torch_layer/test_gpu_variable_length.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from lltm_cupy import _packing

T, B, F, S = 10, 4, 3, 6     # T > 8: CuPy concatenates more than 8 parts with an upload
LENGTHS = [7, 10, 1, 0]


def _arrays(cupy, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    k = S + F
    host = dict(inputs=rng.standard_normal((T, B, F)), weights=rng.uniform(-1, 1, (3 * S, k)),
                bias=rng.uniform(-1, 1, 3 * S), h0=rng.uniform(-1, 1, (B, S)),
                c0=rng.standard_normal((B, S)), g_out=rng.standard_normal((T, B, S)),
                g_h=rng.standard_normal((B, S)), g_c=rng.standard_normal((B, S)))
    return {n: cupy.asarray(a.astype(dtype)) for n, a in host.items()}


def _array_paths(cupy):
    a = _arrays(cupy)
    step = (a["inputs"][0], a["weights"], a["bias"], a["h0"], a["c0"])

    def one_step():
        h, c, saved = lltm_cupy.forward(*step)
        lltm_cupy.backward(a["g_h"], a["g_c"], saved)

    def sequence(**kw):
        def run():
            seq = (a["inputs"], a["weights"], a["bias"], a["h0"], a["c0"])
            *_, saved = lltm_cupy.forward_sequence(*seq, **kw)
            lltm_cupy.backward_sequence(a["g_out"], a["g_h"], a["g_c"], saved)
        return run

    return {"one step": one_step, "sequence": sequence(),
            "lengths (list)": sequence(lengths=LENGTHS),
            "lengths (NumPy), reverse": sequence(lengths=np.array(LENGTHS), reverse=True),
            "reverse": sequence(reverse=True)}


@pytest.mark.parametrize("path", list(_array_paths(np)))
def test_array_api_steady_state_copies_and_waits_for_nothing(emulated_cupy, path):
    emu = emulated_cupy.emulator
    run = _array_paths(emulated_cupy)[path]
    run()                       # first call: compiles, and uploads the layout of the lengths
    emu.reset()
    run()
    assert emu.transfers == [], f"{path}: host-device copies in steady state: {emu.transfers}"
    assert emu.syncs == 0, f"{path}: {emu.syncs} synchronisations in steady state"
    assert "gemm" in emu.log       # the call did run


def test_lengths_on_the_device_are_read_with_one_documented_download(emulated_cupy):
    """lengths given as a CuPy array: one device-to-host copy (the docstring says so), and
    nothing else."""
    emu = emulated_cupy.emulator
    a = _arrays(emulated_cupy)
    lengths = emulated_cupy.asarray(np.array(LENGTHS))
    args = (a["inputs"], a["weights"], a["bias"], a["h0"], a["c0"])
    lltm_cupy.forward_sequence(*args, lengths=lengths)
    emu.reset()
    lltm_cupy.forward_sequence(*args, lengths=lengths)
    assert [kind for kind, _ in emu.transfers] == ["d2h"] and emu.syncs == 1


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")


def _torch_paths():
    torch = _torch()
    import lltm_cupy.torch as lt
    from torch.nn.utils.rnn import pack_padded_sequence

    torch.manual_seed(0)
    cell = lt.LLTMCell(F, S)
    seq = lt.LLTM(F, S)
    deep = lt.LLTM(F, S, num_layers=2, bidirectional=True)
    x = torch.randn(T, B, F, requires_grad=True)
    lengths = torch.tensor(LENGTHS[:3] + [2])      # a PackedSequence needs lengths >= 1

    def loss(out):
        return sum(t.float().sum() for t in out if t is not None)

    def run_cell():
        h, c = cell(x[0])
        loss((h, c)).backward()

    def run_sequence():
        out, (h, c) = seq(x)
        loss((out, h, c)).backward()

    def run_lengths():
        out, h, c = lt.lltm_sequence(x, cell.weights, cell.bias, x.new_zeros(B, S),
                                     x.new_zeros(B, S), lengths=lengths)
        loss((out, h, c)).backward()

    def run_packed():
        packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
        out, (h, c) = deep(packed, (torch.randn(4, B, S), torch.randn(4, B, S)))
        loss((out.data, h, c)).backward()

    return {"LLTMCell": run_cell, "LLTM sequence": run_sequence, "lltm_sequence lengths=":
            run_lengths, "packed 2-layer bidirectional LLTM": run_packed}


@pytest.mark.parametrize("path", ["LLTMCell", "LLTM sequence", "lltm_sequence lengths=",
                                  "packed 2-layer bidirectional LLTM"])
def test_torch_layer_steady_state_copies_and_waits_for_nothing(emulated_cuda_torch, path):
    emu = emulated_cuda_torch.emulator
    run = _torch_paths()[path]
    run()
    emu.reset()
    run()
    assert emu.transfers == [], f"{path}: host-device copies in steady state: {emu.transfers}"
    assert emu.syncs == 0, f"{path}: {emu.syncs} synchronisations in steady state"
    assert "gemm" in emu.log


def _packed_step(model, x, lengths, hx):
    from torch.nn.utils.rnn import pack_padded_sequence

    for p in model.parameters():
        p.grad = None
    xg = x.detach().clone().requires_grad_()
    out, (h, c) = model(pack_padded_sequence(xg, lengths, enforce_sorted=False), hx)
    (out.data.sum() + h.pow(2).sum() + c.sum()).backward()
    return [out.data.detach(), h.detach(), c.detach(), xg.grad,
            *(p.grad.clone() for p in model.parameters())]


def test_packed_input_under_capture_replays_the_eager_call(emulated_cuda_torch):
    """The warm-up call uploads the layout; under capture the same lengths run with no copy,
    torch's GEMM (on the thread's existing handle) and the eager results."""
    torch = _torch()
    import lltm_cupy.torch as lt

    emu = emulated_cuda_torch.emulator
    torch.manual_seed(1)
    model = lt.LLTM(F, S, num_layers=2, bidirectional=True, dtype=torch.float64)
    x = torch.randn(T, B, F, dtype=torch.float64)
    hx = (torch.randn(4, B, S, dtype=torch.float64), torch.randn(4, B, S, dtype=torch.float64))
    lengths = torch.tensor([3, 5, 1, 2])
    eager = _packed_step(model, x, lengths, hx)
    emu.reset()
    with emu.capture():
        captured = _packed_step(model, x, lengths, hx)
    assert emu.transfers == [] and emu.syncs == 0
    assert "cublas" not in emu.gemm_engines, "cuBLAS through CuPy under capture"
    for a, b in zip(eager, captured):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", ["packed", "lengths="])
def test_variable_lengths_under_capture_without_a_warm_up_are_refused_before_any_work(
        emulated_cuda_torch, form):
    torch = _torch()
    import lltm_cupy.torch as lt
    from torch.nn.utils.rnn import pack_padded_sequence

    emu = emulated_cuda_torch.emulator
    model = lt.LLTM(F, S, bidirectional=True)
    x = torch.randn(T, B, F)
    lengths = torch.tensor([4, 5, 1, 2])          # lengths no call has run with
    lt.LLTMCell(F, S)(x[0])                        # the thread has its torch cuBLAS handle
    emu.reset()
    emu.capturing = True
    with pytest.raises(_packing.CaptureError, match="eagerly once.*same lengths"):
        if form == "packed":
            model(pack_padded_sequence(x, lengths, enforce_sorted=False))
        else:
            lt.lltm_sequence(x, model.weights, model.bias, x.new_zeros(B, S), x.new_zeros(B, S),
                             lengths=lengths)
    assert emu.log == [] and emu.transfers == [], "device work queued before the refusal"


def test_array_api_lengths_under_capture_without_a_warm_up_are_refused(emulated_cupy):
    emu = emulated_cupy.emulator
    a = _arrays(emulated_cupy)
    emu.reset()
    emu.capturing = True
    with pytest.raises(_packing.CaptureError):
        lltm_cupy.forward_sequence(a["inputs"], a["weights"], a["bias"], a["h0"], a["c0"],
                                   lengths=[5, 2, 4, 1])
    assert emu.log == [] and emu.transfers == []


@pytest.mark.parametrize("module", ["LLTMCell", "LLTM"])
def test_a_bare_module_captures_after_its_eager_warm_up(emulated_cuda_torch, module):
    """A module with no torch GEMM of its own: its eager calls run cuBLAS through CuPy, so
    torch's handle for the thread must be made by the layer before a capture needs it (the
    emulator raises CUBLAS_STATUS_NOT_INITIALIZED for a torch GEMM in a capture otherwise, as
    cublasCreate does)."""
    torch = _torch()
    import lltm_cupy.torch as lt

    emu = emulated_cuda_torch.emulator
    torch.manual_seed(2)
    model = getattr(lt, module)(F, S, dtype=torch.float64)
    x = torch.randn(*((T, B, F) if module == "LLTM" else (B, F)), dtype=torch.float64)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(x)
        h, c = out[1] if module == "LLTM" else out
        (h.sum() + c.pow(2).sum()).backward()
        return [h.detach(), c.detach(), *(p.grad.clone() for p in model.parameters())]

    eager = [step() for _ in range(3)][-1]      # the warm-up iterations, as torch asks for
    with emu.capture():
        captured = step()
    for a, b in zip(eager, captured):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
