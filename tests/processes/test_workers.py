"""pytest-xdist's workers run with one thread per library (tests/helpers/workers.py), unless
the environment already sets a pool's size; a run without workers keeps the defaults."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.workers import THREAD_VARIABLES

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from helpers.workers import pytest_configure
"""

SHOW = """
import os
def test_show():
    with open({out!r}, "w") as f:
        f.write(" ".join(os.environ.get(n, "-") for n in {names!r}))
"""


def _threads(tmp_path, options, env):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    out = tmp_path / "threads.txt"
    (tmp_path / "test_show.py").write_text(SHOW.format(out=str(out), names=THREAD_VARIABLES))
    clean = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           *options, str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, env={**clean, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out.read_text().split()


@pytest.mark.parametrize("options,env,want", [
    pytest.param(("-n", "2"), {}, ["1", "1", "1"], id="workers", marks=pytest.mark.slow),
    pytest.param(("-n", "2"), {"OMP_NUM_THREADS": "3"}, ["3", "1", "1"], id="workers-pool-set",
                 marks=pytest.mark.slow),
    pytest.param((), {}, ["-", "-", "-"], id="no-workers"),
])
def test_workers_run_one_thread_per_library(tmp_path, options, env, want):
    assert _threads(tmp_path, options, env) == want
