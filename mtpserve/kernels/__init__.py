"""Triton kernels, one per file, each beside the plain-torch reference that is the CPU path and test oracle.

On CUDA the models use the fused kernels (RMSNorm with its residual add, SwiGLU, RoPE, split-KV
attention, the split-vocabulary argmax of greedy steps); MTPSERVE_FUSED_KERNELS=0 in the environment
makes them use the torch references instead (the one-pass paged attention and the KV store stay), for
A/B timings in one benchmark run and as a fallback on a GPU where one of them misbehaves. The small-M
GEMM (skinny_gemm) has its own switch, MTPSERVE_SKINNY_GEMM (auto by default; linear_dispatch.py, which also
measures F.linear with cuBLASLt preferred unless MTPSERVE_CUBLASLT=off). On
the CPU, fp32 products of large weights go through oneDNN with the weight packed once (cpu_linear.py;
MTPSERVE_CPU_GEMM=torch turns it off).
"""

import os

FUSED_KERNELS = os.environ.get("MTPSERVE_FUSED_KERNELS", "1") != "0"


def use_fused(x) -> bool:
    """Whether a fused kernel should take tensor x (a CUDA tensor, with the kernels switched on)."""
    return FUSED_KERNELS and x.is_cuda
