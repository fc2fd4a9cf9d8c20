#!/usr/bin/env python
"""Where the host time of a training step goes: cProfile of LLTMCell (or LLTM) steps.

Each step is the benchmark's: forward, then backward of every output with gradient one, for the
parameters. On the CPU the profile holds all the work; on the GPU kernels and GEMMs run
asynchronously, so it shows the Python and launch cost per step, which decides the speed at
small sizes (one synchronisation at the end waits for the queued work).

With ``--emulated`` it profiles nothing: it runs the torch layer's CUDA path on the emulated CuPy
of the tests (tests/helpers/emulated_cupy.py, kernels and GEMMs no-ops, every argument still
checked), on any machine, and prints per LLTMCell step and per LLTM sequence step (the
difference of two lengths, divided by the steps between them), forward and backward apart, and
per forward-only step with variable lengths (under no_grad: a PackedSequence, and unsorted
``lengths=``, whose outputs need a scatter), what the host makes (CuPy arrays, DLPack
conversions, allocations, stream objects) and launches (kernels, GEMMs), and the host time per
step (process time) beside the tutorial's eager cell on the CPU: medians of interleaved
repetitions. Run it with OMP_NUM_THREADS=1 for comparable numbers.

Examples:
    python scripts/profile_step.py                       # LLTMCell at (16, 32, 128) on the CPU
    python scripts/profile_step.py --cuda                # the same on the GPU
    python scripts/profile_step.py --cuda --sequence     # LLTM over T = 64 steps on the GPU
    OMP_NUM_THREADS=1 python scripts/profile_step.py --emulated   # host work of the CUDA path
    python scripts/profile_step.py --calls               # Python calls per step, CPU and CUDA

With ``--calls`` it counts, with ``sys.setprofile``, the calls of functions defined in lltm_cupy/
and the calls lltm_cupy code makes into CuPy (tests/helpers/calls.py), per LLTMCell forward +
backward and per LLTM call and step (padded, and on a PackedSequence of unsorted lengths), on
the CPU and on the emulated CUDA path: deterministic, no clock, what
tests/budgets/test_call_budget.py holds to its budgets.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("-b", "--batch-size", type=int, default=16)
    p.add_argument("-f", "--features", type=int, default=32)
    p.add_argument("-s", "--state-size", type=int, default=128)
    p.add_argument("-c", "--cuda", action="store_true", help="run on the GPU")
    p.add_argument("--sequence", action="store_true", help="profile LLTM over a sequence instead")
    p.add_argument("-t", "--steps", type=int, default=64, help="sequence length for --sequence")
    p.add_argument("-r", "--runs", type=int, default=None,
                   help="profiled steps (default: 300 for the cell, 5 sequences)")
    p.add_argument("--top", type=int, default=30, help="functions listed (default: 30)")
    p.add_argument("--sort", choices=("tottime", "cumtime", "ncalls"), default="tottime")
    p.add_argument("--emulated", action="store_true",
                   help="count and time the CUDA path's host work on the emulated CuPy")
    p.add_argument("--repeats", type=int, default=7,
                   help="interleaved repetitions of the --emulated timings (default: 7)")
    p.add_argument("--calls", action="store_true",
                   help="count the Python calls of a step (lltm_cupy's functions, and its calls "
                        "into CuPy) on the CPU and on the emulated CUDA path, instead of "
                        "profiling: the figures tests/budgets/test_call_budget.py pins")
    args = p.parse_args(argv)
    if args.calls:
        return calls(args)
    if args.emulated:
        return emulated(args)

    import torch

    import lltm_bench as bm
    from lltm_cupy.torch import LLTM, LLTMCell

    if args.cuda and not torch.cuda.is_available():
        print("--cuda given but torch finds no CUDA device", file=sys.stderr)
        return 2
    device = "cuda" if args.cuda else "cpu"
    B, F, S = args.batch_size, args.features, args.state_size
    torch.manual_seed(0)
    h = torch.randn(B, S, device=device)
    c = torch.randn(B, S, device=device)
    if args.sequence:
        module = LLTM(F, S, device=device)
        x = torch.randn(args.steps, B, F, device=device)
        runs = args.runs or 5

        def step():
            out, (_, c_n) = module(x, (h, c))
            torch.autograd.backward((out, c_n), (torch.ones_like(out), torch.ones_like(c_n)))
    else:
        module = LLTMCell(F, S, device=device)
        x = torch.randn(B, F, device=device)
        ones = torch.ones_like(h)
        runs = args.runs or 300

        def step():
            torch.autograd.backward(module(x, (h, c)), (ones, ones))

    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    for _ in range(max(3, runs // 10)):  # warm-up: compilation, caches, allocator
        step()
    sync()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(runs):
        step()
    sync()
    profiler.disable()
    wall = time.perf_counter() - t0

    what = f"LLTM over {args.steps} steps" if args.sequence else "LLTMCell"
    print(f"{what} at (batch, features, state) = ({B}, {F}, {S}), float32 on "
          f"{bm.machine_name(args.cuda)}; {runs} profiled steps, "
          f"{wall / runs * 1e6:.1f} us per step under the profiler (which slows Python calls)")
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats(args.sort).print_stats(args.top)
    print(out.getvalue().rstrip())
    return 0


def calls(args) -> int:
    """--calls: the Python calls of a step (see the module docstring)."""
    import pytest
    import torch

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    from helpers import emulated_cupy as emu, emulated_torch
    from helpers.calls import counted
    from torch.nn.utils.rnn import pack_padded_sequence

    from lltm_cupy.torch import LLTM, LLTMCell

    B, F, S = args.batch_size, args.features, args.state_size
    torch.manual_seed(0)
    h, c, ones = torch.randn(B, S), torch.randn(B, S), torch.ones(B, S)
    x = torch.randn(B, F)

    def cell_step():
        cell = LLTMCell(F, S)
        return lambda: torch.autograd.backward(cell(x, (h, c)), (ones, ones))

    def lltm_call(steps, packed=False):
        """An LLTM call, forward + backward; ``packed``: on a PackedSequence of unsorted lengths
        (the last sequence a step shorter)."""
        model = LLTM(F, S)
        xs = torch.randn(steps, B, F)

        def call():
            x = pack_padded_sequence(xs, [steps] * (B - 1) + [steps - 1],
                                     enforce_sorted=False) if packed else xs
            out, (_, c_n) = model(x, (h[None], c[None]))
            out = out.data if packed else out
            torch.autograd.backward((out, c_n), (torch.ones_like(out), torch.ones_like(c_n)))
        return call

    def count(run):
        run()
        run()
        return counted(run)[1]

    def report(where):
        cell = count(cell_step())
        short, long = count(lltm_call(4)), count(lltm_call(8))
        step = (long.total - short.total) / 4
        print(f"{where}: LLTMCell forward + backward {cell.library} library + {cell.cupy} "
              f"CuPy calls; LLTM call beyond its steps {short.total - 4 * step:g}, a step "
              f"{step:g} (library + CuPy; T = 4 and 8)")
        short, long = count(lltm_call(4, True)), count(lltm_call(8, True))
        step = (long.total - short.total) / 4
        print(f"{where}: LLTM call on a PackedSequence beyond its steps "
              f"{short.total - 4 * step:g}, a step {step:g}")
        if args.top:
            top = sorted(cell.names.items(), key=lambda kv: -kv[1])[:args.top]
            print("  LLTMCell's: " + ", ".join(f"{n} x{k}" for n, k in top))

    print(f"Python calls at (batch, features, state) = ({B}, {F}, {S}), float32, torch "
          f"{torch.__version__}")
    report("CPU")
    with pytest.MonkeyPatch.context() as patch:
        fake = emulated_torch.install_cupy(patch, emu.host_get_kernels(None))
        emulated_torch.install_torch(patch, fake)
        fake.emulator.noop = True
        report("CUDA (emulated CuPy)")
    return 0


def emulated(args) -> int:
    """--emulated: the CUDA path's host work per step (see the module docstring)."""
    import statistics

    import pytest
    import torch

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    from helpers import emulated_cupy as emu, emulated_torch
    from torch.nn.utils.rnn import pack_padded_sequence

    from lltm_cupy.torch import LLTM, LLTMCell, lltm_sequence
    from lltm_cupy.torch.reference import ReferenceLLTMCell

    B, F, S = args.batch_size, args.features, args.state_size
    short, long = 4, max(args.steps, 5)
    torch.manual_seed(0)
    h, c = torch.randn(B, S), torch.randn(B, S)
    x, xs = torch.randn(B, F), torch.randn(long, B, F)
    ones = torch.ones(B, S)
    with pytest.MonkeyPatch.context() as patch:
        fake = emulated_torch.install_cupy(patch, emu.host_get_kernels(None))
        emulated_torch.install_torch(patch, fake)
        state = fake.emulator
        state.noop = True
        cell, model, tutorial = LLTMCell(F, S), LLTM(F, S), ReferenceLLTMCell(F, S)

        def cell_step():
            out = cell(x, (h, c))
            return lambda: torch.autograd.backward(out, (ones, ones))

        def sequence(steps):
            def step():
                out, (_, c_n) = model(xs[:steps], (h, c))
                return lambda: torch.autograd.backward(
                    (out, c_n), (torch.ones_like(out), torch.ones_like(c_n)))
            return step

        def forward_only(steps, packed):
            """A forward under no_grad, its last sequence a step shorter than the others (by
            ``lengths=`` first in the batch: not sorted by length)."""
            data = pack_padded_sequence(xs[:steps], [steps] * (B - 1) + [steps - 1],
                                        enforce_sorted=False)
            lengths = [steps - 1] + [steps] * (B - 1)

            def step():
                with torch.no_grad():
                    if packed:
                        model(data, (h[None], c[None]))
                    else:
                        lltm_sequence(xs[:steps], model.weights, model.bias, h, c,
                                      lengths=lengths)
                return lambda: None
            return step

        def counted(step):
            """(forward, backward) counts of one call of ``step``."""
            state.reset()
            backward = step()
            forward = state.tally()
            state.reset()
            backward()
            return forward, state.tally()

        inference = [[forward_only(steps, packed) for steps in (short, long)]
                     for packed in (True, False)]
        for run in (cell_step, sequence(short), sequence(long), *sum(inference, [])):  # warm-up
            run()()
        cell_counts = counted(cell_step)
        per_step = [{k: (b[k] - a[k]) / (long - short) for k in a}
                    for a, b in zip(counted(sequence(short)), counted(sequence(long)))]
        per_step += [{k: (b[k] - a[k]) / (long - short) for k in a}
                     for a, b in ((counted(s)[0], counted(t)[0]) for s, t in inference)]

        def timed(step, runs):      # process time: what this process spent, not its waits
            t0 = time.process_time()
            for _ in range(runs):
                step()()
            return (time.process_time() - t0) / runs * 1e6

        def tutorial_step():
            out = tutorial(x, (h, c))
            return lambda: torch.autograd.backward(out, (ones, ones))

        times = {"cell": [], "tutorial": [], "short": [], "long": []}
        runs = args.runs or 200
        for _ in range(args.repeats):
            times["cell"].append(timed(cell_step, runs))
            times["tutorial"].append(timed(tutorial_step, runs))
            times["short"].append(timed(sequence(short), max(runs // 20, 3)))
            times["long"].append(timed(sequence(long), max(runs // 20, 3)))
        med = {k: statistics.median(v) for k, v in times.items()}
        seq_step = (med["long"] - med["short"]) / (long - short)

    names = ("arrays", "dlpack", "allocations", "streams", "launches", "gemms")
    print(f"torch layer's CUDA path on the emulated CuPy (kernels and GEMMs no-ops), float32, "
          f"(batch, features, state) = ({B}, {F}, {S}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); medians of {args.repeats} interleaved repetitions")
    print(f"{'':34}" + "".join(f"{n:>12}" for n in names))
    rows = [("LLTMCell step, forward", cell_counts[0]), ("LLTMCell step, backward", cell_counts[1]),
            (f"LLTM step, forward (T {short}->{long})", per_step[0]),
            (f"LLTM step, backward (T {short}->{long})", per_step[1]),
            (f"forward only, packed (T {short}->{long})", per_step[2]),
            (f"forward only, unsorted (T {short}->{long})", per_step[3])]
    for label, counts in rows:
        print(f"{label:34}" + "".join(f"{counts[n]:>12.4g}" for n in names))
    print(f"host us per LLTMCell step (forward + backward):            {med['cell']:9.1f}")
    print(f"host us per LLTM sequence step (forward + backward):       {seq_step:9.1f}")
    print(f"host us per LLTM call beyond its steps (T -> 0):           "
          f"{med['short'] - short * seq_step:9.1f}")
    print(f"us per step of the tutorial's eager cell on the CPU (f + b): {med['tutorial']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
