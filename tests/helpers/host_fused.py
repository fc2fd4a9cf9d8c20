"""cuda_src/lltm_fused.cu built as host C++ with block semantics (tests/host_shim/shim.h's
shim_launch_block: one context per thread, __syncthreads() a real barrier, per-block dynamic
shared memory poisoned with 0xFF) and loaded with ctypes; and a stand-in for
lltm_cupy._cuda.fused_kernels.get_kernels that launches it from the emulated CuPy
(tests/helpers/emulated_cupy.py), as strict about arguments as a RawKernel launch."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from lltm_cupy._cuda import kernels as _kernels
from . import host_build
from .host_kernels import SUFFIX

#: scheduling orders of the shim: threads ascending, descending, a random permutation per barrier
SCHEDULES = {"ascending": 0, "descending": 1, "random": 2}


def build(out_dir: Path, source_dir: Path | None = None, sources: dict | None = None
          ) -> ctypes.CDLL:
    """tests/host_shim/harness_fused.cpp built (or found in the run's cache) and loaded from a
    copy in out_dir. ``source_dir``: a folder whose lltm_fused.cu (and lltm.cu, if present)
    replace cuda_src's (mutation tests); ``sources``: {file name: text}, the same."""
    return build_harness("harness_fused.cpp", Path(out_dir) / "lltm_fused_host.so", source_dir,
                         sources)


def build_harness(harness: str, out: Path, source_dir: Path | None = None,
                  sources: dict | None = None) -> ctypes.CDLL:
    """tests/host_shim/``harness`` (with cuda_src on the include path, ``source_dir``'s sources
    or ``sources`` first) built, or found in the run's cache (tests/helpers/host_build.py), and
    loaded from a copy at ``out``."""
    lib = host_build.build(harness, Path(out).parent, Path(out).name, source_dir, sources)
    lib.lltm_host_last_error.restype = ctypes.c_char_p
    lib.lltm_host_barriers.restype = ctypes.c_longlong
    return lib


def set_schedule(lib, name: str, seed: int = 1) -> None:
    lib.lltm_host_set_schedule(ctypes.c_int(SCHEDULES[name]), ctypes.c_ulonglong(seed))


# argument kinds of the two kernels, in order ("array": of the kernel's dtype; "index": int64)
_FWD = ["array", "int64"] + ["array"] * 8 + ["index"] + ["int32"] * 5
_FWD_OUTPUTS = (3, 6, 7, 8, 9)
_BWD = ["array", "int64"] + ["array"] * 8 + ["index"] + ["int32"] * 8
_BWD_OUTPUTS = (7, 8, 9)


def _rows(offsets, packed, steps, batch) -> int:
    """The packed rows a launch runs: from the plan's step offsets (an array or a pointer into
    live memory), or steps * batch."""
    if not packed:
        return steps * batch
    from helpers import emulated_cupy as emu

    off = emu._host_view(offsets, steps + 1, np.int64) if type(offsets) is int \
        else np.asarray(offsets)
    return int(off[steps] - off[0])


def fused_extents(kinds):
    """The elements each array and index argument of a fused launch touches (the kernels of
    cuda_src/lltm_fused.cu and their cluster, group and tensor-core variants), so that they may
    be passed as device pointers."""
    if kinds is _FWD:
        def extents(args):
            w, k, _, _, _, _, _, _, _, _, offsets, packed, steps, batch, state, _ = args
            steps, batch, state = int(steps), int(batch), int(state)
            rows, n = _rows(offsets, int(packed), steps, batch), batch * state
            return (3 * state * int(k), 3 * state, rows * 3 * state, n, n, rows * state,
                    rows * state, n, n, steps + 1 if int(packed) else 0)
        return extents

    def extents(args):
        (w, k, _, _, _, _, _, _, _, _, offsets, packed, has_out, has_h, has_c, steps, batch,
         state, _) = args
        steps, batch, state = int(steps), int(batch), int(state)
        rows, n = _rows(offsets, int(packed), steps, batch), batch * state
        return (3 * state * int(k), rows * 3 * state, rows * state,
                rows * state if has_out else 0, n if has_h else 0, n if has_c else 0,
                rows * 3 * state, n, n, steps + 1 if int(packed) else 0)
    return extents


def convert_fused(args, dtype, kinds, outputs):
    """emulated_cupy.convert_kernel_args for a fused launch: arrays or device pointers."""
    from helpers import emulated_cupy as emu

    return emu.convert_kernel_args(args, dtype, kinds, outputs, fused_extents(kinds),
                                   index_extents=True)


def _host_kernel(lib, limit, fn, name, kinds, outputs, dtype, variant=None):
    """A launch handle (as CuPy's) of the host build's entry point ``fn``, logged as
    ``kernel:<name>`` in the emulated CuPy's log (after ``variant:<variant>`` if given)."""
    from helpers import emulated_cupy as emu

    def launch(grid, block, args, shared_mem=0):
        assert grid[0] > 0 and block[0] > 0, "a launch with an empty grid is an error"
        assert block[0] <= 1024, "more than 1024 threads per block"
        assert 0 <= shared_mem <= limit, f"{shared_mem} bytes of shared memory > {limit}"
        if variant:
            emu._state.log.append(f"variant:{variant}")
        emu._state.log.append(f"kernel:{name}")
        fn(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), ctypes.c_ulonglong(shared_mem),
           *convert_fused(args, dtype, kinds, outputs))
        error = lib.lltm_host_last_error()
        assert error is None, f"{name}: {error.decode()}"
    return launch


def host_get_mma_kernels(lib, limit: int):
    """A replacement for lltm_cupy._cuda.fused_mma.get_kernels launching the host build (each
    kernel logged as the fused one of its direction, ``kernel:seq_fwd`` / ``kernel:seq_bwd``,
    after ``variant:mma``)."""
    from helpers import emulated_cupy as emu

    def get_kernels(dtype):
        dtype = np.dtype(dtype)
        emu._state.compile("lltm_fused_mma.cu", dtype.str)
        suffix = SUFFIX[dtype]
        return _kernels.FusedKernels(
            _host_kernel(lib, limit, getattr(lib, f"lltm_seq_fwd_mma_{suffix}"), "seq_fwd", _FWD,
                         _FWD_OUTPUTS, dtype, variant="mma"),
            _host_kernel(lib, limit, getattr(lib, f"lltm_seq_bwd_mma_{suffix}"), "seq_bwd", _BWD,
                         _BWD_OUTPUTS, dtype, variant="mma"))

    return get_kernels


def host_get_fused_kernels(lib, limit: int):
    """A replacement for lltm_cupy._cuda.fused_kernels.get_kernels launching the host build; a launch
    asking for more than ``limit`` bytes of shared memory fails as on a device with that limit."""
    from helpers import emulated_cupy as emu

    def kernel(fn, name, kinds, outputs, dtype):
        return _host_kernel(lib, limit, fn, name, kinds, outputs, dtype)

    def get_fused_kernels(dtype):
        dtype = np.dtype(dtype)
        emu._state.compile("lltm_fused.cu", dtype.str)
        suffix = SUFFIX[dtype]
        return _kernels.FusedKernels(
            kernel(getattr(lib, f"lltm_seq_fwd_{suffix}"), "seq_fwd", _FWD, _FWD_OUTPUTS, dtype),
            kernel(getattr(lib, f"lltm_seq_bwd_{suffix}"), "seq_bwd", _BWD, _BWD_OUTPUTS, dtype))

    return get_fused_kernels
