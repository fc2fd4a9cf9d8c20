"""The torch layer's autograd Functions, one per operation: :class:`LLTMFunction` (one step,
here, with what both share) and :class:`LLTMSequenceFunction` (a whole sequence, padded or
packed by a plan: ``_sequence_function``).

Each forward allocates what it returns and what its backward keeps, has the backend write into
it, and saves every tensor the backward reads with ``ctx.save_for_backward`` as it is (so
``torch.utils.checkpoint``, ``save_on_cpu`` and any saved-tensor hooks see, drop, move or
compress it; no state is kept on ``ctx`` by other means):

- one step on the CPU: the NumPy backend's step on arrays over the tensors' memory
  (``_cpu_arrays.view``), into ``torch.empty_like`` tensors; the backward's four factors (4,
  batch, state) are kept, [old_h, input] is not (the backward concatenates it again if the
  weights need a gradient);
- one step on CUDA: the kernels of ``cuda_src/lltm.cu`` launched on the tensors' device
  pointers, on torch's current stream, into ``torch.empty`` tensors (torch's allocator owns
  every byte), the GEMMs torch's; X = [old_h, input], the gate pre-activations and new_cell
  are kept;
- a sequence: the backend's sequence loop on arrays over the tensors' memory (``_interop``),
  its saved arrays kept as tensors over the same memory.

Every argument is saved too, as it is: an in-place change of one before the backward raises
(autograd's version check), and a backward run with grad mode on (``create_graph=True``, and
the ``torch.func`` transforms) computes the gradients from them with differentiable torch
operations (:mod:`lltm_cupy.torch.reference`'s backward formulas), so second derivatives
(Hessians, gradient penalties) are right. With grad mode off, the backend's backward runs, and
that path costs nothing more.

The Functions are written in the style ``torch.func`` asks for (``setup_context``); the public
functions call them through torch's C++ ``apply`` (:func:`apply`), which skips the Python
``Function.apply``'s per-call binding of default arguments, except under ``torch.func``'s
transforms, which need it.
"""
from __future__ import annotations

import numpy as np
import torch

from .._cuda import step as _cuda_step
from .._numpy import step as _step
from . import _cpu_arrays, _interop, _torch_gemm, reference
from ._interop import cuda_backend, without_autocast
from ._torch_gemm import kept_operand

__all__ = ["LLTMFunction", "apply", "step_forward", "step_inference", "step_backward",
           "kept_for_backward",
           "cpu_step_backward", "cuda_step_forward", "cuda_step_backward", "INPLACE_MESSAGE"]

INPLACE_MESSAGE = (
    "lltm_cupy.torch: a tensor that the LLTM's backward reads was modified in place after the "
    "forward (see which in the error above): an argument (the weights, the input or the "
    "state), or an output whose memory the backward reads (the outputs of a sequence; "
    "new_cell of an LLTMCell on CUDA). Modify a copy instead (out = out.clone(); "
    "out.relu_()), or use the out-of-place operation (out = out.relu()).")

_from_numpy = torch.from_numpy
#: the CPU step's outputs: torch's own tensors (resizable, shareable, usable as ``out=``), the
#: NumPy backend writing into their memory through arrays that leave them so (``_cpu_arrays``;
#: the caller's tensors too: ``Tensor.numpy()`` would make their storage non-resizable)
_new, _DENSE = torch.empty_like, torch.contiguous_format
_array = _cpu_arrays.view
_baddbmm, _cat, _mm = torch.baddbmm, torch.cat, torch.mm
_F32 = np.dtype(np.float32)


def apply(cls, *args):
    """``cls.apply(*args)``: through torch's C++ ``apply`` outside torch.func's transforms
    (it runs forward, then setup_context), through the Python one under them."""
    if torch._C._are_functorch_transforms_active():
        return torch.autograd.Function.apply.__func__(cls, *args)
    return super(torch.autograd.Function, cls).apply(*args)


