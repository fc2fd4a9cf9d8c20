"""Processes that fork after using the library: each keeps its own memory.

``DataLoader(num_workers > 0)``, ``multiprocessing.Pool`` and Hogwild training fork a process
that has already run the library, so the child inherits what the library keeps between calls
(the CPU backend's scratch, sequence workspaces and the one-step forward's kept views; the
packing plans). Every test here warms the library up in the parent, forks, and runs the same
calls in parent and child at the same time, each result compared bit for bit with what one
process computed; on the GPU backend the child gets a clear error instead (a CUDA context does
not survive a fork). The helpers: tests/helpers/forking.py (why the child runs one thread).
"""
from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
import torch

import lltm_cupy
from lltm_cupy._numpy import memory
from lltm_cupy.torch import LLTM, LLTMCell, lltm_sequence
from helpers.forking import in_child, in_parent_and_child, same
from helpers import fork_work

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")

#: calls each process makes at the same time: enough that parent and child overlap many times
#: (with the scratch shared, 20-70 % of them came out wrong)
ROUNDS = 40


def _no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def _training(module, make_input, make_state=None):
    """A forward and backward of ``module``: the outputs, then every gradient (input, state,
    parameters)."""
    def run():
        x = make_input().requires_grad_()
        state = None if make_state is None else tuple(s.requires_grad_() for s in make_state())
        module.zero_grad(set_to_none=True)
        out = module(x) if state is None else module(x, state)
        outputs = _flatten(out)
        sum((o.float() * (i + 1)).sum() for i, o in enumerate(outputs)).backward()
        grads = [x.grad] + ([] if state is None else [s.grad for s in state])
        return (*(o.detach() for o in outputs), *grads,
                *(p.grad for p in module.parameters()))
    return run


def _flatten(out):
    if isinstance(out, torch.nn.utils.rnn.PackedSequence):
        return [out.data]
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flatten(o)]


def _check(run, rounds=ROUNDS):
    expected = run()
    assert same(run(), expected), "not deterministic in one process"
    wrong_parent, wrong_child = in_parent_and_child(run, expected, rounds)
    assert (wrong_parent, wrong_child) == (0, 0), (
        f"after a fork, {wrong_parent} of {rounds} results in the parent and {wrong_child} in "
        f"the child differ from one process's")
    assert same(run(), expected)


