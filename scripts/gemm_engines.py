#!/usr/bin/env python
"""The torch layer's CPU GEMM engines side by side: torch's BLAS (TORCH_GEMM) against oneDNN
(ONEDNN_GEMM, and the one-step path's oneDNN products), each against nn.LSTM, interleaved.

Times our LLTM (float32) with the engine the library chooses for its size (oneDNN from
``_torch_gemm.ONEDNN_MIN`` = batch * state^2 on) and with each engine forced (the gate set to 0
or out of reach), in interleaved rounds (the order rotated every round) beside nn.LSTM of the
same size; with --cell, LLTMCell stepped T times from Python beside nn.LSTMCell instead. Prints
per engine the median time, its slowest round over its fastest, the median per-round ratio to
nn.LSTM and to the BLAS engine, and the largest error of the outputs against a float64 twin.
Process CPU time at one thread, wall time at more.
Usage: python scripts/gemm_engines.py [--sizes TxBxFxS,...] [--threads N] [--rounds N]
       [--no-grad] [--cell]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lltm_bench._common import machine_name, parse_sequence_sizes  # noqa: E402

SIZES = "64x16x32x128,128x32x128x256,64x64x256x512,32x256x512x1024"


def measure(size, threads: int, rounds: int, train: bool, cell: bool = False) -> dict:
    """{engine: (median s, slowest / fastest, median ratio to nn.LSTM, median ratio to torch,
    max error)} at ``size`` = (T, B, F, S)."""
    import torch

    from lltm_cupy.torch import LLTM, LLTMCell, _torch_gemm

    steps, batch, features, state = size
    torch.manual_seed(0)
    if cell:
        ours, lstm = LLTMCell(features, state), torch.nn.LSTMCell(features, state)
        twin = LLTMCell(features, state, dtype=torch.float64)
    else:
        ours, lstm = LLTM(features, state), torch.nn.LSTM(features, state)
        twin = LLTM(features, state, dtype=torch.float64)
    twin.load_state_dict({k: v.double() for k, v in ours.state_dict().items()})
    x = torch.randn(steps, batch, features)
    gate = _torch_gemm.ONEDNN_MIN
    engines = {"chosen": gate, "torch": 1 << 62}
    if _torch_gemm.ONEDNN_GEMM is not None:
        engines["onednn"] = 0

    def call(model, inputs):
        if not cell:
            out, (h, c) = model(inputs)
            return out, out.sum() + h.sum() + c.sum()
        state_ = None
        outs = []
        for step in inputs:
            state_ = model(step, state_)
            outs.append(state_[0])
        out = torch.stack(outs)
        return out, out.sum() + state_[1].sum()

    def runner(model, min_size=None):
        def run():
            if min_size is not None:
                _torch_gemm.ONEDNN_MIN = min_size
            try:
                with torch.set_grad_enabled(train):
                    out, loss = call(model, x)
                    if train:
                        loss.backward()
                return out
            finally:
                _torch_gemm.ONEDNN_MIN = gate
        return run

    calls = {name: runner(ours, min_size) for name, min_size in engines.items()}
    calls["nn.LSTM"] = runner(lstm)
    with torch.no_grad():
        want = call(twin, x.double())[0]
    errors = {name: float((calls[name]().detach().double() - want).abs().max())
              for name in engines}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    try:
        for run in calls.values():     # warm-up
            run()
        times = {name: [] for name in calls}
        names = list(calls)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = clock()
                calls[name]()
                times[name].append(clock() - t0)
    finally:
        torch.set_num_threads(before)

    def ratio(a, b):
        return statistics.median(u / v for u, v in zip(times[a], times[b]))
    return {name: (statistics.median(times[name]), max(times[name]) / min(times[name]),
                   ratio(name, "nn.LSTM"), ratio(name, "torch"), errors[name])
            for name in engines}


def main(argv=None) -> int:
    lines = __doc__.splitlines()
    p = argparse.ArgumentParser(description=" ".join(lines[:2]),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(lines[2:]))
    p.add_argument("--sizes", type=parse_sequence_sizes, default=parse_sequence_sizes(SIZES),
                   help=f"TxBxFxS[,...] (default {SIZES})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's threads (default: torch's own count)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--no-grad", action="store_true",
                   help="a forward under no_grad instead of a training step")
    p.add_argument("--cell", action="store_true",
                   help="LLTMCell stepped T times beside nn.LSTMCell, not LLTM beside nn.LSTM")
    args = p.parse_args(argv)
    import numpy
    import torch

    from lltm_cupy.torch import _torch_gemm

    threads = args.threads or torch.get_num_threads()
    print(f"{machine_name(False)}; Python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"NumPy {numpy.__version__}; float32; "
          f"{'LLTMCell stepped' if args.cell else 'LLTM'}, "
          f"{'forward under no_grad' if args.no_grad else 'training step'}; {threads} "
          f"thread(s), {'process CPU' if threads == 1 else 'wall'} time; medians of "
          f"{args.rounds} interleaved rounds; oneDNN from rows*state^2 >= "
          f"{_torch_gemm.ONEDNN_MIN}"
          + ("" if _torch_gemm.ONEDNN_GEMM is not None else " (no oneDNN in this torch)"),
          flush=True)
    other = "nn.LSTMCell" if args.cell else "nn.LSTM"
    print(f"| (T, B, F, S) | engine | ms | slowest/fastest | / {other} | / torch | max error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for size in args.sizes:
        for name, (t, spread, to_lstm, to_torch, err) in measure(
                size, threads, args.rounds, not args.no_grad, args.cell).items():
            print(f"| {tuple(size)} | {name} | {t * 1e3:.1f} | {spread:.2f} | {to_lstm:.2f}x | "
                  f"{to_torch:.2f}x | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
