"""The command-line entry points run and report honestly."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def script(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_grad_check_passes_and_prints_a_table():
    proc = script("grad_check.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "numpy float64" in proc.stdout and "d_weights" in proc.stdout
    assert "all gradients match" in proc.stdout


def test_grad_check_fails_with_an_impossible_tolerance():
    proc = script("grad_check.py", "--tol", "0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout


def test_check_compares_every_backend_against_the_torch_reference():
    proc = script("check.py", "-b", "5", "-f", "7", "-s", "9")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("numpy       float32", "numpy       float64", "torch cpu   float32",
                "torch cpu   float64"):
        assert row in proc.stdout, proc.stdout
    assert "all backends match the torch reference" in proc.stdout


def test_grad_check_includes_torch_gradcheck():
    proc = script("grad_check.py")
    assert "torch cpu float64     gradcheck passed  ok" in proc.stdout, proc.stdout
