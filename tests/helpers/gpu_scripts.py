"""What the tests of the GPU-only measuring scripts (scripts/block_rows.py,
scripts/fused_kernel_time.py) share: loading a script as a module, and its refusals."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    """scripts/<name>.py as a module (its main() takes argv)."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_refuses(main, *argvs) -> None:
    """Each argv ends the script at argparse (exit status 2)."""
    for argv in argvs:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv


def assert_fails_without_a_gpu(name: str) -> None:
    """Run as a command where CuPy finds no GPU, the script says so and exits with status 1."""
    import cupy

    if cupy.cuda.is_available():
        pytest.skip("GPU test: runs only without a GPU (with one, the script measures)")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), "--runs", "1"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "needs a GPU" in proc.stderr and "nothing measured" in proc.stderr, proc.stderr