def _saved(ctx):
    """``ctx.saved_tensors``, with the library's advice added to autograd's in-place error."""
    try:
        return ctx.saved_tensors
    except RuntimeError as error:
        if "modified by an inplace operation" in str(error):
            raise RuntimeError(f"{error}\n{INPLACE_MESSAGE}") from error
        raise


_tracing = torch._C._is_tracing


def _refusal() -> RuntimeError:
    """torch.jit.trace would record a backend call's results as constants."""
    from ._export import refusal

    return refusal("a call into lltm_cupy's NumPy/CuPy backends")


def batched(*grads) -> bool:
    """Whether an incoming gradient is a batch of gradients (torch's legacy vmap:
    ``torch.autograd.grad(..., is_grads_batched=True)``, ``jacobian`` and ``hessian`` with
    ``vectorize=True``): a tensor without memory of its own, which the backends cannot read
    and torch's operations take (the backwards then run the formulas as torch operations).
    Asked only after a backend refused the gradients, so it costs a call nothing."""
    check = torch._C._functorch.is_legacy_batchedtensor
    return any(g is not None and check(g) for g in grads)


def _refuse_vmap(info, in_dims, *args):
    raise RuntimeError(
        "lltm_cupy.torch: torch.func.vmap over the LLTM is not supported (its kernels have no "
        "batching rule): the LLTM takes a batch dimension already; put the mapped dimension "
        "into it (or loop). torch.func.grad, vjp and jacrev work.")


def _refuse_jvp(ctx, *tangents):
    raise RuntimeError(
        "lltm_cupy.torch: forward-mode AD (torch.func.jvp, jacfwd, torch.func.hessian, "
        "torch.autograd.forward_ad) is not supported by the LLTM, whose kernels have no "
        "forward derivative; use reverse mode (backward(), torch.func.grad, vjp, jacrev; "
        "second derivatives by reverse over reverse, e.g. torch.autograd.functional.hessian).")


# ---------------------------------------------------------------------------------------------
# One step

class LLTMFunction(torch.autograd.Function):
    """One LLTM step with autograd: ``apply(input, weights, bias, old_h, old_cell)`` returns
    ``(new_h, new_cell)`` followed by what the backward keeps (the CPU's factors; CUDA's X and
    gate pre-activations). Prefer :func:`lltm_cupy.torch.lltm`, which checks the arguments,
    handles autocast and torch.compile, and returns the two outputs only. ``torch.func.grad``,
    ``vjp`` and ``jacrev`` work; ``vmap`` and forward-mode AD are refused. Its forward and
    backward bodies (:func:`step_forward`, :func:`step_backward`) are also the custom operators'
    (``_custom_ops``): eager and compiled calls compute with the same code."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output[2:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs[:5], *kept_for_backward(output))

    @staticmethod
    def backward(ctx, grad_h, grad_cell, *_):
        saved = _saved(ctx)
        if grad_h is None and grad_cell is None:
            return None, None, None, None, None
        return step_backward(grad_h, grad_cell, saved, ctx.needs_input_grad)

    vmap = staticmethod(_refuse_vmap)
    jvp = staticmethod(_refuse_jvp)


def _one_step(input, weights, bias, old_h, old_cell, keep):
    """One step: ``(new_h, new_cell, *kept)``, ``kept`` what the backward reads (the CPU's
    factors (4, B, S); CUDA's X (B, S + F) and gate pre-activations (B, 3S)); with ``keep``
    False (no backward to follow) only ``(new_h, new_cell)``, the same bits. The CPU step's
    gate pre-activations come gate-major (3, B, S) from torch's batched GEMM (one product per
    gate, the bias added) straight into the NumPy backend's scratch (``step.gate_rows``), the
    element-wise step's layout."""
    if _tracing():
        raise _refusal()
    if cuda_backend(input):
        return cuda_step_forward(input, weights, bias, old_h, old_cell, keep=keep)
    c = _array(old_cell)
    batch, state = c.shape
    z, run = _step.gate_rows(batch, state, c.dtype, keep, kept_operand)
    X = _cat((old_h, input), 1)
    width = X.shape[1]
    if batch * state * state >= _torch_gemm.ONEDNN_MIN and c.dtype == _F32 and \
            _torch_gemm.ONEDNN_GEMM is not None and _torch_gemm._mkldnn_enabled():
        # (the sequences' rule, ``_torch_gemm.cpu_gemm``: oneDNN, its (B, 3S) product copied
        # gate-major; the weights as they are, no packing for one product)
        w = weights if weights.is_contiguous() else weights.contiguous()   # (onednn_mm says why)
        with torch.no_grad():
            product = _torch_gemm._linear(X, w, bias.reshape(-1), "none", [], "")
            z.copy_(product.view(batch, 3, state).transpose(0, 1))
    elif keep:
        _baddbmm(bias.reshape(3, 1, state), X.expand(3, batch, width),
                 weights.view(3, state, width).transpose(1, 2), out=z)
    else:   # (out= would refuse tensors that require grad, under grad mode: none is recorded)
        with torch.no_grad():
            _baddbmm(bias.reshape(3, 1, state), X.expand(3, batch, width),
                     weights.view(3, state, width).transpose(1, 2), out=z)
    new_h = _new(old_cell, memory_format=_DENSE)
    new_cell = _new(old_cell, memory_format=_DENSE)
    if not keep:
        run(c, _array(new_h), _array(new_cell))
        return new_h, new_cell
    factors = np.empty((4, batch, state), c.dtype)
    run(c, _array(new_h), _array(new_cell), factors)
    return new_h, new_cell, _from_numpy(factors)


