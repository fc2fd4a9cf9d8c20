"""The modules' argument checks and helpers: sizes and flags checked as nn.LSTM checks them, the
input and state checks with messages naming the module, older state-dict keys renamed, and the
TorchScript refusal."""
from __future__ import annotations

from torch import Tensor

def _rename_old_keys(state_dict, prefix: str, renames: dict) -> None:
    """Rename keys of an older layout (old name -> new name) under ``prefix``, in place, before
    ``load_state_dict`` reads them. Called from the modules' ``_load_from_state_dict`` (a method,
    not a registered hook: a closure hook in the instance would make the module unpicklable)."""
    for old, new in renames.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


def _check_int(module: str, name: str, value, minimum: int) -> int:
    """A size argument: an int (not a bool, float or NumPy integer: TypeError, as nn.LSTM) of
    at least ``minimum`` (ValueError)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{module}: {name} should be of type int, got: {type(value).__name__} "
                        f"{value!r}")
    if value < minimum:
        raise ValueError(f"{module}: {name} must be >= {minimum}, got {value}")
    return value


def _check_bool(module: str, name: str, value) -> bool:
    """A flag: a bool (TypeError otherwise, as nn.LSTM's bias and batch_first)."""
    if not isinstance(value, bool):
        raise TypeError(f"{module}: {name} should be of type bool, got: {type(value).__name__} "
                        f"{value!r}")
    return value


def _sizes(name, input_size, hidden_size, input_features, state_size, min_input: int = 1):
    """nn.LSTM's names, or the tutorial's (``input_features``, ``state_size``)."""
    input_size = input_features if input_size is None else input_size
    hidden_size = state_size if hidden_size is None else hidden_size
    if input_size is None or hidden_size is None:
        raise TypeError(f"{name}: input_size and hidden_size are required")
    return (_check_int(name, "input_size", input_size, min_input),
            _check_int(name, "hidden_size", hidden_size, 1))


def _refuse_torchscript(module):
    raise RuntimeError(f"{type(module).__name__} does not support TorchScript (torch.jit.script): "
                       f"its forward runs NumPy or CuPy code, which TorchScript cannot compile. "
                       f"Run the model eagerly or with torch.compile (padded input without "
                       f"graph breaks)")


def _check_input(name, input, dims, features) -> None:
    if not isinstance(input, Tensor):
        hint = (" (PackedSequence goes to LLTM, not to a cell)"
                if type(input).__name__ == "PackedSequence" else "")
        raise TypeError(f"{name}: input must be a torch.Tensor {dims}, got "
                        f"{type(input).__module__}.{type(input).__qualname__}{hint}")
    if input.dim() != dims.count(",") + 1:
        raise ValueError(f"{name}: input must be {dims.count(',') + 1}-D {dims}, got shape "
                         f"{tuple(input.shape)}")
    if input.shape[-1] != features:
        raise ValueError(f"{name}: input has {input.shape[-1]} features, the module expects "
                         f"{features} (input_size)")
    if not input.is_floating_point():
        raise TypeError(f"{name}: input must be a floating-point tensor, got {input.dtype} (as "
                        f"for nn.LSTM, convert it: input.float(), or embed integer tokens first)")


def _check_packed(input, features: int) -> None:
    """A PackedSequence's parts agree: data (N, features) with N the sum of batch_sizes, a 1-D
    non-increasing batch_sizes of positive integers, indices of batch_sizes[0] entries."""
    _check_input("LLTM", input.data, "(rows, input_size)", features)
    sizes = input.batch_sizes
    if (not isinstance(sizes, Tensor) or sizes.dim() != 1 or sizes.is_floating_point()
            or sizes.device.type != "cpu"):
        raise ValueError(f"LLTM: the PackedSequence's batch_sizes must be a 1-D integer CPU tensor "
                         f"(as pack_padded_sequence makes it), got {sizes!r}")
    if len(sizes) and (sizes.min() < 1 or (sizes[1:] > sizes[:-1]).any()):
        raise ValueError(f"LLTM: the PackedSequence's batch_sizes must be positive and "
                         f"non-increasing, got {sizes.tolist()}")
    rows = int(sizes.sum())
    if input.data.shape[0] != rows:
        raise ValueError(f"LLTM: the PackedSequence's data has {input.data.shape[0]} rows, but its "
                         f"batch_sizes {sizes.tolist()} sum to {rows}: build it with "
                         f"pack_padded_sequence / pack_sequence")
    batch = int(sizes[0]) if len(sizes) else 0
    for name in ("sorted_indices", "unsorted_indices"):
        index = getattr(input, name)
        if index is not None and tuple(index.shape) != (batch,):
            raise ValueError(f"LLTM: the PackedSequence's {name} must have shape ({batch},) "
                             f"(batch_sizes[0] sequences), got {tuple(index.shape)}")


def _check_pair(name, state) -> None:
    if isinstance(state, Tensor) or not isinstance(state, (tuple, list)):
        raise TypeError(f"{name}: state must be a tuple (h, c) of two tensors or None, got "
                        f"{'a single Tensor' if isinstance(state, Tensor) else type(state).__qualname__}")
    if len(state) != 2:
        raise ValueError(f"{name}: state must hold two tensors (h, c), got {len(state)}")
    for part, t in zip("hc", state):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {part} of state must be a torch.Tensor, got "
                            f"{type(t).__qualname__}")
