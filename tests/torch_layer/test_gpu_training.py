"""GPU training as people run it (GPU tests; skipped with the reason where there is no GPU):
memory from torch's caching allocator, CUDA-graph capture and replay of whole training steps,
torch.compile(mode="reduce-overhead"), sync debug mode, non-default streams.

The same mechanisms run in CI on the emulated CuPy (tests/torch_layer/test_torch_cuda_path.py);
these tests check them against the real CUDA runtime, cuBLAS and torch's allocator.
"""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy  # noqa: E402
import lltm_cupy.torch as lt  # noqa: E402
from helpers.torch_cuda import needs_cuda  # noqa: E402

pytestmark = pytest.mark.gpu
B, F, S, T = 16, 32, 128, 5


class Model(torch.nn.Module):
    """Linear -> LLTMCell stepped T times, or LLTM over the sequence -> Linear."""

    def __init__(self, sequence=False, dtype=torch.float32):
        super().__init__()
        kw = dict(device="cuda", dtype=dtype)
        self.sequence = sequence
        self.inp = torch.nn.Linear(F, F, **kw)
        self.rnn = (lt.LLTM if sequence else lt.LLTMCell)(F, S, **kw)
        self.head = torch.nn.Linear(S, 10, **kw)

    def forward(self, xs):                      # (T, B, F)
        z = self.inp(xs)
        if self.sequence:
            h = self.rnn(z)[1][0][-1]
        else:
            state = None
            for x in z:
                state = self.rnn(x, state)
            h = state[0]
        return self.head(h)


def _loss(model, xs, target):
    return torch.nn.functional.cross_entropy(model(xs).float(), target)


def _data(seed, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = torch.randn(T, B, F, device="cuda", generator=g).to(dtype)
    return xs, torch.randint(0, 10, (B,), device="cuda", generator=g)


#: dtype -> (rtol, atol) of a compiled step against the eager one: float32 at the suite's table
#: (1e-5; compiled code fuses the Linear layers and the loss, each a few float32 roundings
#: apart), 16-bit at the 16-bit rounding. A replayed graph must equal the eager step exactly.
STEP_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-2, 2e-3),
                  torch.bfloat16: (5e-2, 1e-2)}
STEP_DTYPES = pytest.mark.parametrize("dtype", list(STEP_TOLERANCE), ids=["f32", "f16", "bf16"])


def _eager_step(model, xs, target):
    model.zero_grad(set_to_none=True)
    loss = _loss(model, xs, target)
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]


@contextlib.contextmanager
def _sync_debug_error():
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _cupy_pool():
    cupy = pytest.importorskip("cupy")
    return cupy.get_default_memory_pool()


# ------------------------------------------------------------------------------------ memory

@needs_cuda
@pytest.mark.parametrize("sequence", [False, True], ids=["cell", "sequence"])
def test_cupy_pool_does_not_grow_over_20_training_steps(sequence):
    pool = _cupy_pool()
    torch.manual_seed(0)
    model = Model(sequence)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs, target = _data(1)
    torch.cuda.synchronize()
    used, total = pool.used_bytes(), pool.total_bytes()
    with _sync_debug_error():
        for _ in range(20):
            opt.zero_grad(set_to_none=True)
            _loss(model, xs, target).backward()
            opt.step()
    torch.cuda.synchronize()
    assert (pool.used_bytes(), pool.total_bytes()) == (used, total)


@needs_cuda
def test_outputs_and_saved_values_are_counted_by_torch_and_in_its_snapshot():
    torch.manual_seed(0)
    cell = lt.LLTMCell(F, S)
    cell.cuda()
    x = torch.randn(B, F, device="cuda")
    state = (torch.randn(B, S, device="cuda"), torch.randn(B, S, device="cuda"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    h, c = cell(x, state)
    grown = torch.cuda.memory_allocated() - before
    # new_h, new_cell, and what backward keeps: X (B, S+F) and the gates (B, 3S)
    assert grown >= 4 * (2 * B * S + B * (S + F) + 3 * B * S)
    active = [(blk["address"], blk["size"]) for seg in torch.cuda.memory_snapshot()
              for blk in seg["blocks"] if blk["state"] == "active_allocated"]
    for t in (h, c):
        assert any(a <= t.data_ptr() < a + n for a, n in active), "result not in torch's snapshot"
    h.sum().backward()
    assert cell.weights.grad is not None


@needs_cuda
def test_record_stream_keeps_a_result_alive_for_another_stream():
    cell = lt.LLTMCell(F, S, device="cuda")
    x = torch.randn(B, F, device="cuda")
    side = torch.cuda.Stream()
    with torch.no_grad():
        h, _ = cell(x)
    address, nbytes = h.data_ptr(), h.untyped_storage().nbytes()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)           # keep the side stream busy
        y = h * 2
    h.record_stream(side)
    del h, _
    # the freed block may not be handed out again on this stream while `side` still uses it
    fresh = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(4)]
    assert all(t.data_ptr() != address for t in fresh)
    side.synchronize()
    assert torch.isfinite(y).all()