#: the Function's forward, and a step's forward alone (``keep`` False): :func:`_one_step`
step_forward = without_autocast(_one_step, "step_forward", keep=True)
step_inference = without_autocast(_one_step, "step_inference", keep=False)
LLTMFunction.forward = staticmethod(step_forward)


def kept_for_backward(output) -> tuple:
    """What a step's backward reads besides the arguments, from :func:`step_forward`'s output:
    the CPU's factors; CUDA's X, gates and new_cell (which its kernel reads)."""
    return output[2:] if len(output) == 3 else (*output[2:], output[1])


def _step_backward(grad_h, grad_cell, saved, needed):
    """One step's gradients in the forward's argument order (None where ``needed`` says so),
    from ``saved`` = the five arguments and :func:`kept_for_backward`'s. With grad mode off the
    backend's backward; with it on (``create_graph=True``, ``torch.func``), and for a batch of
    gradients (which the backends cannot read), docs/derivation.md's formulas in torch
    operations, differentiable (backpropagation through time for a sequence)."""
    input, weights, bias, old_h, old_cell = saved[:5]
    if not torch.is_grad_enabled():
        try:
            if len(saved) > 6:      # CUDA: X, gates, new_cell
                X, gates, new_cell = saved[5:]
                return cuda_step_backward(grad_h, grad_cell, X, gates, new_cell, weights,
                                          bias.shape, needed)
            return cpu_step_backward(grad_h, grad_cell, saved[5], weights, bias.shape, needed,
                                     old_h, input)
        except RuntimeError:        # (a batch of gradients reaches the backend: no memory)
            if not batched(grad_h, grad_cell):
                raise
    return reference.lltm_backward_reference(grad_h, grad_cell, input, weights, bias, old_h,
                                             old_cell, needed)


step_backward = without_autocast(_step_backward, "step_backward")


