"""Diagnostics a run prints beside its table: the GPU's element-wise kernels' bandwidth and the
GEMMs' share of a step, the CPU step's share in BLAS (NumPy's and torch's), and the cell between
torch layers (thread-pool contention)."""
from __future__ import annotations

import collections
import statistics
import time

import numpy as np

from ._common import Config, _log, interleaved
from .reports import SCALES


# ---------------------------------------------------------------------------------------------
# GPU: bandwidth of the element-wise kernels and the share of time in GEMMs

def gpu_kernel_report(cfg: Config, runs=50) -> dict:
    """Time the fused kernels and the GEMMs of one step alone, with CuPy and CUDA events.

    Bytes counted per element of (B, S): forward reads gates (3), bias (negligible), old_cell (1)
    and writes gates (3), new_h (1), new_cell (1): 9; backward reads grad_h, grad_cell (2),
    gates (3), new_cell (1) and writes d_gates (3), d_old_cell (1): 10.
    """
    import cupy

    from lltm_cupy._cuda import elementwise as _kernels

    dtype = np.float64 if cfg.double else np.float32
    B, F, S = cfg.size
    rng = cupy.random.default_rng(cfg.seed)
    X = rng.standard_normal((B, S + F), dtype=dtype)
    W = rng.standard_normal((3 * S, S + F), dtype=dtype) / float(np.sqrt(S + F))  # a weak scalar
    bias = cupy.zeros(3 * S, dtype)
    old_cell = rng.standard_normal((B, S), dtype=dtype)
    gates = cupy.empty((B, 3 * S), dtype)
    new_h, new_cell = cupy.empty((B, S), dtype), cupy.empty((B, S), dtype)
    d_gates, d_old_cell = cupy.empty((B, 3 * S), dtype), cupy.empty((B, S), dtype)
    grad = cupy.ones((B, S), dtype)
    n = B * S
    grid, block, wide = _kernels.launch_config(n)
    kernels = _kernels.get_kernels(dtype, wide)
    fwd, bwd = kernels.fwd, kernels.bwd
    cupy.matmul(X, W.T, out=gates)

    def timed(fn):
        for _ in range(3):
            fn()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        cupy.cuda.Device().synchronize()
        start.record()
        for _ in range(runs):
            fn()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3 / runs

    t_fwd = timed(lambda: fwd(grid, block, (gates, bias, old_cell, new_h, new_cell,
                                            np.int64(n), np.int32(S))))
    t_bwd = timed(lambda: bwd(grid, block, (grad, grad, gates, new_cell, d_gates, d_old_cell,
                                            np.int32(1), np.int32(1), np.int64(n), np.int32(S))))
    t_gemm_fwd = timed(lambda: cupy.matmul(X, W.T, out=gates))
    t_gemm_bwd = timed(lambda: (cupy.matmul(d_gates.T, X), cupy.matmul(d_gates, W[:, :S]),
                                cupy.matmul(d_gates, W[:, S:])))

    import lltm_cupy

    # the step as a user calls it: contiguous input and state (slices of X would be copied)
    args = (cupy.ascontiguousarray(X[:, S:]), W, bias, cupy.ascontiguousarray(X[:, :S]),
            old_cell)

    def step():
        out = lltm_cupy.forward(*args)
        lltm_cupy.backward(grad, grad, out[2])

    t_step = timed(step)
    itemsize = np.dtype(dtype).itemsize
    peak = _peak_bandwidth()
    bw_fwd = 9 * n * itemsize / t_fwd
    bw_bwd = 10 * n * itemsize / t_bwd
    gemms = t_gemm_fwd + t_gemm_bwd
    pct = (lambda bw: 100 * bw / peak) if peak else (lambda bw: float("nan"))
    return {"fwd_kernel_s": t_fwd, "bwd_kernel_s": t_bwd, "fwd_kernel_GBps": bw_fwd / 1e9,
            "bwd_kernel_GBps": bw_bwd / 1e9, "peak_GBps": (peak or float("nan")) / 1e9,
            "fwd_kernel_pct_peak": pct(bw_fwd), "bwd_kernel_pct_peak": pct(bw_bwd),
            "gemm_fwd_s": t_gemm_fwd, "gemm_bwd_s": t_gemm_bwd, "step_s": t_step,
            "step_over_gemms": t_step / gemms, "gemm_share_pct": 100 * gemms / t_step}


#: Datasheet memory bandwidth (bytes/s) for GPUs whose driver no longer reports the memory clock
#: (CUDA 13 removed cudaDeviceProp.memoryClockRate).
_DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                        "A100-SXM4-80GB": 2.039e12, "A100": 1.555e12, "L40S": 0.864e12}


