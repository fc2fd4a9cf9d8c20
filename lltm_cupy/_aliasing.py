"""The array API's promise that no array the caller holds is one a later backward reads.

The backends keep what the backward needs with as few copies as they can: on the fixed-length
path the hidden states they save are the outputs' own memory, and the saved inputs are the
caller's ``inputs`` whenever a reshape of them needs no copy (on the GPU, whenever they are
C-contiguous); on the GPU the one-step backward reads ``new_cell`` itself. The torch layer
protects its tensors with autograd's version counters; the array API has none, so a caller who
modified an output in place (``np.tanh(out, out=out)``) or refilled an input buffer (a data
loader reusing its array) between forward and backward would get silently wrong gradients.
These helpers give the caller arrays of its own instead. What the copies cost is measured in
docs/performance.md ("What the array API copies").
"""
from __future__ import annotations

__all__ = ["private_sequence", "private_cell"]


def _address(a) -> int:
    data = a.data      # a memoryview for NumPy, a MemoryPointer for CuPy
    return data.ptr if hasattr(data, "ptr") else a.__array_interface__["data"][0]


def shares_start(a, b) -> bool:
    """Whether ``a`` starts where ``b`` does: a view made by reshape or ascontiguousarray (no
    copy) does, a copy never does (the two are alive at once)."""
    return a.size > 0 and b.size > 0 and _address(a) == _address(b)


def private_sequence(inputs, outputs, saved, copy_outputs: bool = True):
    """After a fixed-length forward_sequence: the outputs as a copy the backward never reads,
    and ``saved.inputs`` replaced by a copy when it is the caller's ``inputs``' memory. The
    variable-length path gathers its inputs and scatters its outputs: nothing to do there."""
    if saved.plan is not None:
        return outputs
    if shares_start(saved.inputs, inputs):
        saved.inputs = saved.inputs.copy()
    return outputs.copy() if copy_outputs else outputs


def private_cell(new_cell, saved):
    """After a GPU forward (one step or the cell alone): ``new_cell`` as a copy, since the GPU
    backward reads the saved one (the CPU backward reads only products it made itself)."""
    return new_cell.copy() if saved.backend == "cupy" else new_cell
