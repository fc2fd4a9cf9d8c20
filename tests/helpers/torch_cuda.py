"""Whether torch's CUDA path can run here, and the marks of the tests that need it: ``DEVICES``
(the ``device`` parameter: "cpu", and "cuda" marked gpu and skipped with the reason where no
GPU is usable) and ``needs_cuda`` (a test marked gpu, skipped likewise)."""
from __future__ import annotations

import pytest


def _cuda_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install .[torch])"
    if not torch.cuda.is_available():
        return "torch finds no CUDA device (CPU build or no GPU)"
    from lltm_cupy.verify import gpu_unavailable_reason
    return gpu_unavailable_reason()


CUDA_REASON = _cuda_reason()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu] + (
    [pytest.mark.skip(reason=f"GPU test: {CUDA_REASON}")] if CUDA_REASON else []))]


def needs_cuda(fn):
    return pytest.mark.gpu(pytest.mark.skipif(CUDA_REASON is not None,
                                              reason=f"GPU test: {CUDA_REASON}")(fn))
