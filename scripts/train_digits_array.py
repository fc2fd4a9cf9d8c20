#!/usr/bin/env python
"""Train the digits classifier (scikit-learn's 8x8 digits read as 8-row sequences) with the
array API alone, NumPy or CuPy, no torch: forward_layers / backward_layers, a linear head and
Adam written out; print a table, optionally plot. With --compare-torch the torch LLTM trains
beside it from the same parameters on the same batches, and at every step computes the loss
and gradients from the array model's parameters; exit 1 if those part by more than rounding
allows.

Needs the examples extra (pip install '.[examples]'); exits 2 without it (or without a GPU for
--array cupy, or without torch for --compare-torch).
Usage: python scripts/train_digits_array.py [--array numpy|cupy] [--epochs N] [--plot FILE.png]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lltm_cupy import digits, digits_array  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--array", choices=("numpy", "cupy"), default="numpy",
                   help="NumPy on the CPU or CuPy on the GPU (default numpy)")
    digits.add_options(p)
    p.add_argument("--layers", type=int, default=digits_array.ArrayConfig.num_layers)
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--compare-torch", action="store_true",
                   help="train the torch LLTM beside it from the same parameters (needs torch)")
    p.add_argument("--nudge", action="store_true",
                   help="start from the initial parameters moved one ulp up (numpy.nextafter): "
                        "how far rounding alone carries a run")
    args = p.parse_args(argv)
    if min(args.epochs, args.batch_size, args.state_size, args.layers) < 1:
        p.error("--epochs, --batch-size, --state-size and --layers must be positive")
    try:
        digits.require("sklearn", "tqdm", *(("matplotlib",) if args.plot else ()))
    except digits.MissingExtra as exc:
        print(f"train_digits_array.py: {exc}", file=sys.stderr)
        return 2
    if args.compare_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("--compare-torch needs torch: pip install '.[torch]'", file=sys.stderr)
            return 2
    if args.array == "cupy":
        from lltm_cupy.verify import gpu_unavailable_reason

        reason = gpu_unavailable_reason()
        if reason:
            print(f"--array cupy needs a GPU: {reason}", file=sys.stderr)
            return 2
    cfg = digits_array.ArrayConfig.from_args(
        args, num_layers=args.layers, bidirectional=args.bidirectional, array=args.array,
        compare_torch=args.compare_torch, nudge=args.nudge)
    result = digits_array.train(cfg)
    if args.array == "cupy":
        import cupy

        result["machine"] = cupy.cuda.runtime.getDeviceProperties(
            cupy.cuda.Device().id)["name"].decode()
    else:
        from lltm_bench import machine_name

        result["machine"] = machine_name(False)
    print(digits_array.format_table(result))
    print(f"on {result['machine']}")
    digits.write_outputs(result, args.json, args.plot)
    # this comparison's own pass criterion and message (train_digits.py has its own)
    if args.compare_torch and result["same_parameters_gap"] > result["same_parameters_tolerance"]:
        print("FAIL: from the same parameters, the array model and the torch LLTM computed losses "
              "or gradients further apart than rounding allows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
