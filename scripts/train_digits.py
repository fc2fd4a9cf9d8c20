#!/usr/bin/env python
"""Train a digit classifier (scikit-learn's 8x8 digits read as 8-row sequences) with our LLTM, the
tutorial's LLTM stepped from Python and torch.nn.LSTM side by side; print a table; exit 1 if our
LLTM's per-step losses leave the tutorial's by more than float rounding allows in epoch one.

Needs torch and the examples extra (pip install '.[examples]'); exits 2 without them.
Usage: python scripts/train_digits.py [--epochs N] [--plot FILE.png] [--json FILE] [-h]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lltm_cupy import digits  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    digits.add_options(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the three models")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.state_size < 1:
        p.error("--epochs, --batch-size and --state-size must be positive")
    try:
        import torch

        digits.require("sklearn", "tqdm", *(("matplotlib",) if args.plot else ()))
    except ImportError:
        print("train_digits.py needs torch: pip install '.[torch]'", file=sys.stderr)
        return 2
    except digits.MissingExtra as exc:
        print(f"train_digits.py: {exc}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda given but torch finds no CUDA device", file=sys.stderr)
        return 2
    cfg = digits.Config.from_args(args, device=args.device, compile=args.compile)
    result = digits.train(cfg)
    from lltm_bench import machine_name

    result["machine"] = machine_name(args.device == "cuda")
    print(digits.format_table(result))
    print(f"on {result['machine']}, torch {torch.__version__}")
    digits.write_outputs(result, args.json, args.plot)
    # this comparison's own pass criterion and message (train_digits_array.py has its own)
    if result["first_epoch_loss_gap"] > result["loss_gap_tolerance"]:
        print("FAIL: our LLTM's losses left the tutorial's by more than float rounding allows",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
