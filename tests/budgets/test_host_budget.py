"""The host work of the CUDA path, counted on the emulated CuPy (tests/helpers/emulated_cupy.py's
``counts``): per call and per sequence step, the CuPy arrays made (views included), DLPack
conversions, allocations, stream objects made (CuPy's and torch's), kernel launches and GEMMs.
On a GPU each of these costs host time, and the host, not the GPU, decides the speed of an eager
step at the sizes of tests/budgets/test_launch_budget.py.

The budgets:

- a step of a sequence on the default (per-step) path, forward and backward, through the array
  API and through the torch layer: one kernel launch and one GEMM, and no CuPy array, DLPack
  conversion, allocation or stream object (per-step figures are the difference of two sequence
  lengths, divided by the steps between them);
- forward only with variable lengths (``lengths=``, a PackedSequence's data), every layout: the
  same per step; per block of steps the input projection's GEMM (:data:`BLOCK_ARRAYS`); where
  the outputs need a scatter (a permutation, reverse), one every ``SCATTER_STEPS`` steps
  (:data:`SCATTER_ARRAYS`); where sequences end, two device-to-device copies on pointers and
  no object;
- an ``LLTMCell`` step through the torch layer: the launches and GEMMs of
  tests/budgets/test_launch_budget.py and nothing else: no CuPy array, DLPack conversion, allocation
  or stream object (its kernels run on the tensors' device pointers, its buffers are torch's).
"""
from __future__ import annotations

import numpy as np
import pytest

import lltm_cupy
from lltm_cupy import _cuda, _packing
from lltm_cupy._cuda import packed as _packed, sequence as _sequence

#: (arrays, DLPack conversions, allocations) at most of one LLTMCell forward and of its
#: backward with every gradient
CELL_FORWARD = (0, 0, 0)
CELL_BACKWARD = (0, 0, 0)


def _per_step(short, long, steps):
    return {k: (long[k] - short[k]) / steps for k in short}


def _sequence_case(xp, steps, batch=4, features=3, state=6, dtype=np.float32):
    rng = np.random.default_rng(steps)
    xs = rng.standard_normal((steps, batch, features)).astype(dtype)
    w = (rng.standard_normal((3 * state, state + features)) / 3).astype(dtype)
    b, h0, c0 = (rng.standard_normal(s).astype(dtype) for s in
                 (3 * state, (batch, state), (batch, state)))
    g = rng.standard_normal((steps, batch, state)).astype(dtype)
    return [xp.asarray(a) for a in (xs, w, b, h0, c0, g)]


def _counted(emu, forward):
    """(forward, backward) tallies of ``forward()``, which runs a forward and returns a callable
    that runs its backward (or None)."""
    emu.reset()
    backward = forward()
    counts = emu.tally()
    if backward is None:
        return counts, None
    emu.reset()
    backward()
    return counts, emu.tally()


def _array_api_counts(cupy, steps, dtype, keep, **kw):
    """(forward, backward) tallies of one sequence through the array API."""
    xs, w, b, h0, c0, g = _sequence_case(cupy, steps, dtype=dtype)

    def forward():
        *_, saved = lltm_cupy.forward_sequence(xs, w, b, h0, c0, return_saved=keep, **kw)
        return keep and (lambda: lltm_cupy.backward_sequence(g, h0, c0, saved)) or None

    return _counted(cupy.emulator, forward)


EMPTY_STEP = dict(arrays=0, dlpack=0, allocations=0, streams=0, launches=1, gemms=1)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("keep", [True, False], ids=["training", "forward-only"])
def test_a_sequence_step_makes_nothing_but_a_launch_and_a_gemm(emulated_cupy, dtype, keep):
    short = _array_api_counts(emulated_cupy, 3, dtype, keep)
    long = _array_api_counts(emulated_cupy, 8, dtype, keep)
    assert _per_step(short[0], long[0], 5) == EMPTY_STEP, "forward"
    if keep:
        assert _per_step(short[1], long[1], 5) == EMPTY_STEP, "backward"


@pytest.mark.parametrize("reverse", [False, True])
def test_a_variable_length_training_step_makes_nothing_but_a_launch_and_a_gemm(emulated_cupy,
                                                                               reverse):
    """Variable lengths, both directions: the same budget per step (one sequence a step shorter
    than the others at both lengths: where sequences end, the backward makes the incoming cell
    gradient, an array of its own, once per call here)."""
    short, long = (_array_api_counts(emulated_cupy, steps, np.float32, True,
                                     lengths=[steps, steps, steps - 1, steps], reverse=reverse)
                   for steps in (3, 8))
    assert _per_step(short[0], long[0], 5) == EMPTY_STEP, "forward"
    assert _per_step(short[1], long[1], 5) == EMPTY_STEP, "backward"


