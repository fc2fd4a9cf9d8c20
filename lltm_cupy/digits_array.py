"""Does it learn without torch? The digits classifier of :mod:`lltm_cupy.digits` trained with the
array API alone (NumPy or CuPy): :func:`lltm_cupy.forward_layers` / :func:`backward_layers`, a
linear head and softmax cross-entropy written out, and Adam written out as ``torch.optim.Adam``
computes it. Parameters start from :func:`lltm_cupy.init_parameters`; the head from the same
generator, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as ``nn.Linear``.

With ``compare_torch`` the torch ``LLTM`` (and ``nn.Linear``, ``torch.optim.Adam``) trains beside
it from the same parameters on the same batches, and at every step a second torch copy, given
the array model's current parameters (copied in place, as an optimiser writes them), computes
the loss and every gradient on the same batch: the same model computes the same step wherever
training takes it, to float rounding (:data:`SAME_PARAMETERS_TOLERANCE`). The two trained
apart part further as training goes on (Adam amplifies rounding: the array model started one
ulp away from itself parts from itself alike), so their losses and accuracies are reported,
not judged.

``scripts/train_digits_array.py`` is the command line.
"""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np

import lltm_cupy

from .digits import (RunConfig, _first_epoch_loss_gap, _fit, _new_record, _table, _timed,
                     _torch_accuracy, _torch_step, load_data)
from .verify import to_numpy

__all__ = ["ArrayConfig", "ARRAY_MODEL", "TORCH_MODEL", "SAME_PARAMETERS_TOLERANCE", "Adam",
           "train", "format_table"]

ARRAY_MODEL, TORCH_MODEL = "LLTM (array API)", "LLTM (torch)"
#: The largest relative difference allowed, at any step, between the array model's loss and
#: gradients and the torch LLTM's from the same parameters on the same batch (each gradient
#: relative to its largest element). Measured on a CPU along the default run's 450 steps: at
#: most 4.0e-6 with one layer and 1.4e-5 with two bidirectional (seeds 0-2) in float32, 8.2e-15
#: in float64 (two layers, seed 0). A wrong derivative or a mixed-up gate differs by percents;
#: rounding is not amplified here, as it is between two models trained apart (docs/examples.md).
SAME_PARAMETERS_TOLERANCE = {"float32": 1e-4, "float64": 1e-12}


@dataclasses.dataclass(kw_only=True)
class ArrayConfig(RunConfig):
    num_layers: int = 1
    bidirectional: bool = False
    array: str = "numpy"          # or "cupy"
    compare_torch: bool = False
    nudge: bool = False           # every initial parameter moved one ulp up (numpy.nextafter)