def _inputs(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return lambda: torch.randn(*shape, generator=g.manual_seed(seed), dtype=dtype)


# ----------------------------------------------------------------------------- the memory rule

def test_a_forked_child_writes_its_own_copy_of_the_kept_memory():
    """The rule itself, deterministically: what a child writes into the scratch buffer and a
    sequence workspace it inherited is not seen by the parent, and the reverse."""
    dtype = np.dtype(np.float64)
    scratch = memory.scratch(1000, dtype)
    scratch[:] = 1.0
    space = memory.workspace(4, 8, dtype)
    space.d_c[...] = 2.0

    def child():
        mine = memory.scratch(1000, dtype)
        assert mine.ctypes.data == scratch.ctypes.data     # the same (inherited) buffer
        mine[:] = -1.0
        memory.workspace(4, 8, dtype).d_c[...] = -2.0
        raise SystemExit(0)

    assert in_child(child) == ("SystemExit", "0")
    assert (memory.scratch(1000, dtype) == 1.0).all(), "the child wrote the parent's scratch"
    assert (memory.workspace(4, 8, dtype).d_c == 2.0).all(), \
        "the child wrote the parent's sequence workspace"


# ------------------------------------------------------------------------- torch layer, CPU

@pytest.mark.parametrize("mode", ["no_grad", "training"])
def test_lltm_cell_after_a_fork(mode):
    torch.manual_seed(0)
    cell = LLTMCell(16, 96).double()
    x = _inputs(64, 16)
    if mode == "no_grad":
        _check(_no_grad(lambda: cell(x())))
    else:
        _check(_training(cell, x, lambda: (torch.zeros(64, 96, dtype=torch.float64) + 0.1,
                                           torch.zeros(64, 96, dtype=torch.float64) - 0.2)))


@pytest.mark.parametrize("case", ["padded", "no_grad", "bidirectional", "packed"])
def test_lltm_after_a_fork(case):
    torch.manual_seed(0)
    model = LLTM(8, 48, num_layers=2 if case == "bidirectional" else 1,
                 bidirectional=case == "bidirectional").double()
    x = _inputs(12, 16, 8)
    if case == "no_grad":
        _check(_no_grad(lambda: model(x())))
    elif case == "packed":
        lengths = torch.tensor([12, 3, 9, 12, 1, 7, 12, 5, 2, 12, 11, 4, 6, 8, 10, 12])

        def packed():
            return torch.nn.utils.rnn.pack_padded_sequence(x(), lengths, enforce_sorted=False)

        def run():
            data = packed()
            data.data.requires_grad_()
            model.zero_grad(set_to_none=True)
            out, (h_n, c_n) = model(data)
            (out.data.sum() + 2 * h_n.sum() + 3 * c_n.sum()).backward()
            return (out.data.detach(), h_n.detach(), c_n.detach(), data.data.grad,
                    *(p.grad for p in model.parameters()))
        _check(run)
    else:
        _check(_training(model, x))


def test_lltm_sequence_with_lengths_after_a_fork():
    torch.manual_seed(0)
    cell = LLTMCell(8, 40).double()
    x = _inputs(10, 12, 8)
    lengths = [10, 1, 4, 0, 10, 7, 3, 10, 9, 2, 5, 6]

    def run():
        inputs = x().requires_grad_()
        h0 = torch.zeros(12, 40, dtype=torch.float64, requires_grad=True)
        c0 = torch.zeros(12, 40, dtype=torch.float64, requires_grad=True)
        cell.zero_grad(set_to_none=True)
        out, h_n, c_n = lltm_sequence(inputs, cell.weights, cell.bias, h0, c0, lengths=lengths)
        (out.sum() + 2 * h_n.sum() + 3 * c_n.sum()).backward()
        return (out.detach(), h_n.detach(), c_n.detach(), inputs.grad, h0.grad, c0.grad,
                cell.weights.grad, cell.bias.grad)
    _check(run)


# --------------------------------------------------------------------------------- array API

def _case(batch=48, features=8, state=40, steps=10):
    rng = np.random.default_rng(1)
    params = lltm_cupy.init_parameters(features, state, num_layers=2, bidirectional=True,
                                       rng=rng, dtype="float64")
    return dict(params=params, W=params["weights_l0"], b=params["bias_l0"],
                x=rng.standard_normal((batch, features)),
                xs=rng.standard_normal((steps, batch, features)),
                h=rng.standard_normal((batch, state)), c=rng.standard_normal((batch, state)),
                lengths=list(rng.integers(0, steps + 1, batch)))


def test_array_api_cell_after_a_fork():
    k = _case()

    def run():
        new_h, new_cell, saved = lltm_cupy.forward(k["x"], k["W"], k["b"], k["h"], k["c"])
        g = lltm_cupy.backward(np.ones_like(new_h), new_cell * 0.5, saved)
        return (new_h, new_cell, *g)
    _check(run)


@pytest.mark.parametrize("lengths", [False, True])
def test_array_api_sequence_after_a_fork(lengths):
    k = _case()
    kw = {"lengths": k["lengths"]} if lengths else {}

    def run():
        out, h_n, c_n, saved = lltm_cupy.forward_sequence(k["xs"], k["W"], k["b"], k["h"],
                                                          k["c"], **kw)
        g = lltm_cupy.backward_sequence(np.ones_like(out), h_n, None, saved)
        only = lltm_cupy.forward_sequence(k["xs"], k["W"], k["b"], k["h"], k["c"], **kw,
                                          return_saved=False)
        return (out, h_n, c_n, *g, *only[:3])
    _check(run)


def test_array_api_layers_after_a_fork():
    k = _case(batch=24, state=24, steps=6)

    def run():
        out, h_n, c_n, saved = lltm_cupy.forward_layers(k["xs"], k["params"],
                                                        lengths=k["lengths"])
        g = lltm_cupy.backward_layers(np.ones_like(out), None, c_n, saved)
        return (out, h_n, c_n, g.d_inputs, *(g.d_parameters[n] for n in sorted(k["params"])))
    _check(run)


# ------------------------------------------------------- worker processes as people run them

@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_beside_a_busy_parent(context):
    """DataLoader workers run the model on their items while the parent runs it too: every
    item's result and every one of the parent's is one process's."""
    torch.manual_seed(0)
    dataset = fork_work.ModelItems(seed=0, items=24)
    expected = [dataset[i] for i in range(len(dataset))]       # warms up the parent
    parent_run = _no_grad(lambda: dataset.model(dataset.inputs(0)))
    parent_expected = parent_run()
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                         multiprocessing_context=context)
    wrong_items = wrong_parent = 0
    for i, item in enumerate(loader):
        wrong_items += not same(item, expected[i])
        for _ in range(4):
            wrong_parent += not same(parent_run(), parent_expected)
    assert (wrong_items, wrong_parent) == (0, 0), (
        f"{wrong_items} of {len(dataset)} items from the workers and {wrong_parent} of the "
        f"parent's results differ from one process's")


