"""scripts/gpu_check.sh, the one command a lent GPU machine runs, held to that machine's limits
without a GPU: its steps' caps within its deadline and the deadline within the time a lease
allows, its budget note naming every step, what comes back from the machine (only the files in
$OUT: 8 at most, 16 MiB each, two folders down at most) holding every result, and its answer
where there is no GPU."""
from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
TEXT = GPU_CHECK.read_text()
#: seconds a lease allows the check (DESIGN.md: about 7 minutes of its 15, the start included)
LEASE_S = 420
#: what comes back from the GPU machine: files in $OUT
OUT_FILES, OUT_BYTES, OUT_DEPTH = 8, 16 * 2**20, 2


def _steps():
    """[(name, cap)] of the script's steps in order (the prerequisites first), and its deadline."""
    prereq = int(re.search(r"^timeout -k 5 (\d+) python3 - ", TEXT, re.M).group(1))
    steps = [(m.group(1), int(m.group(2)))
             for m in re.finditer(r'^step "([^"]+)" (\d+) ', TEXT, re.M)]
    budget = int(re.search(r"^budget=\$\{BUDGET_S:-(\d+)\}", TEXT, re.M).group(1))
    return [("prerequisites", prereq)] + steps, budget


def test_every_step_runs_within_the_deadline_and_the_deadline_within_a_lease():
    """The caps add up to the deadline at most, so that no step is left "not run" whatever the
    steps before it took; the deadline and the last step's kill grace (timeout -k 5) fit the
    lease."""
    steps, budget = _steps()
    total = sum(cap for _, cap in steps)
    assert total <= budget, f"the caps add up to {total} s, past the {budget} s deadline: {steps}"
    assert budget + 5 <= LEASE_S, budget
    assert len(steps) >= 10 and all(cap >= 10 for _, cap in steps), steps


def test_the_budget_note_names_every_step_with_its_cap():
    """The header's table (step, cap, expected seconds) is the steps' own list: every step with
    the cap the script gives it, in order, each expected within its cap, and their sum."""
    block = TEXT[TEXT.index("#   step "):TEXT.index("#   sum ")]
    rows = [(m.group(1), int(m.group(2)), int(m.group(3))) for m in
            re.finditer(r"^#   (\S(?:.*?\S)?)\s{2,}(\d+)\s+(\d+)(?:\s|$)", block, re.M)]
    steps, _ = _steps()
    assert [(name, cap) for name, cap, _ in rows] == steps, rows
    assert all(expected < cap for _, cap, expected in rows), rows
    total = int(re.search(r"^#   sum\s+(\d+)", TEXT, re.M).group(1))
    assert total == sum(cap for _, cap in steps), total


