#!/usr/bin/env bash
# One command for whoever is lent a GPU for a few minutes: its prerequisites, the GPU tests (the
# torch layer's CUDA path first, and in it first the tests only a GPU can run of its pointer
# launches for variable lengths and the fused group variant: test_torch_pointer_path.py,
# test_gpu_variable_length.py, then test_torch{,_cuda_path,_inference,_sequence}.py and
# test_gpu_training.py (tests/torch_layer/); then the fused kernels' (tests/kernels/):
# the one-block, tensor-core and cluster kernels, warmup(fused=True) and the 16-block clusters;
# then the rest; then the torch.compile ones), then the timing rows the open
# goals need: the fused kernels' own time per step (one block, and clusters past one block's
# shared memory), the fused path against the default path and cuDNN's nn.LSTM at B = 16 and 64,
# S = 128 and 256, T = 64 and 512, the cell at the tutorial size against the tutorial's eager
# cell and nn.LSTMCell (float32 and bfloat16), whole sequences (a call's fixed cost and its cost
# per step), and the forward-only input projection's block size (time and peak memory).
#
# Where results go: every file into DIR (default ./gpu_check_results; made absolute), CuPy's
# kernel cache into DIR/cupy_cache unless CUPY_CACHE_DIR is set. Where $OUT is set (the lent GPU
# machine, from which only the files in $OUT come back: 8 at most, 16 MiB each, two folders down
# at most), DIR must lie outside it, and after every step the script refreshes these 5 files in
# $OUT: summary.txt, env.txt, gpu_tests.txt, benchmark.txt (the last 15 MB of each at most) and
# results.tar.gz (everything in DIR but the kernel cache: the JSON of every benchmark too), so
# that a run cut short still brings back every step done. tests/scripts/test_scripts.py holds
# the script to these limits.
#
# Needs python3 with torch (CUDA), cupy, numpy and pytest (without them nothing runs), and
# hypothesis, mpmath, ml_dtypes, scikit-learn and tqdm (a missing one skips whole test modules
# with GPU tests: named first, and the run fails, but the rest still runs); installs nothing.
# On the GPU machine a skipped GPU test fails its tests step unless its reason is on the list
# below (ALLOWED_SKIPS: needs two GPUs; a device without 16-block clusters, where that test
# checks the stepped path instead). Every benchmark checks each implementation's outputs
# against the float64 reference (the fused rows: against the default path) before timing it: a
# wrong one posts no time and fails its step.
#
# Time: one deadline (BUDGET_S, 415 s) and a cap per step (a step that overruns is killed,
# `timeout -k 5`, and reported "cut off"; its partial output is kept). The caps add up to the
# deadline at most (tests/scripts/test_scripts.py checks it), so every step runs, each for its
# cap at most: the whole ends within BUDGET_S + 5 s, inside the 420 s a lent machine's 15 minutes
# allow. Every step's result (passed, failed, cut off, not run) and its seconds are in the
# summary; the exit status is 0 only if every step passed. Expected seconds, from a run on an
# H200 (torch 2.11, CuPy 14.2; [measured] there, the rest estimated), with cold NVRTC compiles
# (lltm.cu ~1 s a dtype, the cluster module ~6-8 s a dtype, CuPy's own small kernels ~0.5 s
# each, about 30) and torch/CUDA start-up (~5 s a process):
#   step                     cap  expected
#   prerequisites             15   5   torch, CuPy and the GPU seen
#   tests (torch CUDA path)   85  62   62 tests of test_torch_pointer_path.py (variable lengths on
#                                      side streams, the group variant: never run on a GPU yet),
#                                      test_gpu_variable_length.py (capture, sync debug, two fresh
#                                      processes of ~10 s each), test_torch.py,
#                                      _cuda_path, _inference, _sequence and
#                                      test_gpu_training.py: first, so that no overrun of another
#                                      step leaves them unrun; lltm.cu, the group module (float32)
#                                      and CuPy's own kernels compiled cold
#   tests (fused kernels)     67  50   47 tests of test_fused_*.py: the modules of every fused
#                                      variant compiled cold (cluster: float32 and bfloat16)
#   tests (the rest)          60  43   the other tests [the rest and the torch tests together:
#                                      38 s for 130 tests then]
#   tests (compiled)          60  42   [42 s] 12 tests; torch.compile's Inductor compiles
#                                      dominate, and vary: 18 s of margin on a cold machine
#   fused kernel time         15  10   4 size-dtype pairs x (check + 2 + 5 timed calls)
#   fused cluster time        20  15   S = 256, 388, 512 (16 blocks where held) x float32 and
#                                      bfloat16 x (check + 1 + 3 timed calls)
#   bench fused f32           20  15   4 sizes x T = 64, 512: stepped (~60 ms a call at 512),
#                                      fused, nn.LSTM, 3 + 10 calls each
#   bench fused bf16          12   8   the same sizes at T = 64
#   bench tutorial            16  12   eager reference, our cell eager and captured, the array
#                                      API, nn.LSTMCell: 10 + 200 calls each
#   bench bf16                12   8   the same in bfloat16 (reference, cell, cell-graph, lstm)
#   bench sequence            20  18   [18 s]
#   block rows                13  10   2 sizes x 6 block sizes x (check + 2 + 5 forward calls)
#   sum                      415
# Not in the check (measured on the H200 before, by hand when wanted): the layered and ragged
# sequence rows (--impl lltm-2x-bidir,cells-2x-bidir,ragged,ragged-padded), the large sizes
# (--sizes 1024x1024x1024,4096x1024x1024), torch.compile rows of the benchmark (--impl compiled),
# and the host-time profiles (scripts/profile_step.py --cuda [--sequence]).
#
#   bash scripts/gpu_check.sh [DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
dir="${1:-gpu_check_results}"
case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac      # absolute: the cache path below too
share="${OUT:-}"
if [ -n "$share" ]; then
  share="$(cd "$share" && pwd)" || exit 1
  case "$dir/" in "$share"/*)
    echo "gpu_check: DIR ($dir) must be outside \$OUT ($share): only 8 files come back from there"
    exit 1 ;;
  esac
fi
mkdir -p "$dir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$dir/cupy_cache}"
#: the only skips a GPU test may report on the GPU machine (substrings of the reason)
ALLOWED_SKIPS=("needs two CUDA devices" "holds no 16-block cluster")
skip_args=()
for reason in "${ALLOWED_SKIPS[@]}"; do skip_args+=(--skips-allowed "$reason"); done
budget=${BUDGET_S:-415}
start=$(date +%s)
deadline=$(( start + budget ))
status=0
summary=()

# The summary so far into DIR, and the results so far into $OUT (where set): 5 files, each at
# most 15 MB (the tail of a log).
publish() {
  write_summary "running" > "$dir/summary.txt"
  copy_out
}

copy_out() {
  [ -n "$share" ] || return 0
  local name
  for name in summary.txt env.txt gpu_tests.txt benchmark.txt; do
    if [ -f "$dir/$name" ]; then tail -c 15000000 "$dir/$name" > "$share/$name"; fi
  done
  tar -czf "$share/results.tar.gz.part" -C "$dir" --exclude=./cupy_cache . &&
    mv "$share/results.tar.gz.part" "$share/results.tar.gz"
}

write_summary() {
  echo
  echo "gpu_check summary ($1; $(( $(date +%s) - start )) s of $budget s; results in $dir):"
  printf '  %s\n' "${summary[@]}"
}

# step NAME CAP_S FILE CMD...: run CMD with a limit of min(CAP_S, time left), appending to FILE.
step() {
  local name=$1 cap=$2 file=$3; shift 3
  local left=$(( deadline - $(date +%s) )) t0 result rc
  (( left < cap )) && cap=$left
  if (( cap < 5 )); then
    echo "gpu_check: no time left for: $*" | tee -a "$file"
    status=1; summary+=("$(printf '%-24s %-10s %4s s' "$name" "not run" 0)"); publish; return
  fi
  t0=$(date +%s)
  timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$file"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    result="cut off"; echo "gpu_check: cut off after ${cap} s: $*" | tee -a "$file"
  elif [ "$rc" -eq 0 ]; then result="passed"; else result="failed ($rc)"; fi
  [ "$rc" -eq 0 ] || status=1
  summary+=("$(printf '%-24s %-10s %4s s' "$name" "$result" $(( $(date +%s) - t0 )))")
  publish
}

# Prerequisites, checked first. Without torch, CuPy, NumPy, pytest or a GPU nothing can run: stop,
# naming what is missing. A package whose absence skips whole test modules holding GPU tests
# (hypothesis, mpmath, ml_dtypes; scikit-learn and tqdm for tests/array_api/test_digits_array.py) is
# named here as missing and fails the run, but the rest still runs: the tests steps then fail
# on those skips (ALLOWED_SKIPS), and the benchmarks are still measured.
timeout -k 5 15 python3 - >"$dir/env.txt" 2>&1 <<'EOF'
import importlib, sys
missing, for_tests = [], []
for name in ("torch", "cupy", "numpy", "pytest", "hypothesis", "mpmath", "ml_dtypes", "sklearn",
             "tqdm"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        (missing if name in ("torch", "cupy", "numpy", "pytest") else for_tests).append(
            f"{name} ({type(exc).__name__}: {exc})")
if not missing:
    import cupy, numpy, torch
    print("numpy", numpy.__version__, "python", sys.version.split()[0])
    if not torch.cuda.is_available():
        missing.append("a CUDA device for torch (torch.cuda.is_available() is False)")
    else:
        print("GPU:", torch.cuda.get_device_name(), "CUDA", torch.version.cuda)
    try:
        print("CuPy sees", cupy.cuda.runtime.getDeviceCount(), "GPU(s)")
    except Exception as exc:
        missing.append(f"a GPU for CuPy ({type(exc).__name__}: {exc})")
if missing:
    print("gpu_check: missing:", "; ".join(missing + for_tests))
    sys.exit(1)
if for_tests:
    print("gpu_check: missing for the tests (their modules will be skipped and the tests steps "
          "fail):", "; ".join(for_tests))
    sys.exit(3)
EOF
prereq=$?
cat "$dir/env.txt"
if [ "$prereq" -ne 0 ] && [ "$prereq" -ne 3 ]; then
  echo "gpu_check: prerequisites missing; nothing else run (status $prereq)" |
    tee -a "$dir/env.txt"
  summary+=("$(printf '%-24s %-10s %4s s' "prerequisites" "failed" $(( $(date +%s) - start )))")
  publish
  exit 1
fi
if [ "$prereq" -eq 3 ]; then
  status=1; summary+=("$(printf '%-24s %-10s %4s s' "prerequisites" "missing" 0)")
else
  summary+=("$(printf '%-24s %-10s %4s s' "prerequisites" "passed" $(( $(date +%s) - start )))")
fi
publish

# The tests first: nothing of the present CUDA path has run on a GPU. The torch layer's CUDA path
# (rewritten: torch.empty buffers, pointer launches, torch's GEMMs) first, and in it first what
# only a GPU can check of its newest part (variable lengths and the group variant on pointer
# launches), then the fused kernels' tests (the code
# furthest from anything a GPU ran), then the rest; each module in one step only.
torch_tests=(tests/torch_layer/test_torch_pointer_path.py
             tests/torch_layer/test_gpu_variable_length.py tests/torch_layer/test_torch.py
             tests/torch_layer/test_torch_cuda_path.py tests/torch_layer/test_torch_inference.py
             tests/torch_layer/test_torch_sequence.py tests/torch_layer/test_gpu_training.py)
fused_tests=(tests/kernels/test_fused_variants.py tests/kernels/test_fused_cluster_occupancy.py
             tests/kernels/test_fused_mma_geometry.py)
ignored=()
for f in "${torch_tests[@]}" "${fused_tests[@]}"; do ignored+=(--ignore "$f"); done
step "tests (torch CUDA path)" 85 "$dir/gpu_tests.txt" python3 -m pytest -q -rs -m gpu \
    -k "not compile" -p no:cacheprovider "${skip_args[@]}" "${torch_tests[@]}"
step "tests (fused kernels)" 67 "$dir/gpu_tests.txt" python3 -m pytest -q -rs -m gpu \
    -p no:cacheprovider "${skip_args[@]}" "${fused_tests[@]}"
step "tests (the rest)" 60 "$dir/gpu_tests.txt" python3 -m pytest -q -rs -m gpu \
    -k "not compile" -p no:cacheprovider "${skip_args[@]}" "${ignored[@]}" tests
# (the torch.compile tests of every module but the fused kernels', the torch layer's among them)
step "tests (compiled)" 60 "$dir/gpu_tests.txt" python3 -m pytest -q -rs -m gpu \
    -k "compile" -p no:cacheprovider "${skip_args[@]}" \
    "${fused_tests[@]/#/--ignore=}" tests
# The fused kernels' own time per step (CUDA events around each launch, no GEMM or host work)
# beside the whole call's, at B = 16, F = 32, S = 128, T = 64 and 512, float32 and bfloat16,
# each checked against a float64 run first.
step "fused kernel time" 15 "$dir/benchmark.txt" python3 scripts/fused_kernel_time.py \
    --runs 5 --warmup 2
# The cluster variant (hidden sizes past one block's shared memory, sm_90 and newer): kernel
# and whole-call time per step at S = 256 (B = 16), S = 388 (B = 33: more tiles than a
# 132-SM device's 8-block clusters may hold at once: waves) and S = 512 (B = 16; float32 in
# 16-block clusters where the device holds them, bfloat16 in 8), float32 and bfloat16, each
# checked against a float64 run first; its "blocks" column says how many blocks per tile ran.
step "fused cluster time" 20 "$dir/benchmark.txt" python3 scripts/fused_kernel_time.py \
    --sizes 64x16x32x256,64x33x32x388,64x16x32x512 --runs 3 --warmup 1
# The fused sequence kernels (LLTM(fused=True)) against the default path and cuDNN's nn.LSTM
# where the choice between them is to be made: B = 16 and 64, S = 128 and 256 (F = 32), T = 64
# and 512; their outputs and gradients are checked against the default path's before anything
# is timed.
step "bench fused f32" 20 "$dir/benchmark.txt" python3 scripts/benchmark.py --cuda --sequence \
    --sizes 16x32x128,64x32x128,16x32x256,64x32x256 -t 64,512 -r 10 --warmup 3 \
    --impl sequence,fused,lstm --json "$dir/benchmark_fused.json"
# bfloat16 at T = 64 only: the LLTM's cell state grows with T (nothing forgets it), and at
# T = 512 bfloat16 drifts from the float64 run by more than the harness's check allows for the
# default path and the fused path alike (1.8 normalised on an H200).
step "bench fused bf16" 12 "$dir/benchmark.txt" python3 scripts/benchmark.py --cuda --bf16 \
    --sequence --sizes 16x32x128,64x32x128,16x32x256,64x32x256 -t 64 -r 10 --warmup 3 \
    --impl sequence,fused,lstm --json "$dir/benchmark_fused_bf16.json"
# The cell at the tutorial size: eager against the tutorial's eager cell, captured in a CUDA
# graph, the array API and nn.LSTMCell. compiled-ro (the tutorial's reference under
# torch.compile mode="reduce-overhead") is not in this row: on torch 2.11 its first backward
# failed with "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent
# run" (H200), with and without cudagraph_mark_step_begin before each step, and also with its
# outputs cloned outside the compiled region. `--impl compiled-ro` still runs it by hand.
step "bench tutorial" 16 "$dir/benchmark.txt" python3 scripts/benchmark.py --cuda -b 16 -f 32 \
    -s 128 -r 200 --impl reference,cell,cell-graph,array,lstm \
    --json "$dir/benchmark_tutorial.json"
step "bench bf16" 12 "$dir/benchmark.txt" python3 scripts/benchmark.py --cuda --bf16 \
    --sizes 16x32x128 -r 200 --impl reference,cell,cell-graph,lstm \
    --json "$dir/benchmark_bf16.json"
step "bench sequence" 20 "$dir/benchmark.txt" python3 scripts/benchmark.py --cuda --sequence \
    -r 10 --impl sequence,cell-stepped,reference-stepped,array-sequence,array-stepped,lstm \
    --json "$dir/benchmark_sequence.json"
# Forward only: time (CUDA events) and peak CuPy memory of a sequence's forward at
# (500, 64, 16, 512) and (128, 32, 128, 256) for input-projection blocks of 512 ... 8192 rows
# and one block for the whole sequence, float32, each checked against a float64 run first.
step "block rows" 13 "$dir/benchmark.txt" python3 scripts/block_rows.py --runs 5

{
  write_summary "done"
  echo "gpu_check: exit status $status"
} | tee "$dir/summary.txt"
copy_out
exit "$status"
