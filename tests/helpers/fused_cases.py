"""The cases of the fused sequence kernels' tests (tests/kernels/test_fused_*.py and the tests of
other folders that run the fused path): the dtypes, the emulated devices' shared memory, the
tolerances between the fused and the stepped path, a case's arrays, a run of the GPU backend's
forward and backward, the comparison with the stepped path and the float64 reference
(tests/helpers/lengths_reference.py), ptxas -v of a source, and the torch layer's case. The
emulated devices themselves (fixtures) are in tests/helpers/fused_devices.py."""
from __future__ import annotations

import re
import subprocess

import numpy as np

from lltm_cupy import _packing
from lltm_cupy._cuda import fused as _fused, fused_kernels as _fused_kernels, kernels as _kernels
from lltm_cupy.verify import TOLERANCE, normalised_error as max_error, to_numpy
from .lengths_reference import _reference

BF16 = _kernels.BFLOAT16
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32),
          "float64": np.dtype(np.float64)}
#: the 16-bit dtypes (the tensor-core kernels')
DTYPES16 = {"float16": np.dtype(np.float16), "bfloat16": BF16}
#: the emulated device's opt-in shared memory per block: an H100/H200's (sm_90)
LIMIT = _fused.ARCH_SHARED_MEMORY[90]
#: the emulated sm_80 device's (A100)
LIMIT80 = _fused.ARCH_SHARED_MEMORY[80]
#: fused vs stepped (they differ in the order of the recurrent product's sums, then in what the
#: roundings of a 16-bit type make of that), per dtype
AGREE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2,
         BF16: 2e-2}
OUT = ("outputs", "h_n", "c_n", "d_inputs", "d_weights", "d_bias", "d_h0", "d_c0")
GRADS = ("grad_outputs", "grad_h_n", "grad_c_n")


def to_bits(a):
    import ml_dtypes

    return np.ascontiguousarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
                                .view(np.uint16))


