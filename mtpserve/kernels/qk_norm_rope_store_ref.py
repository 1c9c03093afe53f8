"""Reference of an attention layer's step between the QKV projection and the attention itself: the per-head
RMSNorm of q and k (Qwen3, GLM; skipped without weights), rotate-half RoPE of both, and the store of this
step's k and v into the paged cache: the composition of rms_norm_ref, rope_ref and store_kv_ref.
  q [T, H, D], k and v [T, Hkv, D] (strided views of the projection are fine)
  q_weight, k_weight [D] or None; cos, sin [P, rot // 2] fp32; positions [T]
  k_cache, v_cache [NB, BS, Hkv, D] written in place at slot_mapping [T] (< 0: skipped)
  -> q, normed and rotated, [T, H, D]
"""

from __future__ import annotations

import torch

from mtpserve.kernels.rmsnorm_ref import rms_norm_ref
from mtpserve.kernels.rope_ref import rope_ref
from mtpserve.kernels.store_kv_ref import store_kv_ref


def qk_norm_rope_store_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                           k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                           positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> torch.Tensor:
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q, k = rope_ref(q, cos, sin, positions), rope_ref(k, cos, sin, positions)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q