def test_a_torch_lltm_step_makes_nothing_but_a_launch_and_a_gemm(emulated_cuda_torch):
    torch = pytest.importorskip("torch")
    from lltm_cupy.torch import LLTM

    emu = emulated_cuda_torch.emulator
    torch.manual_seed(0)
    model = LLTM(3, 6)
    h, c = torch.randn(4, 6), torch.randn(4, 6)

    def counts(steps):
        xs = torch.randn(steps, 4, 3)

        def forward():
            out, (_, c_n) = model(xs, (h, c))
            return lambda: torch.autograd.backward(
                (out, c_n), (torch.ones_like(out), torch.ones_like(c_n)))

        return _counted(emu, forward)

    counts(3)                   # the first call makes what later calls reuse
    short, long = counts(3), counts(8)
    assert _per_step(short[0], long[0], 5) == EMPTY_STEP, "forward"
    assert _per_step(short[1], long[1], 5) == EMPTY_STEP, "backward"


def test_an_lltm_cell_step_stays_within_its_budget(emulated_cuda_torch):
    torch = pytest.importorskip("torch")
    from lltm_cupy.torch import LLTMCell

    emu = emulated_cuda_torch.emulator
    torch.manual_seed(0)
    cell = LLTMCell(32, 128)
    x, h, c = (torch.randn(16, n).requires_grad_() for n in (32, 128, 128))
    ones = torch.ones(16, 128)

    def step():
        out = cell(x, (h, c))
        return lambda: torch.autograd.backward(out, (ones, ones))

    step()                      # the first call makes what later calls reuse
    for _ in range(2):          # the same on every later call
        forward, backward = _counted(emu, step)
        for name, got, (arrays, dlpack, allocations), launches, gemms in (
                ("forward", forward, CELL_FORWARD, 2, 1),
                ("backward", backward, CELL_BACKWARD, 1, 3)):
            assert got["streams"] == 0, f"{name}: {got['streams']} stream objects made"
            assert (got["launches"], got["gemms"]) == (launches, gemms), (name, got)
            assert got["arrays"] <= arrays, (name, got)
            assert got["dlpack"] <= dlpack, (name, got)
            assert got["allocations"] <= allocations, (name, got)


#: Forward-only variable-length layouts: name -> (lengths at T steps (a PackedSequence's
#: batch_sizes of the same lengths where ``packed``), reverse, packed)
FORWARD_ONLY_LAYOUTS = {
    "lengths, sorted": (lambda t: [t, t, t, t - 1], False, False),
    "lengths, unsorted": (lambda t: [t, t, t - 1, t], False, False),
    "lengths, sorted, reverse": (lambda t: [t, t, t, t - 1], True, False),
    "packed": (lambda t: [t, t, t, t - 1], False, True),
    "packed, reverse": (lambda t: [t, t, t, t - 1], True, True)}

#: CuPy arrays at most of one scatter of a forward only with variable lengths, where the outputs
#: need one (a permutation, reverse): the index arrays' slices (two for padded outputs, one for a
#: PackedSequence's data) and the hidden states' rows it reads
SCATTER_ARRAYS = 3
#: ... of one block of steps beyond its steps: the views of the block's packed inputs and gates
#: its input projection reads and writes
BLOCK_ARRAYS = 2


def _direct(layout):
    """Whether the layout's hidden states go straight into the outputs (no scatter)."""
    lengths, reverse, packed = layout
    return not reverse and (packed or lengths(3) == sorted(lengths(3), reverse=True))


def _forward_only_counts(emu, cupy, lengths, reverse, packed, dtype=np.float32):
    """The tallies (with the copies of the log) of one variable-length forward only."""
    steps = max(lengths)
    xs, w, b, h0, c0, _ = _sequence_case(cupy, steps, batch=len(lengths), dtype=dtype)
    if packed:
        sizes = [sum(n > t for n in lengths) for t in range(steps)]
        plan = _packing.packed_plan(sizes, reverse)
        data = cupy.asarray(np.random.default_rng(steps).standard_normal(
            (plan.rows, xs.shape[2])).astype(dtype))

        def run():
            return _cuda.forward_sequence(data, w, b, h0, c0, plan=plan, keep=False)
    else:
        def run():
            return lltm_cupy.forward_sequence(xs, w, b, h0, c0, lengths=lengths, reverse=reverse,
                                              return_saved=False)
    run()           # the plan's index arrays are uploaded by the first call
    emu.reset()
    assert run()[3] is None
    return dict(emu.tally(), copies=emu.log.count("copy"))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("layout", FORWARD_ONLY_LAYOUTS.values(), ids=FORWARD_ONLY_LAYOUTS.keys())
