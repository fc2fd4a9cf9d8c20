#!/usr/bin/env python
"""Where the host time of a training step goes: cProfile of LLTMCell (or LLTM) steps.

Each step is the benchmark's: forward, then backward of every output with gradient one, for the
parameters. On the CPU the profile holds all the work; on the GPU kernels and GEMMs run
asynchronously, so it shows the Python and launch cost per step, which decides the speed at
small sizes (one synchronisation at the end waits for the queued work).

Examples:
    python scripts/profile_step.py                       # LLTMCell at (16, 32, 128) on the CPU
    python scripts/profile_step.py --cuda                # the same on the GPU
    python scripts/profile_step.py --cuda --sequence     # LLTM over T = 64 steps on the GPU
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
    args = p.parse_args(argv)

    import torch

    from lltm_cupy import benchmark as bm
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


if __name__ == "__main__":
    sys.exit(main())
