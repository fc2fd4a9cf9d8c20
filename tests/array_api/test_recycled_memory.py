"""The CPU backend's large arrays in the memory of earlier calls' (``lltm_cupy._numpy.memory.
recycled``): memory is handed out again only when nothing refers to it any more, so that an
output the caller keeps, what a pending backward keeps, and the array API's ``saved`` are never
overwritten by a later call. The size gate is lowered to 0 here, so that every array of these
small calls is recycled (by default only arrays of 32 MiB and more are)."""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from lltm_cupy._numpy import memory


@pytest.fixture
def recycle_all(monkeypatch):
    """Every array recycled, from an empty memory of earlier arrays (restored afterwards)."""
    monkeypatch.setattr(memory, "RECYCLE_BYTES", 0)
    memory.forget()
    yield
    memory.forget()


def _kept() -> list:
    """The large arrays this thread remembers."""
    return memory._kept.recycled.get("numpy", [])


def _address(a) -> int:
    return a.__array_interface__["data"][0]


def _who_refers() -> str:
    """For a failure of the reuse below: what refers to each array this thread remembers
    (a reference the test cannot see, such as a snapshot of a frame's locals made by a trace
    or profile function, keeps memory from being reused; it failed once under xdist)."""
    import gc
    import sys

    lines = [f"trace {sys.gettrace()!r}, profile {sys.getprofile()!r}"]
    for owner in _kept():       # (3 references here: the list, `owner`, getrefcount's)
        referrers = [type(r).__name__ for r in gc.get_referrers(owner)]
        lines.append(f"{_address(owner)}: {sys.getrefcount(owner) - 3} references beyond the "
                     f"list (gc sees {referrers}; an array's base is not shown)")
    return "\n".join(lines)


def test_memory_is_handed_out_again_only_when_nothing_refers_to_it(recycle_all):
    # (what must stop referring to the memory is held in a list and dropped by clearing it,
    # not by `del` of names: a snapshot of this frame's locals would keep named arrays alive)
    held = memory.recycled(np.float32, (4, 64))        # [a]
    first = _address(held[0])
    held[0] = held[0][1:].reshape(-1)                   # a itself gone, a view of it left
    b, = memory.recycled(np.float32, (4, 64))         # the view still refers to a's memory
    assert not np.shares_memory(b, held[0])
    pair = memory.recycled(np.float32, (256,), (256,))  # b's and a's are taken: new memory
    held.append(pair[0])                                # [view of a, c]
    d = pair[1]
    pair.clear()
    assert not np.shares_memory(held[1], held[0]) and not np.shares_memory(held[1], b)
    assert not np.shares_memory(d, held[1])
    freed = {first, _address(held[1])}
    held.clear()
    remembered = len(_kept())
    e, = memory.recycled(np.float32, (16, 16))          # nothing refers to a's or c's: reused
    assert e.shape == (16, 16) and e.flags.c_contiguous
    assert _address(e) in freed, _who_refers()
    f, = memory.recycled(np.float32, (256,))            # the other one
    assert _address(f) in freed - {_address(e)}
    assert len(_kept()) == remembered
    g, = memory.recycled(np.float64, (128,))            # another dtype: new memory
    assert _address(g) not in freed and len(_kept()) == remembered + 1


def test_small_arrays_are_new_by_default():
    kept = list(_kept())
    a, b = memory.recycled(np.float32, (16,), (1 << 20,))
    assert [*_kept()] == kept     # not remembered
    assert a.shape == (16,) and b.shape == (1 << 20,)


def test_the_thread_remembers_a_bounded_number(recycle_all):
    held = [memory.recycled(np.float32, (n + 1,))[0] for n in range(3 * memory.RECYCLE_COUNT)]
    assert len(_kept()) == memory.RECYCLE_COUNT
    del held


def _case(steps=6, batch=5, features=4, state=7, seed=0):
    rng = np.random.default_rng(seed)
    k = state + features
    return dict(inputs=rng.standard_normal((steps, batch, features)).astype(np.float32),
                weights=(rng.uniform(-1, 1, (3 * state, k)) / np.sqrt(k)).astype(np.float32),
                bias=rng.uniform(-1, 1, 3 * state).astype(np.float32),
                h0=rng.uniform(-1, 1, (batch, state)).astype(np.float32),
                c0=rng.standard_normal((batch, state)).astype(np.float32))


def test_array_api_saved_and_outputs_survive_later_calls(recycle_all):
    one, two = _case(seed=0), _case(seed=1)
    names = ("inputs", "weights", "bias", "h0", "c0")
    out1, h1, c1, saved1 = lltm_cupy.forward_sequence(*(one[n] for n in names))
    kept = [a.copy() for a in (out1, h1, c1)]
    grads = [g.copy() for g in lltm_cupy.backward_sequence(np.ones_like(out1), None, None, saved1)]
    out1, h1, c1, saved1 = lltm_cupy.forward_sequence(*(one[n] for n in names))
    # a second call (and its backward) while the first one's outputs and saved are held
    out2, _, _, saved2 = lltm_cupy.forward_sequence(*(two[n] for n in names))
    lltm_cupy.backward_sequence(np.ones_like(out2), None, None, saved2)
    for got, want in zip((out1, h1, c1), kept):
        np.testing.assert_array_equal(got, want)
    again = lltm_cupy.backward_sequence(np.ones_like(out1), None, None, saved1)
    for got, want in zip(again, grads):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_torch_outputs_and_pending_backwards_survive_later_calls(recycle_all, packed):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    from torch.nn.utils.rnn import pack_padded_sequence
    from lltm_cupy.torch import LLTM

    torch.manual_seed(0)
    model = LLTM(4, 7)
    xs = [torch.randn(6, 5, 4) for _ in range(2)]
    lengths = torch.tensor([6, 3, 5, 1, 4])

    def run(x):
        if packed:
            x = pack_padded_sequence(x, lengths, enforce_sorted=False)
        out, (h, c) = model(x)
        return (out.data if packed else out), h, c

    def grads_of(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    # each call alone: its outputs and gradients
    alone = []
    for x in xs:
        out, h, c = run(x)
        alone.append(([t.clone() for t in (out, h, c)], grads_of(out.sum() + h.sum() + c.sum())))
    # both forwards before one backward (what each keeps for it is held meanwhile), then the
    # first call's outputs, kept by the caller, read after a third call
    first, second = run(xs[0]), run(xs[1])
    summed = grads_of(sum(t.sum() for t in first + second))
    want = [a + b for a, b in zip(alone[0][1], alone[1][1])]
    for got, expected in zip(summed, want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        run(xs[1])
    for got, expected in zip(first, alone[0][0]):
        assert torch.equal(got, expected)
    with torch.no_grad():       # forward only: an output kept while the next call runs
        kept = run(xs[0])
        run(xs[1])
    for got, expected in zip(kept, alone[0][0]):
        assert torch.equal(got, expected)
