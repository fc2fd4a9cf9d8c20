"""Our ``LLTM`` against ``nn.LSTM`` of the same hidden size on the CPU (and, in time, the
tutorial's cell stepped from Python): a forward under ``torch.no_grad`` (inference) in peak
memory and in time, a training step (forward, then the backward of ``output.sum() +
h_n.sum() + c_n.sum()`` into the parameters) in time, and a call's split into a cost per step
and a fixed cost per call (two lengths, :func:`split_report`).

- **memory**: each implementation runs in a fresh Python process (so that nothing another one
  allocated or cached is counted): it builds the module and the input, runs a 2-step forward
  (libraries and lazy imports loaded), resets the kernel's peak-RSS mark (``/proc/self/clear_refs``
  = 5, Linux), runs the forward and reports ``VmHWM - VmRSS`` before the call: the peak of the
  resident memory the forward added, whoever allocated it (NumPy, torch's CPU allocator, oneDNN's
  scratch). tracemalloc would see NumPy's allocations only, not torch's. Rounds alternate the
  implementations; the median is reported.
- **time**: in one process, at the thread count given (``scripts/benchmark.py``: torch's
  default, what a user gets, unless ``--threads`` says otherwise), implementations interleaved,
  the median of per-round ratios and each one's slowest round over its fastest, by
  :func:`._common.thread_clock`;
- **GEMM-only floor**: beside each implementation, the GEMMs a recurrent layer of its gate count
  (3 for the LLTM, 4 for the LSTM) does on the same sizes, alone: ``torch.mm`` on preallocated
  operands, the input projection in one call, one recurrent product per step, and for a
  training step one product into the hidden-state gradient per step and the two weight
  gradients: no element-wise work, no allocation. An implementation whose GEMMs are
  ``torch.mm``'s spends all its time in the BLAS at its floor; one whose GEMMs run elsewhere
  (``nn.LSTM``'s fused oneDNN primitive, the LLTM's oneDNN products from a size on) can go
  below it, by as much as that engine is faster than torch's BLAS on the machine.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import lltm_cupy

from ._common import CLOCK_TEXT, interleaved, thread_clock

#: this package's folder's parent (scripts/): a child process imports the package from there
_SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (T, B, F, S) of the memory figure and of the time figures
MEMORY_SIZES = ((500, 64, 16, 512),)
TIME_SIZES = ((64, 16, 32, 128), (128, 32, 128, 256), (64, 64, 256, 512))
TRAIN_SIZES = ((64, 16, 32, 128), (128, 32, 128, 256), (64, 64, 256, 512), (32, 256, 512, 1024))
#: (B, F, S) and the two lengths of the per-step / fixed split
SPLIT_SIZE, SPLIT_STEPS = (16, 32, 128), (4, 64)
INFERENCE_IMPLS = ("lltm", "lstm")
#: the time reports' implementations: ours, nn.LSTM and the tutorial's cell stepped from Python
TIME_IMPLS = ("lltm", "lstm", "reference")


def _module(impl, features, state):
    """Our LLTM, nn.LSTM, or the tutorial's cell (eager torch) stepped from Python over a
    sequence, each called as a sequence module: ``(outputs, (h_n, c_n))``."""
    import torch

    import lltm_cupy.torch as lt

    torch.manual_seed(0)
    if impl != "reference":
        return lt.LLTM(features, state) if impl == "lltm" else torch.nn.LSTM(features, state)
    cell = lt.ReferenceLLTMCell(features, state)

    def stepped(xs):
        h = c = xs.new_zeros(xs.shape[1], state)
        outs = []
        for x in xs:
            h, c = cell(x, (h, c))
            outs.append(h)
        return torch.stack(outs), (h, c)

    return stepped


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _child(impl: str, steps: int, batch: int, features: int, state: int, threads: int) -> dict:
    """In a fresh process: the resident memory one no_grad forward adds at its peak."""
    import torch

    torch.set_num_threads(threads)
    module = _module(impl, features, state)
    x = torch.randn(steps, batch, features)
    with torch.no_grad():
        module(x[:2])
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                  # VmHWM := VmRSS
        out, _ = module(x)
        peak = _status("VmHWM")
    return {"peak_bytes": peak - before, "output_bytes": out.numel() * out.element_size()}


def memory_report(sizes=MEMORY_SIZES, rounds: int = 3, threads: int = 1) -> dict:
    """Median over ``rounds`` (implementations alternating) of each one's peak added RSS."""
    if not os.path.exists("/proc/self/clear_refs"):
        raise RuntimeError("the memory figure reads /proc/self (Linux only)")
    report = {}
    for size in sizes:
        runs = {impl: [] for impl in INFERENCE_IMPLS}
        for r in range(rounds):
            for impl in (INFERENCE_IMPLS if r % 2 == 0 else INFERENCE_IMPLS[::-1]):
                code = (f"import json; from lltm_bench.inference import _child; "
                        f"print(json.dumps(_child({impl!r}, *{tuple(size)!r}, {threads})))")
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                    [_SCRIPTS, os.path.dirname(os.path.dirname(lltm_cupy.__file__))]
                    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
                done = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                      capture_output=True, text=True)
                runs[impl].append(json.loads(done.stdout.strip().splitlines()[-1]))
        report[str(tuple(size))] = {
            impl: {"peak_bytes": statistics.median(r["peak_bytes"] for r in runs[impl]),
                   "output_bytes": runs[impl][0]["output_bytes"],
                   "rounds": [r["peak_bytes"] for r in runs[impl]]}
            for impl in INFERENCE_IMPLS}
    return report


