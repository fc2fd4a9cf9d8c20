#!/usr/bin/env bash
# One command for whoever is lent a GPU for a few minutes: the GPU tests, then the benchmark at
# the tutorial size (every implementation, torch.compile included), at the large sizes (with
# the kernels' bandwidth and GEMM share) and over whole sequences (against stepped cells and
# cuDNN's nn.LSTM), and a profile of the host time per step (what decides small sizes).
# Writes text and JSON into DIR (default: $OUT if set, else ./gpu_check_results): 7 files.
# Needs python3 with torch (CUDA), cupy and pytest; installs nothing.
# Budget: about 3-5 minutes (torch.compile on the GPU takes most of it); hard limits
# 180 + 120 + 90 + 90 + 60 s.
#
#   bash scripts/gpu_check.sh [DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_check_results}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

python3 - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, cupy, numpy
print("torch", torch.__version__, "cupy", cupy.__version__, "numpy", numpy.__version__)
print("GPU:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
PY
status=0
timeout 180 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/gpu_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 120 python3 scripts/benchmark.py --cuda -b 16 -f 32 -s 128 -r 300 \
    --json "$out/benchmark_tutorial.json" 2>&1 | tee "$out/benchmark.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 90 python3 scripts/benchmark.py --cuda --sizes 1024x1024x1024,4096x1024x1024 -r 50 \
    --impl reference,cell,array,lstm --json "$out/benchmark_large.json" 2>&1 | tee -a "$out/benchmark.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 90 python3 scripts/benchmark.py --cuda --sequence -r 20 \
    --json "$out/benchmark_sequence.json" 2>&1 | tee -a "$out/benchmark.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
{ timeout 30 python3 scripts/profile_step.py --cuda --top 25
  timeout 30 python3 scripts/profile_step.py --cuda --sequence --top 25; } 2>&1 | tee "$out/profile.txt"
echo "gpu_check: exit status $status; results in $out"
exit "$status"