def _peak_bandwidth():
    """Peak memory bandwidth in bytes/s: the device properties', else the datasheet's, or None."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    clock, width = props.get("memoryClockRate"), props.get("memoryBusWidth")
    if clock and width:
        return 2 * clock * 1e3 * width / 8
    name = props.get("name", b"")
    name = name.decode() if isinstance(name, bytes) else str(name)
    for key, value in _DATASHEET_BANDWIDTH.items():
        if key in name:
            return value
    return None


def format_gpu_report(size, rep: dict) -> str:
    return (f"GPU kernels at {size}: forward {rep['fwd_kernel_s'] * 1e6:.1f} us = "
            f"{rep['fwd_kernel_GBps']:.0f} GB/s ({rep['fwd_kernel_pct_peak']:.0f}% of "
            f"{rep['peak_GBps']:.0f} GB/s peak), backward {rep['bwd_kernel_s'] * 1e6:.1f} us = "
            f"{rep['bwd_kernel_GBps']:.0f} GB/s ({rep['bwd_kernel_pct_peak']:.0f}%); GEMMs "
            f"{(rep['gemm_fwd_s'] + rep['gemm_bwd_s']) * 1e6:.1f} us of a "
            f"{rep['step_s'] * 1e6:.1f} us array-API step ({rep['gemm_share_pct']:.0f}%; "
            f"step / GEMMs = {rep['step_over_gemms']:.2f})")


# ---------------------------------------------------------------------------------------------
# CPU: the share of the step in BLAS, with NumPy's BLAS and with torch's

def blas_names() -> dict:
    """{"numpy": ..., "torch": ...}: the BLAS library each was built with, as they report it."""
    import torch

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        numpy_blas = f"{blas['name']} {blas.get('version', '')}".strip()
    except Exception:  # older NumPy, or a build that does not say
        numpy_blas = "unknown BLAS"
    torch_blas = "MKL" if torch.backends.mkl.is_available() else "its own BLAS"
    return {"numpy": numpy_blas, "torch": torch_blas}


def cpu_blas_report(cfg: Config, runs=100) -> dict:
    """The NumPy backend's step (forward, then the backward of the gradients the benchmark asks
    for) with its GEMMs run by NumPy's BLAS (the array API) and by torch's (what ``LLTMCell``
    runs on the CPU), and the GEMMs' part of it: every GEMM goes through a wrapper that times it.

    The two are timed one after the other, not interleaved (two BLAS thread pools taking turns
    would measure their contention). Returns medians in seconds and the GEMM share in percent.
    """
    from lltm_cupy import _numpy
    from lltm_cupy.torch._torch_gemm import torch_mm as _torch_mm

    dtype = np.float64 if cfg.double else np.float32
    B, F, S = cfg.size
    rng = np.random.default_rng(cfg.seed)
    x, h, c = (rng.standard_normal(shape).astype(dtype) for shape in ((B, F), (B, S), (B, S)))
    W = (rng.standard_normal((3 * S, S + F)) / np.sqrt(S + F)).astype(dtype)
    bias = np.zeros(3 * S, dtype)
    ones = np.ones((B, S), dtype)
    needed = (True,) * 5 if cfg.all_grads else (False, False, True, True, False)
    clock = time.perf_counter
    report = {}
    for name, mm in (("numpy", np.matmul), ("torch", _torch_mm)):
        gemms = []              # per step, the seconds in its GEMMs

        def timed_mm(a, b, mm=mm, gemms=gemms):
            t0 = clock()
            out = mm(a, b)
            gemms[-1] += clock() - t0
            return out

        def step():
            gemms.append(0.0)
            saved = _numpy.forward(x, W, bias, h, c, mm=timed_mm)[2]
            _numpy.backward(ones, ones, saved, needed, mm=timed_mm)

        steps = interleaved({name: step}, runs, clock, warmup=cfg.warmup)[name]
        del gemms[:cfg.warmup]
        step_s, gemm_s = statistics.median(steps), statistics.median(gemms)
        report[name] = {"step_s": step_s, "gemm_s": gemm_s, "gemm_share_pct": 100 * gemm_s / step_s}
        time.sleep(0.5)  # let this pool's workers go idle before the other one runs
    report["torch_gemm_over_numpy_gemm"] = report["torch"]["gemm_s"] / report["numpy"]["gemm_s"]
    report["blas"] = blas_names()
    report["runs"] = runs
    return report


def format_blas_report(size, rep: dict, scale="us") -> str:
    factor, unit = SCALES[scale]
    parts = []
    for name, who in (("numpy", "NumPy's BLAS"), ("torch", "torch's BLAS")):
        r = rep[name]
        parts.append(f"{who} ({rep['blas'][name]}"
                     f"{'; what LLTMCell runs' if name == 'torch' else ''}): step "
                     f"{r['step_s'] * factor:.1f} {unit}, GEMMs {r['gemm_s'] * factor:.1f} {unit}"
                     f" ({r['gemm_share_pct']:.0f}%)")
    return (f"BLAS share at {size} (the NumPy backend's step, medians of {rep['runs']} runs): "
            + "; ".join(parts)
            + f"; torch's GEMMs / NumPy's GEMMs = {rep['torch_gemm_over_numpy_gemm']:.2f}")


# ---------------------------------------------------------------------------------------------
# CPU: the cell between torch layers (thread-pool contention check)

def mixed_model_report(cfg: Config, runs=200, quiet=False) -> dict:
    """Time torch layers alone, the cell alone, and both in one model, interleaved.

    Model: x -> Linear(F, F) + tanh -> cell -> Linear(S, S) + tanh -> sum. "layers alone" runs
    the two Linear layers on the same shapes without the cell, "cell alone" the cell on its own.
    With no contention, mixed ~= layers alone + cell alone. Inside the steps, the forward of the
    layer after the cell and the forward of the cell are also timed on their own, alone and in
    the mixed model, to see which side a slowdown lands on.
    """
    import torch

    import lltm_cupy.torch as lt

    dtype = cfg.torch_dtype()
    torch.manual_seed(cfg.seed)
    B, F, S = cfg.size
    pre = torch.nn.Linear(F, F, dtype=dtype)
    post = torch.nn.Linear(S, S, dtype=dtype)
    x, h0, c0 = (torch.randn(B, n, dtype=dtype) for n in (F, S, S))
    clock = time.perf_counter
    results = {}
    for cell_name, cell in (("cell", lt.LLTMCell(F, S, dtype=dtype)),
                            ("reference", lt.ReferenceLLTMCell(F, S, dtype=dtype))):
        segments = collections.defaultdict(list)     # the forwards timed inside the steps

        def layers_only():
            y = torch.tanh(pre(x))
            t0 = clock()
            z = torch.tanh(post(h0))
            segments["post fwd alone"].append(clock() - t0)
            (y.sum() + z.sum()).backward()

        def cell_only():
            t0 = clock()
            h, c = cell(x, (h0, c0))
            segments["cell fwd alone"].append(clock() - t0)
            (h.sum() + c.sum()).backward()

        def mixed():
            y = torch.tanh(pre(x))
            t0 = clock()
            h, c = cell(y, (h0, c0))
            t1 = clock()
            z = torch.tanh(post(h))
            t2 = clock()
            segments["cell fwd mixed"].append(t1 - t0)
            segments["post fwd mixed"].append(t2 - t1)
            (z.sum() + c.sum()).backward()

        fns = {"layers alone": layers_only, "cell alone": cell_only, "mixed": mixed}
        interleaved(fns, 0, clock, warmup=cfg.warmup)
        segments.clear()
        samples = interleaved(fns, runs, clock, warmup=0)
        med = {k: statistics.median(v) for k, v in samples.items()}
        med.update({k: statistics.median(v) for k, v in segments.items()})
        med["mixed / (layers + cell)"] = med["mixed"] / (med["layers alone"] + med["cell alone"])
        results[cell_name] = med
        _log(quiet, f"  mixed model with {cell_name}: done")
    return results


def format_mixed(size, rep: dict, scale="us") -> str:
    factor, unit = SCALES[scale]
    cols = ("layers alone", "cell alone", "mixed", "post fwd alone", "post fwd mixed",
            "cell fwd alone", "cell fwd mixed")
    lines = [f"Mixed model at {size} (torch Linear+tanh before and after the cell), medians in "
             f"{unit} (fwd+bwd of each model; 'post fwd' is the forward of the layer after the "
             f"cell, 'cell fwd' the cell's forward):",
             f"{'cell':<11}" + "".join(f"{c:>16}" for c in cols) + f"{'mixed/(sum)':>13}"]
    for name, r in rep.items():
        lines.append(f"{name:<11}" + "".join(f"{r[c] * factor:>16.1f}" for c in cols)
                     + f"{r['mixed / (layers + cell)']:>13.2f}")
    return "\n".join(lines)
