"""cuda_src compiles with NVRTC for every dtype and architecture, with no GPU needed.

Uses CuPy's NVRTC binding with the nvidia-cuda-nvrtc wheel; it must not skip in CI.
"""
from __future__ import annotations

import numpy as np
import pytest

from lltm_cupy._cuda import elementwise as _elementwise, kernels as _kernels


DTYPES = [np.float16, np.float32, np.float64, _kernels.BFLOAT16]


@pytest.mark.parametrize("arch", _kernels.ARCHITECTURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "float32", "float64", "bfloat16"])
def test_nvrtc_compiles(dtype, arch):
    cubin = _elementwise.compile_offline(dtype, arch, output="cubin")
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return an ELF cubin"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, _kernels.BFLOAT16],
                         ids=["float16", "float32", "bfloat16"])
def test_single_precision_kernels_use_no_double_arithmetic(dtype):
    """float/half kernels compute in float: a double instruction means an accidental promotion."""
    ptx = _elementwise.compile_offline(dtype, 80, output="ptx").decode()
    f64 = [line.strip() for line in ptx.splitlines() if ".f64" in line]
    assert not f64, f"double-precision instructions in the {np.dtype(dtype)} kernels: {f64[:5]}"
    for kernel in _elementwise.KERNEL_NAMES:
        assert kernel in ptx


def test_compile_error_reports_the_log(monkeypatch):
    monkeypatch.setattr(_kernels, "joined", lambda files: "this is not C++;")
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        _elementwise.compile_offline(np.float32, 75)
