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
