"""What a run prints and draws: the results table (and the warning when its runs were
disturbed) and the plot; the diagnostics printed beside them are :mod:`.diagnostics`'."""
from __future__ import annotations

from ._common import CLOCK_TEXT, PHASES

#: --scale: (factor from seconds, unit)
SCALES = {"s": (1.0, "s"), "ms": (1e3, "ms"), "us": (1e6, "us")}


def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


#: A median this many times its minimum: the runs were disturbed (see :func:`spread_warning`).
SPREAD_LIMIT = 2.0


def spread_warning(record: dict) -> str:
    """A warning line when some implementation's median sits more than ``SPREAD_LIMIT`` times
    above its minimum (the fastest run: what the code can do), else ``""``. On a busy machine
    (other processes, or NumPy's and torch's BLAS threads competing for the cores) the medians
    measure the contention, not the code."""
    worst = {}
    for name, r in record["results"].items():
        ratios = [r[p]["median_s"] / r[p]["min_s"] for p in PHASES if r[p]["min_s"] > 0]
        if ratios and max(ratios) > SPREAD_LIMIT:
            worst[name] = max(ratios)
    if not worst:
        return ""
    listing = ", ".join(f"{n} {v:.1f}x" for n, v in worst.items())
    return (f"warning: medians far above their minimums ({listing}): the runs were disturbed "
            f"(a busy machine, or BLAS threads competing for the cores), so the medians "
            f"measure that; rerun on a quiet machine with one thread (OMP_NUM_THREADS=1) for "
            f"steady figures")


def format_table(record: dict, scale="us") -> str:
    """A text table: median / min per phase, speed-up of fwd+bwd over the baseline (the eager
    reference; for sequences our cell stepped from Python)."""
    factor, unit = SCALES[scale]
    res = record["results"]
    baseline = record.get("baseline", "reference")
    base = res.get(baseline, {}).get("fwd+bwd", {}).get("median_s")
    steps = f", {record['steps']} steps" if "steps" in record else ""
    lines = [f"(batch, features, state) = ({record['batch']}, {record['features']}, "
             f"{record['state']}){steps}, {record['dtype']} on {record['device']}, "
             f"{record['runs']} runs; times in {unit}, median / min"]
    names = [*res, *record.get("skipped", {})]
    width = max(11, max(len(n) for n in names) + 2) if names else 11
    head = (f"{'impl':<{width}}" + "".join(f"{p:>22}" for p in PHASES)
            + f"{'vs ' + baseline:>20}{'saved':>12}")
    lines += [head, "-" * len(head)]
    for name, r in res.items():
        cells = "".join(f"{r[p]['median_s'] * factor:>12.1f} /{r[p]['min_s'] * factor:>8.1f}"
                        for p in PHASES)
        ratio = f"{base / r['fwd+bwd']['median_s']:.2f}x" if base else "n/a"
        lines.append(f"{name:<{width}}{cells}{ratio:>20}{_fmt_bytes(r['saved_bytes']):>12}")
    for name, why in record["skipped"].items():
        lines.append(f"{name:<{width}}not run: {why}")
    if record.get("separately_timed"):
        lines.append(f"timed in a separate block (NumPy BLAS threads vs torch threads): "
                     f"{', '.join(record['separately_timed'])}")
    if base:
        lines.append(f"vs {baseline}: its fwd+bwd median / this fwd+bwd median "
                     f"(above 1: faster than {baseline})")
    for row, other in record.get("pairs", {}).items():
        a, b = (res[n]["fwd+bwd"]["median_s"] for n in (row, other))
        tokens = (f"; {record['ragged_tokens']:.0%} of its tokens"
                  if row.startswith("ragged") and "ragged_tokens" in record else "")
        lines.append(f"{row} / {other}: {a / b:.2f}x of its fwd+bwd median "
                     f"(min: {res[row]['fwd+bwd']['min_s'] / res[other]['fwd+bwd']['min_s']:.2f}x"
                     f"{tokens})")
    warning = spread_warning(record)
    if warning:
        lines.append(warning)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plot

