"""The command-line entry points run and report honestly."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def script(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_grad_check_passes_and_prints_a_table():
    proc = script("grad_check.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "numpy float64" in proc.stdout and "d_weights" in proc.stdout
    assert "all gradients match" in proc.stdout


@pytest.mark.slow
def test_grad_check_fails_with_an_impossible_tolerance():
    proc = script("grad_check.py", "--tol", "0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout


@pytest.mark.slow
def test_check_compares_every_backend_against_the_torch_reference():
    proc = script("check.py", "-b", "5", "-f", "7", "-s", "9")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("numpy       float32", "numpy       float64", "torch cpu   float32",
                "torch cpu   float64"):
        assert row in proc.stdout, proc.stdout
    assert "all backends match the torch reference" in proc.stdout


@pytest.mark.slow
def test_grad_check_includes_torch_gradcheck():
    proc = script("grad_check.py")
    assert "torch cpu float64     gradcheck passed  ok" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_benchmark_runs_and_writes_json(tmp_path):
    import json

    out = tmp_path / "bench.json"
    proc = script("benchmark.py", "-b", "4", "-f", "3", "-s", "5", "-r", "3", "--warmup", "1",
                  "--impl", "reference,cell,array,cell-op,cell-floor,function-floor", "--mixed", "--quiet",
                  "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr  # --quiet: no progress output
    data = json.loads(out.read_text())
    (record,) = data["sizes"]
    assert (record["batch"], record["features"], record["state"]) == (4, 3, 5)
    assert set(record["results"]) == {"reference", "cell", "array", "cell-op", "cell-floor",
                                       "function-floor"}
    for result in record["results"].values():
        for phase in ("forward", "backward", "fwd+bwd"):
            assert 0 < result[phase]["min_s"] <= result[phase]["median_s"]
    # X (4 x 8) plus 5 * B * S float32 values on the CPU (four backward factors and new_cell)
    # for the array API and the bare Function of cell-floor; the torch cell's autograd
    # Function, and the custom operator that runs its body, keep the four factors only: they
    # save their arguments as they are (X = [old_h, input] is concatenated again by the
    # backward) and not new_cell, which the CPU backward never reads.
    for name in ("array", "cell-floor"):
        assert record["results"][name]["saved_bytes"] == (4 * 8 + 5 * 4 * 5) * 4, name
    for name in ("cell", "cell-op"):
        assert record["results"][name]["saved_bytes"] == (4 * 4 * 5) * 4, name
    assert "vs reference" in proc.stdout and "Mixed model" in proc.stdout
    # The BLAS share with NumPy's BLAS (the array API) and torch's (LLTMCell on the CPU).
    assert "BLAS share at (4, 3, 5)" in proc.stdout
    blas = data["cpu_blas"]["(4, 3, 5)"]
    for name in ("numpy", "torch"):
        assert 0 < blas[name]["gemm_s"] < blas[name]["step_s"], blas
        assert 0 < blas[name]["gemm_share_pct"] < 100


def test_benchmark_table_warns_when_medians_sit_far_above_minimums():
    """A median 100x its minimum (a loaded machine) gets a warning under the table that suggests
    one thread; medians near their minimums get none."""
    from lltm_bench import PHASES, format_table
    from lltm_bench.reports import SPREAD_LIMIT

    def record(ratio):
        times = {p: {"median_s": 1e-4 * ratio, "min_s": 1e-4} for p in PHASES}
        steady = {p: {"median_s": 1.1e-4, "min_s": 1e-4} for p in PHASES}
        return dict(batch=4, features=3, state=5, dtype="float32", device="cpu", runs=9,
                    skipped={}, results={"reference": dict(steady, saved_bytes=None),
                                         "cell": dict(times, saved_bytes=None)})

    loaded = format_table(record(100.0))
    assert "warning: medians far above their minimums (cell 100.0x)" in loaded
    assert "OMP_NUM_THREADS=1" in loaded and "reference" not in loaded.splitlines()[-1]
    for ratio in (1.2, SPREAD_LIMIT):
        assert "warning" not in format_table(record(ratio))


def test_benchmark_rejects_unknown_implementations():
    proc = script("benchmark.py", "--impl", "nope", "--quiet")
    assert proc.returncode == 2 and "unknown --impl nope" in proc.stderr


@pytest.mark.slow
def test_profile_step_prints_a_profile_of_our_functions():
    for extra in ((), ("--sequence", "-t", "3")):
        proc = script("profile_step.py", "-b", "4", "-f", "3", "-s", "5", "-r", "3", *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "us per step under the profiler" in proc.stdout
        assert "lltm_cupy/_numpy/" in proc.stdout, proc.stdout  # our backend is in the profile


@pytest.mark.slow
def test_profile_step_emulated_prints_the_host_counts_per_step():
    proc = script("profile_step.py", "--emulated", "-b", "4", "-f", "3", "-s", "5", "-t", "7",
                  "-r", "20", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[:34].strip(): line[34:].split() for line in proc.stdout.splitlines()}
    # arrays, DLPack, allocations, stream objects, launches, GEMMs
    assert rows["LLTM step, forward (T 4->7)"] == ["0", "0", "0", "0", "1", "1"], proc.stdout
    assert rows["LLTM step, backward (T 4->7)"] == ["0", "0", "0", "0", "1", "1"], proc.stdout
    assert rows["LLTMCell step, forward"][3:] == ["0", "2", "1"], proc.stdout
    # forward only, variable lengths: a scatter into the outputs every few steps where unsorted
    assert rows["forward only, packed (T 4->7)"] == ["0", "0", "0", "0", "1", "1"], proc.stdout
    assert rows["forward only, unsorted (T 4->7)"][1:] == ["0", "0", "0", "1", "1"], proc.stdout
    assert "host us per LLTMCell step" in proc.stdout


def test_a_failing_gradcheck_is_reported_as_a_failure():
    """A wrong gradient is a FAIL with gradcheck's message, not a crash of the script."""
    torch = pytest.importorskip("torch")
    from lltm_cupy import verify
    from lltm_cupy.torch import lltm

    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            return lltm(*(a.detach() for a in args))

        @staticmethod
        def backward(ctx, grad_h, grad_c):
            return (None, None, None, None, torch.ones_like(grad_c))  # d_old_cell: wrong

    results = verify.torch_gradchecks(fn=Wrong.apply)
    assert results and all(not ok for _, ok, _ in results), results
    assert all("Jacobian mismatch" in message for _, _, message in results), results


