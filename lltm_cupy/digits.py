"""Does it learn? A sequence classifier on scikit-learn's handwritten digits (1,797 8x8 images,
each read as a sequence of 8 rows of 8 features; shipped with scikit-learn, nothing downloaded),
with three recurrent layers side by side: our :class:`lltm_cupy.torch.LLTM`, the tutorial's
pure-torch LLTM stepped from Python (:class:`lltm_cupy.torch.ReferenceLLTMCell`), and
``torch.nn.LSTM``. Same seed, head, optimiser and batches for all three; our LLTM and the
tutorial's start from the same parameters, so their per-step losses must agree to float rounding.

Needs the ``examples`` extra (scikit-learn, tqdm; matplotlib for the plot):
``pip install .[examples]``. ``scripts/train_digits.py`` is the command line.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from ._extras import MissingExtra, pyplot, require

__all__ = ["Config", "MODELS", "LOSS_GAP_TOLERANCE", "MissingExtra", "require", "pyplot",
           "load_data", "train", "format_table", "plot_curves", "add_training_options",
           "add_output_options", "write_outputs"]

MODELS = ("LLTM (ours)", "LLTM (tutorial, stepped)", "nn.LSTM")
#: The largest relative gap between the per-step training losses of our LLTM and the tutorial's
#: allowed over the first epoch, per dtype. Both compute the same function from the same
#: parameters on the same batches; they differ only in rounding (other summation orders, our
#: relatively accurate activation forms), about one unit roundoff per operation (6e-8 in
#: float32, 1.1e-16 in float64), which training feeds back through Adam. Measured on this
#: project's CPU, first epoch (45 steps at batch 32): float32 gaps of 1.8e-7 to 2.0e-6 over seeds
#: 0-9, float64 3.6e-16 to 5.7e-16 over seeds 0-2. The tolerances leave a factor of 50 (float32)
#: and about 2000 (float64) for other BLAS libraries and devices; a difference in the math (a
#: wrong derivative, a mixed-up gate) moves the losses apart by percents within a few steps.
LOSS_GAP_TOLERANCE = {"float32": 1e-4, "float64": 1e-12}


# Apart from digits_array.ArrayConfig on purpose: each run's own fields, in its own JSON order.
@dataclasses.dataclass
class Config:
    epochs: int = 10
    batch_size: int = 32
    state_size: int = 64
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    compile: bool = False
    lr: float = 1e-2
    progress: bool = True


def load_data(seed: int):
    """(x_train, y_train, x_test, y_test) as NumPy: images scaled to [0, 1] as (N, 8 rows, 8),
    a stratified 80/20 split."""
    datasets, model_selection = require("sklearn.datasets", "sklearn.model_selection")
    digits = datasets.load_digits()
    x = (digits.images / 16.0).astype(np.float64)
    x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
        x, digits.target, test_size=0.2, random_state=seed, stratify=digits.target)
    return x_tr, y_tr, x_te, y_te


def _models(cfg: Config):
    """The three classifiers, initialised from ``cfg.seed``: our LLTM and the tutorial's cell
    with identical parameters, the same head for all three."""
    import torch

    from .torch import LLTM, ReferenceLLTMCell

    dtype = getattr(torch, cfg.dtype)
    kw = dict(device=cfg.device, dtype=dtype)
    torch.manual_seed(cfg.seed)
    tutorial_cell = ReferenceLLTMCell(8, cfg.state_size, **kw)
    ours = LLTM(8, cfg.state_size, **kw)
    ours.load_state_dict(tutorial_cell.state_dict())
    lstm = torch.nn.LSTM(8, cfg.state_size, **kw)
    head = torch.nn.Linear(cfg.state_size, 10, **kw)

    class Classifier(torch.nn.Module):
        def __init__(self, rnn, kind):
            super().__init__()
            self.rnn, self.kind = rnn, kind
            self.head = copy.deepcopy(head)

        def forward(self, xs):                    # xs: (8 rows, batch, 8)
            if self.kind == "stepped":
                state = None
                for x in xs:
                    state = self.rnn(x, state)
                h = state[0]
            else:       # nn.LSTM and our LLTM: h_n is (num_layers * directions, batch, S)
                h = self.rnn(xs)[1][0][-1]
            return self.head(h)

    return {MODELS[0]: Classifier(ours, "sequence"),
            MODELS[1]: Classifier(tutorial_cell, "stepped"),
            MODELS[2]: Classifier(lstm, "lstm")}


def train(cfg: Config) -> dict:
    """Train the three models side by side; returns a JSON-ready record: per model the loss of
    every step, the test accuracy after every epoch, the final loss, training time and time per
    step, and the largest relative loss gap between our LLTM and the tutorial's in epoch one."""
    import torch

    (tqdm,) = require("tqdm")
    x_tr, y_tr, x_te, y_te = load_data(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    to = dict(device=cfg.device)
    x_tr_t = torch.tensor(x_tr, dtype=dtype, **to).permute(1, 0, 2)   # (8, N, 8)
    x_te_t = torch.tensor(x_te, dtype=dtype, **to).permute(1, 0, 2)
    y_tr_t = torch.tensor(y_tr, **to)
    y_te_t = torch.tensor(y_te, **to)
    models = _models(cfg)
    runs = {name: torch.compile(m) if cfg.compile else m for name, m in models.items()}
    optims = {name: torch.optim.Adam(m.parameters(), lr=cfg.lr) for name, m in models.items()}
    record = _new_record(models)
    n = x_tr_t.shape[1]
    steps_per_epoch = -(-n // cfg.batch_size)
    generator = torch.Generator().manual_seed(cfg.seed)
    sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else (lambda: None)
    bar = tqdm.tqdm(total=cfg.epochs * steps_per_epoch, desc="training", unit="step",
                    disable=not cfg.progress)
    for epoch in range(cfg.epochs):
        order = torch.randperm(n, generator=generator).to(cfg.device)
        for start in range(0, n, cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            xs, ys = x_tr_t[:, idx], y_tr_t[idx]
            for name, model in runs.items():
                sync()
                t0 = time.perf_counter()
                optims[name].zero_grad()
                loss = torch.nn.functional.cross_entropy(model(xs), ys)
                loss.backward()
                optims[name].step()
                sync()
                record[name]["train_seconds"] += time.perf_counter() - t0
                record[name]["loss"].append(loss.item())
            bar.update(1)
        with torch.no_grad():
            for name, model in runs.items():
                pred = model(x_te_t).argmax(dim=1)
                record[name]["test_accuracy"].append((pred == y_te_t).double().mean().item())
        bar.set_postfix({"epoch": epoch + 1,
                         "test acc (ours)": f"{record[MODELS[0]]['test_accuracy'][-1]:.3f}"})
    bar.close()
    result = _result(cfg, record, int(n), int(len(y_te)), steps_per_epoch)
    result["first_epoch_loss_gap"] = _first_epoch_loss_gap(record, MODELS[0], MODELS[1],
                                                           steps_per_epoch)
    result["loss_gap_tolerance"] = LOSS_GAP_TOLERANCE[cfg.dtype]
    return result


# The record and table helpers below serve this module and lltm_cupy.digits_array (the same
# JSON layout and table for the torch and the array-API training).

def _new_record(names) -> dict:
    """An empty training record per model name: every step's loss, the test accuracy after
    every epoch, the seconds spent in training steps."""
    return {name: {"loss": [], "test_accuracy": [], "train_seconds": 0.0} for name in names}


def _result(cfg, record: dict, train_samples: int, test_samples: int,
            steps_per_epoch: int) -> dict:
    """The JSON-ready result of a finished run: ``record`` completed with each model's final
    loss and seconds per step, with the config and the data's sizes."""
    total_steps = cfg.epochs * steps_per_epoch
    for r in record.values():
        r["final_loss"] = r["loss"][-1]
        r["seconds_per_step"] = r["train_seconds"] / total_steps
    return {"config": dataclasses.asdict(cfg), "train_samples": train_samples,
            "test_samples": test_samples, "steps_per_epoch": steps_per_epoch, "models": record}


def _first_epoch_loss_gap(record: dict, name: str, reference: str, steps: int) -> float:
    """The largest relative gap between the per-step losses of models ``name`` and
    ``reference`` over the first ``steps`` steps, relative to ``reference``'s."""
    losses = np.array(record[name]["loss"][:steps])
    reference_losses = np.array(record[reference]["loss"][:steps])
    return float(np.max(np.abs(losses - reference_losses) / np.abs(reference_losses)))


def _model_rows(models: dict, name_width: int) -> list:
    """The table's header, its rule and a row per model of a result's ``models``: test accuracy
    after the last epoch, final loss, training time, time per step; the model names in a
    column ``name_width`` wide."""
    head = (f"{'model':<{name_width}}{'test accuracy':>15}{'final loss':>12}"
            f"{'training time':>15}{'time per step':>15}")
    lines = [head, "-" * len(head)]
    for name, r in models.items():
        lines.append(f"{name:<{name_width}}{r['test_accuracy'][-1]:>15.4f}"
                     f"{r['final_loss']:>12.4f}{r['train_seconds']:>14.2f}s"
                     f"{r['seconds_per_step'] * 1e3:>13.2f}ms")
    return lines


def _run_line(result: dict, where: str, layers: str = "") -> str:
    """The table's line on the run: data, epochs, batch, state size (then ``layers``), dtype,
    ``where`` it ran, learning rate and seed."""
    cfg = result["config"]
    return (f"{result['train_samples']} training and {result['test_samples']} test images, "
            f"{cfg['epochs']} epochs of {result['steps_per_epoch']} steps (batch "
            f"{cfg['batch_size']}), state {cfg['state_size']}{layers}, {cfg['dtype']} on "
            f"{where}, Adam lr {cfg['lr']}, seed {cfg['seed']}")


def format_table(result: dict) -> str:
    lines = _model_rows(result["models"], 26)
    lines.append(_run_line(result, result["config"]["device"]))
    lines.append(f"largest relative gap between the per-step losses of our LLTM and the "
                 f"tutorial's over epoch one: {result['first_epoch_loss_gap']:.2e} "
                 f"(tolerance {result['loss_gap_tolerance']:.0e})")
    return "\n".join(lines)


def plot_curves(result: dict, path, machine: str = "") -> tuple:
    """Training loss per step and test accuracy per epoch of the three models, one PNG.
    Returns the image size in pixels (width, height)."""
    plt = pyplot()
    names = list(result["models"])      # these three, or another script's (e.g. the array API's)
    colors = dict(zip(names, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    styles = dict(zip(names, ("-", "--", "-", "-.")))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=100)
    spe = result["steps_per_epoch"]
    window = max(1, spe // 5)
    for name, r in result["models"].items():
        loss = np.array(r["loss"])
        epochs = np.arange(1, len(loss) + 1) / spe
        ax1.plot(epochs, loss, "-", color=colors[name], lw=0.6, alpha=0.25)
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax1.plot(epochs[window - 1:], smooth, styles[name], color=colors[name], lw=1.4,
                 label=f"{name}")
        acc = np.array(r["test_accuracy"]) * 100
        ax2.plot(np.arange(1, len(acc) + 1), acc, styles[name], marker="o", ms=3,
                 color=colors[name], label=name)
    ax1.set(xlabel="epoch", ylabel="training loss (cross-entropy)", yscale="log",
            title=f"Training loss (each step; mean over {window} steps)")
    ax2.set(xlabel="epoch", ylabel="test accuracy (%)", title="Test accuracy after each epoch")
    ax2.set_ylim(top=100)
    ax2.xaxis.get_major_locator().set_params(integer=True)
    if "first_epoch_loss_gap" in result:
        ax1.text(0.98, 0.97, f"{result.get('gap_label', 'ours vs tutorial')}, epoch 1: largest"
                 f"\nrelative loss gap "
                 f"{result['first_epoch_loss_gap']:.1e}", transform=ax1.transAxes, ha="right",
                 va="top", fontsize=7, color="0.3")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"scikit-learn digits as 8-row sequences: state {cfg['state_size']}, batch "
                 f"{cfg['batch_size']}, {cfg['dtype']} on {cfg.get('device', cfg.get('array'))}"
                 + (f"\n{machine}" if machine else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    size = tuple(int(v) for v in fig.get_size_inches() * fig.dpi)
    plt.close(fig)
    return size


# ------------------------------------------------------------------ the scripts' shared parts
# (scripts/train_digits.py and scripts/train_digits_array.py)

def add_training_options(parser, defaults=Config) -> None:
    """--epochs, --batch-size, --state-size, --seed, --dtype and --lr on an argparse
    ``parser``, with the defaults of the config class ``defaults`` (:class:`Config` or
    :class:`lltm_cupy.digits_array.ArrayConfig`)."""
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--state-size", type=int, default=defaults.state_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--dtype", choices=("float32", "float64"), default=defaults.dtype)
    parser.add_argument("--lr", type=float, default=defaults.lr,
                        help="Adam learning rate (default %(default)s)")


def add_output_options(parser) -> None:
    """--json, --plot and --no-progress on an argparse ``parser`` (see :func:`write_outputs`)."""
    parser.add_argument("--json", metavar="FILE", help="write every loss and accuracy as JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="loss and accuracy curves, one figure")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def write_outputs(result: dict, json_path=None, plot_path=None) -> None:
    """Write ``result`` as JSON to ``json_path`` and its curves (:func:`plot_curves`, titled
    with ``result["machine"]``) to ``plot_path``, each where given; say so on stdout."""
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {json_path}")
    if plot_path:
        width, height = plot_curves(result, plot_path, result["machine"])
        print(f"wrote {plot_path} ({width}x{height} pixels)")
