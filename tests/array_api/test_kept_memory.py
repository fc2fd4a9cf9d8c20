"""What the CPU backend keeps per thread (``lltm_cupy._numpy.memory``): each thread its own
workspaces, the steps over them made once per thread and shape whatever runs between, and
``forget`` dropping all of it, the torch layer's recycled tensors included. (After a fork:
tests/processes/test_fork.py; after a call that failed half-way:
tests/processes/test_faults_cpu.py.)"""
from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest

import lltm_cupy
from lltm_cupy._numpy import memory

from helpers.lengths_reference import NAMES as SEQ_NAMES, _case as make_sequence

B, F, S = 16, 8, 64


def _case(seed, steps=5):
    return make_sequence(steps, B, F, S, np.float32, seed)


def _run(a):
    """A cell step and a sequence each way through the array API: every result's bytes."""
    x, w, b, h0, c0 = (a[n] for n in SEQ_NAMES)
    h, c, saved = lltm_cupy.forward(x[0], w, b, h0, c0)
    cell = lltm_cupy.backward(a["grad_h_n"], a["grad_c_n"], saved)
    out, h_n, c_n, saved = lltm_cupy.forward_sequence(x, w, b, h0, c0)
    grads = lltm_cupy.backward_sequence(a["grad_outputs"], None, a["grad_c_n"], saved)
    return [r.tobytes() for r in (h, c, *cell, out, h_n, c_n, *grads)]


def test_threads_each_run_on_their_own_workspace():
    """Four threads calling at once, each on its own inputs of one shape, get the bits one
    thread gets alone: no thread writes a workspace or scratch another is using."""
    cases = [_case(seed) for seed in range(4)]
    want = [_run(a) for a in cases]
    wrong, errors = [0] * len(cases), []
    start = threading.Barrier(len(cases))

    def work(i):
        try:
            start.wait()
            for _ in range(40):
                wrong[i] += _run(cases[i]) != want[i]
        except BaseException as exc:    # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert wrong == [0] * len(cases), f"calls with results other than one thread's: {wrong}"


def test_the_one_step_forward_is_made_once_and_maps_nothing_again(monkeypatch):
    """The one-step forward's element-wise step is made once per thread and shape and runs on
    memory mapped once: a call between two steps that grows the thread's scratch (a longer
    sequence's backward) makes neither the step nor a mapping for it again."""
    a = _case(0, steps=40)
    memory.forget()
    x, w, b, h0, c0 = (a[n] for n in SEQ_NAMES)
    step = lambda: lltm_cupy.forward(x[0], w, b, h0, c0)     # noqa: E731
    step()
    made, mapped = [], []
    real_step, real_mmap = memory.forward_step, mmap.mmap
    monkeypatch.setattr(memory, "forward_step",
                        lambda *args: made.append(args) or real_step(*args))
    monkeypatch.setattr(mmap, "mmap", lambda *args, **kw: mapped.append(args) or
                        real_mmap(*args, **kw))
    out, _, _, saved = lltm_cupy.forward_sequence(x, w, b, h0, c0)
    lltm_cupy.backward_sequence(np.ones_like(out), None, None, saved)   # grows the scratch
    made.clear()
    mapped.clear()
    for _ in range(3):
        step()
    assert (made, mapped) == ([], [])
    memory.forget()


def test_forget_drops_everything_the_thread_keeps(monkeypatch):
    """One ``forget`` drops the workspaces, the scratch and the recycled arrays of both kinds:
    the backend's and the torch layer's tensors."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
    from lltm_cupy.torch import LLTM

    monkeypatch.setattr(memory, "RECYCLE_BYTES", 0)        # every array recycled
    memory.forget()
    out, _, _, saved = lltm_cupy.forward_sequence(*(_case(0)[n] for n in SEQ_NAMES))
    lltm_cupy.backward_sequence(np.ones_like(out), None, None, saved)
    torch.manual_seed(0)
    out, (h, c) = LLTM(F, S)(torch.randn(5, B, F))
    (out.sum() + h.sum() + c.sum()).backward()
    kept = memory._kept
    assert kept.workspaces and kept.scratch
    assert kept.recycled.get("numpy") and kept.recycled.get("torch"), kept.recycled
    memory.forget()
    assert (kept.workspaces, kept.scratch, kept.recycled) == ({}, {}, {})
