"""The element-wise kernels of ``cuda_src/lltm.cu`` (the cell forward and backward, the
concatenation, the add): their launch handles. The family's record is
:data:`.kernels.ELEMENTWISE` (a module per (device, dtype) holding both index widths, launched
through the loaded functions).

``launch`` caches, per (device, dtype, size), the grid, the kernels of the index width it needs
and the size arguments as the kernels' scalar types, so that a launch makes no object but its
argument tuple: the kernels are called with integer device pointers (CuPy passes a Python int as
a 64-bit value, what a pointer parameter takes: ``cupy/cuda/function.pyx``, ``_pointer``;
``cupy/_core/_scalar.pyx``, ``numpy_dtype_from_pyscalar``, v14.2) and NumPy scalars of the
exact C types.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import kernels
from .kernels import ELEMENTWISE as FAMILY, Kernels, current_device

__all__ = ["FAMILY", "SOURCE_NAME", "KERNEL_NAMES", "Kernels", "source",
           "name_expression", "get_kernels", "Launch", "FLAG", "launch", "launch_config",
           "needs_wide_index", "compile_offline"]

SOURCE_NAME, KERNEL_NAMES = FAMILY.files[-1], FAMILY.kernels
#: ``get_kernels(dtype, wide)``: the :class:`~.kernels.Kernels` of that index width (``wide``:
#: the 64-bit instance) on the current device, compiled once per (device, dtype).
source, name_expression, get_kernels = FAMILY.source, FAMILY.name_expression, FAMILY.get_kernels
compile_offline = FAMILY.compile_offline
#: Threads per block of the element-wise kernels, and blocks per SM at most in the grid-stride.
THREADS = 256
BLOCKS_PER_SM = 8


class Launch(NamedTuple):
    """The element-wise kernels' launch over ``n`` = rows * state elements: geometry, the
    kernels of the index width it needs, and the size arguments as the kernels take them."""

    grid: tuple
    block: tuple
    kernels: Kernels
    n: np.int64
    state: np.int32


#: the kernels' int flags (``FLAG[condition]``), made once
FLAG = (np.int32(0), np.int32(1))

_launches: dict = {}
#: distinct (device, dtype, n, state) kept at most; then the cache starts again
_LAUNCHES_KEPT = 4096


def launch(dtype, n: int, state: int) -> Launch:
    """The :class:`Launch` of the element-wise kernels for ``n`` > 0 elements of rows of
    ``state`` on the current device, cached per (device, dtype, n, state)."""
    key = (current_device(), dtype, n, state)
    found = _launches.get(key)
    if found is None:
        grid, block, wide = launch_config(n)
        if len(_launches) >= _LAUNCHES_KEPT:
            _launches.clear()
        found = _launches[key] = Launch(grid, block, get_kernels(dtype, wide), np.int64(n),
                                        np.int32(state))
    return found


def launch_config(n: int) -> tuple:
    """(grid, block, wide) for a grid-stride loop over n = B * S > 0 elements on this device.

    wide is True when a 32-bit index could overflow: the gates index reaches 3 * n, and the
    grid-stride adds up to grid * block past the last element.
    """
    blocks = min(-(-n // THREADS), kernels._sm_count(current_device()) * BLOCKS_PER_SM)
    return (blocks,), (THREADS,), needs_wide_index(n, blocks * THREADS)


def needs_wide_index(n: int, threads: int) -> bool:
    return 3 * n + threads >= 2**32