def test_a_variable_length_forward_only_step_makes_nothing_but_a_launch_and_a_gemm(
        emulated_cupy, layout, dtype):
    """Forward only, variable lengths, every layout (one block of steps at both lengths): one
    launch and one GEMM a step and nothing else; where the outputs need a scatter, one every
    ``SCATTER_STEPS`` steps (of the whole batch), of at most :data:`SCATTER_ARRAYS` arrays."""
    lengths, reverse, packed = layout
    short, long = (_forward_only_counts(emulated_cupy.emulator, emulated_cupy, lengths(steps),
                                        reverse, packed, dtype) for steps in (3, 19))
    per_step = _per_step(short, long, 16)
    scatters = per_step.pop("copies")
    assert scatters == (0 if _direct(layout) else 1 / _packed.SCATTER_STEPS), per_step
    assert per_step["arrays"] <= SCATTER_ARRAYS * scatters, per_step
    assert dict(per_step, arrays=0) == dict(EMPTY_STEP, arrays=0), per_step


@pytest.mark.parametrize("layout", FORWARD_ONLY_LAYOUTS.values(), ids=FORWARD_ONLY_LAYOUTS.keys())
def test_a_variable_length_forward_only_block_stays_within_its_budget(emulated_cupy,
                                                                       monkeypatch, layout):
    """Blocks of one step each (of the batch's 4 rows): a step then costs a block too, its
    input projection's GEMM and at most :data:`BLOCK_ARRAYS` arrays, and no allocation."""
    monkeypatch.setattr(_sequence, "_BLOCK_ROWS", 4)
    lengths, reverse, packed = layout
    short, long = (_forward_only_counts(emulated_cupy.emulator, emulated_cupy, lengths(steps),
                                        reverse, packed) for steps in (3, 19))
    per_step = _per_step(short, long, 16)
    scatters = per_step.pop("copies")
    assert scatters == (0 if _direct(layout) else 1 / _packed.SCATTER_STEPS), per_step
    assert per_step["arrays"] <= BLOCK_ARRAYS + SCATTER_ARRAYS * scatters, per_step
    assert dict(per_step, arrays=0) == dict(EMPTY_STEP, arrays=0, gemms=2), per_step


@pytest.mark.parametrize("layout", FORWARD_ONLY_LAYOUTS.values(), ids=FORWARD_ONLY_LAYOUTS.keys())
def test_where_sequences_end_a_forward_only_makes_two_copies_and_no_object(emulated_cupy,
                                                                           layout):
    """Four steps, lengths 4, 3, 3, 3 (two steps where sequences end) against 4, 3, 2, 1 (four),
    longest first or (unsorted) last, each one scatter (if any) in all: per step where
    sequences end, the rows of h and c that end there copied to the final state, by pointers,
    and nothing else."""
    _, reverse, packed = layout
    order = (lambda a: a[::-1]) if layout is FORWARD_ONLY_LAYOUTS["lengths, unsorted"] else list
    two, four = (_forward_only_counts(emulated_cupy.emulator, emulated_cupy, order(lengths),
                                      reverse, packed) for lengths in ([4, 3, 3, 3], [4, 3, 2, 1]))
    assert _per_step(two, four, 2) == dict(
        arrays=0, dlpack=0, allocations=0, streams=0, launches=0, gemms=0, copies=2)


def test_a_torch_lltm_forward_only_packed_step_makes_nothing_but_a_launch_and_a_gemm(
        emulated_cuda_torch):
    """The torch layer's PackedSequence input (unsorted lengths) under no_grad."""
    torch = pytest.importorskip("torch")
    from torch.nn.utils.rnn import pack_padded_sequence

    from lltm_cupy.torch import LLTM

    emu = emulated_cuda_torch.emulator
    torch.manual_seed(0)
    model = LLTM(3, 6)
    h, c = torch.randn(1, 4, 6), torch.randn(1, 4, 6)

    def counts(steps):
        packed = pack_padded_sequence(torch.randn(steps, 4, 3), [steps, steps, steps - 1, steps],
                                      enforce_sorted=False)
        with torch.no_grad():
            model(packed, (h, c))           # the first call with these lengths uploads the plan
            emu.reset()
            model(packed, (h, c))
        return emu.tally()

    short, long = counts(3), counts(8)
    assert _per_step(short, long, 5) == EMPTY_STEP
