"""The attention layer's fused q/k norm + RoPE + KV store (kernels/qk_norm_rope_store.py) in the served model:
on a CUDA GPU the engine's greedy output with the fused kernels equals the output with the torch references
(MTPSERVE_FUSED_KERNELS=0's path), with and without speculation. The kernel itself is tested against its
reference in tests/kernels/test_qk_norm_rope_store.py, interpreted on CPU and compiled on CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mtpserve.kernels
from mtpserve import LLM, SamplingParams
from tests.conftest import prompts_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels run on CUDA only")


@pytest.mark.parametrize("k", [0, 3])
def test_fused_attention_gives_the_reference_output(trained_ckpt: Path, k: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = prompts_of(64, [3, 9, 14, 5], seed=2)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(str(trained_ckpt), device="cuda", dtype="float32", num_speculative_tokens=k)
        return [o.token_ids for o in llm.generate(prompts, greedy)]

    fused = run()
    monkeypatch.setattr(mtpserve.kernels, "FUSED_KERNELS", False)
    assert run() == fused
