#!/usr/bin/env bash
# One command for whoever is lent a GPU for a few minutes: the GPU tests, then the benchmark at
# the tutorial size (every implementation: eager, torch.compile default and reduce-overhead, our
# cell and the reference captured in CUDA graphs, nn.LSTMCell), in bfloat16 (ours, the eager
# reference and nn.LSTMCell, tutorial and large size), over whole sequences (against
# stepped cells and cuDNN's nn.LSTM), at the large sizes (kernel bandwidth and GEMM share), and a
# profile of the host time per step (what decides small sizes).
# Writes text and JSON into DIR (default: $OUT if set, else ./gpu_check_results): 8 files.
# Needs python3 with torch (CUDA), cupy and pytest; installs nothing.
#
# The whole check finishes within 5 minutes, hard limits included: one deadline (BUDGET_S,
# default 290 s from the start) caps every step, in order of importance, each also capped at
# its own share; a step cut off by the deadline is reported as such and fails the check.
#
#   bash scripts/gpu_check.sh [DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_check_results}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
deadline=$(( $(date +%s) + ${BUDGET_S:-290} ))
status=0

# step CAP_S FILE CMD...: run CMD with a limit of min(CAP_S, time left), appending to FILE.
step() {
  local cap=$1 file=$2; shift 2
  local left=$(( deadline - $(date +%s) ))
  (( left < cap )) && cap=$left
  if (( cap < 5 )); then
    echo "gpu_check: no time left for: $*" | tee -a "$file"; status=1; return
  fi
  timeout "$cap" "$@" 2>&1 | tee -a "$file"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ]; then echo "gpu_check: cut off after ${cap} s: $*" | tee -a "$file"; fi
  [ "$rc" -eq 0 ] || status=1
}

step 20 "$out/env.txt" python3 -c '
import torch, cupy, numpy
print("torch", torch.__version__, "cupy", cupy.__version__, "numpy", numpy.__version__)
print("GPU:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'
step 130 "$out/gpu_tests.txt" python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests
step 60 "$out/benchmark.txt" python3 scripts/benchmark.py --cuda -b 16 -f 32 -s 128 -r 200 \
    --impl reference,compiled,compiled-ro,reference-graph,cell,cell-graph,array,lstm \
    --json "$out/benchmark_tutorial.json"
step 35 "$out/benchmark.txt" python3 scripts/benchmark.py --cuda --bf16 \
    --sizes 16x32x128,4096x1024x1024 -r 30 --impl reference,cell,cell-graph,lstm \
    --json "$out/benchmark_bf16.json"
step 25 "$out/benchmark.txt" python3 scripts/benchmark.py --cuda --sequence -r 10 \
    --json "$out/benchmark_sequence.json"
step 20 "$out/benchmark.txt" python3 scripts/benchmark.py --cuda \
    --sizes 1024x1024x1024,4096x1024x1024 -r 30 --impl reference,cell,cell-graph,array,lstm \
    --json "$out/benchmark_large.json"
step 8 "$out/profile.txt" python3 scripts/profile_step.py --cuda --top 25
step 8 "$out/profile.txt" python3 scripts/profile_step.py --cuda --sequence --top 25
echo "gpu_check: exit status $status; $(( ${BUDGET_S:-290} - (deadline - $(date +%s)) )) s; results in $out"
exit "$status"
