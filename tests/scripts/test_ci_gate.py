"""The CI gate: ``.ci/run`` runs the README's test command with ``--gpu-skips-only``, which fails
the run, naming the module, when anything is skipped for a reason other than a missing GPU."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from helpers.skip_gate import (pytest_addoption, pytest_collectreport, pytest_runtest_logreport,
                               pytest_sessionfinish, pytest_terminal_summary)
"""

MODULES = {
    "test_needs_torch.py": 'import pytest\n'
                           'pytest.importorskip("no_such_module_xyz", reason="torch is not installed")\n'
                           'def test_a():\n    pass\n',
    "test_gpu.py": 'import pytest\n'
                   '@pytest.mark.skip(reason="GPU test: CuPy finds no GPU")\n'
                   'def test_marked():\n    pass\n'
                   'def test_called():\n    pytest.skip("GPU test: torch finds no CUDA device")\n'
                   'def test_runs():\n    pass\n',
    "test_skips_inside.py": 'import pytest\n'
                            'def test_b():\n    pytest.skip("the compiler is missing")\n',
}


def _run(tmp_path, modules, *options):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, text in modules.items():
        (tmp_path / name).write_text(text)
    return subprocess.run([sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *options, str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True)


#: the README's command runs the suite on pytest-xdist's workers: the gate must see every skip
#: of every worker (xdist hands the workers' reports to the controlling process's hooks)
WORKERS = [pytest.param((), id="one-process"),
           pytest.param(("-n", "2"), id="xdist-workers", marks=pytest.mark.slow)]


@pytest.mark.parametrize("workers", WORKERS)
def test_gate_fails_naming_each_module_skipped_for_another_reason(tmp_path, workers):
    proc = _run(tmp_path, MODULES, "--gpu-skips-only", *workers)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "SKIP REFUSED: module test_needs_torch.py (module test_needs_torch.py): torch is " \
           "not installed" in out, out
    assert "SKIP REFUSED: test test_skips_inside.py::test_b (module test_skips_inside.py): " \
           "the compiler is missing" in out, out
    assert "test_gpu.py" not in "".join(l for l in out.splitlines() if "REFUSED" in l), out


@pytest.mark.parametrize("workers", WORKERS)
def test_gate_fails_a_run_that_only_skipped(tmp_path, workers):
    proc = _run(tmp_path, {"test_needs_torch.py": MODULES["test_needs_torch.py"]},
                "--gpu-skips-only", *workers)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "SKIP REFUSED: module test_needs_torch.py" in proc.stdout, proc.stdout


@pytest.mark.parametrize("workers", WORKERS)
def test_gate_passes_gpu_skips_and_is_off_without_the_option(tmp_path, workers):
    gpu_only = {"test_gpu.py": MODULES["test_gpu.py"]}
    proc = _run(tmp_path, gpu_only, "--gpu-skips-only", *workers)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 skipped" in proc.stdout and "REFUSED" not in proc.stdout, proc.stdout
    proc = _run(tmp_path, MODULES, *workers)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("workers", WORKERS)
def test_gate_keeps_a_failure_a_failure(tmp_path, workers):
    proc = _run(tmp_path, {"test_fails.py": "def test_f():\n    assert False\n"},
                "--gpu-skips-only", *workers)
    assert proc.returncode == 1, proc.stdout


def _readme_setup():
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^    python3 -m venv \.venv && \. \.venv/bin/activate && pip install "
                      r"(?P<args>.+?) && (?P<test>python -m pytest.*)$", text, re.M)
    assert match, "README: the test set-up line is missing or reworded"
    return match["args"], match["test"]


def test_ci_runs_the_readmes_set_up_and_test_command_with_the_gate():
    args, test = _readme_setup()
    ci = (ROOT / ".ci" / "run").read_text()
    installs = re.findall(r"^PIP_RETRIES=0 python -m pip install --quiet (.+)$", ci, re.M)
    assert installs == [args], (installs, args)
    commands = [line for line in ci.splitlines() if line.startswith("python -m pytest")]
    assert len(commands) == 1 and commands[0].startswith(test), commands
    assert "--gpu-skips-only" in commands[0].split(), commands


def test_every_skip_for_want_of_a_gpu_uses_the_phrase():
    """A GPU skip written with another wording would fail CI on a GPU-less machine; catch it
    here, where the message says which file."""
    offenders = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = re.search(r"""(?:skip|skipif|importorskip)\(.*reason=f?["']([^"']*)""", line) \
                or re.search(r"""pytest\.skip\(f?["']([^"']*)""", line)
            if m and re.search(r"\bGPU\b|CUDA|cupy|CuPy", m[1]) and not m[1].startswith(
                    ("GPU test:", "{GPU_PHRASE}")) and "not installed" not in m[1]:
                offenders.append(f"{path.relative_to(TESTS)}:{n}: {m[1]}")
    assert not offenders, offenders


@pytest.mark.parametrize("workers", WORKERS)
def test_skips_allowed_refuses_every_skip_not_on_its_list(tmp_path, workers):
    """gpu_check.sh's gate on the GPU machine: a GPU test skipped there (even for want of a GPU)
    fails the run unless its reason contains an allowed text."""
    two = {"test_two.py": 'import pytest\n'
                          'def test_two_gpus():\n'
                          '    pytest.skip("GPU test: needs two CUDA devices")\n'}
    proc = _run(tmp_path, {**MODULES, **two}, "--skips-allowed", "needs two CUDA devices",
                *workers)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    refused = "\n".join(line for line in out.splitlines() if "SKIP REFUSED" in line)
    for nodeid in ("test_gpu.py::test_marked", "test_gpu.py::test_called",
                   "test_skips_inside.py::test_b", "test_needs_torch.py"):
        assert nodeid in refused, out
    assert "test_two" not in refused, out
    alone = tmp_path / "alone"
    alone.mkdir()
    proc = _run(alone, two, "--skips-allowed", "needs two CUDA devices", *workers)
    assert proc.returncode == 0, proc.stdout + proc.stderr