# ------------------------------------------------------------------------------- CUDA graphs

@needs_cuda
@STEP_DTYPES
@pytest.mark.parametrize("sequence", [False, True], ids=["cell", "sequence"])
def test_captured_training_step_replays_the_eager_results(sequence, dtype):
    pool = _cupy_pool()
    torch.manual_seed(0)
    model = Model(sequence, dtype)
    static_x, static_t = _data(1, dtype)
    lltm_cupy.warmup(dtype)                       # nothing compiles inside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                # warm-up: compiles kernels, creates handles
        for _ in range(3):
            _eager_step(model, static_x, static_t)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    used = pool.used_bytes()
    with _sync_debug_error(), torch.cuda.graph(graph):
        static_loss = _loss(model, static_x, static_t)
        static_loss.backward()
    assert pool.used_bytes() == used
    static_grads = [p.grad for p in model.parameters()]   # the graph writes these on replay
    for seed in (2, 3):
        xs, target = _data(seed, dtype)
        static_x.copy_(xs)
        static_t.copy_(target)
        graph.replay()
        replayed = static_loss.clone(), [g.clone() for g in static_grads]
        loss, grads = _eager_step(model, xs, target)
        # the same kernels and the same GEMM engine (torch's) eagerly and in the graph
        assert torch.equal(replayed[0], loss), (replayed[0], loss)
        for i, (a, b) in enumerate(zip(replayed[1], grads)):
            assert a.dtype == dtype
            assert torch.equal(a, b), f"gradient {i}: {(a - b).abs().max()}"


@needs_cuda
@STEP_DTYPES
@pytest.mark.parametrize("sequence", [False, True], ids=["cell", "sequence"])
def test_reduce_overhead_compile_matches_eager(sequence, dtype):
    torch.manual_seed(0)
    model = Model(sequence, dtype)
    lltm_cupy.warmup(dtype)
    compiled = torch.compile(model, mode="reduce-overhead")
    rtol, atol = STEP_TOLERANCE[dtype]
    for seed in range(4):
        xs, target = _data(seed, dtype)
        loss, grads = _eager_step(model, xs, target)
        model.zero_grad(set_to_none=True)
        closs = torch.nn.functional.cross_entropy(compiled(xs).float(), target)
        closs.backward()
        torch.testing.assert_close(closs.detach(), loss, rtol=rtol, atol=atol)
        for p, g in zip(model.parameters(), grads):
            torch.testing.assert_close(p.grad, g, rtol=rtol, atol=atol)


@needs_cuda
@pytest.mark.parametrize("sequence", [False, True], ids=["cell", "sequence"])
def test_training_step_on_a_side_stream_without_host_sync(sequence):
    torch.manual_seed(0)
    model = Model(sequence)
    xs, target = _data(4)
    expected = _eager_step(model, xs, target)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), _sync_debug_error():
        got = _eager_step(model, xs, target)
    side.synchronize()
    torch.testing.assert_close(got[0], expected[0])
    for a, b in zip(got[1], expected[1]):
        torch.testing.assert_close(a, b)


@needs_cuda
def test_warmup_loads_every_dtype_and_16_bit_gemms_restore_the_math_mode():
    cupy = pytest.importorskip("cupy")
    from lltm_cupy import _cuda
    from lltm_cupy._cuda import kernels as _kernels

    lltm_cupy.warmup(("float16", "bfloat16", "float32", "float64"))
    device = cupy.cuda.Device().id
    for dtype in (cupy.float16, _kernels.BFLOAT16, cupy.float32, cupy.float64):
        assert ("elementwise", device, cupy.dtype(dtype).str) in _kernels._cache
    handle = cupy.cuda.device.get_cublas_handle()
    before = cupy.cuda.cublas.getMathMode(handle)
    a = cupy.ones((64, 256), cupy.float16)
    out = _cuda.gemm(a, a.T, cupy.empty((64, 64), cupy.float16))
    assert cupy.cuda.cublas.getMathMode(handle) == before
    assert bool((out == 256).all())