def plot_speedups(records: list, path, machine: str = "") -> tuple:
    """The fwd+bwd speed-up of every implementation over the run's baseline (the eager reference;
    for sequences our cell stepped from Python), per size, as grouped bars in one PNG. Needs
    matplotlib (the examples extra). Returns the image size in pixels (width, height)."""
    from lltm_cupy._extras import pyplot, save_figure

    plt = pyplot()
    impls = []
    for r in records:
        impls += [n for n in r["results"] if n not in impls]
    labels = [f"({r['batch']}, {r['features']}, {r['state']})"
              + (f"\nT = {r['steps']}" if "steps" in r else "") for r in records]
    baseline = records[0].get("baseline", "reference")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 + 1.1 * len(records) * max(1, len(impls)) / 3),
                                    3.8), dpi=100)
    width = 0.8 / max(1, len(impls))
    top = 1.0
    for k, name in enumerate(impls):
        xs, ys = [], []
        for i, r in enumerate(records):
            res = r["results"]
            if name in res and baseline in res:
                xs.append(i - 0.4 + width * (k + 0.5))
                ys.append(res[baseline]["fwd+bwd"]["median_s"] / res[name]["fwd+bwd"]["median_s"])
        top = max([top, *ys])
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
    ax.set_xticks(range(len(records)), labels, fontsize=8)
    ax.set_xlabel("(batch, features, state)")
    ax.set_ylabel(f"speed-up over {baseline}\n(fwd+bwd median; above 1 is faster)")
    first = records[0]
    ax.set_title(f"lltm_cupy benchmark, {first['dtype']} on {first['device']}"
                 + (f"\n{machine}" if machine else ""), fontsize=9)
    ax.set_ylim(0, top * 1.35)   # room for the legend above the bars
    ax.legend(fontsize=7, ncol=min(3, max(1, len(impls))), loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


#: the implementations of the --inference picture: (row, label)
INFERENCE_PLOT_ROWS = (("lltm", "LLTM (lltm_cupy)"), ("lstm", "nn.LSTM (oneDNN)"),
                       ("reference", "tutorial's LLTM cell, stepped"))


def plot_inference(runs, path, title: str = "") -> tuple:
    """Time per call of each of :data:`INFERENCE_PLOT_ROWS` at every (T, B, F, S) of the
    --inference reports, as grouped bars on a log scale, each labelled with its time and its
    ratio to nn.LSTM's: one column per thread count, side by side, the training step (forward
    + backward) above the forward under no_grad. ``runs``: one dict per thread count, with
    ``threads``, ``time`` and ``training`` (the reports of :func:`lltm_bench.inference.
    time_report`; either may be empty). ``title``: the machine and versions. Needs
    matplotlib (the examples extra). Returns the image size in pixels (width, height)."""
    from lltm_cupy._extras import pyplot, save_figure

    plt = pyplot()
    modes = [m for m in (("training", "training step (forward + backward)"),
                         ("time", "forward under no_grad")) if any(r.get(m[0]) for r in runs)]
    fig, axes = plt.subplots(len(modes), len(runs), figsize=(5.2 * len(runs), 4.0 * len(modes)),
                             dpi=100, squeeze=False)
    width = 0.8 / len(INFERENCE_PLOT_ROWS)
    for column, run in enumerate(runs):
        for row_index, (key, name) in enumerate(modes):
            ax, table = axes[row_index][column], run.get(key) or {}
            if not table:
                ax.set_axis_off()
                continue
            first = next(iter(table.values()))
            clock = CLOCK_TEXT[first["clock"]]
            threads = run["threads"]
            sizes = list(table)
            for k, (row, label) in enumerate(INFERENCE_PLOT_ROWS):
                seconds = [table[size][f"{row}_s"] for size in sizes]
                bars = ax.bar([i - 0.4 + width * (k + 0.5) for i in range(len(sizes))],
                              [t * 1e3 for t in seconds], width, label=label)
                ax.bar_label(bars, [f"{_ms(t * 1e3)}\n{t / table[size]['lstm_s']:.2f}x"
                                    for t, size in zip(seconds, sizes)], fontsize=6, padding=1)
            ax.set_yscale("log")
            ax.set_xticks(range(len(sizes)), [s.replace(" ", "") for s in sizes], fontsize=7)
            ax.set_xlabel("(T, B, F, S)")
            ax.set_ylabel("ms per call (log scale)")
            ax.set_title(f"{name}, {threads} thread{'s' if threads != 1 else ''} ({clock})\n"
                         f"bar labels: ms, and the time over nn.LSTM's", fontsize=8)
            low, high = ax.get_ylim()
            ax.set_ylim(low, high * 4)      # room for the labels and the legend
            ax.legend(fontsize=7, loc="upper left")
            ax.grid(axis="y", alpha=0.3, which="both")
    if title:
        fig.suptitle(title, fontsize=8)
    return save_figure(fig, path)


def _ms(value: float) -> str:
    """A time in ms, three digits at most, no exponent."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"
