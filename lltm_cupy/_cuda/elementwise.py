"""The element-wise kernels of ``cuda_src/lltm.cu`` (the cell forward and backward, the
concatenation, the add): their module and launch handles.

``get_kernels`` compiles on first use with ``cupy.RawModule`` (NVRTC) and caches the launch
handles per (device, dtype); ``launch`` caches, per (device, dtype, size), the grid, the kernels
of the index width it needs and the size arguments as the kernels' scalar types, so that a
launch makes no object but its argument tuple: the kernels are called with integer device
pointers (CuPy passes a Python int as a 64-bit value, what a pointer parameter takes:
``cupy/cuda/function.pyx``, ``_pointer``; ``cupy/_core/_scalar.pyx``,
``numpy_dtype_from_pyscalar``, v14.2) and NumPy scalars of the exact C types.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from . import kernels
from .kernels import CUDA_TYPE, current_device

__all__ = ["SOURCE_NAME", "KERNEL_NAMES", "Kernels", "INDEX_TYPE", "source", "name_expression",
           "get_kernels", "Launch", "FLAG", "launch", "launch_config", "needs_wide_index",
           "compile_offline"]

SOURCE_NAME = "lltm.cu"
KERNEL_NAMES = ("lltm_fwd_kernel", "lltm_bwd_kernel", "lltm_concat_kernel", "lltm_add_kernel")
#: Threads per block of the element-wise kernels, and blocks per SM at most in the grid-stride.
THREADS = 256
BLOCKS_PER_SM = 8


class Kernels(NamedTuple):
    """The compiled kernels of one (device, dtype, index width), in KERNEL_NAMES order."""

    fwd: Any
    bwd: Any
    concat: Any
    add: Any


@functools.lru_cache(maxsize=None)
def source() -> str:
    return kernels.read_source(SOURCE_NAME)


#: Index type of the kernels: 32-bit unless an index could pass 2**32 (see ``launch_config``).
INDEX_TYPE = {False: "unsigned int", True: "unsigned long long"}


def name_expression(kernel: str, dtype, wide: bool = False) -> str:
    return f"{kernel}<{CUDA_TYPE[np.dtype(dtype)]}, {INDEX_TYPE[wide]}>"


def _all_names(dtype):
    return [name_expression(k, dtype, w) for w in (False, True) for k in KERNEL_NAMES]


def get_kernels(dtype, wide: bool = False):
    """Return the :class:`Kernels` for ``dtype`` on the current device, compiling once: launch
    handles (``RawKernel.kernel``, CuPy's ``Function``: ``fn(grid, block, args, shared_mem=0)``
    on CuPy's current stream, without RawKernel's per-call lookup of the device's module).

    wide: the 64-bit index instantiation (``launch_config`` says when it is needed).
    """
    import cupy

    def build():
        fns = [f.kernel for f in kernels.load(source(), names, whole_shared_memory=False)]
        count = len(KERNEL_NAMES)
        return {False: Kernels(*fns[:count]), True: Kernels(*fns[count:])}

    dtype = np.dtype(dtype)
    names = _all_names(dtype)
    return kernels.cached((cupy.cuda.Device().id, dtype.str), build)[wide]


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


def compile_offline(dtype, arch: int, output: str = "cubin") -> bytes:
    """Compile the kernels for ``dtype`` with NVRTC for ``sm_<arch>``, both index widths; needs
    no GPU or driver (:func:`.kernels.nvrtc`)."""
    return kernels.nvrtc(source(), SOURCE_NAME, _all_names(dtype), arch, output)
