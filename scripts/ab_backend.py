#!/usr/bin/env python
"""A/B of the NumPy backend: the working tree's against an earlier revision's, in one process.

A change to the NumPy backend (``lltm_cupy/_numpy/``) is judged by the step it costs, and on a
shared machine only a comparison within one process means anything: this loads the backend of
``--base`` (a git revision) next to the current one and times the same step with each, swapped every 20 steps,
timing every step on its own. It prints the 10th, 25th and 50th percentiles per backend and
their ratios; the low percentiles are the least disturbed by other tenants.

The step is the benchmark's: forward, then the backward of the parameters (weights and bias)
with gradient one for new_h and new_cell, at (batch, features, state); with --cell the same
through the torch layer's ``LLTMCell`` (backward of new_h.sum() + new_cell.sum()). Parameters
are initialised as ``LLTMCell`` does (uniform in +-1/sqrt(state)), inputs and state from a
standard normal; --randn draws the parameters from a standard normal too, which saturates the
gates (pre-activations of about sqrt(state + features)).

With --sequence TxBxFxS[,...] it times whole sequences instead: the torch layer's ``LLTM``
(training: forward, then the backward of ``output.sum() + h_n.sum() + c_n.sum()`` into the
parameters; --no-grad: a forward under ``torch.no_grad``) on each backend, interleaved in
--rounds rounds with ``nn.LSTM`` of the same size (the order rotated every round); per row each
one's median time, its slowest round over its fastest, its median system time and page faults
per call (``getrusage``), the median per-round ratio to ``nn.LSTM`` and of the working tree
to the base. At --threads 1 process CPU time, at more wall time (default: torch's threads).

Examples:
    python scripts/ab_backend.py --base 554f7e2                 # array API, float32, 60 s
    python scripts/ab_backend.py --base 554f7e2 --cell -d       # LLTMCell, float64
    OPENBLAS_NUM_THREADS=1 python scripts/ab_backend.py --base HEAD~1 --seconds 20
    python scripts/ab_backend.py --base HEAD~1 --sequence 32x256x512x1024 --threads 2

Needs git and a checkout. The earlier backend is imported as it was, from a copy of that
revision's whole ``lltm_cupy`` (so its own helpers, ``_types`` and ``_packing``, come with it).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

import numpy as np  # noqa: E402

from lltm_cupy import _numpy  # noqa: E402

BACKEND_PATH = "lltm_cupy/_numpy"


def load_backend(revision: str) -> types.ModuleType:
    """The NumPy backend as of ``revision`` (a package ``lltm_cupy/_numpy/``, or the one module
    ``lltm_cupy/_numpy.py`` of older revisions), imported from a copy of that revision's
    ``lltm_cupy`` under a name of its own, so that its relative imports resolve in its own
    package."""
    import importlib
    import io
    import tarfile
    import tempfile

    try:
        archive = subprocess.run(["git", "archive", "--format=tar", revision, "lltm_cupy"],
                                 cwd=ROOT, check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or str(exc)
        detail = detail.decode(errors="replace") if isinstance(detail, bytes) else detail
        raise SystemExit(f"ab_backend.py: cannot read {BACKEND_PATH} at {revision!r}: "
                         f"{detail.strip()}")
    name = "lltm_cupy_at_" + "".join(c if c.isalnum() else "_" for c in revision)
    folder = Path(tempfile.mkdtemp(prefix="ab_backend_"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data") if hasattr(tarfile, "data_filter") \
            else tar.extractall(folder)
    (folder / "lltm_cupy").rename(folder / name)
    sys.path.insert(0, str(folder))
    return importlib.import_module(f"{name}._numpy")


def _parameters(rng, size, randn: bool):
    """weights (3S, S + F) and bias (3S,) as float64: LLTMCell's init, or standard normal."""
    _, features, state = size
    shapes = ((3 * state, state + features), (3 * state,))
    if randn:
        return [rng.standard_normal(shape) for shape in shapes]
    bound = 1.0 / np.sqrt(state)
    return [rng.uniform(-bound, bound, shape) for shape in shapes]


def array_step(size, dtype, randn: bool):
    """The step through the backend's own forward and backward (as the array API calls them,
    without its checks), and a function that selects the backend it runs."""
    batch, features, state = size
    rng = np.random.default_rng(0)
    weights, bias = _parameters(rng, size, randn)
    args = [a.astype(dtype) for a in (rng.standard_normal((batch, features)), weights, bias,
                                      rng.standard_normal((batch, state)),
                                      rng.standard_normal((batch, state)))]
    ones = np.ones((batch, state), dtype)
    needed = (False, False, True, True, False)

    current = [_numpy]

    def step():     # the backend's own entry points (each revision's types pass its own checks)
        backend = current[0]
        saved = backend.forward(*args)[2]
        backend.backward(ones, ones, saved, needed)

    def use(backend):
        current[0] = _numpy if backend is None else backend

    return step, use


