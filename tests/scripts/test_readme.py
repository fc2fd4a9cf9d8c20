"""Every Python block of README.md and docs/*.md runs.

The blocks of one file run in order in one namespace, in a temporary directory (some save
files), as a reader would paste them. A block preceded by the line ``<!-- needs: gpu -->`` runs
only where CuPy (and, for torch code, torch) sees a GPU: it is a test of its own, skipped with
the reason elsewhere.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import gpu_unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GPU_MARK = "<!-- needs: gpu -->"
BLOCK = re.compile(r"^(" + re.escape(GPU_MARK) + r"\n)?```python\n(.*?)^```", re.S | re.M)


def blocks(page: Path) -> list:
    """[(needs_gpu, code)] of the page's Python blocks, in order."""
    return [(bool(m.group(1)), m.group(2)) for m in BLOCK.finditer(page.read_text())]


def _run(page, upto, namespace):
    """Run the page's blocks up to index ``upto`` (inclusive); GPU blocks before it are skipped."""
    for i, (needs_gpu, code) in enumerate(blocks(page)[: upto + 1]):
        if needs_gpu and i != upto:
            continue
        if re.search(r"^\s*(import torch|from torch|from lltm_cupy.torch)", code, re.M):
            pytest.importorskip("torch", reason=f"{page.name} block {i + 1} needs torch")
        exec(compile(code, f"{page.name} (Python block {i + 1})", "exec"), namespace)


def _gpu_reason(code):
    reason = gpu_unavailable_reason()
    if reason is None and "torch" in code:
        import torch

        if not torch.cuda.is_available():
            reason = "torch sees no CUDA device"
    return reason


#: the deploy page's blocks export, compile and quantize models (tens of seconds): left out of
#: the quick loop (docs/testing.md), as the deploy tests are
CPU_CASES = [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name == "deploy.md" else [])
             for p in PAGES if any(not g for g, _ in blocks(p))]
GPU_CASES = [pytest.param(p, i, id=f"{p.name}-block{i + 1}")
             for p in PAGES for i, (g, _) in enumerate(blocks(p)) if g]


def test_the_pages_hold_the_examples():
    assert len(CPU_CASES) >= 3, "README.md and docs/ should have Python examples"
    assert GPU_CASES, "the GPU examples should be marked and collected"
    for page in PAGES:  # a ``` python fence the pattern does not see would go untested
        text = page.read_text()
        assert text.count("```python") == len(blocks(page)), f"unparsed Python block in {page.name}"


@pytest.mark.parametrize("page", CPU_CASES)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {}
    last_cpu = max(i for i, (needs_gpu, _) in enumerate(blocks(page)) if not needs_gpu)
    _run(page, last_cpu, namespace)
    if page.name == "README.md":
        assert namespace["grads"].d_inputs.shape[0] == 64   # the sequence example ran
        assert (tmp_path / "model.pt").exists()             # and the torch one saved


@pytest.mark.gpu
@pytest.mark.parametrize("page,index", GPU_CASES)
def test_gpu_blocks_run(page, index, tmp_path, monkeypatch):
    reason = _gpu_reason(blocks(page)[index][1])
    if reason:
        pytest.skip(f"GPU test: {reason}")
    monkeypatch.chdir(tmp_path)
    _run(page, index, {})


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces -> -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", [pytest.param(p, id=p.name) for p in PAGES])
def test_relative_links_resolve(page):
    """Every link to another file of the repository names one that exists, and its #anchor a
    heading of that file."""
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name} links to a missing {target}"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", dest.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page.name}: no heading for {target}"


def test_gpu_example_without_a_gpu_gives_the_librarys_error(tmp_path, monkeypatch):
    """Where CuPy is installed but finds no usable GPU, README.md's CuPy example stops at its
    first line that reaches CuPy through the library (lltm_cupy.warmup), with the library's
    RuntimeError, not inside CuPy with a driver error."""
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install .[test])")
    if gpu_unavailable_reason() is None:
        pytest.skip("GPU test: runs only without a GPU (with one, test_gpu_blocks_run runs it)")
    page = ROOT / "README.md"
    index = next(i for i, (g, code) in enumerate(blocks(page)) if g and "torch" not in code)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="lltm_cupy: .*no usable GPU"):
        _run(page, index, {})
