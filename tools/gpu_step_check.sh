#!/usr/bin/env bash
# One GPU run of the device-resident step (docs/design.md §8): CUDA tests, then the step benchmark
# against its same-run lean reference, then the default model's speculation matrix. Results under $OUT.
#   source .gpu/setup.sh && bash tools/gpu_step_check.sh [step_benchmark args]
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python -m pytest -q -x tests/workers/test_uniform_step.py -k "cuda or graphs" 2>&1 | tail -15 | tee "$OUT/tests.txt"
timeout 300 python benchmarks/step_benchmark.py --results "$OUT/RESULTS.md" "$@" 2>&1 | tail -45 | tee "$OUT/step.txt"
timeout 300 python benchmarks/spec_matrix.py --ks "${SPEC_KS:-0,1,2,3}" --concurrency "${SPEC_CONC:-1,32,128}" \
    --results "$OUT/RESULTS.md" 2>&1 | tail -25 | tee "$OUT/spec.txt"
