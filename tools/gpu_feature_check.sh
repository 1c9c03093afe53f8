#!/usr/bin/env bash
# One GPU run (sized for one 600 s device command) of the figures the feature issues ask of one H100:
# worker-fault recovery time (tp=1, default model; needs Ray, so source the .gpu bundle first) and the
# prefix cache's TTFT and prefill tokens on a shared-system-prompt workload. Results under $OUT.
#   source .gpu/setup.sh && COMMIT=<sha> bash tools/gpu_feature_check.sh
# Each part has its own time limit and a failure in one does not stop the other.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
commit="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"  # the device copy has no .git: pass COMMIT=...
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 280 python benchmarks/recovery.py --device cuda --commit "$commit" --results "$OUT/RESULTS.md" \
    2>&1 | tail -25 | tee "$OUT/recovery.txt"
timeout 280 python benchmarks/prefix_cache.py --device cuda --commit "$commit" --results "$OUT/RESULTS.md" \
    2>&1 | tail -25 | tee "$OUT/prefix_cache.txt"
