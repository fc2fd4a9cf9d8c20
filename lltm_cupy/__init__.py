"""lltm_cupy: the LLTM cell of the PyTorch C++/CUDA extension tutorial, on NumPy and CuPy arrays.

    new_h, new_cell, saved = lltm_cupy.forward(input, weights, bias, old_h, old_cell)
    grads = lltm_cupy.backward(grad_h, grad_cell, saved)
    outputs, h_n, c_n, saved = lltm_cupy.forward_sequence(inputs, weights, bias, h0, c0)
    outputs, h_n, c_n, _ = lltm_cupy.forward_sequence(..., return_saved=False)   # inference
    grads = lltm_cupy.backward_sequence(grad_outputs, grad_h_n, grad_c_n, saved)
    params = lltm_cupy.init_parameters(features, hidden, num_layers, rng=numpy_generator)
    outputs, h_n, c_n, saved = lltm_cupy.forward_layers(inputs, params, lengths=..., dropout=...)
    grads = lltm_cupy.backward_layers(grad_outputs, grad_h_n, grad_c_n, saved)
    new_h, new_cell, saved = lltm_cupy.cell_forward(gates, old_cell)   # the fused cell alone
    lltm_cupy.warmup(dtypes=("float32",))   # compile the GPU kernels now (before CUDA graphs)

NumPy arrays run on the CPU backend, CuPy arrays on the GPU backend (fused CUDA kernels compiled
at run time, cuBLAS GEMMs). ``lltm_cupy.torch`` wraps both for PyTorch. Importing this package
imports neither CuPy nor torch and compiles nothing.
"""
from __future__ import annotations

# The face only: every name is defined in a module below it (the dispatch in _dispatch, which
# the one-step cell and the whole models import too), none of which imports from here.
from ._cell import cell_backward, cell_forward
from ._dispatch import backward, backward_sequence, forward, forward_sequence, warmup
from ._layers import backward_layers, forward_layers
from ._parameters import init_parameters
from ._types import (LLTMCellGrads, LLTMCellSaved, LLTMGrads, LLTMLayersGrads, LLTMLayersSaved,
                     LLTMSaved, LLTMSequenceGrads, LLTMSequenceSaved)

__all__ = ["forward", "backward", "forward_sequence", "backward_sequence", "forward_layers",
           "backward_layers", "init_parameters", "cell_forward", "cell_backward", "warmup",
           "LLTMGrads", "LLTMSaved", "LLTMSequenceGrads", "LLTMSequenceSaved", "LLTMLayersGrads",
           "LLTMLayersSaved", "LLTMCellGrads", "LLTMCellSaved", "__version__"]
__version__ = "0.1.0"
