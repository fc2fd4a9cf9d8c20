"""Whole sequences: our LLTM layer against our cell and the reference stepped from Python, the
array API's sequence functions against stepping them, nn.LSTM of the same hidden size (oneDNN's
fused RNN on the CPU, cuDNN on a GPU), a 2-layer bidirectional LLTM against the same built from
stepped cells, a ragged batch against the same padded, and the fused sequence kernels
(``LLTM(..., fused=True)``, GPU) against the default path."""
from __future__ import annotations

from ._common import _NO_BF16_ARRAYS, Config, _not_run, check_outputs, timed_record
from .cell import _array_side, _TorchRunner, _warmup

SEQUENCE_IMPLS = ("sequence", "cell-stepped", "reference-stepped", "array-sequence",
                  "array-stepped", "lstm", "lltm-2x-bidir", "cells-2x-bidir", "ragged",
                  "ragged-padded", "ragged-user", "fused")
#: Rows that time a pair (a row and what it replaces) with their ratio in the table:
#: a 2-layer bidirectional LLTM against the same built from stepped LLTMCells, and a ragged
#: batch (lengths uniform in [1, T], as a PackedSequence) against the same batch padded to T:
#: ``ragged`` takes the loss on the packed output's data, ``ragged-user`` pads the output back
#: first (``pad_packed_sequence``), as a user converting from padded code writes it.
PAIRED_SEQUENCE_IMPLS = {"lltm-2x-bidir": "cells-2x-bidir", "ragged": "ragged-padded",
                         "ragged-user": "ragged-padded", "fused": "sequence",
                         "array-sequence": "array-stepped"}
#: the fused path's largest normalised error (outputs and every gradient, against a float64 run)
#: accepted before timing whatever the default path's own error (see check_fused)
FUSED_TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "float16": 2e-2, "bfloat16": 5e-2}
SEQUENCE_SIZES = ((16, 32, 128), (64, 256, 512))


class _TorchSequenceRunner(_TorchRunner):
    """A torch module over T steps: one call for sequence modules, a Python loop for cells."""

    def __init__(self, module, xs, h, c, mode):
        import torch

        self.torch = torch
        self.module, self.xs, self.h, self.c, self.mode = module, xs, h, c, mode

    def forward(self):
        if self.mode == "sequence":
            out, (_, c) = self.module(self.xs, (self.h, self.c))
            return [out, c]
        if self.mode == "lstm":
            out, (_, c) = self.module(self.xs, (self.h[None], self.c[None]))
            return [out, c]
        state, outs = (self.h, self.c), []
        for x in self.xs:
            state = self.module(x, state)
            outs.append(state[0])
        return outs + [state[1]]

    def backward(self, out):
        self.torch.autograd.backward(out, [self.torch.ones_like(t) for t in out])

    def _inputs(self):
        return (self.xs, self.h, self.c)


class _ArraySequenceRunner:
    def __init__(self, cfg, params, xs, h, c, stepped):
        import lltm_cupy

        self.lltm, self.stepped = lltm_cupy, stepped
        xp, self.stream_ctx, conv = _array_side(cfg)
        self.w, self.b = (conv(t) for t in params)
        self.xs, self.h, self.c = conv(xs), conv(h), conv(c)
        self.ones = xp.ones_like(self.h)
        self.ones_out = xp.ones(self.xs.shape[:2] + self.h.shape[1:], self.h.dtype)

    def forward(self):
        with self.stream_ctx():
            if not self.stepped:
                return self.lltm.forward_sequence(self.xs, self.w, self.b, self.h, self.c)
            h, c, saves = self.h, self.c, []
            for x in self.xs:
                h, c, saved = self.lltm.forward(x, self.w, self.b, h, c)
                saves.append(saved)
            return saves

    def backward(self, out):
        with self.stream_ctx():
            if not self.stepped:
                self.lltm.backward_sequence(self.ones_out, None, self.ones, out[3])
                return
            d_h, d_c, d_w, d_b = None, self.ones, 0, 0
            for saved in reversed(out):
                g = self.lltm.backward(self.ones if d_h is None else d_h + self.ones, d_c, saved,
                                       needed=(True, False, True, True, True))
                d_h, d_c = g.d_old_h, g.d_old_cell
                d_w = d_w + g.d_weights
                d_b = d_b + g.d_bias

    def saved_bytes(self) -> int:
        out = self.forward()
        return out[3].nbytes if not self.stepped else sum(s.nbytes for s in out)


