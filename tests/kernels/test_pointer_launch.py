"""Kernel launches with integer device pointers, as the CUDA backend makes them (CuPy passes a
Python int as a 64-bit value, what a pointer parameter takes), are held by the emulated CuPy to
what a GPU needs: the pointer inside live device memory for every element the kernel touches,
no written range overlapping another argument (``__restrict__``), a pointer only where the
kernel takes one, and the size arguments of their exact NumPy types."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from lltm_cupy._cuda import elementwise


@pytest.fixture
def fwd(emulated_cupy):
    """(launch, arrays) of the forward kernel over 4 x 5 elements in float32, the arrays as
    (gates, bias, old_cell, new_h, new_cell)."""
    batch, state = 4, 5
    arrays = [emulated_cupy.zeros(s, np.float32) for s in
              ((batch, 3 * state), 3 * state, (batch, state), (batch, state), (batch, state))]
    return elementwise.launch(np.dtype(np.float32), batch * state, state), arrays


def _call(run, pointers):
    run.kernels.fwd(run.grid, run.block, (*pointers, run.n, run.state))


def test_pointers_run_the_kernel_as_arrays_do(fwd):
    run, arrays = fwd
    arrays[0][...] = 0.5
    _call(run, [a.data.ptr for a in arrays])
    by_pointer = [a.copy() for a in arrays[3:]]
    arrays[0][...] = 0.5
    _call(run, arrays)
    for got, want in zip(by_pointer, arrays[3:]):
        np.testing.assert_array_equal(got, want)
    assert float(abs(np.asarray(by_pointer[0])).max()) > 0


@pytest.mark.slow
def test_a_pointer_into_freed_memory_is_refused(fwd, emulated_cupy):
    run, arrays = fwd
    gone = emulated_cupy.zeros((4, 5), np.float32)
    address = gone.data.ptr
    del gone
    gc.collect()
    pointers = [a.data.ptr for a in arrays]
    pointers[2] = address
    with pytest.raises(AssertionError, match="in no live device memory"):
        _call(run, pointers)


def test_a_pointer_short_of_what_the_kernel_reads_is_refused(fwd, emulated_cupy):
    run, arrays = fwd
    short = emulated_cupy.zeros((4, 4), np.float32)      # 16 of the 20 elements read
    pointers = [a.data.ptr for a in arrays]
    pointers[2] = short.data.ptr
    with pytest.raises(AssertionError, match="in no live device memory"):
        _call(run, pointers)


def test_an_output_overlapping_another_argument_is_refused(fwd):
    run, arrays = fwd
    pointers = [a.data.ptr for a in arrays]
    pointers[3] = arrays[0].data.ptr + 4 * 5 * 4       # new_h inside the gates
    with pytest.raises(AssertionError, match="overlaps"):
        _call(run, pointers)


def test_a_python_int_where_the_kernel_takes_a_scalar_is_refused(fwd):
    run, arrays = fwd
    with pytest.raises(AssertionError, match="numpy.int64"):
        run.kernels.fwd(run.grid, run.block,
                        (*(a.data.ptr for a in arrays), int(run.n), run.state))


def test_a_numpy_integer_where_the_kernel_takes_a_pointer_is_refused(fwd):
    run, arrays = fwd
    pointers = [a.data.ptr for a in arrays]
    pointers[1] = np.int64(pointers[1])
    with pytest.raises(AssertionError, match="array argument"):
        _call(run, pointers)


def test_launches_are_cached_per_size(fwd):
    run, _ = fwd
    assert elementwise.launch(np.dtype(np.float32), 20, 5) is run
    other = elementwise.launch(np.dtype(np.float32), 25, 5)
    assert other is not run and other.n == np.int64(25) and type(other.n) is np.int64
    assert type(other.state) is np.int32