def cell_step(size, dtype, randn: bool):
    """The step through LLTMCell, and a function that selects the backend it runs."""
    import torch

    from lltm_cupy.torch import LLTMCell, _functions

    batch, features, state = size
    torch_dtype = torch.float64 if dtype == np.float64 else torch.float32
    torch.manual_seed(0)
    cell = LLTMCell(features, state).to(torch_dtype)
    if randn:
        with torch.no_grad():
            for parameter in cell.parameters():
                parameter.normal_()
    x, h, c = (torch.randn(batch, n, dtype=torch_dtype) for n in (features, state, state))

    def step():
        new_h, new_cell = cell(x, (h, c))
        (new_h.sum() + new_cell.sum()).backward()

    original = _functions._step

    def use(backend):
        _functions._step = original if backend is None else _step_module(backend)

    return step, use


def _step_module(backend):
    """The backend's element-wise step the torch layer calls (``step.gate_rows`` and
    ``step.cell_backward_into``, into given buffers); for a revision without ``gate_rows``, the
    same built from its ``cell_rows`` and ``cell_forward_into``; older revisions lack those."""
    step = getattr(backend, "step", None)
    if step is None or not hasattr(step, "cell_forward_into"):
        raise SystemExit(f"ab_backend.py --cell: the backend at {backend.__name__} has no "
                         f"step.cell_forward_into/cell_backward_into (the torch layer's entry "
                         f"points): compare it through the array API (without --cell)")
    return step if hasattr(step, "gate_rows") else _GateRows(step)


class _GateRows:
    """A backend's step module with ``gate_rows`` made of its ``cell_rows`` and
    ``cell_forward_into`` (what the torch layer called before ``gate_rows``)."""

    def __init__(self, step):
        self._step = step

    def __getattr__(self, name):
        return getattr(self._step, name)

    def gate_rows(self, batch, state, dtype, derivatives, operand):
        step = self._step
        z = step.cell_rows(batch, state, dtype)[:3]

        def run(old_cell, new_h, new_cell, factors=None):
            step.cell_forward_into(z, old_cell, new_h, new_cell, factors, gate_major=True)
        return operand(z), run


def measure(step, use, backends: dict, seconds: float, chunk: int = 20) -> dict:
    """Per-step times in microseconds for each backend, interleaved in chunks of ``chunk``;
    ``use(backend)`` selects one, ``use(None)`` restores the library's own."""
    times = {name: [] for name in backends}
    clock = time.perf_counter_ns
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for name, backend in backends.items():
            use(backend)
            step()
            step()
            out = times[name]
            for _ in range(chunk):
                t0 = clock()
                step()
                out.append((clock() - t0) / 1e3)
    use(None)
    return times


def report(times: dict, base: str, label: str) -> str:
    pct = (10, 25, 50)
    ref = {p: np.percentile(times[base], p) for p in pct}
    lines = [label, f"{'backend':<18} {'steps':>7} " + " ".join(f"{'p' + str(p) + ' us':>9}"
                                                             for p in pct)
             + "  " + " ".join(f"{'vs p' + str(p):>8}" for p in pct)]
    for name, values in times.items():
        q = {p: np.percentile(values, p) for p in pct}
        lines.append(f"{name:<18} {len(values):>7} " + " ".join(f"{q[p]:>9.1f}" for p in pct)
                     + "  " + " ".join(f"{q[p] / ref[p] - 1:>+8.1%}" for p in pct))
    return "\n".join(lines)


def sequence_rounds(size, backends: dict, rounds: int, threads: int, train: bool) -> dict:
    """``LLTM`` at (T, B, F, S) = ``size`` on each of ``backends`` (name -> NumPy backend
    module) and ``nn.LSTM``, interleaved (see the module docstring): {name: [(seconds,
    system seconds, page faults) per round]}."""
    import resource

    import torch

    from lltm_cupy.torch import LLTM, _interop

    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    steps, batch, features, state = size
    torch.manual_seed(0)
    ours, lstm = LLTM(features, state), torch.nn.LSTM(features, state)
    x = torch.randn(steps, batch, features)
    own = _interop.CPU_CALL.backend

    def run(module):
        if not train:
            module(x)
            return
        out, (h, c) = module(x)
        (out.sum() + h.sum() + c.sum()).backward()

    def on(backend):
        def call():
            _interop.CPU_CALL.backend = backend
            try:
                run(ours)
            finally:
                _interop.CPU_CALL.backend = own
        return call

    calls = {**{name: on(b) for name, b in backends.items()}, "nn.LSTM": lambda: run(lstm)}
    names = list(calls)
    samples = {name: [] for name in names}
    with torch.set_grad_enabled(train):
        for call in calls.values():
            call()
            call()
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                before = resource.getrusage(resource.RUSAGE_SELF)
                t0 = clock()
                calls[name]()
                elapsed = clock() - t0
                after = resource.getrusage(resource.RUSAGE_SELF)
                samples[name].append((elapsed, after.ru_stime - before.ru_stime,
                                      after.ru_minflt - before.ru_minflt))
    return samples


