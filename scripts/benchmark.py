#!/usr/bin/env python
"""Benchmark lltm_cupy against the tutorial's pure-torch LLTM, torch.compile and nn.LSTMCell.

Examples:
    python scripts/benchmark.py                       # the default size sweep on the CPU
    python scripts/benchmark.py -b 16 -f 32 -s 128 -r 1000 --scale us
    python scripts/benchmark.py --cuda --json gpu.json
    python scripts/benchmark.py --mixed               # the cell between torch layers (CPU)
    python scripts/benchmark.py --sequence            # T = 64: our LLTM vs stepped cells
    python scripts/benchmark.py --inference           # sequences against nn.LSTM: memory, time
    python scripts/benchmark.py --inference --threads 1,2 --plot docs/cpu_sequences.png   # one
                                                      # thread and two, and the picture

Options -b/-f/-s/-r/--scale/-c/-d are those of the tutorial's benchmark.py. Giving any of
-b/-f/-s runs that one size; otherwise the sweep of --sizes (default: the CPU or GPU sweep).
An implementation named in --impl that cannot run is an error (exit status 1, with the reason);
of the defaults, one that cannot run on this machine is skipped with the reason printed.
--json is rewritten after every size and every quarter of a size's runs (the partial medians
under "in_progress"), so an interrupted run keeps what it measured. Every implementation's
outputs are checked against the float64 reference before it is timed; one that is off is not
timed (an error when named with --impl).
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import lltm_bench as bm  # noqa: E402
from lltm_bench._common import int_list, parse_sequence_sizes  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("-b", "--batch-size", type=int)
    p.add_argument("-f", "--features", type=int)
    p.add_argument("-s", "--state-size", type=int)
    p.add_argument("-r", "--runs", type=int, default=None,
                   help="timed iterations per size (default: 1000 at the smallest size, fewer "
                        "above)")
    p.add_argument("--scale", choices=("s", "ms", "us"), default="us")
    p.add_argument("-c", "--cuda", action="store_true", help="run on the GPU")
    p.add_argument("-d", "--double", action="store_true", help="float64 instead of float32")
    p.add_argument("--bf16", action="store_true",
                   help="bfloat16 instead of float32: the torch implementations (the array API "
                        "has no bfloat16); on the CPU our cell computes in float32")
    p.add_argument("--sizes", type=lambda t: parse_sequence_sizes(t, form="BxFxS"), default=None,
                   help="BxFxS[,BxFxS...] sweep")
    p.add_argument("--impl", default=None,
                   help=f"comma-separated subset of "
                        f"{','.join(bm.IMPLS + bm.GRAPH_IMPLS + bm.EXTRA_IMPLS)} "
                        f"(default: all but {', '.join(bm.EXTRA_IMPLS)}; lstm and the CUDA-graph "
                        f"rows {', '.join(bm.GRAPH_IMPLS)} on GPU only); "
                        f"with --sequence, of "
                        f"{','.join(bm.SEQUENCE_IMPLS)}")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--process-time", action="store_true",
                   help="CPU: time by process CPU time, not wall time (for a loaded machine; "
                        "run with one thread, OMP_NUM_THREADS=1, else every thread's time "
                        "counts)")
    p.add_argument("--all-grads", action="store_true",
                   help="inputs and state require grad too (default: parameters only, as the "
                        "tutorial)")
    p.add_argument("--mixed", action="store_true",
                   help="also time the cell between torch layers (CPU)")
    p.add_argument("--sequence", action="store_true",
                   help="time whole sequences instead (our LLTM vs stepped cells and nn.LSTM)")
    p.add_argument("-t", "--steps", type=int_list, default=[64],
                   help="sequence length for --sequence; several separated by commas (64,512)")
    p.add_argument("--inference", action="store_true",
                   help="our LLTM against nn.LSTM and the tutorial's cell stepped (CPU): a "
                        "forward under torch.no_grad's peak resident memory added (a fresh "
                        "process per implementation) at (T, B, F, S) = (500, 64, 16, 512), the "
                        "time of a forward under no_grad at (64, 16, 32, 128), (128, 32, 128, "
                        "256) and (64, 64, 256, 512) and of a training step at four sizes, "
                        "interleaved, medians (process CPU time with one thread, wall time with "
                        "more); and the per-step / fixed split of a call at (B, F, S) = (16, "
                        "32, 128) (T = 4 and 64); with --plot, the times as a picture")
    p.add_argument("--threads", type=int_list, default=None,
                   help="torch threads (default: torch's own, what a user gets); 1 is the "
                        "quiet-machine figure: with --process-time, or with --inference, timed "
                        "by process CPU time, which other processes disturb least; with "
                        "--inference several, separated by commas (1,2): the reports for each "
                        "in turn, and the picture's panels side by side")
    p.add_argument("--no-kernels", action="store_true",
                   help="skip the GPU kernel bandwidth report (GPU) or the BLAS share report (CPU)")
    p.add_argument("--json", metavar="FILE", help="write all results as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="the speed-ups as a bar chart; with --inference, each implementation's "
                        "time per call (needs matplotlib: pip install '.[examples]')")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    args = p.parse_args(argv)

    import torch

    if args.plot:
        from lltm_cupy._extras import MissingExtra, require

        try:
            require("matplotlib")
        except MissingExtra as exc:
            print(f"benchmark.py --plot: {exc}", file=sys.stderr)
            return 2
    if args.inference:
        return _inference(args, torch)
    if args.threads:
        if len(args.threads) > 1:
            p.error("several --threads only with --inference")
        torch.set_num_threads(args.threads[0])
    if args.cuda and not torch.cuda.is_available():
        print("--cuda given but torch finds no CUDA device", file=sys.stderr)
        return 2
    if args.bf16 and args.double:
        p.error("--bf16 and --double exclude each other")
    if any(v is not None for v in (args.batch_size, args.features, args.state_size)):
        sizes = [(args.batch_size or 16, args.features or 32, args.state_size or 128)]
    else:
        default = (bm.SEQUENCE_SIZES if args.sequence else bm.GPU_SIZES if args.cuda
                   else bm.CPU_SIZES)
        sizes = args.sizes or list(default)
    known = bm.SEQUENCE_IMPLS if args.sequence else bm.IMPLS + bm.GRAPH_IMPLS + bm.EXTRA_IMPLS
    # nn.LSTMCell (lstm) only on the GPU; whole sequences compare nn.LSTM on the CPU too
    gpu_only = bm.GRAPH_IMPLS + (("fused",) if args.sequence else ("lstm",))
    impls = args.impl.split(",") if args.impl else [
        i for i in known if (i not in gpu_only or args.cuda) and i not in bm.EXTRA_IMPLS]
    unknown = set(impls) - set(known)
    if unknown:
        p.error(f"unknown --impl {','.join(sorted(unknown))}; choose from {','.join(known)}")

    machine = bm.machine_name(args.cuda)
    print(f"lltm_cupy benchmark on {machine}; torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}")
    out = {"machine": machine, "torch": torch.__version__, "sizes": [], "gpu_kernels": {},
           "cpu_blas": {}, "mixed": {}}
    try:
        _run_sizes(args, sizes, impls, out)
    except bm.ImplementationError as exc:
        traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
        print(f"benchmark.py: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(f"\nwrote {args.json}")
    if args.plot:
        width, height = bm.plot_speedups(out["sizes"], args.plot, machine)
        print(f"wrote {args.plot} ({width}x{height} pixels)")
    return 0


def _inference(args, torch) -> int:
    from lltm_bench import inference

    if args.cuda:
        print("--inference measures the CPU (nn.LSTM's CPU path against ours)", file=sys.stderr)
        return 2
    import numpy

    counts = args.threads or [torch.get_num_threads()]     # (torch's default: what users get)
    versions = (f"{bm.machine_name(False)}; Python {sys.version.split()[0]}, torch "
                f"{torch.__version__}, NumPy {numpy.__version__}; float32")
    runs = []
    for threads in counts:
        clock = "process CPU time" if threads == 1 else "wall time"
        print(f"lltm_cupy inference benchmark on {versions}, {threads} thread(s), {clock}"
              + (" (the quiet-machine figure)" if threads == 1 else ""), flush=True)
        memory = inference.memory_report(rounds=3, threads=threads)
        timing = inference.time_report(rounds=args.runs or 15, threads=threads)
        training = inference.time_report(inference.TRAIN_SIZES, rounds=args.runs or 7,
                                         threads=threads, train=True)
        print(inference.format_inference(memory, timing, training))
        split = inference.split_report(rounds=args.runs or 21, threads=threads)
        print(inference.format_split(split) + "\n", flush=True)
        runs.append({"threads": threads, "memory": memory, "time": timing,
                     "training": training, "split": split})
        if args.json:
            Path(args.json).write_text(json.dumps({
                "machine": bm.machine_name(False), "torch": torch.__version__,
                "numpy": numpy.__version__, "runs": runs}, indent=1))
    if args.plot:
        title = f"{versions}; one thread: process CPU time, more: wall time"
        width, height = bm.plot_inference(runs, args.plot, title)
        print(f"wrote {args.plot} ({width}x{height} pixels)")
    return 0


def _run_sizes(args, sizes, impls, out) -> None:
    strict = args.impl is not None

    def progress(partial):      # the size being timed, so far (dropped once it is complete)
        out["in_progress"] = partial
        _write_json(args, out)
        del out["in_progress"]

    from lltm_bench import _common

    _common.progress = progress
    for i, size in enumerate(sizes, 1):
        work = size[0] * size[2] * (size[1] + size[2])
        runs = args.runs or max(30, min(1000, int(2e9 // work)))
        cfg = bm.Config(*size, cuda=args.cuda, double=args.double, bf16=args.bf16, runs=runs,
                        warmup=args.warmup, all_grads=args.all_grads,
                        process_time=args.process_time)
        print(f"[{i}/{len(sizes)}] size {size}, {runs} runs", file=sys.stderr, flush=True) \
            if not args.quiet else None
        if args.sequence:
            for steps in args.steps:
                cfg.runs = args.runs or max(10, runs // steps)
                record = bm.run_sequence(cfg, steps, impls, quiet=args.quiet, strict=strict)
                out["sizes"].append(record)
                print()
                print(bm.format_table(record, args.scale), flush=True)
                _write_json(args, out)
            continue
        record = bm.run_size(cfg, impls, quiet=args.quiet, strict=strict)
        out["sizes"].append(record)
        print()
        print(bm.format_table(record, args.scale), flush=True)
        _write_json(args, out)
        if args.cuda and not args.no_kernels and not args.bf16 and size[0] * size[2] >= 1 << 20:
            rep = bm.gpu_kernel_report(cfg)
            out["gpu_kernels"][str(size)] = rep
            print(bm.format_gpu_report(size, rep), flush=True)
        if not args.cuda and not args.no_kernels and not args.bf16:
            rep = bm.cpu_blas_report(cfg, runs=max(20, runs // 4))
            out["cpu_blas"][str(size)] = rep
            print(bm.format_blas_report(size, rep, args.scale), flush=True)
        if args.mixed and not args.cuda and not args.bf16:
            rep = bm.mixed_model_report(cfg, runs=max(50, runs // 2), quiet=args.quiet)
            out["mixed"][str(size)] = rep
            print(bm.format_mixed(size, rep, args.scale), flush=True)
        _write_json(args, out)


def _write_json(args, out) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
