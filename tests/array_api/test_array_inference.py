"""Forward only (``return_saved=False``): the same bits as the training forward, nothing kept.

On the NumPy backend and the GPU backend over the emulated CuPy (and the real one with a GPU):
one step, fixed-length sequences in blocks of steps (the projection block made small here, so
that several blocks and a partial last one run), variable lengths, reverse, and a
PackedSequence's own layout. What is kept is checked by the memory the calls take: tracemalloc
on NumPy, the emulated CuPy's allocation log on the GPU path.
"""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from lltm_cupy import _cuda, _numpy, _packing
from lltm_cupy._cuda import sequence as _sequence
from conftest import TOLERANCE, max_error, reference_results, make_case, to_numpy
from helpers.memory import peak_traced_bytes

NAMES = ("input", "weights", "bias", "old_h", "old_cell")
SEQ = ("inputs", "weights", "bias", "h0", "c0")


@pytest.fixture
def small_blocks(monkeypatch):
    """Projection blocks of 8 rows on both backends (several blocks at the tests' sizes)."""
    monkeypatch.setattr(_numpy.sequence, "_BLOCK_ROWS", 8)
    monkeypatch.setattr(_sequence, "_BLOCK_ROWS", 8)


def _sequence_case(steps, batch, features, state, dtype, seed=0, bias_2d=False):
    rng = np.random.default_rng(seed)
    k = state + features
    case = dict(inputs=rng.standard_normal((steps, batch, features)),
                weights=rng.uniform(-1, 1, (3 * state, k)) / np.sqrt(k) * 2,
                bias=rng.uniform(-1, 1, (1, 3 * state) if bias_2d else 3 * state),
                h0=rng.uniform(-1, 1, (batch, state)), c0=rng.standard_normal((batch, state)))
    return {k: v.astype(dtype) for k, v in case.items()}


def _same_bits(got, want, names):
    for name, g, w in zip(names, got, want):
        g, w = to_numpy(g), to_numpy(w)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert np.array_equal(g, w, equal_nan=True), (
            f"{name}: forward only differs from the training forward in "
            f"{int((g != w).sum())} of {g.size} values")


def _unchanged(before, after):
    for name in before:
        assert np.array_equal(to_numpy(before[name]), to_numpy(after[name])), (
            f"{name} was modified")


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_one_step_same_bits(xp, dtype):
    case = make_case(5, 7, 17, dtype, seed=1)
    args = [xp.asarray(case[n]) for n in NAMES]
    new_h, new_cell, saved = lltm_cupy.forward(*args)
    got = lltm_cupy.forward(*args, return_saved=False)
    assert len(got) == 3 and got[2] is None and saved is not None
    _same_bits(got[:2], (new_h, new_cell), ("new_h", "new_cell"))
    want = reference_results(case)
    assert max_error(got[0], want[0]) <= TOLERANCE[np.dtype(dtype)]


@pytest.mark.parametrize("steps", [0, 1, 7, 23])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_sequence_same_bits(xp, small_blocks, dtype, steps):
    case = _sequence_case(steps, 3, 4, 5, dtype, seed=steps)
    args = {n: xp.asarray(case[n]) for n in SEQ}
    kept = {n: a.copy() for n, a in args.items()}
    want = lltm_cupy.forward_sequence(*args.values())
    got = lltm_cupy.forward_sequence(*args.values(), return_saved=False)
    assert len(got) == 4 and got[3] is None
    _same_bits(got[:3], want[:3], ("outputs", "h_n", "c_n"))
    _unchanged(kept, args)


LENGTHS = {"unsorted with 0, 1, T and ties": [3, 0, 9, 1, 9, 3],
           "sorted with 0, 1, T and ties": [9, 9, 4, 4, 1, 0],
           "all full": [9] * 6, "all zero": [0] * 6, "one long": [1, 1, 9, 1, 1, 1]}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_lengths_same_bits(xp, small_blocks, dtype, lengths, reverse):
    case = _sequence_case(9, 6, 4, 5, dtype, seed=sum(lengths), bias_2d=reverse)
    args = {n: xp.asarray(case[n]) for n in SEQ}
    kept = {n: a.copy() for n, a in args.items()}
    want = lltm_cupy.forward_sequence(*args.values(), lengths=lengths, reverse=reverse)
    got = lltm_cupy.forward_sequence(*args.values(), lengths=lengths, reverse=reverse,
                                     return_saved=False)
    assert got[3] is None
    _same_bits(got[:3], want[:3], ("outputs", "h_n", "c_n"))
    _unchanged(kept, args)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lengths", [LENGTHS["sorted with 0, 1, T and ties"], LENGTHS["all full"],
                                     LENGTHS["unsorted with 0, 1, T and ties"]],
                         ids=["sorted", "full", "unsorted"])
