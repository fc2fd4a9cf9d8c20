"""The device work of one cell step as the emulated CuPy logs it (tests/helpers/emulated_cupy.py):
the budget that tests/budgets/test_launch_budget.py holds the array API to and
tests/torch_layer/test_torch_cuda_path.py the torch layer's CUDA path."""

FORWARD = ["kernel:concat", "gemm", "kernel:fwd", "copy"]   # the caller's own new_cell
BACKWARD = ["kernel:bwd", "gemm", "gemm", "gemm", "reduce"]
