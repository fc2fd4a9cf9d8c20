"""The LLTM in torch's own operators, for the tools that record a model rather than run it:
``torch.export`` (strict or not; so also ``torch.onnx.export(dynamo=True)`` and AOTInductor),
``torch.jit.trace`` and ``torch.onnx.export(dynamo=False)``, which traces.

The backends compute through NumPy or CuPy arrays, which no recorder sees: under
``torch.jit.trace`` a backend call would be recorded as constants (the traced inputs' results,
silently wrong on new data), and an exported custom operator needs ``lltm_cupy`` wherever the
program runs. So while one of these tools records, :func:`lltm_cupy.torch.lltm` and
:func:`lltm_cupy.torch.lltm_sequence` compute the cell as the pure-torch reference
(:func:`lltm_cupy.torch.reference.lltm_reference`) instead, and autograd differentiates it:

- non-strict ``torch.export`` with a static sequence length: a loop over the steps, unrolled
  into the graph; with a dynamic one (a ``Dim`` for the steps), and under strict export (where
  Dynamo shows every size as an int): ``torch._higher_order_ops.scan`` over the steps, which
  the ONNX exporter turns into an ONNX ``Scan``;
- ``torch.jit.trace``: the same loop compiled by TorchScript (``torch.jit.script``), which the
  trace calls, so the recorded program runs any number of steps (and the TorchScript ONNX
  exporter writes an ONNX loop).

Either way the recorded program holds torch operators only and runs without ``lltm_cupy``.
Variable lengths (``lengths=``, ``PackedSequence``) are refused there: their layout is planned
on the host from the lengths' values. Anything else that would reach a backend while
``torch.jit.trace`` records raises :func:`refusal` (see ``_functions._refusal``).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["recording", "tracing", "refusal", "sequence"]

_is_exporting = getattr(torch.compiler, "is_exporting", None)
_dynamo_tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def tracing() -> bool:
    """Whether ``torch.jit.trace`` (or the TorchScript ONNX exporter) is recording."""
    return torch.jit.is_tracing()


def _exporting() -> bool:
    """Whether ``torch.export`` (strict or not) is tracing the call: torch's own flag, read
    directly. Not ``torch.compiler.is_exporting()`` inside a Dynamo trace: Dynamo before torch
    2.13 folds that call to True in every trace, torch.compile's included (torch 2.11: the
    compiled layer took the recording path), where reading the flag gives its value."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if flag is not None:
        return bool(flag)
    return _is_exporting is not None and _is_exporting()


def recording() -> bool:
    """Whether ``torch.export`` (strict or not) or ``torch.jit.trace`` is recording the call."""
    return _exporting() or torch.jit.is_tracing()


def refusal(what: str) -> RuntimeError:
    """The error for ``what``, which ``torch.export`` / ``torch.jit.trace`` cannot record."""
    tool = "torch.jit.trace" if tracing() else "torch.export"
    return RuntimeError(
        f"lltm_cupy.torch: {what} cannot be recorded by {tool} (the work runs in NumPy or CuPy, "
        f"which the recording would not see). LLTMCell, LLTM and lltm / lltm_sequence on padded "
        f"tensors record as torch operators under torch.export, torch.onnx.export and "
        f"torch.jit.trace (see docs/deploy.md); run variable-length input eagerly or "
        f"under torch.compile")


@functools.lru_cache(maxsize=None)
def _scripted_loop():
    import warnings

    with warnings.catch_warnings():     # torch.jit.script's deprecation: our use, not the user's
        warnings.simplefilter("ignore", DeprecationWarning)
        from .reference import lltm_sequence_reference

        return torch.jit.script(lltm_sequence_reference)


#: The first torch whose scan differentiates the LLTM correctly: on torch 2.11 an exported
#: program's gradients through scan were wrong (5.4 normalised; forward right), on 2.13 right.
SCAN_GRADIENTS_FROM = (2, 13)


# (worked out at import: a TorchVersion cannot be made inside a Dynamo trace, strict export's)
_SCAN_GRADIENTS_OK = torch.torch_version.TorchVersion(torch.__version__) >= SCAN_GRADIENTS_FROM


def _scan_gradients_ok() -> bool:
    return _SCAN_GRADIENTS_OK


def _scan(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor, c0: Tensor):
    """``lltm_sequence_reference`` as ``torch._higher_order_ops.scan``: a dynamic number of
    steps. Refused where the program could be differentiated on a torch whose scan gives wrong
    gradients (before :data:`SCAN_GRADIENTS_FROM`): grad mode on and an argument requiring grad,
    outside an ONNX export (an ONNX model is never differentiated)."""
    if (torch.is_grad_enabled() and any(t.requires_grad for t in (inputs, weights, bias, h0, c0))
            and not torch.onnx.is_in_onnx_export() and not _scan_gradients_ok()):
        raise RuntimeError(
            f"lltm_cupy.torch: exporting the LLTM with a dynamic number of steps (or by strict "
            f"export) records a scan, and torch {torch.__version__}'s scan returns wrong "
            f"gradients for it (right from torch 2.13): export under torch.no_grad() for "
            f"inference, or by non-strict export with a static number of steps (no Dim for the "
            f"steps) to differentiate the program")
    try:
        from torch._higher_order_ops.scan import scan
    except ImportError as exc:      # torch too old for scan
        raise RuntimeError(
            f"lltm_cupy.torch: exporting the LLTM with a dynamic sequence length needs "
            f"torch._higher_order_ops.scan, which torch {torch.__version__} lacks: export with a "
            f"static sequence length (no Dim for the steps) or use a newer torch") from exc
    from .reference import lltm_reference

    bias = bias.reshape(-1)     # (a (1, 3S) bias fails the ONNX exporter's size-oblivious trace)

    def step(carry, x):
        h, c = lltm_reference(x, weights, bias, *carry)
        return (h, c), h.clone()        # (scan refuses an output that aliases a carry)

    # clones: the initial carries must not alias each other (LLTM passes one zeros tensor as
    # both), and views (a layer's slice of h_0) make scan specialise the batch size
    (h_n, c_n), outputs = scan(step, (h0.clone(), c0.clone()), inputs)
    return outputs, h_n, c_n


def sequence(inputs: Tensor, weights: Tensor, bias: Tensor, h0: Tensor, c0: Tensor):
    """``lltm_sequence`` (one direction, every sequence full length) in torch operators, as the
    recording tool in use needs it (see the module docstring)."""
    if tracing():
        return _scripted_loop()(inputs, weights, bias, h0, c0)
    if _dynamo_tracing() or isinstance(inputs.shape[0], torch.SymInt):
        # (strict export shows every size to us as an int: scan, static or not)
        return _scan(inputs, weights, bias, h0, c0)
    from .reference import lltm_sequence_reference

    return lltm_sequence_reference(inputs, weights, bias, h0, c0)