@pytest.mark.slow
def test_benchmark_in_bfloat16(tmp_path):
    """--bf16: the torch implementations in bfloat16."""
    import json

    out = tmp_path / "bench.json"
    proc = script("benchmark.py", "--bf16", "-b", "4", "-f", "3", "-s", "5", "-r", "3",
                  "--warmup", "1", "--impl", "reference,cell", "--quiet", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())["sizes"]
    assert record["dtype"] == "bfloat16"
    assert set(record["results"]) == {"reference", "cell"}


@pytest.mark.parametrize("flags,impl,words", [
    (["--bf16"], "array", "no bfloat16"),
    (["--all-grads"], "cell-floor", "parameter-gradient case only"),
    ([], "cell-graph", "needs CUDA"),
])
@pytest.mark.slow
def test_benchmark_fails_when_a_named_implementation_cannot_run(flags, impl, words):
    proc = script("benchmark.py", *flags, "-b", "4", "-f", "3", "-s", "5", "-r", "2",
                  "--warmup", "1", "--impl", f"reference,{impl}", "--quiet")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"benchmark.py: {impl} cannot run" in proc.stderr and words in proc.stderr


def test_benchmark_skips_an_unnamed_implementation_with_the_reason(capsys):
    """Only implementations the caller did not name may be skipped, and the reason is printed
    and recorded."""
    pytest.importorskip("torch")
    import lltm_bench as bm

    cfg = bm.Config(4, 3, 5, bf16=True, runs=2, warmup=1)
    record = bm.run_size(cfg, ["reference", "array"], quiet=True)
    assert set(record["results"]) == {"reference"}
    assert "no bfloat16" in record["skipped"]["array"]
    assert "array: not run (the array API has no bfloat16" in capsys.readouterr().err
    with pytest.raises(bm.ImplementationError, match="array cannot run"):
        bm.run_size(cfg, ["reference", "array"], quiet=True, strict=True)