def _gemm_floor(steps: int, batch: int, features: int, state: int, gates: int, train: bool):
    """A callable doing the GEMMs alone of a ``gates``-gate recurrent layer (see the module
    docstring)."""
    import torch

    g = gates * state
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.rand(*shape, generator=gen) - 0.5   # noqa: E731
    x, w_x = rand(steps * batch, features), rand(features, g)
    w_h, w_h_t = rand(state, g), rand(g, state)
    h, proj, z = rand(batch, state), torch.empty(steps * batch, g), torch.empty(batch, g)
    d_gates, hs = rand(steps, batch, g), rand(steps * batch, state)
    d_h = torch.empty(batch, state)
    d_w_h, d_w_x = torch.empty(g, state), torch.empty(g, features)
    d_rows = d_gates.unbind(0)
    d_flat = d_gates.view(steps * batch, g)

    def run():
        torch.mm(x, w_x, out=proj)
        for _ in range(steps):
            torch.mm(h, w_h, out=z)
        if train:
            for d in d_rows:
                torch.mm(d, w_h_t, out=d_h)
            torch.mm(d_flat.T, hs, out=d_w_h)
            torch.mm(d_flat.T, x, out=d_w_x)
    return run


def sequence_call(module, x, train: bool):
    """One call of a sequence module on ``x``; ``train``: and the backward of the outputs'
    and final states' sums."""
    def run():
        if not train:
            module(x)
            return
        out, (h, c) = module(x)
        (out.sum() + h.sum() + c.sum()).backward()
    return run


def time_report(sizes=TIME_SIZES, rounds: int = 15, threads: int = 1,
                train: bool = False) -> dict:
    """Time of one no_grad forward (``train``: one forward + backward) of each of
    :data:`TIME_IMPLS` and of the GEMM-only floor of ours and nn.LSTM's (``lltm_gemm``,
    ``lstm_gemm``), interleaved: medians, the median of the per-round ratio LLTM / nn.LSTM,
    and each implementation's slowest round over its fastest."""
    import torch

    torch.set_num_threads(threads)
    clock, clock_name = thread_clock(threads)
    report = {}
    for steps, batch, features, state in sizes:
        x = torch.randn(steps, batch, features)
        calls = {impl: sequence_call(_module(impl, features, state), x, train)
                 for impl in TIME_IMPLS}
        for impl, gates in (("lltm", 3), ("lstm", 4)):
            calls[f"{impl}_gemm"] = _gemm_floor(steps, batch, features, state, gates, train)
        with torch.set_grad_enabled(train):
            times = interleaved(calls, rounds, clock)
        ratios = [a / b for a, b in zip(times["lltm"], times["lstm"])]
        report[str((steps, batch, features, state))] = {
            **{f"{row}_s": statistics.median(times[row]) for row in calls},
            "ratio": statistics.median(ratios), "rounds": rounds, "threads": threads,
            "clock": clock_name,
            **{f"{row}_spread": max(times[row]) / min(times[row]) for row in TIME_IMPLS
               if min(times[row]) > 0}}
    return report