def sequence_report(samples: dict, base: str, label: str) -> str:
    from statistics import median

    lstm = [t for t, _, _ in samples["nn.LSTM"]]
    ref = [t for t, _, _ in samples[base]]
    lines = [label, f"{'':<14} {'median ms':>10} {'max/min':>8} {'sys ms':>7} {'faults':>8} "
                    f"{'/ nn.LSTM':>10} {'/ ' + base:>12}"]
    for name, rows in samples.items():
        t = [r[0] for r in rows]
        ratio = median(a / b for a, b in zip(t, lstm))
        to_base = median(a / b for a, b in zip(t, ref))
        lines.append(f"{name:<14} {median(t) * 1e3:>10.1f} {max(t) / min(t):>8.2f} "
                     f"{median(r[1] for r in rows) * 1e3:>7.0f} {median(r[2] for r in rows):>8.0f} "
                     f"{ratio:>10.2f} {to_base:>12.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--base", required=True, help="git revision of the backend to compare with")
    p.add_argument("-b", "--batch-size", type=int, default=16)
    p.add_argument("-f", "--features", type=int, default=32)
    p.add_argument("-s", "--state-size", type=int, default=128)
    p.add_argument("-d", "--double", action="store_true", help="float64 instead of float32")
    p.add_argument("--cell", action="store_true", help="time LLTMCell instead of the array API")
    p.add_argument("--randn", action="store_true",
                   help="parameters from a standard normal (saturated gates) instead of "
                        "LLTMCell's init")
    p.add_argument("--seconds", type=float, default=60.0, help="measuring time (default: 60)")
    p.add_argument("--sequence", metavar="TxBxFxS[,...]", default=None,
                   help="time the torch layer's LLTM over whole sequences against nn.LSTM")
    p.add_argument("--no-grad", action="store_true", help="with --sequence: a forward under "
                                                          "torch.no_grad, not a training step")
    p.add_argument("--rounds", type=int, default=15, help="with --sequence (default: 15)")
    p.add_argument("--threads", type=int, default=None,
                   help="with --sequence: torch threads (default: torch's own)")
    args = p.parse_args(argv)
    if args.sequence:
        from lltm_bench._common import parse_sequence_sizes

        import torch

        try:
            sizes = parse_sequence_sizes(args.sequence, "--sequence")
        except argparse.ArgumentTypeError as exc:
            p.error(str(exc))
        threads = args.threads or torch.get_num_threads()
        backends = {args.base: load_backend(args.base), "working tree": _numpy}
        for size in sizes:
            samples = sequence_rounds(size, backends, args.rounds, threads, not args.no_grad)
            what = "forward under no_grad" if args.no_grad else "training step"
            clock = "process CPU time" if threads == 1 else "wall time"
            print(sequence_report(samples, args.base,
                                  f"LLTM {what} at (T, B, F, S) = {size}, {threads} thread(s), "
                                  f"{clock}, {args.rounds} interleaved rounds"), flush=True)
        return 0
    if args.seconds <= 0 or min(args.batch_size, args.features, args.state_size) < 1:
        p.error("--seconds and the sizes must be positive")

    size = (args.batch_size, args.features, args.state_size)
    dtype = np.float64 if args.double else np.float32
    backends = {args.base: load_backend(args.base), "working tree": _numpy}
    step, use = (cell_step if args.cell else array_step)(size, dtype, args.randn)
    what = (f"{'LLTMCell' if args.cell else 'array API'}, {size}, {np.dtype(dtype).name}, "
            f"{'randn' if args.randn else 'LLTMCell-init'} parameters")
    print(f"timing the {what} for {args.seconds:g} s ...", file=sys.stderr, flush=True)
    times = measure(step, use, backends, args.seconds)
    print(report(times, args.base, f"forward + backward of the parameters: {what}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
