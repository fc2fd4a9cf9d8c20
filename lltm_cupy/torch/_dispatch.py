"""What every call of the torch layer decides before the backend runs, shared by the one-step
op (``_cell_op``) and the sequence op (``_sequence_op``).

Two paths give the same results:

- eager calls go through :class:`LLTMFunction` / :class:`LLTMSequenceFunction`, plain
  ``torch.autograd.Function`` s (the cheapest per call), which keep the backend's saved state
  through autograd's saved-tensor mechanism and compose with ``torch.func`` (``_saved``);
- under ``torch.compile`` the same work runs as the custom operators ``lltm_cupy::lltm_forward``,
  ``lltm_cupy::lltm_backward`` and their sequence twins (``torch.library.custom_op`` with fake and
  autograd registrations), which the compiler treats as opaque: no graph break, and CUDA graphs
  (``mode="reduce-overhead"``) capture them like torch's own kernels.

Whenever autograd will not need a backward (grad mode off, as under ``torch.no_grad`` and
``torch.inference_mode``, or no argument requiring grad), both paths run the backends' forward
only (``keep=False``: nothing computed or kept for a backward, the same bits): eagerly as a plain
call, compiled as the custom operators ``lltm_cupy::lltm_inference`` and
``lltm_cupy::lltm_sequence_inference`` (no autograd registration needed).

Under ``torch.autocast`` the arguments are first cast (differentiably, so gradients reach the
parameters in their own dtype) to the dtype the cell computes in: the autocast dtype on CUDA
(float16 or bfloat16), float32 under CPU autocast (NumPy has no bfloat16). float64 tensors are
left alone, as autocast leaves them. bfloat16 tensors on the CPU are computed in float32 and the
results rounded to bfloat16.

This module holds those decisions (autocast, the forward-only choice, the argument orders of the
backends' gradients) and the forward-only call itself.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import _interop

__all__ = ["autocast_dtype"]


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype the cell computes in under the autocast state of ``device_type``, or None when
    autocast is off there."""
    if device_type not in _interop.DTYPES or not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return dtype
    return torch.float32


def _autocast(tensors):
    device = getattr(tensors[0], "device", None)
    dtype = None if device is None else autocast_dtype(device.type)
    if dtype is None or not all(isinstance(t, Tensor) for t in tensors):
        return tensors  # (the checks name a non-tensor argument)
    return tuple(t if t.dtype == torch.float64 or not t.is_floating_point() else t.to(dtype)
                 for t in tensors)


def _in_float32(tensors) -> bool:
    """bfloat16 tensors all on a device the NumPy backend serves: computed in float32."""
    return (all(isinstance(t, Tensor) and t.dtype == torch.bfloat16 for t in tensors)
            and not _interop.uses_cupy(tensors[0].device))


# LLTMGrads order (d_old_h, d_input, d_weights, d_bias, d_old_cell) <-> forward argument order
# (input, weights, bias, old_h, old_cell).
def _to_argument_order(g):
    return g[1], g[2], g[3], g[0], g[4]


def _to_grads_order(needs):
    return needs[3], needs[0], needs[1], needs[2], needs[4]


def _refuse_double_backward() -> None:
    # The compiled path's backward (the eager Functions' refuses in _saved.BackendBackward, when
    # the gradients are differentiated). The engine runs backward with grad mode on exactly when
    # create_graph=True. Our backward is not differentiable; returning its result would silently
    # give zero second derivatives.
    if torch.is_grad_enabled():
        raise RuntimeError("lltm_cupy.torch: double backward (create_graph=True) is not supported: "
                           "the LLTM backward kernels are not differentiable")


# ---------------------------------------------------------------------------------------------
# Forward only: chosen whenever autograd will not need the backward

def _needs_grad(tensors) -> bool:
    """Whether autograd will record the call: grad mode on (off under ``torch.no_grad`` and
    ``torch.inference_mode``) and some argument requiring grad. Read at trace time under
    torch.compile, where Dynamo guards on both, so the choice costs no graph break."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _transformed(tensors) -> bool:
    """Whether any argument is a ``torch.func`` transform's wrapper (vmap's batched tensor,
    grad's tracking tensor): those go to the autograd Functions, which support grad and refuse
    vmap clearly. Eager calls only."""
    check = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return check is not None and any(check(t) for t in tensors)


def _forward_only(tensors, sequence: bool, fused: bool = False, **kw):
    """The backend's forward with ``keep=False``: nothing computed or kept for a backward."""
    with _interop.backend_call(tensors[0].device) as call:
        run = call.backend.forward_sequence if sequence else call.backend.forward
        if sequence:
            kw.update(_fused_kw(call, fused))
        results = run(*(call.array(t) for t in tensors), keep=False, **call.kw, **kw)
        return tuple(call.tensor(a) for a in results[:-1])



def _backend_name(device: torch.device) -> str:
    return "cupy" if _interop.uses_cupy(device) else "numpy"



def _empty_gates(like: Tensor, batch: int, state: int, *steps: int) -> Tensor:
    """An empty tensor shaped like the backend's saved gate values: the four backward factors
    (..., 4, B, S) from the NumPy backend (CPU), the pre-activations (..., B, 3S) from the CuPy
    backend (CUDA)."""
    if not _interop.uses_cupy(like.device):
        return like.new_empty(*steps, 4, batch, state)
    return like.new_empty(*steps, batch, 3 * state)



def _fused_kw(call, fused: bool) -> dict:
    """The backend keyword of ``fused``: only the GPU backend has the fused sequence kernels."""
    return {"fused": True} if fused and call.backend.__name__.endswith("._cuda") else {}



def eager_only(fn):
    """``fn`` run eagerly under torch.compile (a graph break), as ``torch.compiler.disable(fn)``,
    but without importing torch's compiler at import time or in eager calls (``disable`` imports
    ``torch._dynamo`` and with it sympy and more, which doubled the import of this module):
    ``disable`` is applied only when dynamo, already loaded, traces the call."""
    disabled = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper

