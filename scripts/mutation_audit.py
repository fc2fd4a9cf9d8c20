"""Mutation audit: put small, realistic bugs into a temporary copy of the repository, one at a
time, run the tests each one concerns, and report which bugs no test (or too few tests) caught.

    python scripts/mutation_audit.py                    # every mutant (slow: tens of minutes)
    python scripts/mutation_audit.py --list             # the mutants, nothing run
    python scripts/mutation_audit.py --only dropout-after-last-layer stream-null
    python scripts/mutation_audit.py --limit 5 --markdown audit.md

Run from a clone with the README's test set-up (its virtual environment active). The copy holds
the files git tracks plus untracked ones it does not ignore; the tests run there with the copy
first on PYTHONPATH, so its lltm_cupy (and its cuda_src) is the one tested. First a baseline
run of every selected test file on the unmodified copy: a test that fails there is left out of
every mutant's count. Then, per mutant, ``python -m pytest`` on its files; a failing test is a
"kill". A mutant is reported as

- survived: no test failed;
- weak: fewer than two *value* tests failed (tests that count operations, check an error
  message or compile the source are not value tests: see ``NOT_VALUE_TESTS``; for a removed
  argument check, which only error tests can see, every failing test counts);
- killed: two or more value tests failed (the run stops after ``--maxfail`` failures);
- not applied: its text is no longer in the file (the code moved on: update the mutant).

Exit status 1 if a mutant survived or was weak, 2 if one did not apply.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Test files or node-id prefixes whose failures do not count as value checks: they count
#: device operations, check error types and messages, compile the source, or gate the suite.
NOT_VALUE_TESTS = (
    "tests/budgets/test_launch_budget.py",
    "tests/torch_layer/test_torch_cuda_path.py::test_torch_layer_adds_no_device_work",
    "tests/torch_layer/test_torch_cuda_path.py::test_every_launch_and_gemm_runs_on_torchs_current_stream",
    "tests/torch_layer/test_torch_cuda_path.py::test_the_emulator_refuses_work_off_torchs_stream",
    "tests/kernels/test_cuda_compile.py",
    "tests/array_api/test_bad_input.py",
    "tests/array_api/test_errors.py",
    "tests/scripts/test_ci_gate.py",
)

#: (tests/array_api/test_accuracy.py last: its property-based tests shrink every failure, slowly)
KERNEL_TESTS = ("tests/kernels/test_host_kernels.py", "tests/array_api/test_backends.py",
                "tests/array_api/test_array_sequence.py",
                "tests/torch_layer/test_torch_cuda_path.py", "tests/budgets/test_launch_budget.py",
                "tests/array_api/test_accuracy.py")
#: the one-block kernels (lltm_fused.cu): the cases every variant shares, the one-block module's
FUSED_ONE_BLOCK = ("tests/kernels/test_fused_variants.py", "tests/kernels/test_fused_one_block.py")
FUSED_TESTS = FUSED_ONE_BLOCK + ("tests/kernels/test_host_kernels.py",
                                 "tests/torch_layer/test_torch_layers.py")
#: lltm_fused.cu's dot products, which the cluster kernels (lltm_fused_cluster.cu) and their
#: group variant call too
FUSED_DOT_TESTS = FUSED_TESTS + ("tests/kernels/test_fused_cluster_sizes.py",
                                 "tests/kernels/test_fused_cluster_occupancy.py",
                                 "tests/kernels/test_fused_group_exchange.py")
#: lltm_fused.cu's element steps (the rounding around the recurrent product), which every fused
#: variant calls, the tensor-core kernels (lltm_fused_mma.cu) included
FUSED_ALL_TESTS = FUSED_DOT_TESTS + ("tests/kernels/test_fused_mma_geometry.py",)
NUMPY_TESTS = ("tests/array_api/test_backends.py", "tests/array_api/test_array_sequence.py",
               "tests/array_api/test_array_lengths.py",
               "tests/torch_layer/test_torch.py", "tests/torch_layer/test_torch_sequence.py")
CUPY_TESTS = ("tests/array_api/test_backends.py", "tests/array_api/test_array_sequence.py",
              "tests/array_api/test_array_lengths.py",
              "tests/torch_layer/test_torch_cuda_path.py", "tests/budgets/test_launch_budget.py",
              "tests/kernels/test_bfloat16.py")
LAYER_TESTS = ("tests/torch_layer/test_torch_layers.py", "tests/torch_layer/test_torch_sequence.py",
               "tests/torch_layer/test_torch_cuda_path.py")
#: forward only (keep=False): against the training forward's bits, on both backends
INFERENCE_TESTS = ("tests/array_api/test_array_inference.py",
                   "tests/torch_layer/test_torch_inference.py")
#: the array API's whole models (forward_layers / backward_layers)
ARRAY_LAYER_TESTS = ("tests/array_api/test_array_layers.py",
                     "tests/torch_layer/test_torch_array_one_model.py")
#: the torch layer's pointer path for variable lengths and the group variant
POINTER_TESTS = ("tests/torch_layer/test_torch_pointer_path.py",
                 "tests/torch_layer/test_torch_cuda_path.py",
                 "tests/torch_layer/test_torch_layers.py")
#: the torch LLTM module (state dicts, batch_first, PackedSequence)
MODULE_TESTS = ("tests/torch_layer/test_torch_layers.py", "tests/torch_layer/test_dropin.py",
                "tests/torch_layer/test_torch_sequence.py",
                "tests/torch_layer/test_torch_array_one_model.py")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple
    what: str
    nth: int = 0        # which occurrence of ``old`` (0: the text must occur exactly once)
    values: bool = True     # False: a bug only error tests can see (a check removed)


MUTANTS = [
    # ------------------------------------------------------------------ kernels (cuda_src)
    Mutant("kernel-input-gate-from-z-o", "cuda_src/lltm.cu",
           "lltm_sigmoid(tr::load(zi_t), &input_gate, &unused);",
           "lltm_sigmoid(tr::load(zo_t), &input_gate, &unused);",
           KERNEL_TESTS, "forward kernel: the input gate from the output gate's pre-activation"),
    Mutant("kernel-drop-grad-cell", "cuda_src/lltm.cu",
           "const A d_new_cell = d_tanh * (output_gate * gh) + gc;",
           "const A d_new_cell = d_tanh * (output_gate * gh);",
           KERNEL_TESTS, "backward kernel: grad_cell dropped from d_new_cell"),
    Mutant("kernel-d-elu-branches", "cuda_src/lltm.cu",
           "return z > A(0) ? A(1) : lltm_exp(z);", "return z > A(0) ? lltm_exp(z) : A(1);",
           KERNEL_TESTS, "elu' with its branches swapped"),
    Mutant("kernel-d-sigmoid", "cuda_src/lltm.cu", "*ds = e * r * r;", "*ds = e * r;",
           KERNEL_TESTS, "sigmoid' = e / (1 + e) instead of e / (1 + e)^2"),
    Mutant("kernel-bf16-truncates", "cuda_src/lltm.cu",
           "h.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);",
           "h.bits = (unsigned short)(u >> 16);",
           KERNEL_TESTS + ("tests/kernels/test_bfloat16.py",), "bfloat16 store truncates"),
    Mutant("kernel-bf16-ties-away", "cuda_src/lltm.cu",
           "h.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);",
           "h.bits = (unsigned short)((u + 0x8000u) >> 16);",
           KERNEL_TESTS + ("tests/kernels/test_bfloat16.py",),
           "bfloat16 store rounds ties away from zero, not to even"),
    Mutant("kernel-f64-factor-1e-13", "cuda_src/lltm.cu",
           "const A d_tanh_q = A(4) * e2 / (one_e2 * one_e2);",
           "const A d_tanh_q = A(4.0000000000004) * e2 / (one_e2 * one_e2);",
           KERNEL_TESTS, "tanh' 1e-13 too large (float64 only: the factor rounds to 4 in float)"),
    Mutant("kernel-d-tanh-above-1", "cuda_src/lltm.cu",
           "const A d_tanh = d_tanh_q > A(1) ? A(1) : d_tanh_q;", "const A d_tanh = d_tanh_q;",
           KERNEL_TESTS, "tanh' as rounded, 1 + 1 ulp near c = 0 (d_new_cell overflows at a "
           "grad_h near the largest finite value)"),
    Mutant("kernel-grid-stride", "cuda_src/lltm.cu",
           "i += (I)blockDim.x * gridDim.x) {\n    const I b = i / S;\n    const I s = i - b * S;\n"
           "    T* g",
           "i += (I)blockDim.x) {\n    const I b = i / S;\n    const I s = i - b * S;\n    T* g",
           KERNEL_TESTS, "forward kernel strides by one block, not the grid"),
    # lltm_fused.cu's dot products are the cluster and group kernels' too, and its element
    # steps every variant's: all their tests run
    Mutant("fused-recurrent-weight-row", "cuda_src/lltm_fused.cu",
           "    part[1][l] += tr::load(wk[gate]) * hk;",
           "    part[1][l] += tr::load(wk[2 * gate]) * hk;",
           FUSED_DOT_TESTS, "fused sequence kernels (one block, cluster, group): the output "
           "gate's recurrent product uses the candidate's weights"),
    Mutant("fused-partial-sum-dropped", "cuda_src/lltm_fused.cu",
           "      run[q] += (part[q][0] + part[q][1]) + (part[q][2] + part[q][3]);",
           "      run[q] += (part[q][0] + part[q][1]) + part[q][2];",
           FUSED_DOT_TESTS, "fused sequence kernels (one block, cluster, group): one of a "
           "chunk's four partial sums left out of every recurrent dot product (h and d_h)"),
    Mutant("fused-remainder-term-skipped", "cuda_src/lltm_fused.cu",
           "    if (k + l < terms) add(k + l, part, l);",
           "    if (k + l < terms - 1) add(k + l, part, l);",
           FUSED_DOT_TESTS, "fused sequence kernels (one block, cluster, group): the last "
           "recurrent term skipped when the terms are not a multiple of 4"),
    Mutant("fused-step-product-of-another-gate", "cuda_src/lltm_fused.cu",
           "  const T go = tr::store(acc[1] + tr::load(p_o));",
           "  const T go = tr::store(acc[0] + tr::load(p_o));",
           FUSED_ALL_TESTS, "fused sequence forward (every variant, tensor cores too): the "
           "output gate's pre-activation adds the input gate's recurrent product"),
    Mutant("fused-grad-out-dropped", "cuda_src/lltm_fused.cu",
           "tr::load(tr::store(dh + sv.go));", "tr::load(tr::store(dh));",
           FUSED_ALL_TESTS, "fused sequence backward (every variant, tensor cores too): the "
           "outputs' gradient left out of the incoming d_h"),
    Mutant("fused-drop-grad-c-n", "cuda_src/lltm_fused.cu",
           "dc_buf[i] = has_grad_c_n ? tr::load(grad_c_n[src]) : A(0);",
           "dc_buf[i] = has_grad_c_n ? A(0) * tr::load(grad_c_n[src]) : A(0);",
           FUSED_TESTS, "fused sequence backward: the final cell state's gradient dropped"),
    Mutant("fused-prefetch-next-bias", "cuda_src/lltm_fused.cu",
           "        qb_i = bias[s_n];", "        qb_i = b0_i;",
           FUSED_TESTS, "fused sequence forward: a thread's next element in the same step gets "
           "its first element's input-gate bias (several elements per thread)"),
    Mutant("fused-prefetch-next-step-row", "cuda_src/lltm_fused.cu",
           "        row_n = edge + row0 + walk.r0;", "        row_n = first + row0 + walk.r0;",
           FUSED_TESTS, "fused sequence forward: the next step's input projection prefetched "
           "from the current step's rows"),
    Mutant("fused-prefetch-idle-thread", "cuda_src/lltm_fused.cu",
           "    if ((int)threadIdx.x >= m && (int)threadIdx.x < m_prev) {",
           "    if (false) {",
           FUSED_TESTS, "fused sequence backward: a thread with no element at step t does not "
           "load its element of step t - 1 (rows that end at different steps)"),
    # --------------------------------------------------------------- NumPy backend
    Mutant("numpy-drop-grad-cell", "lltm_cupy/_numpy/elementwise.py",
           "        add(part, d_cell, d_cell)           # d_new_cell\n",
           "        copyto(d_cell, part)\n",
           NUMPY_TESTS, "NumPy backward: grad_cell dropped from d_new_cell"),
    Mutant("numpy-sigmoid-wrong-gate", "lltm_cupy/_numpy/elementwise.py",
           "np.multiply(new_h, scratch[..., 1, :, :], factors[..., 1, :, :])",
           "np.multiply(new_h, scratch[..., 0, :, :], factors[..., 1, :, :])",
           NUMPY_TESTS, "NumPy: the output gate's sigmoid' uses sigmoid(-z_i)"),
    Mutant("numpy-bptt-overwrites", "lltm_cupy/_numpy/sequence.py",
           "            addmm_(g_prev, d_op, w_h_op)",
           "            g_prev[...] = 0\n            addmm_(g_prev, d_op, w_h_op)",
           NUMPY_TESTS, "NumPy sequence backward: the recurrent gradient replaces grad_outputs"),
    Mutant("numpy-factor-group-h-shifted", "lltm_cupy/_numpy/sequence.py",
           "h[first + a: first + b].reshape(k, n, state)",
           "h[first + a - n: first + b - n].reshape(k, n, state)",
           NUMPY_TESTS, "NumPy sequence forward: a group's factors take the previous steps' h"),
    Mutant("numpy-d-weights-h-shifted", "lltm_cupy/_numpy/sequence.py",
           "mm.into(flat.T, hs[:-1].reshape(rows, state), d_weights[:, :state])",
           "mm.into(flat.T, hs[1:].reshape(rows, state), d_weights[:, :state])",
           NUMPY_TESTS, "NumPy sequence d_weights: h_t in place of h_(t-1)"),
    # ---------------------------------------------------------------- CuPy backend
    Mutant("cupy-f16-d-bias-in-f16", "lltm_cupy/_cuda/gemm.py",
           "return d_gates.sum(axis=0, dtype=np.float32).astype(np.float16).reshape(bias_shape)",
           "return d_gates.sum(axis=0).reshape(bias_shape)",
           CUPY_TESTS, "float16 d_bias accumulated in float16"),
    Mutant("cupy-recurrent-gemm-overwrites", "lltm_cupy/_cuda/sequence.py",
           "hs, weights[:, :state].T, gates, accumulate=True)",
           "hs, weights[:, :state].T, gates, accumulate=False)",
           CUPY_TESTS, "CuPy sequence: the recurrent GEMM overwrites the input projection"),
    Mutant("cupy-d-h0-last-step", "lltm_cupy/_cuda/sequence.py", "d_h0 = gemm(d_gates[0], w_h,",
           "d_h0 = gemm(d_gates[-1], w_h,", CUPY_TESTS,
           "CuPy sequence: d_h0 from the last step's d_gates"),
    Mutant("cupy-no-16bit-math-mode", "lltm_cupy/_cuda/gemm.py",
           "            self._mode = self._restore | _DISALLOW_REDUCED_PRECISION\n",
           "            self._mode = self._restore\n",
           CUPY_TESTS + ("tests/kernels/test_warmup.py",),
           "16-bit GEMMs allow reduced-precision reductions"),
    # ------------------------------------------------------------------- packing
    Mutant("packing-reverse-index", "lltm_cupy/_packing.py",
           "t_index = lengths[b_index] - 1 - tau if reverse else tau",
           "t_index = steps - 1 - tau if reverse else tau",
           ("tests/array_api/test_array_lengths.py", "tests/torch_layer/test_torch_layers.py",
            "tests/array_api/test_array_layers.py"),
           "reverse direction starts at the padded end, not each sequence's own last step"),
    # -------------------------------------------------------------------- torch layer
    Mutant("dropout-after-last-layer", "lltm_cupy/torch/_lltm_module.py",
           "and k < self.num_layers - 1:", "and self.num_layers > 1:",
           LAYER_TESTS, "LLTM applies dropout after the last layer too"),
    Mutant("stream-null", "lltm_cupy/torch/_interop.py",
           "    return _cupy_stream(index, current_raw_stream(index))",
           "    return _cupy_stream(index, 0)",
           ("tests/torch_layer/test_torch_cuda_path.py", "tests/torch_layer/test_torch_layers.py"),
           "CuPy work on the null stream, not torch's current stream"),
    Mutant("torch-packed-h0-not-sorted", "lltm_cupy/torch/_cuda_sequence.py",
           "h0s, c0s = _permuted(h0, d.perm), _permuted(c0, d.perm)",
           "h0s, c0s = h0.contiguous(), c0.contiguous()",
           POINTER_TESTS, "torch layer, variable lengths: h0, c0 read in the caller's order, "
           "not the sorted one"),
    Mutant("torch-rows-read-at-out-offset", "lltm_cupy/torch/_cuda_packed.py",
           "addmm_(gates.narrow(0, j, n), hs.narrow(0, i, n), w_h_t)",
           "addmm_(gates.narrow(0, j, n), hs.narrow(0, j, n), w_h_t)",
           POINTER_TESTS + ("tests/torch_layer/test_gpu_variable_length.py",),
           "a packed step's recurrent GEMM by torch reads the rows it writes, not the previous "
           "step's"),
    Mutant("torch-packed-grad-h-n-dropped", "lltm_cupy/torch/_cuda_packed.py",
           "    if grad_h_n is not None and ended and rows:",
           "    if False:", POINTER_TESTS,
           "torch layer, variable lengths backward: the final hidden state's gradient dropped"),
    Mutant("torch-packed-outputs-copied", "lltm_cupy/torch/_cuda_packed.py",
           "outputs = unpack_rows(hs, plan, xp,", "outputs = unpack_rows(hs.clone(), plan, xp,",
           POINTER_TESTS, "torch layer, PackedSequence: the outputs a copy of the hidden states "
           "the backward reads (an in-place change of them goes unseen)"),
    Mutant("torch-plan-stream-not-recorded", "lltm_cupy/torch/_interop.py",
           "                    record_stream(a, index, stream)\n",
           "                    pass\n", POINTER_TESTS,
           "a plan's index tensors read on a side stream without record_stream"),
    Mutant("torch-group-exchange-half", "lltm_cupy/torch/_interop.py",
           "exchange = like.new_empty(elements,", "exchange = like.new_empty(elements // 2,",
           POINTER_TESTS, "the group variant's exchange buffer (a torch tensor) half its size"),
    Mutant("stream-cached", "lltm_cupy/torch/_interop.py",
           "    return _cupy_stream(index, current_raw_stream(index))",
           "    return _cupy_stream(index, _torch_stream.__dict__.setdefault("
           "'handle', current_raw_stream(index)))",
           ("tests/torch_layer/test_torch_cuda_path.py", "tests/torch_layer/test_torch_layers.py"),
           "torch's stream read once and cached across calls"),
    Mutant("h-n-directions-swapped", "lltm_cupy/torch/_lltm_module.py",
           "                h_n.append(h)\n", "                h_n.insert(len(h_n) - d, h)\n",
           LAYER_TESTS, "bidirectional h_n: reverse direction stored before the forward one"),
    Mutant("autograd-grads-order", "lltm_cupy/torch/_functions.py",
           "        d_old_h, d_input = d_x[:, :state], d_x[:, state:]",
           "        d_input, d_old_h = d_x[:, :state], d_x[:, state:]",
           ("tests/torch_layer/test_torch.py", "tests/torch_layer/test_torch_sequence.py"),
           "LLTMFunction returns d_old_h as the input's gradient and vice versa"),
    Mutant("second-derivative-step-dropped", "lltm_cupy/torch/_functions.py",
           "    if not torch.is_grad_enabled():",
           "    if True:",
           ("tests/torch_layer/test_second_derivatives.py",
            "tests/torch_layer/test_saved_tensors.py"),
           "one step's backward under create_graph=True by the backend (detached: second "
           "derivatives silently zero)"),
    Mutant("second-derivative-sequence-dropped", "lltm_cupy/torch/_sequence_function.py",
           "    if not torch.is_grad_enabled():",
           "    if True:",
           ("tests/torch_layer/test_second_derivatives.py",
            "tests/torch_layer/test_saved_tensors.py"),
           "a sequence's backward under create_graph=True by the backend (detached: second "
           "derivatives silently zero)"),
    Mutant("second-derivative-d-tanh", "lltm_cupy/torch/reference.py",
           "d_tanh = 4 * torch.sigmoid(2 * new_cell) * torch.sigmoid(-2 * new_cell)",
           "d_tanh = 4 * torch.sigmoid(2 * new_cell) * torch.sigmoid(2 * new_cell)",
           ("tests/torch_layer/test_second_derivatives.py",),
           "the differentiable backward's tanh'(c) with sigmoid(2c) twice"),
    # ------------------------------------------------- forward only (keep=False) paths
    Mutant("torch-forward-only-input-ignored", "lltm_cupy/torch/_ops.py",
           "    return _grad_on() and (a.requires_grad or b.requires_grad or c.requires_grad",
           "    return _grad_on() and (b.requires_grad or c.requires_grad",
           INFERENCE_TESTS + ("tests/torch_layer/test_torch.py",
                              "tests/torch_layer/test_torch_sequence.py"),
           "torch layer: forward only chosen when only the input requires grad (frozen "
           "parameters: the input gets no gradient)"),
    # ------------------------------- the torch layer recorded (torch.export, jit.trace, ONNX)
    Mutant("export-scan-carries-swapped", "lltm_cupy/torch/_export.py",
           "h, c = lltm_reference(x, weights, bias, *carry)",
           "h, c = lltm_reference(x, weights, bias, carry[1], carry[0])",
           ("tests/torch_layer/test_deploy.py",),
           "torch.export with a dynamic number of steps: the scan passes c as h and h as c"),
    Mutant("trace-loop-not-scripted", "lltm_cupy/torch/_export.py",
           "return _scripted_loop()(inputs, weights, bias, h0, c0)",
           "return __import__('lltm_cupy.torch.reference', fromlist=['_'])"
           ".lltm_sequence_reference(inputs, weights, bias, h0, c0)",
           ("tests/torch_layer/test_deploy.py",),
           "jit.trace records the Python loop: the trace replays the traced number of steps only"),
    Mutant("recording-under-compile", "lltm_cupy/torch/_export.py",
           "return _exporting() or torch.jit.is_tracing()",
           "return torch.compiler.is_compiling() or torch.jit.is_tracing()",
           ("tests/torch_layer/test_deploy.py",) + INFERENCE_TESTS,
           "torch.compile takes the recording path: the reference cell, not the library's kernels"),
    Mutant("exporting-by-is-exporting", "lltm_cupy/torch/_export.py",
           'flag = getattr(torch.compiler, "_is_exporting_flag", None)', "flag = None",
           ("tests/torch_layer/test_deploy.py",),
           "export told by torch.compiler.is_exporting(), which Dynamo before torch 2.13 folds "
           "to True under torch.compile too"),
    Mutant("numpy-packed-h-n-sorted", "lltm_cupy/_numpy/packed.py",
           "h_n[plan.perm], c_n[plan.perm] = h_sorted, c_sorted",
           "h_n[:], c_n[:] = h_sorted, c_sorted",
           INFERENCE_TESTS + ("tests/array_api/test_array_layers.py",),
           "NumPy variable lengths: h_n, c_n left in the sorted (longest first) order"),
    Mutant("numpy-packed-forward-only-reverse-time", "lltm_cupy/_numpy/packed.py",
           "outputs[t_index[at], b_index[at]] = block",
           "outputs[np.repeat(np.arange(a, b), sizes[a:b]), b_index[at]] = block",
           INFERENCE_TESTS + ("tests/array_api/test_array_layers.py",),
           "NumPy forward only, variable lengths: reverse outputs written at step tau, not at "
           "each sequence's own time L - 1 - tau"),
    Mutant("cupy-packed-forward-only-h-n-step-early", "lltm_cupy/_cuda/packed.py",
           "copy(hn_at + nxt * row, h_out + nxt * row,",
           "copy(hn_at + nxt * row, h_at + h_rows[tau - 1] * row + nxt * row,",
           INFERENCE_TESTS + ("tests/array_api/test_array_layers.py",),
           "CuPy forward only, variable lengths: a sequence's h_n is its state before its last "
           "step"),
    Mutant("cupy-packed-forward-only-scatter-wrap", "lltm_cupy/_cuda/packed.py",
           "row, first = 0, offsets[tau]", "row, first = 0, offsets[tau - 1]",
           INFERENCE_TESTS,
           "CuPy forward only, unsorted or reverse: after the hidden-state buffer is scattered "
           "and refilled, its rows scattered to the previous step's places"),
    Mutant("cupy-packed-forward-only-direct-reverse", "lltm_cupy/_cuda/packed.py",
           "if d.perm is None and not plan.reverse:", "if d.perm is None:",
           INFERENCE_TESTS + ("tests/array_api/test_array_layers.py",),
           "CuPy forward only, sorted lengths: the reverse direction's outputs written straight "
           "at outputs[tau] too"),
    Mutant("fused-forward-only-cell-not-carried", "lltm_cupy/_cuda/fused.py",
           "h_prev, c_prev = h_last, c_last", "h_prev = h_last",
           FUSED_ONE_BLOCK + INFERENCE_TESTS,
           "fused forward only: a block of steps starts from c0, not the previous block's "
           "final cell"),
    # ---------------------------------------------------- the CPU sequence loops' GEMMs
    Mutant("numpy-gemm-accumulate-overwrites", "lltm_cupy/_numpy/gemm.py",
           "np.add(out, np.matmul(a, b), out)", "np.matmul(a, b, out=out)",
           NUMPY_TESTS, "NumpyGemm.addmm_: out = a @ b instead of out += a @ b"),
    Mutant("numpy-step-drops-projection", "lltm_cupy/_numpy/sequence.py",
           "            add(z, p, z)\n", "            pass\n",
           NUMPY_TESTS, "NumPy sequence forward: z = h @ W_h, the step's input projection "
           "dropped"),
    Mutant("numpy-packed-ring-front-stale", "lltm_cupy/_numpy/sequence.py",
           "                h[: n_t[-1]] = h[starts[-1]: starts[-1] + n_t[-1]]\n",
           "                pass\n",
           INFERENCE_TESTS,
           "NumPy forward only, outputs scattered block by block: a block's first step reads the "
           "rows the previous block started from, not its last step's"),
    Mutant("numpy-packed-drops-final-cell-grad", "lltm_cupy/_numpy/packed.py",
           "d_c = _backward_loop(grad_h, None if gcn is None else gcn[:first], factors, flat,",
           "d_c = _backward_loop(grad_h, None, factors, flat,",
           NUMPY_TESTS, "NumPy variable lengths backward: grad_c_n does not enter each sequence "
           "at its last step"),
    Mutant("torch-gemm-project-drops-bias", "lltm_cupy/torch/_torch_gemm.py",
           "torch.baddbmm(torch.from_numpy(bias).reshape(3, 1, -1).expand(3, rows, -1),\n"
           "                      x.expand(3, *x.shape), w, out=out)",
           "torch.bmm(x.expand(3, *x.shape), w, out=out)",
           ("tests/torch_layer/test_torch.py", "tests/torch_layer/test_torch_sequence.py",
            "tests/torch_layer/test_torch_layers.py"),
           "TorchGemm.project_gates: the bias left out of the input projection"),
    Mutant("torch-gemm-blocks-ignore-gaps", "lltm_cupy/torch/_torch_gemm.py",
           "        pieces += (s - at, n)\n        at = s + n\n",
           "        pieces += (0, n)\n        at += n\n",
           ("tests/torch_layer/test_torch.py", "tests/torch_layer/test_torch_sequence.py",
            "tests/torch_layer/test_torch_layers.py"),
           "TorchGemm, variable lengths: each step's rows taken right after the previous "
           "step's, the rows of the sequences that ended skipped over"),
    Mutant("onednn-gemm-project-drops-bias", "lltm_cupy/torch/_torch_gemm.py",
           'product = _linear(x, w, torch.from_numpy(bias).reshape(-1), "none", [], "")',
           'product = _linear(x, w, None, "none", [], "")',
           ("tests/torch_layer/test_cpu_gemm_engines.py",),
           "OneDnnGemm.project_gates: the bias left out of the input projection"),
    Mutant("onednn-gemm-recurrent-grad-overwrites", "lltm_cupy/torch/_torch_gemm.py",
           'out.copy_(_linear_add(a, out, b, None, "add"))',
           'out.copy_(_linear(a, b, None, "none", [], ""))',
           ("tests/torch_layer/test_cpu_gemm_engines.py",),
           "OneDnnGemm.addmm_: a step's recurrent gradient written over the outputs' gradient "
           "instead of added to it"),
    Mutant("onednn-gemm-gates-not-transposed", "lltm_cupy/torch/_torch_gemm.py",
           'out.copy_(_linear(h, w, None, "none", [], "").view(h.shape[0], 3, -1).transpose(0, 1))',
           'out.copy_(_linear(h, w, None, "none", [], "").view(3, h.shape[0], -1))',
           ("tests/torch_layer/test_cpu_gemm_engines.py",),
           "OneDnnGemm.bmm: the (rows, 3S) product read as gate-major without the transpose"),
    Mutant("onednn-cell-drops-bias", "lltm_cupy/torch/_functions.py",
           'product = _torch_gemm._linear(X, w, bias.reshape(-1), "none", [], "")',
           'product = _torch_gemm._linear(X, w, None, "none", [], "")',
           ("tests/torch_layer/test_cpu_gemm_engines.py",),
           "LLTMCell on oneDNN: the bias left out of the step's gate pre-activations"),
    Mutant("onednn-cell-gates-not-transposed", "lltm_cupy/torch/_functions.py",
           "z.copy_(product.view(batch, 3, state).transpose(0, 1))",
           "z.copy_(product.view(3, batch, state))",
           ("tests/torch_layer/test_cpu_gemm_engines.py",),
           "LLTMCell on oneDNN: the (B, 3S) product read as gate-major without the transpose"),
    # ------------------------------------------------------- whole models, the packing
    Mutant("layers-backward-mask-dropped", "lltm_cupy/_layers.py",
           "            d_x = d_x * saved.masks[k - 1]\n", "            pass\n",
           ARRAY_LAYER_TESTS, "backward_layers: the gradient not multiplied by the dropout mask "
           "of the layer's input"),
    Mutant("layers-directions-concatenated-reversed", "lltm_cupy/_layers.py",
           "x = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=-1)",
           "x = outs[0] if len(outs) == 1 else xp.concatenate(outs[::-1], axis=-1)",
           ARRAY_LAYER_TESTS, "forward_layers: a layer above the first takes the reverse "
           "direction's outputs first"),
    Mutant("packing-step-blocks-skip-step", "lltm_cupy/_packing.py",
           "            tau0 = tau - 1\n", "            tau0 = tau\n",
           ("tests/array_api/test_array_inference.py", "tests/array_api/test_array_lengths.py",
            "tests/array_api/test_array_layers.py"),
           "step_blocks: the next block starts one step late (a step at each block boundary "
           "never runs)"),
    Mutant("fused-packed-h0-not-sorted", "lltm_cupy/_cuda/fused.py",
           "h_prev, c_prev = h0[perm], c0[perm]", "h_prev, c_prev = h0, c0",
           FUSED_ONE_BLOCK,
           "fused, variable lengths: h0, c0 read in the caller's order, not the sorted one"),
    # ----------------------------------------------------------------- the torch LLTM
    Mutant("module-packed-h0-unsorted-indices", "lltm_cupy/torch/_lltm_module.py",
           "order = input.sorted_indices", "order = input.unsorted_indices",
           MODULE_TESTS, "LLTM, unsorted PackedSequence: h_0, c_0 permuted by unsorted_indices, "
           "not sorted_indices"),
    Mutant("module-batch-first-reshape", "lltm_cupy/torch/_module_args.py",
           "input.transpose(0, 1) if batch_first else input",
           "input.reshape(input.shape[1], input.shape[0], -1) if batch_first else input",
           MODULE_TESTS, "LLTM, batch_first: the input reshaped to (steps, batch), not "
           "transposed"),
    Mutant("module-old-keys-without-prefix", "lltm_cupy/torch/_module_args.py",
           "if prefix + old in state_dict and prefix + new not in state_dict:",
           "if old in state_dict and new not in state_dict:",
           MODULE_TESTS, "state dicts of the tutorial's names (weights, bias) renamed only at "
           "the top level, not inside a parent module"),
    # --------------------------------------------------------------- checks, reference
    Mutant("check-dtypes-removed", "lltm_cupy/_checks.py",
           "    if any(d != first for d in dtypes.values()):",
           "    if False:",
           ("tests/array_api/test_bad_input.py", "tests/array_api/test_errors.py",
            "tests/torch_layer/test_torch.py"),
           "the same-dtype check removed (a mixed-dtype call computes silently)",
           values=False),
    Mutant("reference-d-tanh", "lltm_cupy/reference.py",
           "    return (1.0 / np.cosh(z)) ** 2", "    return 1.0 / np.cosh(z)",
           ("tests/array_api/test_finite_differences.py", "tests/array_api/test_backends.py"),
           "the reference's tanh' = sech instead of sech^2 (the spec itself wrong)"),
]


def copy_repository(dest: Path) -> None:
    """Copy the files git tracks plus untracked ones it does not ignore."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, check=True,
                             capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listing):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def apply(copy: Path, mutant: Mutant) -> str | None:
    """Apply ``mutant`` to ``copy``; return the original text, or None if it does not apply."""
    path = copy / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count == 0 or (mutant.nth == 0 and count != 1) or mutant.nth >= max(count, 1):
        return None
    start = -1
    for _ in range(mutant.nth + 1):
        start = text.index(mutant.old, start + 1)
    path.write_text(text[:start] + mutant.new + text[start + len(mutant.old):])
    return text


