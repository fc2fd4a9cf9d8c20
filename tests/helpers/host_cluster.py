"""tests/host_shim/harness_cluster.cpp built as host C++ with cluster semantics (shim.h's
shim_launch_cluster: every thread of every block of a cluster a context, __syncthreads() the
block's barrier, lltm_cluster_sync() the cluster's, lltm_cluster_map / lltm_cluster_store the
distributed shared memory) and group semantics (shim_launch_group: the blocks of a tile as
cooperating contexts exchanging through a weak model of global memory, lltm_group_sync's waiting
loop yielding to the other blocks) and loaded with ctypes."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from lltm_cupy._cuda import cluster_kernels as _cluster_kernels, group_kernels as _group_kernels
from lltm_cupy._cuda import kernels as _kernels
from .host_fused import SCHEDULES, build_harness


def build(out_dir: Path, source_dir: Path | None = None, sources: dict | None = None
          ) -> ctypes.CDLL:
    """tests/host_shim/harness_cluster.cpp built (or found in the run's cache) and loaded from a
    copy in out_dir. ``source_dir``: a folder whose CUDA sources replace cuda_src's (mutation
    tests); ``sources``: {file name: text}, the same."""
    lib = build_harness("harness_cluster.cpp", Path(out_dir) / "lltm_cluster_host.so",
                        source_dir, sources)
    lib.lltm_host_cluster_barriers.restype = ctypes.c_longlong
    lib.lltm_host_group_fences.restype = ctypes.c_longlong
    lib.lltm_host_group_spins.restype = ctypes.c_longlong
    return lib


def set_schedule(lib, name: str, seed: int = 1) -> None:
    lib.lltm_host_set_schedule(ctypes.c_int(SCHEDULES[name]), ctypes.c_ulonglong(seed))


def last_error(lib) -> str | None:
    error = lib.lltm_host_last_error()
    return None if error is None else error.decode()


def host_get_cluster_kernels(lib, limit: int):
    """A replacement for lltm_cupy._cuda.cluster_kernels.get_kernels launching the host build,
    as strict as host_fused.host_get_fused_kernels (and the grid a whole number of clusters);
    each function registered with the emulated driver (its cluster size), so that the occupancy
    query answers for it."""
    from helpers import emulated_cupy as emu
    from helpers.host_fused import _BWD, _BWD_OUTPUTS, _FWD, _FWD_OUTPUTS, convert_fused
    from helpers.host_kernels import SUFFIX

    convert = convert_fused

    def kernel(fn, name, kinds, outputs, dtype, size):
        def launch(grid, block, args, shared_mem=0):
            assert grid[0] > 0 and block[0] > 0, "a launch with an empty grid is an error"
            assert block[0] <= 1024, "more than 1024 threads per block"
            assert grid[0] % size == 0, "the grid is not a whole number of clusters"
            assert 0 <= shared_mem <= limit, f"{shared_mem} bytes of shared memory > {limit}"
            if name in emu._state.refused_launches:
                status = emu._state.refused_launches[name]
                raise emu.CUDADriverError(f"CUresult {status}", status=status)
            emu._state.log.append(f"kernel:{name}")
            fn(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), ctypes.c_uint(size),
               ctypes.c_ulonglong(shared_mem), *convert(args, dtype, kinds, outputs))
            error = lib.lltm_host_last_error()
            assert error is None, f"{name}: {error.decode()}"
        launch.kernel = emu.register_function(name, size)     # as RawKernel.kernel: .ptr
        launch.__name__ = name
        return launch

    made = {}

    def get_cluster_kernels(dtype, size):
        dtype = np.dtype(dtype)
        emu._state.compile("lltm_fused_cluster.cu", dtype.str)
        if (dtype, size) not in made:
            made[dtype, size] = make(dtype, size)
        return made[dtype, size]

    def make(dtype, size):
        suffix = SUFFIX[dtype]
        found = _kernels.FusedKernels(
            kernel(getattr(lib, f"lltm_seq_fwd_cluster_{suffix}"), f"seq_fwd_cluster{size}",
                   _FWD, _FWD_OUTPUTS, dtype, size),
            kernel(getattr(lib, f"lltm_seq_bwd_cluster_{suffix}"), f"seq_bwd_cluster{size}",
                   _BWD, _BWD_OUTPUTS, dtype, size))
        _cluster_kernels.allow_cluster_size(found, size)   # as the real lookup (emulated driver)
        return found

    return get_cluster_kernels


#: Shared memory of one SM of the emulated sm_80 device (A100: 164 KiB, of which a block may
#: take 163 KiB; 1 KiB per resident block is the system's), for resident_blocks.
SM_SHARED = 164 * 1024


def resident_blocks(kernel, threads: int, shared: int) -> int:
    """A stand-in for lltm_cupy._cuda.group_kernels.resident_blocks on the emulated device (its SMs:
    kernels._sm_count, which tests set): blocks per SM as shared memory (1 KiB reserved per
    block), threads (2,048 per SM) and the 32-block limit allow, times the SMs (registers do not
    bind at 256 threads of at most 96 registers)."""
    return min(32, 2048 // threads, SM_SHARED // (shared + 1024)) * _kernels._sm_count(0)


def host_get_group_kernels(lib, limit: int):
    """A replacement for lltm_cupy._cuda.group_kernels.get_kernels launching the host build (each
    group of a tile's blocks as cooperating contexts, shim_launch_group), as strict as a
    cooperative launch of CuPy's: a grid of more blocks than :func:`resident_blocks` says the
    device holds at once fails (CuPy would shrink it and the kernel would wait forever), and as
    strict about arguments as host_fused.host_get_fused_kernels; the exchange buffer (whose
    content is undefined at the launch) is filled with NaN first, the counters must be zero."""
    from helpers import emulated_cupy as emu
    from helpers.host_fused import _BWD, _BWD_OUTPUTS, _FWD, _FWD_OUTPUTS, convert_fused
    from helpers.host_kernels import SUFFIX

    convert = convert_fused

    def kernel(fn, name, kinds, outputs, dtype, size):
        acc = np.dtype(np.float64 if dtype == np.float64 else np.float32)

        def launch(grid, block, args, shared_mem=0):
            assert grid[0] > 0 and block[0] > 0, "a launch with an empty grid is an error"
            assert block[0] <= 1024, "more than 1024 threads per block"
            assert grid[0] % size == 0, "the grid is not a whole number of groups"
            assert 0 <= shared_mem <= limit, f"{shared_mem} bytes of shared memory > {limit}"
            assert grid[0] <= resident_blocks(None, block[0], shared_mem), \
                f"a cooperative launch of {grid[0]} blocks, more than the device holds at once"
            *rest, exchange, counters, first = args
            # device pointers into live memory: the exchange buffer of the launch's tiles (of
            # the arithmetic type), the tiles' counters (uint32, zero)
            tiles = grid[0] // size
            elements = tiles * _group_kernels.exchange_elements(
                int(rest[-2]), int(rest[-1]), kinds is _BWD, size)
            assert type(exchange) is int and type(counters) is int, "pointers expected"
            assert emu._in_live_memory(exchange, elements * acc.itemsize), \
                "the exchange buffer is not in live device memory"
            assert emu._in_live_memory(counters, 4 * tiles), "counters not in live memory"
            assert not emu._host_view(counters, tiles, np.uint32).any(), \
                "the launch's counters are not zero"
            assert type(first) is np.int32
            emu._host_view(exchange, elements, acc)[...] = np.nan
            emu._state.log.append(f"kernel:{name}")
            fn(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), ctypes.c_uint(size),
               ctypes.c_ulonglong(shared_mem), *convert(rest, dtype, kinds, outputs),
               ctypes.c_void_p(exchange), ctypes.c_void_p(counters), ctypes.c_int(int(first)))
            error = lib.lltm_host_last_error()
            assert error is None, f"{name}: {error.decode()}"
        return launch

    def get_group_kernels(dtype, size):
        dtype = np.dtype(dtype)
        emu._state.compile("lltm_fused_cluster.cu", "group", dtype.str)
        suffix = SUFFIX[dtype]
        return _kernels.FusedKernels(
            kernel(getattr(lib, f"lltm_seq_fwd_group_{suffix}"), f"seq_fwd_group{size}",
                   _FWD, _FWD_OUTPUTS, dtype, size),
            kernel(getattr(lib, f"lltm_seq_bwd_group_{suffix}"), f"seq_bwd_group{size}",
                   _BWD, _BWD_OUTPUTS, dtype, size))

    return get_group_kernels