def test_lengths_with_strided_states_same_bits(xp, small_blocks, lengths, reverse):
    """h0 and c0 as strided views (every other column of a wider array): with lengths already
    sorted no permutation copies them, and the forward only must still read them by their
    strides, as the training forward does (the states' rows are the kernel's old_cell at
    step 0)."""
    case = _sequence_case(9, 6, 4, 5, np.float64, seed=7)
    wide = {n: np.repeat(case[n], 2, axis=1) for n in ("h0", "c0")}
    wide["h0"][:, 1::2], wide["c0"][:, 1::2] = 99.0, -99.0
    args = {n: xp.asarray(case[n]) for n in ("inputs", "weights", "bias")}
    args["h0"], args["c0"] = (xp.asarray(wide[n])[:, ::2] for n in ("h0", "c0"))
    want = lltm_cupy.forward_sequence(*(xp.asarray(case[n]) for n in SEQ), lengths=lengths,
                                      reverse=reverse)
    got = lltm_cupy.forward_sequence(*(args[n] for n in SEQ), lengths=lengths, reverse=reverse,
                                     return_saved=False)
    _same_bits(got[:3], want[:3], ("outputs", "h_n", "c_n"))


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_packed_layout_same_bits(xp, small_blocks, reverse):
    """The torch layer's PackedSequence path: data (N, F) in and out, through the backends."""
    backend = _numpy if xp is np else _cuda
    batch_sizes = (4, 4, 3, 1, 1)     # states in the sorted order: the caller permutes them
    plan = _packing.packed_plan(batch_sizes, reverse)
    case = _sequence_case(1, 4, 3, 6, np.float64, seed=5)
    data = xp.asarray(np.random.default_rng(6).standard_normal((sum(batch_sizes), 3)))
    args = [data] + [xp.asarray(case[n]) for n in SEQ[1:]]
    want = backend.forward_sequence(*args, plan=plan)
    got = backend.forward_sequence(*args, plan=plan, keep=False)
    assert got[3] is None
    _same_bits(got[:3], want[:3], ("data", "h_n", "c_n"))


def test_blocks_give_the_same_bits_as_one_block(monkeypatch):
    """Forward only with many projection blocks against the training forward with one: equal
    within rounding (a GEMM of fewer rows may round differently), and equal to the reference."""
    case = _sequence_case(20, 3, 4, 5, np.float64, seed=9)
    args = [case[n] for n in SEQ]
    one = lltm_cupy.forward_sequence(*args)
    monkeypatch.setattr(_numpy.sequence, "_BLOCK_ROWS", 3)
    many = lltm_cupy.forward_sequence(*args, return_saved=False)
    for name, a, b in zip(("outputs", "h_n", "c_n"), many, one):
        assert max_error(a, b) <= 1e-13, name


def test_bad_return_saved_and_backward_of_nothing():
    case = make_case(2, 3, 4, np.float64)
    args = [case[n] for n in NAMES]
    for bad in (0, None, "no"):
        with pytest.raises(TypeError, match="return_saved must be True or False"):
            lltm_cupy.forward(*args, return_saved=bad)
    *_, saved = lltm_cupy.forward(*args, return_saved=np.bool_(False))
    with pytest.raises(TypeError, match="return_saved=False keeps nothing"):
        lltm_cupy.backward(args[3], None, saved)
    seq = _sequence_case(3, 2, 3, 4, np.float64)
    *_, saved = lltm_cupy.forward_sequence(*(seq[n] for n in SEQ), return_saved=False)
    with pytest.raises(TypeError, match="return_saved=False keeps nothing"):
        lltm_cupy.backward_sequence(None, seq["h0"], None, saved)


