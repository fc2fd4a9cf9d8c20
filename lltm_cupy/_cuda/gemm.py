"""The GEMMs of the CUDA backend (cuBLAS ``gemmEx`` through CuPy's binding), the bias reduction
and a sequence's parameter gradients; used by every launcher above it (step, packed, fused,
sequence). CuPy is imported on first call, never at import.
"""
from __future__ import annotations

import threading

import numpy as np

from .kernels import BFLOAT16, current_device

__all__ = ["gemm", "Steps", "steps", "row_steps", "d_bias", "parameter_grads"]


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
    m, n = out.shape
    k = a.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        if not accumulate:
            out.fill(0)
        return out
    with Steps(a, b, out, accumulate) as run:
        run(0, 0)
    return out


class Steps:
    """``run(i, j)``: the GEMM ``out = a @ b`` (``out += a @ b`` with ``accumulate``) with a
    moved by i * ``a_step`` bytes and out by j * ``out_step`` (the steps of a sequence's stacked
    buffers), by cuBLAS ``gemmEx`` on pointers: everything but the two offsets is worked out
    once, here (the operand layouts, data and compute types, the alpha and beta constants, the
    cuBLAS handle), so that a call makes no object. m, n, k >= 1. A ``with`` block holds the
    16-bit math mode (see :func:`gemm`) for the calls inside it.

    The handle is CuPy's of the calling thread and the current device, looked up once per
    thread and device. CuPy's binding sets the handle's stream to CuPy's current stream on
    every call (``cupy_backends/cuda/libs/cublas.pyx``, ``gemmEx`` -> ``_setStream``), and
    raises while that stream is being captured (the torch layer runs torch's GEMMs instead).
    """

    __slots__ = ("_gemm_ex", "_args", "_a", "_a_step", "_c", "_c_step", "_mode", "_restore",
                 "_handle", "_b", "_keep_a")

    def __init__(self, a, b, out, accumulate=False, a_step=0, out_step=0):
        import cupy

        cublas = cupy.cuda.cublas
        m, n = out.shape
        k = a.shape[1]
        cuda_type, compute, one, zero = _constants(cupy, out.dtype)
        assert out.strides[1] == out.itemsize or n == 1, "gemm: out needs a unit column stride"
        ldc = out.strides[0] // out.itemsize if m > 1 else n
        # Row-major out is the column-major (n, m) matrix out.T = b.T @ a.T: cuBLAS's first
        # operand is b, its second a; a row-major operand is already transposed in column-major
        # terms.
        self._b, b_t, ldb = _operand(b)     # (a copy of b, if one was made, lives with self)
        a_, a_t, lda = _operand(a)
        assert a_ is a or not a_step, "gemm: a stepped operand needs a BLAS layout"
        self._handle = handle = _handle(cupy)
        self._gemm_ex = cublas.gemmEx
        op = (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T)
        self._a, self._a_step = a_.data.ptr, a_step
        self._c, self._c_step = out.data.ptr, out_step
        self._args = (handle, op[b_t], op[a_t], n, m, k, one, self._b.data.ptr, cuda_type, ldb,
                      lda, one if accumulate else zero, max(ldc, 1), compute,
                      cublas.CUBLAS_GEMM_DEFAULT)
        self._mode = self._restore = None
        if out.itemsize == 2:    # float16, bfloat16: no reduction in the 16-bit output type
            self._restore = cublas.getMathMode(handle)
            self._mode = self._restore | _DISALLOW_REDUCED_PRECISION
        self._keep_a = a_

    def __enter__(self):
        if self._mode != self._restore:
            import cupy

            cupy.cuda.cublas.setMathMode(self._handle, self._mode)
        return self

    def __exit__(self, *exc):
        if self._mode != self._restore:
            import cupy

            cupy.cuda.cublas.setMathMode(self._handle, self._restore)
        return False

    def __call__(self, i, j, rows=0):
        """The GEMM at offsets i, j; ``rows``: on that many rows of a and out, not m."""
        handle, op_b, op_a, n, m, k, one, b, t, ldb, lda, beta, ldc, compute, algo = self._args
        self._gemm_ex(handle, op_b, op_a, n, rows or m, k, one, b, t, ldb,
                      self._a + i * self._a_step, t, lda, beta, self._c + j * self._c_step, t, ldc,
                      compute, algo)


def row_steps(a, b, out, accumulate=False):
    """The per-step GEMMs ``out[j:j + rows] (+)= a[i:i + rows] @ b`` of a packed sequence's
    rows, a (R, k) and out (R', n) C-contiguous: ``run(i, j, rows)`` (:class:`Steps` on
    pointers). Use it in a ``with`` block."""
    return Steps(a, b, out, accumulate, a.strides[0], out.strides[0])


def steps(a, b, out, accumulate=False):
    """The per-step GEMMs ``out[j] (+)= a[i] @ b`` of a sequence's stacks a (T, m, k) and
    out (T', m, n), m, n, k >= 1: ``run(i, j)`` (:class:`Steps` on pointers). Use it in a
    ``with`` block."""
    return Steps(a[0], b, out[0], accumulate, a.strides[0], out.strides[0])


_CONSTANTS: dict = {}


def _constants(cupy, dtype):
    """(CUDA data type, compute type, pointer to 1, pointer to 0) of ``dtype``'s GEMMs; the
    scalars are made once and kept for the process (cuBLAS reads them from the host)."""
    found = _CONSTANTS.get(dtype)
    if found is None:
        cublas, runtime = cupy.cuda.cublas, cupy.cuda.runtime
        cuda_type = {np.float16: runtime.CUDA_R_16F, np.float32: runtime.CUDA_R_32F,
                     np.float64: runtime.CUDA_R_64F,
                     BFLOAT16.type: runtime.CUDA_R_16BF}[np.dtype(dtype).type]
        compute, scalar = ((cublas.CUBLAS_COMPUTE_64F, np.float64) if dtype == np.float64
                           else (cublas.CUBLAS_COMPUTE_32F, np.float32))
        one, zero = np.ones((), scalar), np.zeros((), scalar)
        _KEPT.extend((one, zero))
        found = _CONSTANTS[dtype] = (cuda_type, compute, one.ctypes.data, zero.ctypes.data)
    return found


_KEPT: list = []
_handles = threading.local()


def _handle(cupy):
    """CuPy's cuBLAS handle of the calling thread on the current device, looked up once per
    thread and device."""
    device = current_device()
    found = getattr(_handles, "by_device", None)
    if found is None:
        found = _handles.by_device = {}
    handle = found.get(device)
    if handle is None:
        handle = found[device] = cupy.cuda.device.get_cublas_handle()
    return handle


#: cublasMath_t flag (cublas_api.h): reductions of a mixed-precision GEMM in the compute type
_DISALLOW_REDUCED_PRECISION = 16


#: 1.0 in bfloat16 bits
_BF16_ONE = 0x3F80


def d_bias(cupy, d_gates, bias_shape):
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


def parameter_grads(cupy, flat, h_in, x, weights, bias_shape, needed):
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
        grad_b = d_bias(cupy, flat, bias_shape)
    if need_x:
        d_inputs = gemm(flat, weights[:, state:], cupy.empty((flat.shape[0], x.shape[1]), dtype))
    return d_inputs, d_weights, grad_b