def split_report(size=SPLIT_SIZE, lengths=SPLIT_STEPS, rounds: int = 21, threads: int = 1) -> dict:
    """A call's cost split into a cost per step and a fixed cost per call, for ours and
    nn.LSTM at (B, F, S) = ``size``, training and no_grad: both lengths of ``lengths`` timed in
    each round (all interleaved), per round per step = (t_long - t_short) / (long - short) and
    fixed = t_short - short * per step; medians over the rounds (process CPU time with one
    thread). Calls at the short length repeat (to a comparable duration) and are averaged."""
    import torch

    torch.set_num_threads(threads)
    clock, clock_name = thread_clock(threads)
    batch, features, state = size
    short, long = lengths
    repeat = max(1, long // short)
    report = {}
    for train in (True, False):
        calls = {}
        for impl in INFERENCE_IMPLS:
            module = _module(impl, features, state)
            for steps, n in ((short, repeat), (long, 1)):
                run = sequence_call(module, torch.randn(steps, batch, features), train)
                calls[impl, steps] = (lambda run=run, n=n: [run() for _ in range(n)])
        with torch.set_grad_enabled(train):
            times = interleaved(calls, rounds, clock)
        rows = {}
        for impl in INFERENCE_IMPLS:
            t_short = [t / repeat for t in times[impl, short]]
            per_step = [(b - a) / (long - short) for a, b in zip(t_short, times[impl, long])]
            rows[impl] = {"per_step_s": statistics.median(per_step),
                          "fixed_s": statistics.median(a - short * p
                                                       for a, p in zip(t_short, per_step)),
                          "long_s": statistics.median(times[impl, long])}
        report["training" if train else "no_grad"] = rows
    return {"size": list(size), "lengths": list(lengths), "rounds": rounds, "threads": threads,
            "clock": clock_name, **report}


def format_inference(memory: dict, timing: dict, training: dict = None) -> str:
    lines = []
    if memory:
        lines += ["inference memory: peak resident memory added by one forward under no_grad "
                  "(fresh process per implementation, VmHWM - VmRSS)",
                  f"{'(T, B, F, S)':<22} {'LLTM MB':>9} {'nn.LSTM MB':>11} {'ratio':>6} "
                  f"{'output MB':>10}"]
        for size, r in memory.items():
            a, b = r["lltm"]["peak_bytes"], r["lstm"]["peak_bytes"]
            lines.append(f"{size:<22} {a / 1e6:>9.1f} {b / 1e6:>11.1f} {a / b:>6.2f} "
                         f"{r['lltm']['output_bytes'] / 1e6:>10.1f}")
    for title, table in (("inference time: one forward under no_grad", timing),
                         ("training step: forward + backward of the parameters", training)):
        if not table:
            continue
        first = next(iter(table.values()))
        clock = CLOCK_TEXT[first["clock"]]
        lines += ["", f"{title}, {clock}, {first['threads']} thread(s), median of "
                      f"{first['rounds']} interleaved rounds; GEMM-only: the same layer's GEMMs "
                      f"alone by torch.mm (torch's BLAS); max/min: the slowest round over the "
                      f"fastest, LLTM/nn.LSTM",
                  f"{'(T, B, F, S)':<22} {'LLTM ms':>9} {'nn.LSTM ms':>11} {'ratio':>6} "
                  f"{'LLTM GEMM-only':>15} {'nn.LSTM GEMM-only':>18} {'max/min':>11} "
                  f"{'tutorial ms':>13}"]
        for size, r in table.items():
            spread = (f"{r['lltm_spread']:.2f}/{r['lstm_spread']:.2f}"
                      if "lltm_spread" in r and "lstm_spread" in r else "")
            lines.append(f"{size:<22} {r['lltm_s'] * 1e3:>9.1f} {r['lstm_s'] * 1e3:>11.1f} "
                         f"{r['ratio']:>6.2f} {_floor(r, 'lltm'):>15} {_floor(r, 'lstm'):>18} "
                         f"{spread:>11} {r['reference_s'] * 1e3:>13.1f}")
    return "\n".join(lines)


def format_split(split: dict) -> str:
    """The per-step / fixed split as a table (microseconds)."""
    b, f, s = split["size"]
    short, long = split["lengths"]
    clock = CLOCK_TEXT[split["clock"]]
    lines = ["", f"per-step / fixed split at (B, F, S) = ({b}, {f}, {s}): T = {short} and {long} "
                 f"interleaved, per round (t_{long} - t_{short}) / {long - short} per step and "
                 f"t_{short} - {short} * per step fixed; medians of {split['rounds']} rounds, "
                 f"{clock}, {split['threads']} thread(s)",
             f"{'':<10} {'impl':<8} {'per step us':>12} {'fixed us':>10} "
             f"{'T = ' + str(long) + ' ms':>10}"]
    for mode in ("training", "no_grad"):
        rows = split[mode]
        for impl, r in rows.items():
            lines.append(f"{mode:<10} {impl:<8} {r['per_step_s'] * 1e6:>12.1f} "
                         f"{r['fixed_s'] * 1e6:>10.0f} {r['long_s'] * 1e3:>10.2f}")
        a, o = rows["lltm"], rows["lstm"]
        lines.append(f"{mode:<10} {'ratio':<8} {a['per_step_s'] / o['per_step_s']:>12.2f} "
                     f"{a['fixed_s'] / o['fixed_s']:>10.2f} {a['long_s'] / o['long_s']:>10.2f}")
    return "\n".join(lines)


def _floor(r: dict, impl: str) -> str:
    """'ms (x of the implementation's time)'"""
    floor = r[f"{impl}_gemm_s"]
    return f"{floor * 1e3:.1f} ({floor / r[f'{impl}_s']:.2f})"