@pytest.mark.parametrize("lengths", [None, "ragged"])
def test_numpy_memory_beyond_the_outputs_does_not_grow_with_steps(monkeypatch, lengths):
    """Peak bytes of the call minus its outputs' bytes, at 50 and 200 steps: forward only, the
    same but for the packed copy of the inputs and the packing plan's index arrays (F floats and
    three integers per packed row); the training forward keeps 5 * B * S values per step more."""
    monkeypatch.setattr(_numpy.sequence, "_BLOCK_ROWS", 64)
    B, F, S = 16, 8, 32
    extra, rows = {}, {}
    lltm_cupy.forward_sequence(*(_sequence_case(2, B, F, S, np.float32)[n] for n in SEQ),
                               lengths=[1] * B, return_saved=False)    # imports done
    for steps in (50, 200):
        case = _sequence_case(steps, B, F, S, np.float32, seed=steps)
        args = [case[n] for n in SEQ]
        ragged = np.where(np.arange(B) % 3, steps, steps // 2)
        kw = {} if lengths is None else {"lengths": ragged}
        rows[steps] = 0 if lengths is None else int(ragged.sum())
        for keep in (True, False):
            peak, (outputs, h_n, c_n, saved) = peak_traced_bytes(
                lambda: lltm_cupy.forward_sequence(*args, **kw, return_saved=keep))
            extra[steps, keep] = peak - outputs.nbytes
    grown = extra[200, False] - extra[50, False]
    assert grown <= (rows[200] - rows[50]) * (4 * F + 3 * 8) + 1024, extra
    per_step_kept = (extra[200, True] - extra[50, True]) / 150
    assert per_step_kept >= 0.9 * 5 * B * S * 4 * (0.5 if lengths else 1), extra


@pytest.mark.parametrize("lengths", [None, "ragged"])
def test_gpu_path_allocates_no_per_step_buffers(emulated_cupy, small_blocks, lengths):
    """Forward only on the GPU path: bytes allocated beyond the outputs do not grow with steps
    (one block of gates, two cell rows); with lengths, but for the packed copy of the inputs
    (F values per packed row); the training forward allocates 4 * B * S values per step more
    (gates and cells)."""
    emu = emulated_cupy.emulator
    B, F, S = 4, 3, 6
    extra, rows = {}, {}
    for steps in (40, 80):
        case = _sequence_case(steps, B, F, S, np.float32, seed=steps)
        args = [emulated_cupy.asarray(case[n]) for n in SEQ]
        lens = None if lengths is None else [steps, 3, 0, steps // 2]
        rows[steps] = 0 if lengths is None else sum(lens)
        for keep in (True, False):      # the plan's index arrays are uploaded by the first
            emu.reset()
            outputs, h_n, c_n, _ = lltm_cupy.forward_sequence(*args, lengths=lens,
                                                              return_saved=keep)
            # the fixed-length outputs are a view of [h0, outputs]
            outputs_bytes = (steps + (lengths is None)) * B * S * 4
            extra[steps, keep] = sum(emu.allocations) - outputs_bytes
    assert extra[80, False] - extra[40, False] <= (rows[80] - rows[40]) * F * 4, extra
    grown_kept = extra[80, True] - extra[40, True]
    assert grown_kept >= (40 * B if lengths is None else rows[80] - rows[40]) * 4 * S * 4, extra


LAYOUTS = {  # name: (lengths (None: a PackedSequence's batch_sizes of the same lengths), reverse)
    "lengths, sorted": ([1.0, 0.5, 0.5, 0.25, 0], False),
    "lengths, sorted, reverse": ([1.0, 0.5, 0.5, 0.25, 0], True),
    "lengths, unsorted": ([0.25, 1.0, 0, 0.5, 0.5], False),
    "packed": (None, False), "packed, reverse": (None, True)}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_gpu_variable_lengths_keep_no_packed_hidden_states(emulated_cupy, small_blocks, layout):
    """Forward only with variable lengths on the GPU path: each step's hidden state goes straight
    into the outputs (or through a buffer of a few steps' rows into them), so the bytes allocated
    beyond the outputs grow with the packed rows by at most the packed copy of the inputs (F
    values per row; none for a PackedSequence in the forward direction, whose data is the packed
    inputs), never by a hidden state per row (S values). The outputs are those of the training
    forward."""
    fractions, reverse = layout
    emu = emulated_cupy.emulator
    B, F, S = 5, 2, 16
    per_row = 0 if fractions is None and not reverse else F * 4
    extra, rows = {}, {}
    for steps in (24, 48):
        lens = [int(f * steps) for f in (fractions or [1.0, 0.5, 0.5, 0.25, 0])]
        rows[steps] = sum(lens)
        case = _sequence_case(steps, B, F, S, np.float32, seed=steps)
        args = [emulated_cupy.asarray(case[n]) for n in SEQ]
        if fractions is None:
            sizes = [sum(n > t for n in lens) for t in range(max(lens))]
            plan = _packing.packed_plan(sizes, reverse)
            data = emulated_cupy.asarray(
                np.random.default_rng(steps).standard_normal((rows[steps], F)).astype(np.float32))
            args[0] = data      # a PackedSequence holds no empty sequence: the state's rows
            args[3:] = [a[: sizes[0]] for a in args[3:]]    # are those of the sorted batch
            want = _cuda.forward_sequence(*args, plan=plan)
            emu.reset()
            got = _cuda.forward_sequence(*args, plan=plan, keep=False)
        else:
            want = lltm_cupy.forward_sequence(*args, lengths=lens, reverse=reverse)
            emu.reset()     # the plan's index arrays were uploaded by the call above
            got = lltm_cupy.forward_sequence(*args, lengths=lens, reverse=reverse,
                                             return_saved=False)
        assert not emu.transfers
        extra[steps] = sum(emu.allocations) - got[0].nbytes
        _same_bits(got[:3], want[:3], ("outputs", "h_n", "c_n"))
    assert extra[48] - extra[24] <= (rows[48] - rows[24]) * per_row, (
        f"bytes beyond the outputs {extra}: more than {per_row} per packed row")