def test_output_check_allows_rounding_that_grows_with_the_steps():
    """The check before timing refuses an error of 2e-4 (float32) on one step or 64 steps but
    not on 512 (rounding of the never-decaying cell state grows with the steps: 3.3e-4 at 512
    steps on the CPU), and refuses an O(1) error at any length."""
    import numpy as np

    from lltm_bench import _common

    cfg = _common.Config(4, 3, 5)
    want = np.linspace(1, 2, 12).reshape(3, 4)

    class _Forward:
        def forward(self):
            return None

    for steps, error, kept in ((1, 2e-4, False), (64, 2e-4, False), (512, 2e-4, True),
                               (512, 1e-2, False), (4096, 0.5, False)):
        runners = {"impl": _Forward()}
        _common.check_outputs(runners, lambda name, out: [want * (1 + error)],
                              lambda name: [want], cfg, {}, False, True, steps=steps)
        assert (list(runners) == ["impl"]) == kept, (steps, error)


def _png_size(path):
    import struct

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_train_digits_one_short_epoch(tmp_path):
    pytest.importorskip("sklearn", reason="the examples extra is not installed")
    pytest.importorskip("matplotlib", reason="the examples extra is not installed")
    import json

    out, png = tmp_path / "digits.json", tmp_path / "digits.png"
    proc = script("train_digits.py", "--epochs", "1", "--state-size", "16", "--batch-size", "64",
                  "--no-progress", "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("LLTM (ours)", "LLTM (tutorial, stepped)", "nn.LSTM"):
        assert name in proc.stdout
    assert "test accuracy" in proc.stdout and "largest relative gap" in proc.stdout
    data = json.loads(out.read_text())
    assert data["steps_per_epoch"] == -(-1437 // 64) and data["test_samples"] == 360
    for r in data["models"].values():
        assert len(r["loss"]) == data["steps_per_epoch"] and len(r["test_accuracy"]) == 1
        assert 0.1 < r["test_accuracy"][0] <= 1.0 and r["loss"][-1] < r["loss"][0]
    assert data["first_epoch_loss_gap"] <= data["loss_gap_tolerance"]
    width, height = _png_size(png)
    assert f"wrote {png} ({width}x{height} pixels)" in proc.stdout
    assert (width, height) == (900, 360)


@pytest.mark.slow
def test_train_digits_without_the_extra_says_which_to_install():
    """scikit-learn hidden from the script: exit status 2 and the extra's name."""
    code = f"""
import sys, runpy
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "sklearn":
            raise ImportError("blocked for this test")
sys.meta_path.insert(0, Block())
sys.argv = ["train_digits.py", "--epochs", "1"]
runpy.run_path({str(ROOT / "scripts" / "train_digits.py")!r}, run_name="__main__")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pip install '.[examples]'" in proc.stderr and "sklearn" in proc.stderr


@pytest.mark.slow
def test_benchmark_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="the examples extra is not installed")
    png = tmp_path / "speedups.png"
    proc = script("benchmark.py", "-b", "4", "-f", "3", "-s", "5", "-r", "3", "--warmup", "1",
                  "--impl", "reference,cell,array", "--no-kernels", "--quiet", "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    width, height = _png_size(png)
    assert f"({width}x{height} pixels)" in proc.stdout and width >= 600 and height >= 380


def _git_revision_available(rev: str) -> bool:
    try:
        return subprocess.run(["git", "rev-parse", "--verify", "--quiet", rev], cwd=ROOT,
                              capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _git_revision_available("HEAD"),
                    reason="ab_backend.py reads the earlier backend from git: no git checkout here")
@pytest.mark.parametrize("extra", [(), ("--cell", "-d")], ids=["array", "cell-float64"])
@pytest.mark.slow
def test_ab_backend_times_both_backends(extra):
    proc = script("ab_backend.py", "--base", "HEAD", "--seconds", "0.3", "-b", "3", "-f", "4",
                  "-s", "5", *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["HEAD", "working"], proc.stdout
    assert all(int(r[-7]) >= 20 for r in rows), proc.stdout     # steps timed per backend
    assert rows[0][-3:] == ["+0.0%"] * 3, proc.stdout


@pytest.mark.skipif(not _git_revision_available("HEAD"),
                    reason="ab_backend.py reads the earlier backend from git: no git checkout here")
def test_ab_backend_times_sequences_against_nn_lstm():
    """--sequence: the torch layer's LLTM on each backend and nn.LSTM, interleaved; a row per
    backend with its time, spread, system time, faults and ratios (the base's own ratio 1)."""
    pytest.importorskip("torch")
    proc = script("ab_backend.py", "--base", "HEAD", "--sequence", "3x2x3x4,2x2x2x2",
                  "--rounds", "2", "--threads", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tables = [block.splitlines() for block in proc.stdout.strip().split("LLTM training step")[1:]]
    assert len(tables) == 2 and "(3, 2, 3, 4)" in tables[0][0] and "process CPU time" in tables[0][0]
    for table in tables:
        rows = {line.split()[0]: line.split()[-6:] for line in table[2:]}
        assert set(rows) == {"HEAD", "working", "nn.LSTM"}, table
        assert rows["HEAD"][-1] == "1.000" and rows["nn.LSTM"][-2] == "1.00", table
    proc = script("ab_backend.py", "--base", "HEAD", "--sequence", "3x2x0x4")
    assert proc.returncode == 2 and "TxBxFxS" in proc.stderr, proc.stderr


def test_ab_backend_names_a_revision_it_cannot_read():
    proc = script("ab_backend.py", "--base", "no-such-revision", "--seconds", "0.1")
    assert proc.returncode != 0
    assert "cannot read lltm_cupy/_numpy at 'no-such-revision'" in proc.stderr


@pytest.mark.slow
def test_benchmark_sequence_pairs(tmp_path):
    """The layered and ragged rows run, and their ratios to what they replace are printed."""
    import json

    out = tmp_path / "seq.json"
    proc = script("benchmark.py", "--sequence", "-b", "3", "-f", "2", "-s", "4", "-t", "5",
                  "-r", "2", "--warmup", "1", "--impl",
                  "lltm-2x-bidir,cells-2x-bidir,ragged,ragged-padded", "--quiet",
                  "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lltm-2x-bidir / cells-2x-bidir:" in proc.stdout
    assert "ragged / ragged-padded:" in proc.stdout
    (record,) = json.loads(out.read_text())["sizes"]
    assert record["pairs"] == {"lltm-2x-bidir": "cells-2x-bidir", "ragged": "ragged-padded"}


@pytest.mark.slow
def test_grad_check_prints_no_warning_that_contradicts_its_verdict():
    pytest.importorskip("torch")
    proc = script("grad_check.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stdout + proc.stderr, proc.stderr
    assert "atol=rtol=0.01" in proc.stdout   # the float32 check's own tolerances are stated


@pytest.mark.slow
def test_check_says_which_column_is_judged():
    pytest.importorskip("torch")
    proc = script("check.py", "-b", "3", "-f", "4", "-s", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not judged" in proc.stdout and "tol" in proc.stdout


@pytest.mark.slow
def test_python_m_lltm_cupy_self_check():
    proc = subprocess.run([sys.executable, "-m", "lltm_cupy"], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"NumPy {__import__('numpy').__version__}" in proc.stdout
    assert "numpy float64" in proc.stdout and "self-check passed" in proc.stdout
    assert "GPU: " in proc.stdout


def test_python_m_lltm_cupy_fails_on_a_wrong_gradient(monkeypatch, capsys):
    """The self-check's verdict comes from the check: a wrong backward makes it exit 1."""
    import lltm_cupy
    from lltm_cupy import __main__ as self_check

    real = lltm_cupy.backward

    def wrong(*args, **kw):
        grads = real(*args, **kw)
        return grads._replace(d_bias=None if grads.d_bias is None else grads.d_bias * 1.5)

    monkeypatch.setattr(lltm_cupy, "backward", wrong)
    assert self_check.main(["--no-torch"]) == 1
    assert "FAILED: numpy float64" in capsys.readouterr().out


def test_mutation_audit_lists_mutants_that_all_still_apply():
    """Every mutant of scripts/mutation_audit.py still finds its text: a change to the code it
    mutates must update the mutant (the audit is how the next kernel or layer change is
    checked against realistic bugs)."""
    proc = script("mutation_audit.py", "--list")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) >= 20, proc.stdout
    stale = [line for line in lines if "[NOT FOUND]" in line]
    assert not stale, "update these mutants in scripts/mutation_audit.py:\n" + "\n".join(stale)


def test_mutation_table_of_the_docs_lists_every_mutant():
    """docs/testing.md's table of the audit has one row per mutant of ``mutation_audit.py
    --list``, each with its file and description as the script has them: a mutant added,
    renamed or redescribed without its row (and the run that fills it) fails here."""
    proc = script("mutation_audit.py", "--list")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = {}
    for line in proc.stdout.splitlines():
        name, path, what = line.split(None, 2)
        listed[name] = (path, what.removeprefix("[NOT FOUND] "))
    text = (ROOT / "docs" / "testing.md").read_text()
    rows = re.findall(r"^\| `([\w-]+)` \| `([^`]+)` \| (.+?) \| (\w+) \|", text, re.M)
    table = {name: (path, what) for name, path, what, _ in rows}
    assert len(rows) == len(table), "a mutant has two rows in docs/testing.md"
    missing, extra = sorted(set(listed) - set(table)), sorted(set(table) - set(listed))
    assert not missing, f"mutants without a row in docs/testing.md: {missing}"
    assert not extra, f"rows of docs/testing.md for no mutant: {extra}"
    differ = {n: (table[n], listed[n]) for n in listed if table[n] != listed[n]}
    assert not differ, f"rows that differ from --list (table, script): {differ}"
    assert all(verdict == "killed" for *_, verdict in rows), rows


@pytest.mark.slow
def test_inference_benchmark_measures_both_in_fresh_processes():
    """--inference's library: peak added RSS per implementation (each in a fresh process) and
    interleaved CPU times, at tiny sizes; the script's --inference flag is wired to them."""
    pytest.importorskip("torch")
    from lltm_bench import inference

    memory = inference.memory_report(sizes=((40, 8, 3, 64),), rounds=1)
    for impl in ("lltm", "lstm"):
        r = memory["(40, 8, 3, 64)"][impl]
        assert r["output_bytes"] == 40 * 8 * 64 * 4 and r["peak_bytes"] >= 0, memory
    timing = inference.time_report(sizes=((3, 2, 3, 4),), rounds=2)
    r = timing["(3, 2, 3, 4)"]
    assert r["lltm_s"] > 0 and r["lstm_s"] > 0 and r["ratio"] > 0 and r["threads"] == 1
    training = inference.time_report(sizes=((3, 2, 3, 4),), rounds=2, train=True)
    assert training["(3, 2, 3, 4)"]["lltm_s"] > 0
    assert training["(3, 2, 3, 4)"]["reference_s"] > 0      # the tutorial's cell, stepped
    text = inference.format_inference(memory, timing, training)
    assert "nn.LSTM MB" in text and "nn.LSTM ms" in text and "training step" in text
    assert "tutorial ms" in text
    split = inference.split_report(size=(2, 3, 4), lengths=(2, 6), rounds=3)
    for mode in ("training", "no_grad"):
        for impl in ("lltm", "lstm"):
            assert split[mode][impl]["long_s"] > 0, split
    assert "per-step / fixed split" in inference.format_split(split)
    proc = script("benchmark.py", "--inference", "--cuda")
    assert proc.returncode == 2 and "CPU" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_inference_picture_is_a_png(tmp_path):
    """--inference --plot's picture, at tiny sizes: a PNG of both panels (training above
    no_grad), the title given; a column per thread count."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib", reason="the examples extra is not installed")
    from lltm_bench import inference, plot_inference

    sizes = ((3, 2, 3, 4), (2, 3, 2, 5))
    timing = inference.time_report(sizes=sizes, rounds=1)
    training = inference.time_report(sizes=sizes, rounds=1, train=True)
    png = tmp_path / "cpu.png"
    width, height = plot_inference([{"threads": 1, "time": timing, "training": training}], png,
                                   "a machine; versions")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and height > width > 0   # two rows
    two = inference.time_report(sizes=sizes, rounds=1, threads=2, train=True)
    runs = [{"threads": 1, "time": timing, "training": training},
            {"threads": 2, "time": {}, "training": two}]
    wide, high = plot_inference(runs, png, "a machine; versions")    # side by side
    assert wide > width and high == height


def test_inference_benchmark_runs_at_torchs_threads_unless_told(monkeypatch, tmp_path, capsys):
    """scripts/benchmark.py --inference: the reports at torch's default thread count (what a
    user gets) unless --threads says otherwise; several counts each in turn, into one JSON
    file and one picture (the reports themselves stubbed: what is checked is the wiring)."""
    torch = pytest.importorskip("torch")
    import importlib.util
    import json

    from lltm_bench import inference

    spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "scripts" / "benchmark.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen = []
    row = {"lltm_s": 2.0, "lstm_s": 1.0, "reference_s": 3.0, "lltm_gemm_s": 1.0,
           "lstm_gemm_s": 1.0, "ratio": 2.0, "rounds": 1}

    def time_report(sizes=None, rounds=1, threads=1, train=False, **_):
        seen.append(("time", threads, train))
        return {"(1, 1, 1, 1)": dict(row, threads=threads,
                                     clock="process" if threads == 1 else "wall")}

    def split_report(rounds=1, threads=1, **_):
        seen.append(("split", threads))
        one = {"per_step_s": 1.0, "fixed_s": 1.0, "long_s": 1.0}
        return {"size": [1, 1, 1], "lengths": [1, 2], "rounds": 1, "threads": threads,
                "clock": "process" if threads == 1 else "wall",
                "training": {"lltm": one, "lstm": one}, "no_grad": {"lltm": one, "lstm": one}}

    def memory_report(rounds=1, threads=1, **_):
        seen.append(("memory", threads))
        return {}

    monkeypatch.setattr(inference, "time_report", time_report)
    monkeypatch.setattr(inference, "split_report", split_report)
    monkeypatch.setattr(inference, "memory_report", memory_report)
    default = torch.get_num_threads()
    try:
        assert bench.main(["--inference", "--quiet"]) == 0
        assert {t for _, t, *rest in seen} == {default}, seen
        seen.clear()
        out = tmp_path / "runs.json"
        assert bench.main(["--inference", "--threads", "1,3", "--json", str(out)]) == 0
        assert [t for kind, t, *rest in seen if kind == "memory"] == [1, 3], seen
        assert [r["threads"] for r in json.loads(out.read_text())["runs"]] == [1, 3]
        text = capsys.readouterr().out
        assert "1 thread(s), process CPU time (the quiet-machine figure)" in text
        assert "3 thread(s), wall time" in text
    finally:
        torch.set_num_threads(default)
    proc = script("benchmark.py", "--threads", "1,2", "-b", "2", "-f", "2", "-s", "2")
    assert proc.returncode == 2 and "only with --inference" in proc.stderr, proc.stderr


def test_every_scripts_help_says_what_it_does_in_whole_sentences():
    """``--help`` of every Python script: its description is a whole sentence (or more), not a
    first line cut where the docstring wraps. One process imports them all."""
    code = (
        "import contextlib, io, runpy, sys\n"
        "sys.path.insert(0, 'scripts')   # as `python scripts/X.py` puts it (scripts/lltm_bench)\n"
        "for path in sys.argv[1:]:\n"
        "    out = io.StringIO()\n"
        "    sys.argv = [path, '--help']\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            runpy.run_path(path, run_name='__main__')\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    text = out.getvalue().split('\\n\\n')\n"
        "    print(path, '|', ' '.join(text[1].split()) if len(text) > 1 else '')\n")
    paths = sorted(str(p) for p in (ROOT / "scripts").glob("*.py"))
    proc = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" | ", 1) for line in proc.stdout.splitlines() if " | " in line)
    assert set(lines) == set(paths), proc.stdout + proc.stderr
    for path, description in lines.items():
        assert description.rstrip().endswith((".", ")")), f"{path}: {description!r}"


@pytest.mark.slow
def test_profile_step_calls_prints_the_budgets_figures():
    proc = script("profile_step.py", "--calls", "-b", "4", "-f", "3", "-s", "5", "--top", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for where in ("CPU", "CUDA (emulated CuPy)"):
        line = next(l for l in proc.stdout.splitlines() if l.startswith(where + ":"))
        cell = int(re.search(r"LLTMCell forward \+ backward (\d+) library", line).group(1))
        assert 0 < cell <= 60, line


def test_cpu_scaling_splits_a_call_and_predicts_more_cores():
    """scripts/cpu_scaling.py's library, at a tiny size: the three parts add up to the call,
    the no-GEMM engine does no torch GEMM, and the prediction is Amdahl's law fitted to one and
    two threads (element-wise and per-call work serial)."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from lltm_bench import scaling

    engine = scaling._no_gemm()
    a = np.ones((2, 3), np.float32)
    out = torch.full((3, 2, 3), 7.0)
    engine.bmm(torch.ones(3, 2, 3), torch.ones(3, 3, 3), out=out)
    engine.addmm_(out[0], torch.ones(2, 3), torch.ones(3, 3))
    assert bool((out == 7).all()) and engine(a, a.T).shape == (2, 2)
    report = scaling.parts(sizes=((3, 2, 3, 4),), threads=(1, 2), rounds=1)
    for n in (1, 2):
        r = report["(3, 2, 3, 4)", n]
        parts = r["gemm_s"] + r["elementwise_s"] + r["per_call_s"]
        assert r["lltm_s"] > 0 and r["lstm_s"] > 0 and parts == pytest.approx(r["lltm_s"])
    one = {"gemm_s": 10.0, "elementwise_s": 2.0, "per_call_s": 1.0, "lstm_s": 20.0}
    two = {"gemm_s": 6.0, "elementwise_s": 2.0, "per_call_s": 1.0, "lstm_s": 12.0}
    predicted = scaling.predict({("s", 1): one, ("s", 2): two}, cores=(8,))["s"][8]
    # GEMM: f = 2 * 6 / 10 - 1 = 0.2, 10 * (0.2 + 0.8 / 8) = 3; nn.LSTM: f = 0.2, 20 * 0.3 = 6
    assert predicted["lltm_s"] == pytest.approx(3.0 + 2.0 + 1.0)
    assert predicted["lstm_s"] == pytest.approx(6.0) and predicted["ratio"] == pytest.approx(1.0)
    assert "predicted" in scaling.format_parts(report, scaling.predict(report))