def run_tests(copy: Path, tests, timeout: float, maxfail: int = 0):
    """Run pytest on ``tests`` in ``copy``: (failed node ids, outcome, seconds)."""
    report = copy / ".audit-junit.xml"
    report.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(copy)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
        PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "-p", "no:randomly", f"--junitxml={report}",
                               *([f"--maxfail={maxfail}"] if maxfail else []), *tests], cwd=copy,
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return set(), "timeout", time.monotonic() - start
    seconds = time.monotonic() - start
    failed = set()
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                module = case.get("classname", "").replace(".", "/")
                failed.add(f"{module}.py::{case.get('name')}")
    if proc.returncode not in (0, 1) and not failed:
        return {f"(pytest exit {proc.returncode}: {proc.stdout.strip().splitlines()[-1:]})"}, \
            "error", seconds
    return failed, "ran", seconds


def is_value_test(node: str) -> bool:
    return not node.startswith(NOT_VALUE_TESTS) and not node.startswith("(")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--limit", type=int, help="run the first N (selected) mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds per pytest run (default 1200); a timeout is not a kill")
    parser.add_argument("--maxfail", type=int, default=10,
                        help="stop a mutant's run after this many failures (default 10; 0: run "
                             "every test); the table then shows 'N+'")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args(argv)

    mutants = MUTANTS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTANTS}
        if unknown:
            parser.error(f"unknown mutant(s): {', '.join(sorted(unknown))}")
        mutants = [m for m in MUTANTS if m.name in args.only]
    if args.limit is not None:
        mutants = mutants[:args.limit]
    if args.list:
        width = max(len(m.name) for m in MUTANTS)
        for m in MUTANTS:
            count = (ROOT / m.path).read_text().count(m.old)
            applies = count == 1 or (m.nth and count > m.nth)
            print(f"{m.name:{width}} {m.path:30} {'' if applies else '[NOT FOUND] '}{m.what}")
        return 0

    copy = Path(tempfile.mkdtemp(prefix="lltm-audit-"))
    try:
        copy_repository(copy)
        probe = subprocess.run([sys.executable, "-c", "import lltm_cupy; print(lltm_cupy.__file__)"],
                               cwd=copy, capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=str(copy)))
        if not probe.stdout.strip().startswith(str(copy)):
            print(f"audit: lltm_cupy imports from {probe.stdout.strip() or probe.stderr}, not "
                  f"the copy {copy}", file=sys.stderr)
            return 2
        files = sorted({t for m in mutants for t in m.tests})
        print(f"baseline: {len(files)} test files on the unmodified copy ...", flush=True)
        baseline, outcome, seconds = run_tests(copy, files, args.timeout)
        print(f"baseline: {len(baseline)} failing ({outcome}, {seconds:.0f} s)"
              + "".join(f"\n  {n}" for n in sorted(baseline)), flush=True)
        rows, bad, stale = [], 0, 0
        for m in mutants:
            original = apply(copy, m)
            if original is None:
                rows.append((m, "not applied", 0, 0, 0.0, []))
                stale += 1
                print(f"{m.name}: not applied (text not found once in {m.path})", flush=True)
                continue
            try:
                failed, outcome, seconds = run_tests(copy, m.tests, args.timeout, args.maxfail)
            finally:
                (copy / m.path).write_text(original)
            capped = bool(args.maxfail) and len(failed) >= args.maxfail
            failed -= baseline
            values = sorted(n for n in failed if is_value_test(n) or not m.values)
            if outcome == "timeout":
                verdict = "timeout"
            elif not failed:
                verdict = "survived"
            elif len(values) < 2:
                verdict = "weak"
            else:
                verdict = "killed"
            bad += verdict in ("survived", "weak", "timeout")
            rows.append((m, verdict, f"{len(failed)}{'+' if capped else ''}", len(values),
                         seconds, values))
            print(f"{m.name}: {verdict}, {len(failed)} failing ({len(values)} value tests), "
                  f"{seconds:.0f} s" + "".join(f"\n  {n}" for n in values[:5]), flush=True)
        table = format_table(rows, baseline)
        print("\n" + table)
        if args.markdown:
            args.markdown.write_text(table + "\n")
    finally:
        if args.keep:
            print(f"copy kept at {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)
    return 2 if stale else 1 if bad else 0


def format_table(rows, baseline) -> str:
    lines = ["| mutant | where | bug | verdict | failing tests | of them value tests | "
             "seconds |", "|---|---|---|---|---|---|---|"]
    for m, verdict, failed, values, seconds, _ in rows:
        lines.append(f"| `{m.name}` | `{m.path}` | {m.what} | {verdict} | {failed} | {values} | "
                     f"{seconds:.0f} |")
    if baseline:
        lines.append("")
        lines.append("Left out (failing before any mutation): "
                     + ", ".join(f"`{n}`" for n in sorted(baseline)))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
