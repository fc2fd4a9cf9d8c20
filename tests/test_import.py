"""Importing lltm_cupy has no side effects, and the CPU path works without CuPy."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT)


def test_import_imports_neither_cupy_nor_torch():
    proc = run_python("""
        import sys, lltm_cupy
        loaded = [m for m in ("cupy", "torch", "cupy_backends") if m in sys.modules]
        assert not loaded, loaded
        kernels = sys.modules.get("lltm_cupy._cuda.kernels")
        assert kernels is None or not kernels._cache
    """)
    assert proc.returncode == 0, proc.stderr


def test_cpu_path_works_with_cupy_absent():
    proc = run_python("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("cupy", "cupy_backends", "cupyx"):
                    raise ImportError(f"{name} blocked for this test")
        sys.meta_path.insert(0, Block())
        import numpy as np, lltm_cupy
        rng = np.random.default_rng(0)
        x, h, c = (rng.standard_normal((2, n)) for n in (3, 4, 4))
        w, b = rng.standard_normal((12, 7)), rng.standard_normal(12)
        new_h, new_cell, saved = lltm_cupy.forward(x, w, b, h, c)
        g = lltm_cupy.backward(new_h, new_cell, saved)
        assert g.d_weights.shape == (12, 7)
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
