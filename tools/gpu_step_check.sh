#!/usr/bin/env bash
# One GPU run of the device-resident step (docs/design.md §8), sized for one 600 s device command:
# the CUDA cases of the kernel, graph and uniform-step tests, then the step benchmark against its
# same-run lean reference, then the default model's speculation matrix. Results under $OUT.
#   source .gpu/setup.sh && COMMIT=<sha> bash tools/gpu_step_check.sh
# MTPSERVE_FUSED_KERNELS=0 runs the models on the torch references instead of the fused kernels (A/B).
# Each part has its own time limit and a failure in one does not stop the others.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
commit="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"  # the device copy has no .git: pass COMMIT=...
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 170 python -m pytest -q -x tests/kernels tests/workers/test_uniform_step.py tests/workers/test_cuda_graphs.py \
    2>&1 | tail -15 | tee "$OUT/tests.txt"
timeout 220 python benchmarks/step_benchmark.py --commit "$commit" --drafts "${STEP_DRAFTS:-0,3}" \
    --results "$OUT/RESULTS.md" 2>&1 | tail -45 | tee "$OUT/step.txt"
timeout 180 python benchmarks/spec_matrix.py --commit "$commit" --ks "${SPEC_KS:-0,1,3}" \
    --concurrency "${SPEC_CONC:-1,32,128}" --results "$OUT/RESULTS.md" 2>&1 | tail -25 | tee "$OUT/spec.txt"
