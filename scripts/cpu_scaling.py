#!/usr/bin/env python
"""Where a CPU call of our LLTM spends its time (GEMM, element-wise passes, per-call work) at
one and two threads against nn.LSTM's, and the ratio that predicts for more cores.

The three parts are measured in one process, interleaved (scripts/lltm_bench/scaling.py says
how); the prediction fits Amdahl's law to the one- and two-thread times of our GEMMs and of
nn.LSTM, with our element-wise and per-call work serial. Process CPU time at one thread, wall
time at more: run it on a quiet machine.
Usage: python scripts/cpu_scaling.py [--sizes TxBxFxS,...] [--threads 1,2] [--rounds N]
       [--no-grad] [--cores 8,16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lltm_bench import scaling  # noqa: E402
from lltm_bench._common import int_list, machine_name, parse_sequence_sizes  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] + " " + __doc__.splitlines()[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--sizes", type=parse_sequence_sizes, default=scaling.SIZES,
                   help="TxBxFxS[,...] (default: the --inference training sizes)")
    p.add_argument("--threads", type=int_list, default=(1, 2),
                   help="thread counts measured (the prediction needs 1 and 2)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-grad", action="store_true", help="a forward under no_grad instead of "
                                                           "a training step")
    p.add_argument("--cores", type=int_list, default=(8, 16), help="core counts predicted")
    args = p.parse_args(argv)
    import numpy
    import torch

    print(f"{machine_name(False)}; Python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"NumPy {numpy.__version__}; float32; "
          f"{'forward under no_grad' if args.no_grad else 'training step'}; medians of "
          f"{args.rounds} interleaved rounds; process CPU time at one thread, wall time at more; "
          f"in brackets: the share of our call", flush=True)
    report = scaling.parts(args.sizes, args.threads, args.rounds, train=not args.no_grad)
    print(scaling.format_parts(report, scaling.predict(report, args.cores)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
