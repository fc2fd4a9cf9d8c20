"""Variable-length sequences and CUDA-graph capture on a real GPU (GPU tests; skipped with the
reason where there is no GPU): the packed and ``lengths=`` paths in every dtype against the CPU,
packed input captured and replayed (and refused without a warm-up), a packed training step
under ``torch.cuda.set_sync_debug_mode("error")``, and bare modules (no torch GEMM of their own)
captured by ``make_graphed_callables`` in a fresh process.

The same mechanisms run in CI on the emulated CuPy: tests/budgets/test_transfers.py.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy  # noqa: E402
import lltm_cupy.torch as lt  # noqa: E402
from lltm_cupy import _packing  # noqa: E402
from helpers.torch_cuda import CUDA_REASON  # noqa: E402
from torch.nn.utils.rnn import pack_padded_sequence  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(CUDA_REASON is not None,
                                                reason=f"GPU test: {CUDA_REASON}")]
T, B, F, S = 6, 5, 8, 16
LENGTHS = torch.tensor([2, 6, 1, 4, 4])
#: dtype -> bound on max|gpu - cpu| / max|cpu| of each result (the CPU runs float64 on the
#: values rounded to the dtype, so this is the GPU's own rounding over T steps)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1.5e-2,
             torch.bfloat16: 6e-2}
DTYPES = pytest.mark.parametrize("dtype", list(TOLERANCE), ids=["f64", "f32", "f16", "bf16"])


def _run(model, x, form, hx):
    """Forward and backward of a 2-layer bidirectional LLTM: [outputs, h_n, c_n, d_x,
    d_h0, d_c0, every parameter's gradient], detached."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    h0, c0 = (t.detach().clone().requires_grad_() for t in hx)
    if form == "packed":
        out, (h, c) = model(pack_padded_sequence(x, LENGTHS, enforce_sorted=False), (h0, c0))
        out = out.data
    else:   # lengths=: one layer and direction through lltm_sequence
        out, h, c = lt.lltm_sequence(x, model.weights_l0, model.bias_l0, h0[0], c0[0],
                                     lengths=LENGTHS)
    (out.float().sum() + h.float().pow(2).sum() + c.float().sum()).backward()
    grads = [x.grad, h0.grad, c0.grad]
    grads += [p.grad for p in model.parameters() if p.grad is not None]
    return [t.detach() for t in (out, h, c, *grads)]


@DTYPES
@pytest.mark.parametrize("form", ["packed", "lengths="])
def test_variable_lengths_on_the_gpu_equal_the_cpu(dtype, form):
    torch.manual_seed(3)
    gpu = lt.LLTM(F, S, num_layers=2, bidirectional=True, dtype=dtype, device="cuda")
    cpu = lt.LLTM(F, S, num_layers=2, bidirectional=True, dtype=torch.float64)
    cpu.load_state_dict({k: v.double().cpu() for k, v in gpu.state_dict().items()})
    x = torch.randn(T, B, F).to(dtype)
    hx = [torch.randn(4, B, S).to(dtype) for _ in range(2)]
    got = _run(gpu, x.cuda(), form, [t.cuda() for t in hx])
    want = _run(cpu, x.double(), form, [t.double() for t in hx])
    assert len(got) == len(want) and all(t is not None for t in got)
    names = ["outputs", "h_n", "c_n", "d_x", "d_h0", "d_c0"] + [
        f"d_{n}" for n, p in cpu.named_parameters() if p.grad is not None]
    for name, a, b in zip(names, got, want):
        assert a.dtype == dtype, name
        err = (a.double().cpu() - b).abs().max() / b.abs().max().clamp_min(1e-30)
        assert err <= TOLERANCE[dtype], f"{name}: normalised error {err:.2e} ({dtype})"


def _packed_model(dtype=torch.float32):
    torch.manual_seed(4)
    return lt.LLTM(F, S, num_layers=2, bidirectional=True, dtype=dtype, device="cuda")


def test_packed_training_step_under_capture_replays_the_eager_results():
    """Warm-up on a side stream (uploads the layout, makes the handles), capture of forward and
    backward over a static PackedSequence, replays with new data against eager steps."""
    model = _packed_model()
    lltm_cupy.warmup(torch.float32)
    static_x = torch.randn(T, B, F, device="cuda")
    packed = pack_padded_sequence(static_x, LENGTHS, enforce_sorted=False)   # before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            out, (h, c) = model(packed)
            (out.data.sum() + h.pow(2).sum() + c.sum()).backward()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, (h, c) = model(packed)
        static_loss = out.data.sum() + h.pow(2).sum() + c.sum()
        static_loss.backward()
    static_grads = [p.grad for p in model.parameters()]
    for seed in (5, 6):
        torch.manual_seed(seed)
        new = torch.randn(T, B, F, device="cuda")
        new_packed = pack_padded_sequence(new, LENGTHS, enforce_sorted=False)
        packed.data.copy_(new_packed.data)       # the graph reads the static packed data
        graph.replay()
        replayed = [static_loss.clone()] + [g.clone() for g in static_grads]
        model.zero_grad(set_to_none=True)
        out, (h, c) = model(new_packed)
        loss = out.data.sum() + h.pow(2).sum() + c.sum()
        loss.backward()
        eager = [loss.detach()] + [p.grad for p in model.parameters()]
        for a, b in zip(replayed, eager):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_packed_input_with_new_lengths_under_capture_is_refused_before_any_work():
    model = _packed_model()
    model(pack_padded_sequence(torch.randn(T, B, F, device="cuda"), LENGTHS,
                               enforce_sorted=False))      # handles, kernels: all made
    fresh = torch.tensor([3, 1, 5, 2, 6])                  # lengths no call has run with
    packed = pack_padded_sequence(torch.randn(T, B, F, device="cuda"), fresh,
                                  enforce_sorted=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(_packing.CaptureError, match="same lengths"):
        with torch.cuda.graph(graph):
            model(packed)
    torch.cuda.synchronize()        # the device and the stream are fine afterwards
    model(packed)                   # and eagerly it runs


def test_packed_training_step_makes_no_host_sync():
    """torch's sync debug mode as an error around a packed forward, backward and optimiser step
    (the first call with these lengths, which uploads the layout, and a steady-state one)."""
    model = _packed_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(T, B, F, device="cuda")
    packed = pack_padded_sequence(x, torch.tensor([5, 3, 6, 1, 2]), enforce_sorted=False)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            out, (h, c) = model(packed)
            (out.data.sum() + h.pow(2).sum() + c.sum()).backward()
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for p in model.parameters())


_FRESH_PROCESS = textwrap.dedent("""
    import copy
    import sys
    import torch
    import lltm_cupy
    import lltm_cupy.torch as lt

    mode, kinds = sys.argv[1], sys.argv[2].split(",")     # the first kind meets a fresh process
    B, F, S, T = 8, 16, 32, 5
    torch.manual_seed(0)

    class Flat(torch.nn.Module):      # tensors in, a tuple of tensors out
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x, h, c):
            if isinstance(self.module, lt.LLTM):
                out, (h_n, c_n) = self.module(x, (h, c))
                return out, h_n, c_n
            return self.module(x, (h, c))

    def make(kind):
        if kind == "cell":
            module = lt.LLTMCell(F, S, device="cuda")
            shapes = ((B, F), (B, S), (B, S))
        else:
            module = lt.LLTM(F, S, device="cuda")
            shapes = ((T, B, F), (1, B, S), (1, B, S))
        args = [torch.randn(*s, device="cuda", requires_grad=True) for s in shapes]
        return Flat(module), args

    def run(fn, module, args):
        module.zero_grad(set_to_none=True)
        for a in args:
            a.grad = None
        outs = fn(*args)
        sum(o.pow(2).sum() for o in outs).backward()
        return [o.detach().clone() for o in outs] + [a.grad.clone() for a in args] + [
            p.grad.clone() for p in module.parameters()]

    for kind in kinds:
        module, args = make(kind)
        reference = copy.deepcopy(module)      # eager; make_graphed_callables replaces forward
        if mode == "make_graphed_callables":   # its own warm-up iterations, then the capture
            graphed = torch.cuda.make_graphed_callables(module, tuple(args))
        else:                                  # lltm_cupy.warmup only, then torch.cuda.graph
            lltm_cupy.warmup("float32")
            static = [a.detach().clone().requires_grad_() for a in args]
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                outs = module(*static)
                sum(o.pow(2).sum() for o in outs).backward()
            static_grads = [s.grad for s in static] + [p.grad for p in module.parameters()]
            graphed = None
        for seed in (1, 2):
            torch.manual_seed(seed)
            new = [torch.randn_like(a).requires_grad_() for a in args]
            eager = run(reference, reference, new)
            if graphed is not None:
                got = run(graphed, module, new)
            else:
                for s, n in zip(static, new):
                    s.detach().copy_(n.detach())
                graph.replay()      # rewrites the gradients it made at capture (.grad was None)
                got = [o.detach() for o in outs] + static_grads
            assert len(got) == len(eager)
            for a, b in zip(got, eager):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        print(kind, "captured and replayed")
    """)


@pytest.mark.parametrize("mode,kinds", [("make_graphed_callables", "sequence,cell"),
                                        ("warmup-then-graph", "cell,sequence")])
def test_bare_modules_capture_in_a_fresh_process(mode, kinds):
    """LLTMCell and LLTM alone (no torch GEMM of their own) captured forward and backward in a
    process whose threads have no torch cuBLAS handle yet (each module is the first in one of
    the two processes): the capture's torch GEMMs (here and on autograd's thread) must find
    handles made before the capture, by the eager warm-up iterations or lltm_cupy.warmup."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, mode, kinds], cwd=root,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sequence captured and replayed" in result.stdout
