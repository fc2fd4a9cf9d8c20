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

from ._extras import MissingExtra, pyplot, require, save_figure

__all__ = ["RunConfig", "Config", "MODELS", "LOSS_GAP_TOLERANCE", "MissingExtra", "require",
           "pyplot", "load_data", "train", "format_table", "plot_curves", "add_options",
           "write_outputs"]

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


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """The settings both demos share (:class:`Config` and ``digits_array.ArrayConfig`` add
    their own)."""
    epochs: int = 10
    batch_size: int = 32
    state_size: int = 64
    seed: int = 0
    dtype: str = "float32"
    lr: float = 1e-2
    progress: bool = True

    @classmethod
    def from_args(cls, args, **own):
        """The config of a script's options (:func:`add_options`) and its ``own`` fields."""
        return cls(epochs=args.epochs, batch_size=args.batch_size, state_size=args.state_size,
                   seed=args.seed, dtype=args.dtype, lr=args.lr, progress=not args.no_progress,
                   **own)


@dataclasses.dataclass(kw_only=True)
class Config(RunConfig):
    device: str = "cpu"
    compile: bool = False


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
    """Train the three models side by side; returns a JSON-ready record (:func:`_fit`) with the
    largest relative loss gap between our LLTM and the tutorial's in epoch one."""
    import torch

    x_tr, y_tr, x_te, y_te = load_data(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    x_tr_t, x_te_t = (torch.tensor(x, dtype=dtype, device=cfg.device).permute(1, 0, 2)
                      for x in (x_tr, x_te))                           # (8, N, 8)
    y_tr_t, y_te_t = (torch.tensor(y, device=cfg.device) for y in (y_tr, y_te))
    models = _models(cfg)
    runs = {name: torch.compile(m) if cfg.compile else m for name, m in models.items()}
    optims = {name: torch.optim.Adam(m.parameters(), lr=cfg.lr) for name, m in models.items()}
    record = _new_record(models)
    generator = torch.Generator().manual_seed(cfg.seed)
    sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else (lambda: None)

    def step(idx):
        for name, model in runs.items():
            _torch_step(record[name], sync, model, optims[name], x_tr_t[:, idx], y_tr_t[idx])

    def evaluate():
        for name, model in runs.items():
            record[name]["test_accuracy"].append(_torch_accuracy(model, x_te_t, y_te_t))

    result = _fit(cfg, record, len(y_tr), len(y_te), step, evaluate, "training",
                  lambda n: torch.randperm(n, generator=generator).to(cfg.device))
    result["first_epoch_loss_gap"] = _first_epoch_loss_gap(result, MODELS[0], MODELS[1])
    result["loss_gap_tolerance"] = LOSS_GAP_TOLERANCE[cfg.dtype]
    return result


# The training and table helpers below serve this module and lltm_cupy.digits_array (the same
# loop, JSON layout and table for the torch and the array-API training).

def _new_record(names) -> dict:
    """Per model: every step's loss, the test accuracy after every epoch, the seconds spent in
    training steps."""
    return {name: {"loss": [], "test_accuracy": [], "train_seconds": 0.0} for name in names}


def _fit(cfg: RunConfig, record: dict, train_samples: int, test_samples: int, step, evaluate,
         desc: str, permutation) -> dict:
    """The training loop: per epoch, ``step(indices)`` for every batch of ``permutation(n)``
    (a progress bar counts them), then ``evaluate()``. Returns the JSON-ready result:
    ``record`` completed with each model's final loss and seconds per step, the config and the
    data's sizes."""
    (tqdm,) = require("tqdm")
    steps_per_epoch = -(-train_samples // cfg.batch_size)
    bar = tqdm.tqdm(total=cfg.epochs * steps_per_epoch, desc=desc, unit="step",
                    disable=not cfg.progress)
    first = next(iter(record))
    for epoch in range(cfg.epochs):
        order = permutation(train_samples)
        for start in range(0, train_samples, cfg.batch_size):
            step(order[start:start + cfg.batch_size])
            bar.update(1)
        evaluate()
        bar.set_postfix({"epoch": epoch + 1,
                         "test acc": f"{record[first]['test_accuracy'][-1]:.3f}"})
    bar.close()
    for r in record.values():
        r["final_loss"] = r["loss"][-1]
        r["seconds_per_step"] = r["train_seconds"] / (cfg.epochs * steps_per_epoch)
    return {"config": dataclasses.asdict(cfg), "train_samples": train_samples,
            "test_samples": test_samples, "steps_per_epoch": steps_per_epoch, "models": record}


def _timed(entry: dict, sync, fn):
    """``fn()``, its seconds between two ``sync()`` (device synchronisations) added to
    ``entry["train_seconds"]``."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    entry["train_seconds"] += time.perf_counter() - t0
    return out


def _torch_step(entry: dict, sync, model, optimiser, xs, ys) -> None:
    """One timed optimiser step of the torch classifier ``model`` on the batch ``xs``, ``ys``
    (cross-entropy); its loss appended to ``entry``."""
    import torch

    def step():
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs), ys)
        loss.backward()
        optimiser.step()
        return loss

    entry["loss"].append(_timed(entry, sync, step).item())


def _torch_accuracy(model, xs, ys) -> float:
    import torch

    with torch.no_grad():
        return (model(xs).argmax(dim=1) == ys).double().mean().item()


def _first_epoch_loss_gap(result: dict, name: str, reference: str) -> float:
    """The largest relative gap between the per-step losses of models ``name`` and
    ``reference`` over the first epoch, relative to ``reference``'s."""
    steps = result["steps_per_epoch"]
    losses, reference_losses = (np.array(result["models"][k]["loss"][:steps])
                                for k in (name, reference))
    return float(np.max(np.abs(losses - reference_losses) / np.abs(reference_losses)))


def _table(result: dict, where: str, *notes: str) -> str:
    """The results table: a row per model (test accuracy after the last epoch, final loss,
    training time, time per step), a line on the run (``where`` it ran), then ``notes``."""
    width = max(20, 2 + max(map(len, result["models"])))
    head = (f"{'model':<{width}}{'test accuracy':>15}{'final loss':>12}"
            f"{'training time':>15}{'time per step':>15}")
    lines = [head, "-" * len(head)]
    for name, r in result["models"].items():
        lines.append(f"{name:<{width}}{r['test_accuracy'][-1]:>15.4f}"
                     f"{r['final_loss']:>12.4f}{r['train_seconds']:>14.2f}s"
                     f"{r['seconds_per_step'] * 1e3:>13.2f}ms")
    cfg = result["config"]
    lines.append(f"{result['train_samples']} training and {result['test_samples']} test images, "
                 f"{cfg['epochs']} epochs of {result['steps_per_epoch']} steps (batch "
                 f"{cfg['batch_size']}), state {cfg['state_size']}{where}, Adam lr {cfg['lr']}, "
                 f"seed {cfg['seed']}")
    return "\n".join(lines + list(notes))


def format_table(result: dict) -> str:
    return _table(result, f", {result['config']['dtype']} on {result['config']['device']}",
                  f"largest relative gap between the per-step losses of our LLTM and the "
                  f"tutorial's over epoch one: {result['first_epoch_loss_gap']:.2e} "
                  f"(tolerance {result['loss_gap_tolerance']:.0e})")


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
    return save_figure(fig, path)


# ------------------------------------------------------------------ the scripts' shared parts
# (scripts/train_digits.py and scripts/train_digits_array.py)

def add_options(parser) -> None:
    """The options both scripts share on an argparse ``parser``: :class:`RunConfig`'s, and
    --json, --plot (see :func:`write_outputs`)."""
    parser.add_argument("--epochs", type=int, default=RunConfig.epochs)
    parser.add_argument("--batch-size", type=int, default=RunConfig.batch_size)
    parser.add_argument("--state-size", type=int, default=RunConfig.state_size)
    parser.add_argument("--seed", type=int, default=RunConfig.seed)
    parser.add_argument("--dtype", choices=("float32", "float64"), default=RunConfig.dtype)
    parser.add_argument("--lr", type=float, default=RunConfig.lr,
                        help="Adam learning rate (default %(default)s)")
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
