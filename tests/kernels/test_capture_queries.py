"""A CUDA-graph capture of the fused kernels past one block's shared memory asks the driver
nothing: the occupancy queries that plan a cluster (sm_90) or a cooperative group (sm_80), and
the context a thread binds for them, are made eagerly, their answers kept per shape; a shape met
for the first time inside a capture is refused with a message that says what to run first,
before any work is queued (docs/gpu-training.md). ``lltm_cupy.warmup`` binds the context of the
threads that launch (the calling thread; autograd's, on a GPU).

On the emulated CuPy, whose driver fails the occupancy query and ``cudaMemGetInfo`` while
capturing and notes each (``capture_queries``): an sm_90 (sm_80) device of 1,200 bytes of shared
memory per block, so that float32 S = 32 (S = 10) takes a cluster of 16 blocks (a group of 2).
"""
from __future__ import annotations

import threading

import pytest

from helpers.fault_benches import bench  # noqa: F401 (a fixture)

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy  # noqa: E402
from lltm_cupy.torch import LLTM  # noqa: E402

SMALL = 1200
DEVICES = {"cluster-16": (dict(limit=SMALL, sm_count=32), 32),
           "group-2": (dict(limit=SMALL, sm_count=4, arch=80), 10)}


def _step(model, x):
    out, (h, c) = model(x)
    (out.sum() + h.sum() + c.pow(2).sum()).backward()
    found = [out.detach(), h.detach(), c.detach()] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return found


@pytest.mark.parametrize("device", DEVICES)
def test_a_capture_after_warmup_alone_is_refused_before_any_query(emulated_cuda_torch, bench,
                                                                  device):
    """After lltm_cupy.warmup alone (no eager call of these shapes), a captured training step of
    LLTM(fused=True) is refused, saying to run it eagerly first, and asks the driver nothing
    during the capture; after one eager step, the captured step asks nothing and computes the
    eager step's bits."""
    kw, state = DEVICES[device]
    bench(emulated_cuda_torch, torch_layer=True, **kw)
    emu = emulated_cuda_torch.emulator
    emu.contexts = set()                # no thread has bound a CUDA context yet
    lltm_cupy.warmup(["float32"], fused=True)
    assert threading.get_ident() in emu.contexts, "warmup binds the calling thread's context"
    torch.manual_seed(0)
    model = LLTM(3, state, fused=True)
    x = torch.randn(2, 3, 3)
    emu.capturing = True
    emu.reset()
    with pytest.raises(RuntimeError, match="eagerly once before the capture"):
        _step(model, x)
    assert emu.capture_queries == [], emu.capture_queries
    assert emu.log == [], "work was queued before the refusal"
    emu.capturing = False
    want = _step(model, x)
    emu.capturing = True
    got = _step(model, x)
    assert emu.capture_queries == [], emu.capture_queries
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert any(e.startswith("kernel:seq_fwd_") for e in emu.log), "the fused kernels ran"


def test_warmup_prepares_the_thread_autograd_runs_the_backward_on(monkeypatch):
    """On a GPU, lltm_cupy.warmup's torch part (_interop.prepare_capture) runs one tiny backward
    through _PrepareThread, whose backward prepares the thread autograd runs it on: torch's
    cuBLAS handle, and the CUDA context bound on the device (_prepare_thread). Here on the CPU
    (autograd runs the backward on this thread), with the device calls stubbed."""
    from lltm_cupy._cuda import kernels
    from lltm_cupy.torch import _interop

    done = []
    monkeypatch.setattr(_interop, "_torch_blas_ready", lambda index: done.append(("blas", index)))
    monkeypatch.setattr(kernels, "on_device", lambda index: _Entered(done, index))
    monkeypatch.setattr(kernels, "ensure_context",
                        lambda: done.append(("context", threading.get_ident())))
    x = torch.ones(1, 1, requires_grad=True)
    _interop._PrepareThread.apply(torch.mm(x, x), 3).sum().backward()
    assert done == [("blas", 3), ("device", 3), ("context", threading.get_ident()), ("left", 3)]
    assert x.grad is not None


class _Entered:
    def __init__(self, log, index):
        self.log, self.index = log, index

    def __enter__(self):
        self.log.append(("device", self.index))

    def __exit__(self, *exc):
        self.log.append(("left", self.index))
        return False