def cpu_step_backward(grad_h, grad_cell, factors, weights, bias_shape, needed, old_h, input):
    """:func:`_step_backward` on the CPU: the NumPy backend's element-wise backward, torch's
    GEMMs; [old_h, input] concatenated again if the weights need it."""
    need_x, need_w, need_b, need_h, need_c = needed
    # the gradients returned: torch's own tensors, the backend writing into their memory
    d_old_cell = factors.new_empty(factors.shape[1:]) if need_c else None
    d_bias = factors.new_empty(3 * factors.shape[2]) if need_b else None
    d_gates, _, _ = _step.cell_backward_into(
        None if grad_h is None else grad_h.numpy(),
        None if grad_cell is None else grad_cell.numpy(), factors.numpy(), bias=need_b,
        d_old_cell=None if d_old_cell is None else _array(d_old_cell),
        d_bias=None if d_bias is None else _array(d_bias))
    rows = _from_numpy(d_gates)         # (this thread's scratch: used up here)
    state = factors.shape[2]
    mm = _mm
    if rows.shape[0] * state * state >= _torch_gemm.ONEDNN_MIN and \
            rows.dtype is torch.float32 and _torch_gemm.ONEDNN_GEMM is not None and \
            _torch_gemm._mkldnn_enabled():      # (as the forward)
        mm = _torch_gemm.onednn_mm
    if need_x and need_h:               # one GEMM, the two gradients views of it
        d_x = mm(rows, weights)
        d_old_h, d_input = d_x[:, :state], d_x[:, state:]
    else:
        d_old_h = mm(rows, weights[:, :state]) if need_h else None
        d_input = mm(rows, weights[:, state:]) if need_x else None
    if need_w:
        d_weights = mm(rows.t(), _cat((old_h, input), 1))
    return (d_input, d_weights if need_w else None,
            d_bias.reshape(bias_shape) if need_b else None, d_old_h,
            d_old_cell if need_c else None)


# -- CUDA: the kernels on device pointers, torch's GEMMs and allocator, torch's current stream

def cuda_step_forward(input, weights, bias, old_h, old_cell, keep=True):
    batch, state = old_h.shape
    features = input.shape[1]
    new = old_h.new_empty
    X, gates = new((batch, state + features)), new((batch, 3 * state))
    new_h, new_cell = new((batch, state)), new((batch, state))
    if batch:   # state >= 1: nothing to launch exactly when batch == 0
        h, x, b, c = (t.contiguous() for t in (old_h, input, bias, old_cell))
        dtype = _interop.KERNEL_DTYPE[input.dtype]
        with _interop.launching(input.device):
            _cuda_step.launch_concat(dtype, batch, features, state, h.data_ptr(), x.data_ptr(),
                                     X.data_ptr())
            _interop.mm(X, weights.t(), gates)
            _cuda_step.launch_forward(dtype, batch, state, gates.data_ptr(), b.data_ptr(),
                                      c.data_ptr(), new_h.data_ptr(), new_cell.data_ptr())
    return (new_h, new_cell, X, gates) if keep else (new_h, new_cell)


def cuda_step_backward(grad_h, grad_cell, X, gates, new_cell, weights, bias_shape, needed):
    """:func:`_step_backward` on CUDA: the backward kernel on device pointers, torch's GEMMs."""
    need_x, need_w, need_b, need_h, need_c = needed
    batch, state = new_cell.shape
    new = new_cell.new_empty
    d_gates, d_old_cell = new((batch, 3 * state)), new((batch, state))
    if batch:
        gh = None if grad_h is None else grad_h.contiguous()
        gc = None if grad_cell is None else grad_cell.contiguous()
        with _interop.launching(new_cell.device):
            _cuda_step.launch_backward(
                _interop.KERNEL_DTYPE[new_cell.dtype], batch, state,
                None if gh is None else gh.data_ptr(), None if gc is None else gc.data_ptr(),
                gates.data_ptr(), new_cell.data_ptr(), d_gates.data_ptr(), d_old_cell.data_ptr())
    mm = _interop.mm
    return (mm(d_gates, weights[:, state:], new((batch, X.shape[1] - state))) if need_x else None,
            mm(d_gates.t(), X, new(weights.shape)) if need_w else None,
            d_gates.sum(0).reshape(bias_shape) if need_b else None,
            mm(d_gates, weights[:, :state], new((batch, state))) if need_h else None,
            d_old_cell if need_c else None)
