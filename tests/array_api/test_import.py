"""Importing lltm_cupy has no side effects, and the CPU path works without CuPy."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_cuda_backend_imports_in_one_direction():
    """Each module of lltm_cupy/_cuda imports (at module level or inside a function) only the
    modules above it in the list of the package's docstring, and that list names every module:
    no import circle, and a new module is placed in the order."""
    import ast
    import re

    package = ROOT / "lltm_cupy" / "_cuda"
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    order = re.findall(r"^    (\w+)\s{2,}\S", doc, re.M)
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    assert sorted(order) == modules, (order, modules)
    for i, name in enumerate(order):
        imported = set()
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= ({node.module.split(".")[0]} if node.module
                             else {alias.name for alias in node.names})
        below = sorted(m for m in imported if m in order[i:])
        assert not below, f"{name} imports {below}, listed at or below it"


def _relative_imports(path: Path) -> set:
    """The sibling modules ``path`` imports (``from . import x``, ``from .x import y``), at
    module level or inside a function."""
    import ast

    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            imported |= ({node.module.split(".")[0]} if node.module
                         else {alias.name for alias in node.names})
    return imported


def _layout_entry(path: str) -> str:
    """The text of docs/testing.md's Layout entry of ``path`` (up to the next entry at its
    indentation or above)."""
    import re

    text = (ROOT / "docs" / "testing.md").read_text()
    match = re.search(rf"^( +){re.escape(path)} .*?(?=^ {{0,4}}\S)", text, re.M | re.S)
    assert match, f"no entry for {path} in docs/testing.md's Layout"
    return match.group(0)


def _assert_one_direction(package: Path, order: list) -> None:
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    assert sorted(order) == modules, (order, modules)
    for i, name in enumerate(order):
        above = sorted(m for m in _relative_imports(package / f"{name}.py") if m in order[:i + 1])
        assert not above, f"{name} imports {above}, listed at or above it in docs/testing.md"


def test_the_layout_states_the_numpy_backends_import_order():
    """docs/testing.md's Layout: each module of lltm_cupy/_numpy imports only the modules named
    after it, and the entry names every module."""
    import re

    package = ROOT / "lltm_cupy" / "_numpy"
    entry = _layout_entry("lltm_cupy/_numpy/")
    names = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    at = {n: m.start() for n in names for m in [re.search(rf"\b{n} \(", entry)] if m}
    _assert_one_direction(package, sorted(at, key=at.get))


def test_the_layout_states_the_torch_layers_import_order():
    """docs/testing.md's Layout: each file of lltm_cupy/torch imports only the files listed
    below it, and the entry lists every file."""
    import re

    entry = _layout_entry("lltm_cupy/torch/")
    order = re.findall(r"^        (\w+)\.py\s", entry, re.M)
    _assert_one_direction(ROOT / "lltm_cupy" / "torch", order)


def test_no_module_imports_from_the_package_face():
    """``lltm_cupy/__init__.py`` only hands names on: no module of the package takes a name from
    it (``from . import name`` or ``from .. import name`` of anything but a submodule, or ``from
    lltm_cupy import name``), and no module that importing the package loads imports the package
    itself: every arrow runs down from the face."""
    import ast

    package = ROOT / "lltm_cupy"
    loaded = run_python("""
        import sys, lltm_cupy
        print(" ".join(sorted(m for m in sys.modules if m.startswith("lltm_cupy."))))
    """)
    assert loaded.returncode == 0, loaded.stderr
    below_the_face = set(loaded.stdout.split())
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == package:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if path.name == "__init__.py" else parts)
        depth = len(parts) - 1      # the relative-import level that names the package
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                face = (node.level == depth and node.module is None) or \
                    (node.level == 0 and node.module == "lltm_cupy")
                if face:
                    names = [a.name for a in node.names
                             if not (package / a.name).is_dir()
                             and not (package / f"{a.name}.py").is_file()]
                    if names:
                        offenders.append(f"{name}: from the face: {names}")
            elif isinstance(node, ast.Import) and name in below_the_face:
                if any(a.name == "lltm_cupy" for a in node.names):
                    offenders.append(f"{name}: import lltm_cupy (loaded by the face)")
    assert not offenders, offenders
