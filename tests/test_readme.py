"""The README's Python examples run (the CuPy one only where a GPU is present)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import gpu_unavailable_reason

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run(tmp_path, monkeypatch):
    pytest.importorskip("torch", reason="the PyTorch example needs torch")
    monkeypatch.chdir(tmp_path)  # the PyTorch example saves a state_dict
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 4
    namespace = {}
    ran = 0
    import torch

    for block in blocks:
        if "import cupy" in block and gpu_unavailable_reason():
            continue
        if 'device="cuda"' in block and (not torch.cuda.is_available() or gpu_unavailable_reason()):
            continue  # the captured training step: GPU only
        exec(compile(block, str(README), "exec"), namespace)
        ran += 1
    assert ran >= 3
    assert namespace["grads"].d_inputs.shape[0] == 64  # the sequence example ran last of the NumPy ones
    assert (tmp_path / "model.pt").exists()