class _LayeredRunner(_TorchSequenceRunner):
    """An nn.LSTM-shaped module over xs (T, B, F), or over xs as a PackedSequence of
    ``lengths``; backward of the output's sum and the final states'."""

    def __init__(self, module, xs, lengths=None, pad=False):
        import torch

        self.torch, self.module, self.xs, self.lengths = torch, module, xs, lengths
        self.pad = pad      # the output padded back to (T, B, S) (pad_packed_sequence)

    def forward(self):
        x = self.xs
        if self.lengths is not None:
            from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

            x = pack_padded_sequence(x, self.lengths, enforce_sorted=False)
        out, (h, c) = self.module(x)
        if self.lengths is not None and self.pad:
            return [pad_packed_sequence(out, total_length=len(self.xs))[0], h, c]
        return [out.data if self.lengths is not None else out, h, c]

    def _inputs(self):
        return (self.xs,)


def _StackedCells(lltm):
    """The same 2-layer bidirectional network as ``lltm`` (its parameters), built from
    LLTMCells stepped from Python: what the layer replaces."""
    import torch

    import lltm_cupy.torch as lt

    class Stacked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cells = torch.nn.ModuleList()
            for k in range(lltm.num_layers):
                for d in range(2):
                    w, b = lltm._layer_parameters(k, d)
                    cell = lt.LLTMCell(w.shape[1] - lltm.hidden_size, lltm.hidden_size,
                                       device=w.device, dtype=w.dtype)
                    cell.load_state_dict({"weights": w.detach(), "bias": b.detach()})
                    self.cells.append(cell)

        def forward(self, xs):
            h_n, c_n = [], []
            for k in range(lltm.num_layers):
                outs = []
                for d in range(2):
                    cell, state, out = self.cells[2 * k + d], None, [None] * len(xs)
                    for t in (range(len(xs)) if d == 0 else reversed(range(len(xs)))):
                        state = cell(xs[t], state)
                        out[t] = state[0]
                    outs.append(torch.stack(out))
                    h_n.append(state[0])
                    c_n.append(state[1])
                xs = torch.cat(outs, dim=2)
            return xs, (torch.stack(h_n), torch.stack(c_n))

    return Stacked()


def _reference_run(model, xs, h0=None, c0=None, lengths=None):
    """The float64 reference (torch ops) of ``model`` (an LLTM: layers, directions) over ``xs``
    (T, B, F): each sequence b over its first ``lengths[b]`` steps (default: all) from (h0, c0)
    (default zeros; given only for one layer and direction). Returns (outputs (T, B, D * S),
    zero past a length; h_n (L * D, B, S); c_n)."""
    import torch

    from lltm_cupy.torch.reference import lltm_reference

    steps, batch = xs.shape[:2]
    f64 = dict(dtype=torch.float64)
    lengths = torch.full((batch,), steps) if lengths is None else lengths.cpu()
    x = xs.detach().cpu().double()
    zeros = torch.zeros(batch, model.hidden_size, **f64)
    h_n, c_n = [], []
    with torch.no_grad():
        for k in range(model.num_layers):
            outs = []
            for d in range(model.num_directions):
                w, b = (p.detach().cpu().double() for p in model._layer_parameters(k, d))
                h = zeros if h0 is None else h0.detach().cpu().double()
                c = zeros if c0 is None else c0.detach().cpu().double()
                out = torch.zeros(steps, batch, model.hidden_size, **f64)
                for t in (range(steps - 1, -1, -1) if d else range(steps)):
                    active = (t < lengths)[:, None]       # reverse: each from its own last step
                    new_h, new_c = lltm_reference(x[t], w, b, h, c)
                    h, c = torch.where(active, new_h, h), torch.where(active, new_c, c)
                    out[t] = torch.where(active, new_h, 0)
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            x = torch.cat(outs, dim=-1)
    return x, torch.stack(h_n), torch.stack(c_n)