def test_pool_runs_the_array_api_beside_the_parent():
    k = _case()
    args = [(k["xs"], k["W"], k["b"], k["h"], k["c"], seed) for seed in range(8)]
    expected = [fork_work.sequence_result(*a) for a in args]     # warms up the parent
    context = multiprocessing.get_context("fork")
    with context.Pool(2, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        pending = pool.starmap_async(fork_work.sequence_result, args)
        wrong_parent = sum(not same(fork_work.sequence_result(*args[i % 8]), expected[i % 8])
                           for i in range(24))
        results = pending.get(timeout=300)
    wrong = sum(not same(r, e) for r, e in zip(results, expected))
    assert (wrong, wrong_parent) == (0, 0), \
        f"{wrong} of 8 pool results and {wrong_parent} of 24 of the parent's are wrong"


def test_hogwild_training_falls_as_in_one_process():
    """pytorch/examples' mnist_hogwild: the model's parameters in shared memory, several forked
    processes training it at once. The loss falls as it does when one process takes all the
    steps (asynchronous updates change the path, not where it goes); with the processes'
    scratch shared, their gradients were wrong and the loss did not fall."""
    torch.manual_seed(0)
    initial = fork_work.HogwildTask()
    start_loss = initial.loss()     # warms up the parent before the fork
    one = fork_work.HogwildTask()
    one.model.load_state_dict(initial.model.state_dict())
    one.train(steps=2 * fork_work.HOGWILD_STEPS, seed=100)
    single_loss = one.loss()
    shared = fork_work.HogwildTask()
    shared.model.load_state_dict(initial.model.state_dict())
    shared.model.share_memory()
    shared.loss()
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=fork_work.hogwild_worker, args=(shared, 100 + 7 * r))
               for r in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    assert [w.exitcode for w in workers] == [0, 0]
    hogwild_loss = shared.loss()
    assert single_loss < 0.5 * start_loss, (start_loss, single_loss)
    assert np.isfinite(hogwild_loss) and hogwild_loss < 1.5 * single_loss, (
        f"Hogwild training: loss {start_loss:.4g} -> {hogwild_loss:.4g}; one process: "
        f"-> {single_loss:.4g}")


# --------------------------------------------------------------------------- the GPU backend

def test_a_child_forked_after_the_gpu_backend_ran_gets_a_clear_error(emulated_cupy):
    """A CUDA context is not usable in a forked child: the GPU backend refuses there with an
    error naming the library and the way out (as torch refuses its own CUDA calls); the parent
    goes on."""
    cp = emulated_cupy
    k = _case(batch=4, state=8)
    args = [cp.asarray(k[n]) for n in ("x", "W", "b", "h", "c")]
    expected = lltm_cupy.forward(*args)[:2]

    found = in_child(lambda: lltm_cupy.forward(*args))
    assert found is not None and found[0] == "RuntimeError", found
    assert "lltm_cupy" in found[1] and "fork" in found[1] and "spawn" in found[1], found[1]
    found = in_child(lambda: lltm_cupy.forward_sequence(
        cp.asarray(k["xs"][:, :4]), *args[1:]))
    assert found is not None and "lltm_cupy" in found[1] and "fork" in found[1], found
    assert same(lltm_cupy.forward(*args)[:2], expected), "the parent changed"


def test_a_child_forked_after_the_torch_cuda_path_ran_gets_a_clear_error(emulated_cuda_torch):
    torch.manual_seed(0)
    cell = LLTMCell(8, 16).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = cell(x)
    found = in_child(_no_grad(lambda: cell(x)))
    assert found is not None and found[0] == "RuntimeError", found
    assert "lltm_cupy" in found[1] and "fork" in found[1], found[1]
    with torch.no_grad():
        assert same(cell(x), expected)
