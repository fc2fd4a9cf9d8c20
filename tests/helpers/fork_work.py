"""The work tests/processes/test_fork.py hands to other processes: importable by name, so that
worker processes started with 'spawn' (which import it afresh) run the same code as forked ones."""
from __future__ import annotations

import numpy as np
import torch

import lltm_cupy
from lltm_cupy.torch import LLTM

__all__ = ["ModelItems", "sequence_result", "HogwildTask", "hogwild_worker", "HOGWILD_STEPS"]


class ModelItems(torch.utils.data.Dataset):
    """Items computed by an LLTM (the work of a data-loading pipeline that runs a model): item i
    is the outputs of the model on input i and the input's gradient, float64."""

    def __init__(self, seed: int, items: int):
        torch.manual_seed(seed)
        self.model = LLTM(8, 64, num_layers=2).double()
        self.items, self.seed = items, seed

    def __len__(self):
        return self.items

    def inputs(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1000 + i)
        return torch.randn(6, 24, 8, generator=g, dtype=torch.float64)

    def __getitem__(self, i: int):
        x = self.inputs(i).requires_grad_()
        out, (h_n, c_n) = self.model(x)
        (d_x,) = torch.autograd.grad(out.sum() + 2 * h_n.sum() + 3 * c_n.sum(), x)
        return out.detach(), h_n.detach(), c_n.detach(), d_x


def sequence_result(xs, W, b, h, c, seed: int):
    """The array API's sequence forward and backward (the inputs scaled by ``seed``)."""
    inputs = xs * (1 + seed / 8)
    out, h_n, c_n, saved = lltm_cupy.forward_sequence(inputs, W, b, h, c)
    g = lltm_cupy.backward_sequence(np.ones_like(out), None, c_n, saved)
    return (out, h_n, c_n, *g)


#: optimiser steps of each Hogwild worker (one process takes twice as many)
HOGWILD_STEPS = 60


class HogwildTask:
    """A small sequence regression (the sum of each sequence's first feature, read from the last
    hidden state), trained with SGD."""

    def __init__(self):
        self.model = torch.nn.ModuleDict({"rnn": LLTM(4, 64), "head": torch.nn.Linear(64, 1)})
        g = torch.Generator().manual_seed(12345)
        self.eval_x, self.eval_y = self.batch(g)

    @staticmethod
    def batch(g):
        x = torch.randn(8, 32, 4, generator=g)
        return x, x[:, :, 0].sum(0, keepdim=True).T / 3

    def _loss(self, x, y):
        out, _ = self.model["rnn"](x)
        return torch.nn.functional.mse_loss(self.model["head"](out[-1]), y)

    def loss(self) -> float:
        with torch.no_grad():
            return float(self._loss(self.eval_x, self.eval_y))

    def train(self, steps: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.5)
        for _ in range(steps):
            x, y = self.batch(g)
            optimizer.zero_grad()
            self._loss(x, y).backward()
            optimizer.step()


def hogwild_worker(task: HogwildTask, seed: int) -> None:
    """One Hogwild process: one thread of torch (as mnist_hogwild's workers run), its share of
    the steps on the shared parameters."""
    torch.set_num_threads(1)
    task.train(HOGWILD_STEPS, seed)