def _check_sequences(runners, seq, xs, h, c, cfg, skipped, strict, quiet):
    """Each runner's outputs against the float64 reference, before timing: the one-layer
    runners' hidden state at every step from (h, c) (array-stepped: the final cell state; the
    array API has no bfloat16, whose rounded cell state can drift far from the exact one over
    hundreds of steps while the hidden state, tanh(c) times a gate, does not); the 2-layer
    bidirectional pair's outputs and h_n; the ragged rows' h_n (each sequence at its own
    length) and outputs where padded. nn.LSTM is not ours, and fused is checked against the
    default path (check_fused): not checked here."""
    import torch

    cache = {}

    def reference(key, *args, **kw):
        if key not in cache:
            cache[key] = _reference_run(*args, **kw)
        return cache[key]

    def pick(name, out):
        if name in ("sequence", "array-sequence"):
            return [out[0]]
        if name in ("cell-stepped", "reference-stepped"):
            return [torch.stack(out[:-1])]
        if name == "array-stepped":
            return [out[-1].new_cell]
        if name in ("lltm-2x-bidir", "cells-2x-bidir", "ragged-padded", "ragged-user"):
            return [out[0], out[1]]
        return [out[1]] if name == "ragged" else None

    def expected(name):
        if name in ("sequence", "cell-stepped", "reference-stepped", "array-sequence"):
            return [reference("one", seq, xs, h, c)[0]]
        if name == "array-stepped":
            return [reference("one", seq, xs, h, c)[2][0]]
        if name in ("lltm-2x-bidir", "cells-2x-bidir"):
            return list(reference(name, runners[name].module_reference, xs)[:2])
        if name == "ragged-padded":
            return list(reference("padded", seq, xs)[:2])
        ragged = reference("ragged", seq, xs, lengths=runners[name].lengths)
        return [ragged[1]] if name == "ragged" else [ragged[0], ragged[1]]

    check_outputs(runners, pick, expected, cfg, skipped, strict, quiet, steps=len(xs))