class Adam:
    """Adam as ``torch.optim.Adam`` (defaults betas (0.9, 0.999), eps 1e-8, no weight decay)
    on a dict of arrays, updated in place."""

    def __init__(self, params: dict, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.m = {k: v * 0 for k, v in params.items()}
        self.v = {k: v * 0 for k, v in params.items()}
        self.t = 0

    def step(self, grads: dict) -> None:
        self.t += 1
        b1, b2 = self.betas
        step_size = self.lr / (1 - b1 ** self.t)
        root_bc2 = (1 - b2 ** self.t) ** 0.5
        for k, p in self.params.items():
            g = grads[k]
            m, v = self.m[k], self.v[k]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p -= step_size * m / (v ** 0.5 / root_bc2 + self.eps)


class _Model:
    """forward_layers, then a linear head on the last layer's final states (both directions)."""

    def __init__(self, cfg: ArrayConfig, xp):
        rng = np.random.default_rng(cfg.seed)
        D = 2 if cfg.bidirectional else 1
        self.D, self.xp = D, xp
        params = lltm_cupy.init_parameters(8, cfg.state_size, cfg.num_layers,
                                           bidirectional=cfg.bidirectional, rng=rng, xp=xp,
                                           dtype=cfg.dtype)
        bound = 1 / np.sqrt(D * cfg.state_size)
        params["head.weight"] = xp.asarray(rng.uniform(-bound, bound, (10, D * cfg.state_size))
                                           .astype(cfg.dtype))
        params["head.bias"] = xp.asarray(rng.uniform(-bound, bound, 10).astype(cfg.dtype))
        if cfg.nudge:    # how far rounding alone carries a run: one ulp in every parameter
            params = {k: xp.nextafter(v, xp.inf).astype(v.dtype) for k, v in params.items()}
        self.params = params

    def rnn_parameters(self):
        return {k: v for k, v in self.params.items() if not k.startswith("head.")}

    def logits(self, xs):
        """xs (8, B, 8) -> logits (B, 10) and what the backward needs."""
        _, h_n, _, saved = lltm_cupy.forward_layers(xs, self.rnn_parameters())
        h = self.xp.concatenate(list(h_n[-self.D:]), axis=1)     # (B, D * H), forward first
        p = self.params
        return h @ p["head.weight"].T + p["head.bias"], (h, h_n.shape, saved)

    def loss_and_grads(self, xs, ys):
        """Mean softmax cross-entropy and the gradient of every parameter."""
        xp = self.xp
        logits, (h, shape, saved) = self.logits(xs)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_z = xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        batch = len(ys)
        rows = xp.arange(batch)
        loss = -(shifted[rows, ys] - log_z[:, 0]).mean()
        d_logits = xp.exp(shifted - log_z)
        d_logits[rows, ys] -= 1
        d_logits /= batch
        grads = {"head.weight": d_logits.T @ h, "head.bias": d_logits.sum(axis=0)}
        d_h = d_logits @ self.params["head.weight"]
        grad_h_n = xp.zeros(shape, d_h.dtype)
        H = shape[2]
        for d in range(self.D):
            grad_h_n[shape[0] - self.D + d] = d_h[:, d * H:(d + 1) * H]
        g = lltm_cupy.backward_layers(None, grad_h_n, None, saved)
        grads.update(g.d_parameters)
        return float(loss), grads


def _torch_twin(model: _Model, cfg: ArrayConfig):
    """The torch LLTM + nn.Linear with the array model's parameters: its logits function and
    its parameters by the array model's names."""
    import torch

    from .torch import LLTM

    dtype = getattr(torch, cfg.dtype)
    rnn = LLTM(8, cfg.state_size, cfg.num_layers, bidirectional=cfg.bidirectional, dtype=dtype)
    head = torch.nn.Linear(model.D * cfg.state_size, 10, dtype=dtype)
    named = dict(rnn.named_parameters())
    named.update({"head.weight": head.weight, "head.bias": head.bias})
    _copy_parameters(named, model)

    def logits(xs):
        h_n = rnn(xs)[1][0]
        return head(torch.cat(list(h_n[-model.D:]), dim=1))

    return logits, named


def _copy_parameters(named: dict, model: _Model) -> None:
    """The array model's parameters into the torch ones, in place (as an optimiser writes)."""
    import torch

    with torch.no_grad():
        for k, p in named.items():
            p.copy_(torch.from_numpy(to_numpy(model.params[k])).reshape(p.shape))


def _same_parameters_gap(probe, model: _Model, xs, ys, loss: float, grads: dict) -> float:
    """``probe`` (a torch twin) given ``model``'s parameters computes the loss and gradients on
    the batch ``xs``, ``ys`` (CPU tensors); the largest relative difference from ``loss`` and
    ``grads`` (the array model's there), each gradient relative to its largest element."""
    import torch

    logits, named = probe
    _copy_parameters(named, model)
    for p in named.values():
        p.grad = None
    t_loss = torch.nn.functional.cross_entropy(logits(xs), ys)
    t_loss.backward()
    gap = abs(loss - t_loss.item()) / abs(t_loss.item())
    for k, p in named.items():
        g = to_numpy(grads[k]).reshape(p.shape)
        scale = max(float(np.abs(g).max()), float(np.finfo(g.dtype).tiny))
        gap = max(gap, float(np.abs(p.grad.numpy() - g).max()) / scale)
    return gap


def train(cfg: ArrayConfig) -> dict:
    """Train the array model (and with ``compare_torch`` its torch twin); a JSON-ready record
    in :func:`lltm_cupy.digits.train`'s layout; when compared, the largest relative gap from
    the same parameters (judged), and the first epoch's largest relative loss gap and the final
    accuracy gap of the two trained apart (reported)."""
    xp = importlib.import_module(cfg.array)
    x_tr, y_tr, x_te, y_te = load_data(cfg.seed)
    x_tr, x_te = (x.transpose(1, 0, 2).astype(cfg.dtype) for x in (x_tr, x_te))  # (8 rows, N, 8)
    x_tr_d, x_te_d, y_tr_d = xp.asarray(x_tr), xp.asarray(x_te), xp.asarray(y_tr)
    model = _Model(cfg, xp)
    adam = Adam(model.params, lr=cfg.lr)
    record = _new_record([ARRAY_MODEL] + [TORCH_MODEL] * cfg.compare_torch)
    ours = record[ARRAY_MODEL]
    if cfg.compare_torch:
        import torch

        twin, twin_params = _torch_twin(model, cfg)
        twin_adam = torch.optim.Adam(list(twin_params.values()), lr=cfg.lr)
        probe = _torch_twin(model, cfg)
        x_tr_t, x_te_t, y_tr_t, y_te_t = map(torch.from_numpy, (x_tr, x_te, y_tr, y_te))
    same_parameters_gap = 0.0
    order_rng = np.random.default_rng(cfg.seed + 1)
    sync = (lambda: xp.cuda.Device().synchronize()) if cfg.array == "cupy" else (lambda: None)

    def step(idx):
        nonlocal same_parameters_gap
        i = xp.asarray(idx)
        loss, grads = _timed(ours, sync, lambda: model.loss_and_grads(x_tr_d[:, i], y_tr_d[i]))
        if cfg.compare_torch:      # before the update: from the same parameters (not timed)
            t_idx = torch.from_numpy(idx)
            xs, ys = x_tr_t[:, t_idx], y_tr_t[t_idx]
            same_parameters_gap = max(same_parameters_gap, _same_parameters_gap(
                probe, model, xs, ys, loss, grads))
        _timed(ours, sync, lambda: adam.step(grads))
        ours["loss"].append(loss)
        if cfg.compare_torch:
            _torch_step(record[TORCH_MODEL], sync, twin, twin_adam, xs, ys)

    def evaluate():
        logits, _ = model.logits(x_te_d)
        ours["test_accuracy"].append(float((to_numpy(logits.argmax(axis=1)) == y_te).mean()))
        if cfg.compare_torch:
            record[TORCH_MODEL]["test_accuracy"].append(_torch_accuracy(twin, x_te_t, y_te_t))

    result = _fit(cfg, record, len(y_tr), len(y_te), step, evaluate, "training (array API)",
                  order_rng.permutation)
    if cfg.compare_torch:
        result["same_parameters_gap"] = same_parameters_gap
        result["same_parameters_tolerance"] = SAME_PARAMETERS_TOLERANCE[cfg.dtype]
        result["first_epoch_loss_gap"] = _first_epoch_loss_gap(result, ARRAY_MODEL, TORCH_MODEL)
        result["accuracy_gap"] = abs(ours["test_accuracy"][-1]
                                     - record[TORCH_MODEL]["test_accuracy"][-1])
        result["gap_label"] = "array API vs torch"
    return result


def format_table(result: dict) -> str:
    cfg = result["config"]
    notes = []
    if "same_parameters_gap" in result:
        notes = [f"array API vs torch LLTM from the same parameters at every step: largest "
                 f"relative gap in the loss and gradients {result['same_parameters_gap']:.2e}"
                 f" (tolerance {result['same_parameters_tolerance']:.0e})",
                 f"trained apart from the same start (not judged: rounding grows with "
                 f"training): largest relative gap between the per-step losses over epoch "
                 f"one {result['first_epoch_loss_gap']:.2e}; test accuracy gap "
                 f"{result['accuracy_gap']:.4f}"]
    return _table(result, f", {cfg['num_layers']} layer(s)"
                  f"{', bidirectional' if cfg['bidirectional'] else ''}, {cfg['dtype']} on "
                  f"{cfg['array']}", *notes)
