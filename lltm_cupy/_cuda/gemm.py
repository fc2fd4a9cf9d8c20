"""The GEMMs of the CUDA backend (cuBLAS ``gemmEx`` through CuPy's binding), the bias reduction
and a sequence's parameter gradients; used by every launcher above it (step, packed, fused,
sequence). CuPy is imported on first call, never at import.
"""
from __future__ import annotations

import numpy as np

from .kernels import BFLOAT16

__all__ = ["gemm", "d_bias", "parameter_grads"]


def _operand(a):
    """(array, transposed, leading dimension) of a 2-D operand for column-major cuBLAS.

    A row-major view (unit column stride) is the column-major matrix a.T; a column-major view
    (unit row stride, e.g. ``w.T``) is a itself. Anything else is copied to C order first.
    """
    rows, cols = a.shape
    item = a.itemsize
    s0, s1 = a.strides
    if cols == 1 or s1 == item:
        ld = s0 // item if rows > 1 else cols
        if ld >= cols and s0 % item == 0:
            return a, False, max(ld, 1)
    if rows == 1 or s0 == item:
        ld = s1 // item if cols > 1 else rows
        if ld >= rows and s1 % item == 0:
            return a, True, max(ld, 1)
    from cupy import ascontiguousarray

    return ascontiguousarray(a), False, max(cols, 1)


def gemm(a, b, out, accumulate=False):
    """out = a @ b, or out += a @ b with ``accumulate``: cuBLAS ``gemmEx`` on CuPy's current
    stream and device, straight on the views given (slices and transposes of row-major arrays),
    with no copy and no temporary.

    a: (m, k); b: (k, n); out: (m, n) with a unit column stride; one dtype for all three.
    float16 and bfloat16 (uint16 bits, ``kernels.BFLOAT16``) are computed in float32 and rounded
    once: for them the handle's math mode gets ``CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION``
    for the call (so that split-K partial sums, too, are added in float32) and is restored
    after it. float32 in float32 (as the handle's math mode allows; CuPy's default mode uses no
    TF32), float64 in float64.
    """
    import cupy

    m, n = out.shape
    k = a.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        if not accumulate:
            out.fill(0)
        return out
    cublas, runtime = cupy.cuda.cublas, cupy.cuda.runtime
    cuda_type = {np.float16: runtime.CUDA_R_16F, np.float32: runtime.CUDA_R_32F,
                 np.float64: runtime.CUDA_R_64F, BFLOAT16.type: runtime.CUDA_R_16BF}[out.dtype.type]
    compute, scalar = ((cublas.CUBLAS_COMPUTE_64F, np.float64) if out.dtype == np.float64
                       else (cublas.CUBLAS_COMPUTE_32F, np.float32))
    assert out.strides[1] == out.itemsize or n == 1, "gemm: out needs a unit column stride"
    ldc = out.strides[0] // out.itemsize if m > 1 else n
    # Row-major out is the column-major (n, m) matrix out.T = b.T @ a.T: cuBLAS's first operand
    # is b, its second a; a row-major operand is already transposed in column-major terms.
    b, b_t, ldb = _operand(b)
    a, a_t, lda = _operand(a)
    alpha = np.ones((), scalar)
    beta = np.full((), 1 if accumulate else 0, scalar)
    handle = cupy.cuda.device.get_cublas_handle()
    mode = restore = None
    if out.itemsize == 2:    # float16, bfloat16: no reduction in the 16-bit output type
        restore = cublas.getMathMode(handle)
        mode = restore | _DISALLOW_REDUCED_PRECISION
        if mode != restore:
            cublas.setMathMode(handle, mode)
    try:
        cublas.gemmEx(handle,
                      cublas.CUBLAS_OP_T if b_t else cublas.CUBLAS_OP_N,
                      cublas.CUBLAS_OP_T if a_t else cublas.CUBLAS_OP_N,
                      n, m, k, alpha.ctypes.data, b.data.ptr, cuda_type, ldb, a.data.ptr,
                      cuda_type, lda, beta.ctypes.data, out.data.ptr, cuda_type, max(ldc, 1),
                      compute, cublas.CUBLAS_GEMM_DEFAULT)
    finally:
        if mode is not None and mode != restore:
            cublas.setMathMode(handle, restore)
    return out


#: cublasMath_t flag (cublas_api.h): reductions of a mixed-precision GEMM in the compute type
_DISALLOW_REDUCED_PRECISION = 16


#: 1.0 in bfloat16 bits
_BF16_ONE = 0x3F80


def d_bias(cupy, d_gates, bias_shape, gemm):
    """Sum of d_gates (rows, 3S) over its rows, shaped like the bias; float16 sums in float32 and
    rounds once; bfloat16 (which CuPy cannot add) as the GEMM ones (1, rows) @ d_gates, float32
    accumulation, rounded once."""
    if d_gates.dtype == BFLOAT16:
        ones = cupy.full((1, d_gates.shape[0]), _BF16_ONE, BFLOAT16)
        out = cupy.empty((1, d_gates.shape[1]), BFLOAT16)
        return gemm(ones, d_gates, out).reshape(bias_shape)
    if d_gates.dtype == np.float16:
        return d_gates.sum(axis=0, dtype=np.float32).astype(np.float16).reshape(bias_shape)
    return d_gates.sum(axis=0).reshape(bias_shape)


def parameter_grads(cupy, flat, h_in, x, weights, bias_shape, needed, gemm):
    """(d_inputs (rows, F), d_weights, d_bias) of a sequence from every step's d_gates ``flat``
    (rows, 3S), the hidden state each row read ``h_in`` (rows, S) and the inputs ``x`` (rows, F):
    one GEMM (or reduction) each over all steps; None where ``needed`` says so."""
    need_x, need_w, need_b = needed[:3]
    state = weights.shape[0] // 3
    dtype = flat.dtype
    d_weights = grad_b = d_inputs = None
    if need_w:
        # both halves written in place by their GEMMs (zeros when there are no rows)
        d_weights = cupy.empty(weights.shape, dtype)
        gemm(flat.T, h_in, d_weights[:, :state])
        gemm(flat.T, x, d_weights[:, state:])
    if need_b:
        grad_b = d_bias(cupy, flat, bias_shape, gemm)
    if need_x:
        d_inputs = gemm(flat, weights[:, state:], cupy.empty((flat.shape[0], x.shape[1]), dtype))
    return d_inputs, d_weights, grad_b