def run_sequence(cfg: Config, steps: int, impls=None, quiet=False, strict=False) -> dict:
    """Time whole-sequence implementations over ``steps`` steps at one cell size (``strict``
    as for :func:`run_size`)."""
    import torch

    import lltm_cupy.torch as lt

    impls = list(impls or [i for i in SEQUENCE_IMPLS if i != "fused" or cfg.cuda])
    kw = dict(device="cuda" if cfg.cuda else "cpu", dtype=cfg.torch_dtype())
    torch.manual_seed(cfg.seed)
    seq = lt.LLTM(cfg.features, cfg.state, **kw)
    xs = torch.randn(steps, cfg.batch, cfg.features, **kw)
    h, c = (torch.randn(cfg.batch, cfg.state, **kw) for _ in range(2))
    _warmup(cfg)
    runners, skipped, tokens = {}, {}, None
    for name in impls:
        if name == "sequence":
            runners[name] = _TorchSequenceRunner(seq, xs, h, c, "sequence")
        elif name == "fused" and not cfg.cuda:
            _not_run(name, "the fused sequence kernels run on CUDA only", skipped, strict, quiet)
        elif name == "fused":
            fused = lt.LLTM(cfg.features, cfg.state, **kw, fused=True)
            fused.load_state_dict(seq.state_dict())
            runners[name] = _TorchSequenceRunner(fused, xs, h, c, "sequence")
            check_fused(seq, fused, xs, h, c, cfg.dtype_name)
        elif name in ("cell-stepped", "reference-stepped"):
            cls = lt.LLTMCell if name == "cell-stepped" else lt.ReferenceLLTMCell
            cell = cls(cfg.features, cfg.state, **kw)
            cell.load_state_dict(seq.state_dict())
            runners[name] = _TorchSequenceRunner(cell, xs, h, c, "stepped")
        elif name in ("array-sequence", "array-stepped") and cfg.bf16:
            _not_run(name, _NO_BF16_ARRAYS, skipped, strict, quiet)
        elif name in ("array-sequence", "array-stepped"):
            runners[name] = _ArraySequenceRunner(cfg, (seq.weights, seq.bias), xs, h, c,
                                                 stepped=(name == "array-stepped"))
        elif name == "lstm":
            lstm = torch.nn.LSTM(cfg.features, cfg.state, **kw)
            runners[name] = _TorchSequenceRunner(lstm, xs, h, c, "lstm")
        elif name in ("lltm-2x-bidir", "cells-2x-bidir"):
            deep = lt.LLTM(cfg.features, cfg.state, num_layers=2, bidirectional=True, **kw)
            module = deep if name == "lltm-2x-bidir" else _StackedCells(deep)
            runners[name] = _LayeredRunner(module, xs)
            runners[name].module_reference = deep      # its parameters, for the output check
        elif name in ("ragged", "ragged-padded", "ragged-user"):
            g = torch.Generator().manual_seed(cfg.seed)
            lengths = torch.randint(1, steps + 1, (cfg.batch,), generator=g)
            tokens = int(lengths.sum()) / (steps * cfg.batch)
            runners[name] = _LayeredRunner(seq, xs, None if name == "ragged-padded" else lengths,
                                           pad=name == "ragged-user")
        else:
            raise ValueError(f"unknown sequence implementation {name!r}; choose from "
                             f"{SEQUENCE_IMPLS}")
    _check_sequences(runners, seq, xs, h, c, cfg, skipped, strict, quiet)
    record = timed_record(runners, cfg, [k for k in runners if k.startswith("array")], skipped,
                          quiet, label=f"T={steps} ", steps=steps, all_grads=False,
                          baseline="cell-stepped")
    record["pairs"] = {a: b for a, b in PAIRED_SEQUENCE_IMPLS.items()
                       if a in record["results"] and b in record["results"]}
    if tokens is not None:
        record["ragged_tokens"] = tokens
    return record



def check_fused(default, fused, xs, h, c, dtype_name: str) -> float:
    """Run both modules and the default module in float64 once (forward, and backward of the
    outputs' and final states' sum) and raise unless the fused outputs and parameter gradients
    are about as close to the float64 run as the default path's are: within four times the
    default path's error or FUSED_TOLERANCE (normalised by max(1, max |float64|)), whichever
    is larger. Over long sequences both paths drift from float64 (their recurrent sums round in
    different orders and the cell state grows), so a fixed tolerance between the two would
    refuse a correct kernel; a wrong one is off by far more than the default path (figures:
    docs/performance.md). Returns the fused path's largest error."""
    import copy

    import torch

    exact = copy.deepcopy(default).double()
    runs = []
    for module, cast in ((exact, torch.Tensor.double), (default, None), (fused, None)):
        module.zero_grad(set_to_none=True)
        args = [t if cast is None else cast(t) for t in (xs, h, c)]
        out, (h_n, c_n) = module(args[0], (args[1][None], args[2][None]))
        (out.double().sum() + h_n.double().sum() + c_n.double().sum()).backward()
        runs.append([t.detach().double() for t in (out, h_n, c_n)]
                    + [p.grad.detach().double() for p in module.parameters()])
        module.zero_grad(set_to_none=True)

    def error(results):
        worst = 0.0
        for want, got in zip(runs[0], results):
            err = ((got - want).abs().max() / torch.clamp(want.abs().max(), min=1.0)).item()
            worst = max(worst, err if err == err else float("inf"))
        return worst

    default_error, fused_error = error(runs[1]), error(runs[2])
    allowed = max(FUSED_TOLERANCE[dtype_name], 4 * default_error)
    if not fused_error <= allowed:
        raise RuntimeError(f"fused sequence kernels are {fused_error:.2e} off a float64 run "
                           f"(normalised), the default path {default_error:.2e}; more than "
                           f"{allowed:.1e} in {dtype_name}: not timed")
    return fused_error
