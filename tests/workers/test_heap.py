"""The start-up heap freeze (mtpserve/workers/heap.py): what an engine's start leaves for collections to walk."""

from __future__ import annotations

import gc
from pathlib import Path

from mtpserve import LLM, SamplingParams


def test_an_engine_leaves_no_start_up_object_for_collections_to_walk(trained_ckpt: Path) -> None:
    gc.unfreeze()
    llm = LLM(str(trained_ckpt), block_size=4)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the model, torch and the engine's own objects
    assert len(gc.get_objects()) < frozen // 10  # what a full collection still walks (the frozen ones it skips)
    out = llm.generate([[5, 9, 14]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].token_ids) == 4