def _stub_python(folder: Path) -> dict:
    """An environment whose python3 succeeds at once: it reads a script from stdin for
    ``python3 -``, writes "{}" to the file after --json, puts a file into CUPY_CACHE_DIR (as CuPy's
    kernel cache would) and prints its arguments."""
    folder.mkdir()
    stub = folder / "python3"
    stub.write_text('#!/usr/bin/env bash\n'
                    'prev=""\n'
                    'for a in "$@"; do [ "$prev" = --json ] && echo "{}" > "$a"; prev=$a; done\n'
                    '[ "${1:-}" = - ] && cat > /dev/null\n'
                    'mkdir -p "$CUPY_CACHE_DIR" && echo cubin > "$CUPY_CACHE_DIR/k.cubin"\n'
                    'echo "stub python3 $*"\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "CUPY_CACHE_DIR", "BUDGET_S")}
    env["PATH"] = f"{folder}{os.pathsep}{env['PATH']}"
    return env


def test_what_comes_back_holds_every_result(tmp_path):
    """With $OUT set (the GPU machine) and every command succeeding, $OUT holds at most 8 plain
    files of at most 16 MiB, two folders down at most, named in letters, digits, '.', '_' and
    '-': the summary (every step passed), the logs, and an archive of everything the steps
    wrote (each benchmark's JSON) but CuPy's kernel cache, which stays in DIR."""
    env = _stub_python(tmp_path / "bin")
    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    env["OUT"] = str(out)
    proc = subprocess.run(["bash", str(GPU_CHECK), str(results)], env=env, capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = sorted(out.rglob("*"))
    assert all(p.is_file() for p in found), found
    assert len(found) <= OUT_FILES, found
    for p in found:
        assert len(p.relative_to(out).parts) <= OUT_DEPTH + 1, p
        assert p.stat().st_size <= OUT_BYTES, p
        assert re.fullmatch(r"[A-Za-z0-9._-]+", p.name), p
    summary = (out / "summary.txt").read_text()
    for name, _ in _steps()[0]:
        assert re.search(rf"{re.escape(name)}\s+passed", summary), (name, summary)
    assert "exit status 0" in summary, summary
    with tarfile.open(out / "results.tar.gz") as tar:
        archived = {Path(n).name for n in tar.getnames()}
        assert not any("cupy_cache" in n for n in tar.getnames()), tar.getnames()
    written = set(re.findall(r'--json "\$dir/([\w.]+)"', TEXT))
    assert len(written) == TEXT.count("--json \"") and written <= archived, (written, archived)
    assert {"env.txt", "gpu_tests.txt", "benchmark.txt", "summary.txt"} <= archived, archived
    assert (results / "cupy_cache" / "k.cubin").is_file()


def test_results_are_not_written_into_out(tmp_path):
    """A DIR inside $OUT is refused before anything runs: only 8 files come back from there."""
    env = _stub_python(tmp_path / "bin")
    out = tmp_path / "out"
    out.mkdir()
    env["OUT"] = str(out)
    proc = subprocess.run(["bash", str(GPU_CHECK), str(out / "results")], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 1 and "must be outside $OUT" in proc.stdout, proc.stdout
    assert not any(out.iterdir())


@pytest.mark.slow
def test_without_a_gpu_it_names_what_is_missing_and_fails(tmp_path):
    from conftest import gpu_unavailable_reason

    if not gpu_unavailable_reason():
        pytest.skip("GPU test: runs only without a GPU (with one, gpu_check.sh would run the "
                    "whole check)")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "CUPY_CACHE_DIR")}
    proc = subprocess.run(["bash", str(GPU_CHECK), str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "prerequisites missing; nothing else run" in proc.stdout
    assert "gpu_check: missing:" in (tmp_path / "env.txt").read_text()
    assert not (tmp_path / "gpu_tests.txt").exists()


def _test_steps():
    """[(name, its pytest arguments)] of the script's test steps, in order."""
    found = []
    for m in re.finditer(r'^step "(tests[^"]*)" \d+ \S+ python3 -m pytest (.*?)(?<!\\)$', TEXT,
                         re.M | re.S):
        found.append((m.group(1), m.group(2)))
    return found


def test_the_torch_cuda_paths_tests_run_first_and_once():
    """The tests of the torch layer's CUDA path (test_torch*.py, test_gpu_training.py: the
    rewritten path, never run on a GPU; first of them what only a GPU can check of its pointer
    launches for variable lengths and the group variant: test_torch_pointer_path.py,
    test_gpu_variable_length.py) are the first tests step, so that no other step's
    overrun leaves them unrun; the rest and the compiled steps do not run them again (but the
    compiled one runs their torch.compile tests, which the first leaves out)."""
    steps = _test_steps()
    assert [name for name, _ in steps][:1] == ["tests (torch CUDA path)"], steps
    first = steps[0][1]
    assert '"${torch_tests[@]}"' in first and '-k "not compile"' in first, first
    torch_files = re.search(r"^torch_tests=\(([^)]*)\)$", TEXT, re.M).group(1).split()
    assert torch_files == ["tests/torch_layer/test_torch_pointer_path.py",
                           "tests/torch_layer/test_gpu_variable_length.py",
                           "tests/torch_layer/test_torch.py",
                           "tests/torch_layer/test_torch_cuda_path.py",
                           "tests/torch_layer/test_torch_inference.py",
                           "tests/torch_layer/test_torch_sequence.py",
                           "tests/torch_layer/test_gpu_training.py"], torch_files
    for path in torch_files:
        assert (ROOT / path).is_file(), path
    ignored = re.search(r'^for f in (.*); do ignored\+=', TEXT, re.M).group(1)
    assert '"${torch_tests[@]}"' in ignored, ignored
    rest = dict(steps)["tests (the rest)"]
    assert '"${ignored[@]}"' in rest and '-k "not compile"' in rest, rest
    compiled = dict(steps)["tests (compiled)"]
    assert "-k \"compile\"" in compiled and "torch_tests" not in compiled, compiled


def test_every_test_step_has_a_margin_over_its_expected_time():
    """A cold GPU machine varies more than the run the expected times come from: every pytest
    step's cap is at least 4/3 of its expected seconds (the compiled step's Inductor compiles
    vary most)."""
    block = TEXT[TEXT.index("#   step "):TEXT.index("#   sum ")]
    rows = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in
            re.finditer(r"^#   (\S(?:.*?\S)?)\s{2,}(\d+)\s+(\d+)(?:\s|$)", block, re.M)}
    for name, _ in _test_steps():
        cap, expected = rows[name]
        assert 3 * cap >= 4 * expected, (name, cap, expected)


def test_the_fused_step_runs_every_fused_module_with_gpu_tests():
    """The fused kernels' step names the modules of tests/kernels/test_fused_*.py that hold GPU
    tests, each of them and no other (a module renamed or split would otherwise show only on a
    GPU machine, as a path pytest does not find, or as GPU tests no step runs)."""
    fused = re.search(r"^fused_tests=\(([^)]*)\)$", TEXT, re.M).group(1).split()
    with_gpu = sorted(p.relative_to(ROOT).as_posix()
                      for p in (ROOT / "tests" / "kernels").glob("test_fused_*.py")
                      if "@pytest.mark.gpu" in p.read_text())
    assert sorted(fused) == with_gpu, (fused, with_gpu)
    assert '"${fused_tests[@]}"' in dict(_test_steps())["tests (fused kernels)"]