def values(a):
    """float64 values of an array of the backend (bfloat16 as its bits)."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        import ml_dtypes

        return a.view(ml_dtypes.bfloat16).astype(np.float64)
    return a.astype(np.float64)


def make(T, B, F, S, dtype, seed):
    """(storage arrays for the backend, the same values in float64)."""
    rng = np.random.default_rng(seed)
    k = S + F
    case = dict(inputs=rng.standard_normal((T, B, F)),
                weights=rng.uniform(-1, 1, (3 * S, k)) / np.sqrt(k),
                bias=rng.uniform(-1, 1, 3 * S), h0=rng.uniform(-1, 1, (B, S)),
                c0=rng.standard_normal((B, S)), grad_outputs=rng.standard_normal((T, B, S)),
                grad_h_n=rng.standard_normal((B, S)), grad_c_n=rng.standard_normal((B, S)))
    stored = {n: to_bits(v) if dtype == BF16 else v.astype(dtype) for n, v in case.items()}
    return stored, {n: values(v) for n, v in stored.items()}


def want(case, lengths, reverse):
    """The float64 reference of a case of :func:`make` (``lengths`` None: every row full)."""
    T, B = case["inputs"].shape[:2]
    full = [T] * B if lengths is None else lengths
    return _reference(case, full, reverse, tuple(case[g] for g in GRADS))


def run(xp, stored, lengths, reverse, fused, grads=GRADS, ran=None):
    """The GPU backend's forward_sequence and backward_sequence: the 8 results as NumPy arrays.
    The forward must have run fused as asked, unless ``ran`` (a list) is given: then whether it
    did is appended to it."""
    from lltm_cupy import _cuda

    T, B = stored["inputs"].shape[:2]
    plan = (None if lengths is None and not reverse else _packing.plan(
        np.full(B, T, np.int64) if lengths is None else np.asarray(lengths, np.int64), T,
        reverse))
    a = {k: xp.asarray(v) for k, v in stored.items()}
    outputs, h_n, c_n, saved = _cuda.forward_sequence(
        *(a[n] for n in ("inputs", "weights", "bias", "h0", "c0")), plan=plan, fused=fused)
    if ran is None:
        assert saved.fused == fused
    else:
        ran.append(saved.fused)
    g = _cuda.backward_sequence(*(a[n] if n else None for n in grads), saved)
    return [to_numpy(v) for v in (outputs, h_n, c_n, *g)]


def run_any(xp, stored, lengths, reverse, fused):
    """:func:`run` without asserting which path ran: (results, saved.fused)."""
    ran = []
    return run(xp, stored, lengths, reverse, fused, ran=ran), ran[0]


def compare(fused, stepped, want, dtype, label):
    """fused equals stepped within AGREE, and is as close to the float64 reference as stepped is
    (within the dtype's tolerance, 10x for the sequences' accumulation in float32 / float64)."""
    for name, f, s, w in zip(OUT, fused, stepped, want):
        assert f.shape == w.shape and f.dtype == s.dtype, f"{label} {name}: shape/dtype"
        assert not np.isnan(values(f)).any(), f"{label} {name}: NaN"
        err = max_error(values(f), values(s))
        assert err <= AGREE[dtype], f"{label} {name}: fused vs stepped {err:.2e}"
        ref_f, ref_s = max_error(values(f), w), max_error(values(s), w)
        bound = (10 * TOLERANCE[dtype] if dtype in (np.float32, np.float64)
                 else 2 * ref_s + AGREE[dtype] / 4)
        assert ref_f <= bound, f"{label} {name}: fused vs reference {ref_f:.2e} > {bound:.1e}" \
                               f" (stepped: {ref_s:.2e})"


def check_fused(xp, stored, case, lengths, reverse, dtype, label, ran=None):
    """The fused path against the stepped path and the float64 reference (:func:`compare`);
    ``ran()``, if given, is called between the two runs (to check which kernels the fused run
    launched). The fused results."""
    fused = run(xp, stored, lengths, reverse, True)
    if ran is not None:
        ran()
    stepped = run(xp, stored, lengths, reverse, False)
    compare(fused, stepped, want(case, lengths, reverse), dtype, label)
    return fused


# ------------------------------------------------------------------------------------ ptxas

def run_ptxas(nvcc, arch, source=None, names=None):
    """ptxas -v (nvcc's) of the kernels ``names`` of ``source`` (default: every one-block fused
    kernel) for sm_<arch>: ({mangled name: {"registers", "spills": (stores, loads), "frame",
    "smem"}}, the cubin)."""
    import tempfile
    from pathlib import Path

    names = names or [_fused_kernels.name_expression(k, d)
                      for d in DTYPES.values() for k in _fused_kernels.KERNEL_NAMES]
    keep = ", ".join(f"(void*)&{n}" for n in names)
    with tempfile.TemporaryDirectory() as folder:
        src, out = Path(folder) / "fused.cu", Path(folder) / "fused.cubin"
        src.write_text((source or _fused_kernels.source())
                       + f"\nvoid* lltm_instances[] = {{{keep}}};\n")
        proc = subprocess.run([nvcc, "--cubin", f"-arch=sm_{arch}", "-Xptxas", "-v",
                               "-ftz=true", "-std=c++17", str(src), "-o", str(out)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        cubin = out.read_bytes()
    report, name = {}, None
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m and name:
            report.setdefault(name, {})["spills"] = (int(m.group(2)), int(m.group(3)))
            report[name]["frame"] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            smem = re.search(r"(\d+) bytes smem", line)
            report[name]["registers"] = int(m.group(1))
            report[name]["smem"] = int(smem.group(1)) if smem else 0
    return report, cubin


# ------------------------------------------------------------------------ the torch layer

def torch_case(torch, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, B, F, H = 5, 4, 3, 6
    xs = torch.randn(T, B, F, generator=g).to(dtype)
    hx = tuple(torch.randn(4, B, H, generator=g).to(dtype) for _ in range(2))
    return xs, hx


def torch_run(torch, model, xs, hx, lengths):
    """A model's outputs, h_n, c_n and the gradients of the inputs, h0, c0 and every parameter
    (float64 NumPy arrays), padded input or packed with ``lengths``."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    xs, hx = xs.clone().requires_grad_(), tuple(h.clone().requires_grad_() for h in hx)
    if lengths is None:
        out, (h_n, c_n) = model(xs, hx)
    else:
        packed = pack_padded_sequence(xs, torch.tensor(lengths), enforce_sorted=False)
        out, (h_n, c_n) = model(packed, hx)
        out = pad_packed_sequence(out, total_length=xs.shape[0])[0]
    (out.float().sum() + 3 * h_n.float().sum() + 2 * c_n.float().sum()).backward()
    grads = [xs.grad, hx[0].grad, hx[1].grad] + [p.grad for p in model.parameters()]
    return [t.detach().double().numpy() for t in [out, h_n, c_n, *grads]]
