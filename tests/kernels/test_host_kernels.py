"""The CUDA source's arithmetic, executed on the CPU: cuda_src/lltm.cu compiled as host C++ with
tests/host_shim/shim.h and launched over several grid/block geometries, against the reference.

Runs everywhere (it needs g++, not a GPU); it must not skip in CI.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from lltm_cupy import reference
from lltm_cupy._cuda import elementwise as _elementwise
from conftest import assert_close, make_case, reference_results
from helpers.host_kernels import SUFFIX, ptr
# (grid, block): one thread for everything, blocks that do not divide the work, more threads
# than elements, and a grid-stride with several rounds per thread.
GEOMETRIES = [(1, 1), (1, 32), (3, 7), (5, 64), (64, 256), (2, 1000)]


def host_forward(lib, dtype, grid, block, case, wide=False):
    """The fused forward on the CPU; the GEMM X @ W.T is done in float64 and rounded to dtype."""
    x = np.concatenate([case["old_h"], case["input"]], axis=1).astype(np.float64)
    gates = np.ascontiguousarray((x @ case["weights"].astype(np.float64).T).astype(dtype))
    batch, state = case["old_h"].shape
    new_h = np.full((batch, state), np.nan, dtype)
    new_cell = np.full((batch, state), np.nan, dtype)
    getattr(lib, f"lltm_fwd_{SUFFIX[np.dtype(dtype)]}{'_wide' if wide else ''}")(
        ctypes.c_uint(grid), ctypes.c_uint(block), ptr(gates),
        ptr(np.ascontiguousarray(case["bias"].reshape(-1))), ptr(case["old_cell"]), ptr(new_h),
        ptr(new_cell), ctypes.c_longlong(batch * state), ctypes.c_int(state))
    return new_h, new_cell, gates


def host_backward(lib, dtype, grid, block, gates, new_cell, grad_h, grad_cell, wide=False):
    batch, state = new_cell.shape
    d_gates = np.full((batch, 3 * state), np.nan, dtype)
    d_old_cell = np.full((batch, state), np.nan, dtype)
    getattr(lib, f"lltm_bwd_{SUFFIX[np.dtype(dtype)]}{'_wide' if wide else ''}")(
        ctypes.c_uint(grid), ctypes.c_uint(block),
        ptr(grad_h if grad_h is not None else new_cell),
        ptr(grad_cell if grad_cell is not None else new_cell), ptr(gates), ptr(new_cell),
        ptr(d_gates), ptr(d_old_cell), ctypes.c_int(grad_h is not None),
        ctypes.c_int(grad_cell is not None), ctypes.c_longlong(batch * state), ctypes.c_int(state))
    return d_gates, d_old_cell


def reference_d_gates(case):
    """Reference (d_gates, d_new_cell, gate pre-activations) for the case."""
    names = ("input", "weights", "bias", "old_h", "old_cell")
    new_h, new_cell, ig, og, cc, _, z = reference.lltm_forward(*(case[n] for n in names))
    d_gates, d_new_cell = reference.lltm_backward_gates(case["grad_h"], case["grad_cell"],
                                                        new_cell, ig, og, cc, z)
    return d_gates, d_new_cell, z


@pytest.mark.parametrize("wide", [False, True], ids=["index32", "index64"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("grid,block", GEOMETRIES)
@pytest.mark.parametrize("batch,features,state", [(1, 1, 1), (3, 17, 5), (16, 1, 129)])
def test_host_kernels_match_reference(host_lib, dtype, grid, block, batch, features, state, wide):
    case = make_case(batch, features, state, dtype, seed=batch + state, zeros_at=(0,))
    new_h, new_cell, gates = host_forward(host_lib, dtype, grid, block, case, wide)
    ref_h, ref_c, _ = reference_results(case)
    ref_d_gates, ref_d_nc, ref_z = reference_d_gates(case)
    assert_close(gates, ref_z, dtype, "gates + bias")
    assert_close(new_h, ref_h, dtype, "new_h")
    assert_close(new_cell, ref_c, dtype, "new_cell")
    d_gates, d_old_cell = host_backward(host_lib, dtype, grid, block, gates, new_cell,
                                        case["grad_h"], case["grad_cell"], wide)
    assert_close(d_gates, ref_d_gates, dtype, "d_gates")
    assert_close(d_old_cell, ref_d_nc, dtype, "d_old_cell")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_host_kernels_saturated_and_missing_gradients(host_lib, dtype):
    case = make_case(4, 3, 7, dtype, seed=23, scale=1e4)
    new_h, new_cell, gates = host_forward(host_lib, dtype, 3, 5, case)
    ref_h, ref_c, _ = reference_results(case)
    assert_close(new_h, ref_h, dtype, "new_h")
    assert_close(new_cell, ref_c, dtype, "new_cell")
    ref_d_gates, ref_d_nc, _ = reference_d_gates(case)
    d_gates, d_old_cell = host_backward(host_lib, dtype, 3, 5, gates, new_cell,
                                        case["grad_h"], case["grad_cell"])
    assert np.isfinite(d_gates).all() and np.isfinite(d_old_cell).all()
    assert_close(d_gates, ref_d_gates, dtype, "d_gates")
    # A missing gradient behaves as zeros.
    zero = np.zeros_like(case["grad_h"])
    for gh, gc in ((None, case["grad_cell"]), (case["grad_h"], None), (None, None)):
        got = host_backward(host_lib, dtype, 2, 8, gates, new_cell, gh, gc)
        want = host_backward(host_lib, dtype, 2, 8, gates, new_cell,
                             zero if gh is None else gh, zero if gc is None else gc)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_index_width_choice():
    """32-bit indices only while the largest gate index plus one grid-stride fits."""
    assert not _elementwise.needs_wide_index(16 * 128, 2048)
    limit = (2**32 - 1 - 270336) // 3       # 132 SMs x 8 blocks x 256 threads
    assert not _elementwise.needs_wide_index(limit, 270336)
    assert _elementwise.needs_wide_index(limit + 1, 270336)
    assert _elementwise.needs_wide_index(2**31, 256)
