"""The quick loop of docs/testing.md (``python -m pytest -n auto -m "not slow"``) leaves out
the tests marked ``slow`` and still runs some of every other test module (this one's check is
itself slow: a collection of the whole suite)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_quick_loop_runs_every_module():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-m", "not slow", "tests"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", proc.stdout)
    assert summary and int(summary[3]) > 0, proc.stdout[-500:]
    run = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")} - {
        Path(__file__).resolve().relative_to(ROOT).as_posix()}
    assert not modules - run, f"modules the quick loop does not run at all: {sorted(modules - run)}"
