"""The tensor-parallel pass in one process (world size 1, gloo): streaming loads and identical outputs.

Multi-rank correctness (tp = 2 against the single-process engine) is tested on Ray in
tests/cluster/test_ray_equivalence.py; here the point is how the pass loads: one part at a time, the
rest of the model still on the meta device, and the result the same model as load_model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mtpserve.workers.models.loader import CheckpointLoader, load_model
from mtpserve.workers.tensor_parallel import TPGroup, check_shardable, shard_model
from tests.checkpoints import make_batch, make_hf_checkpoint, make_kv_pool


@pytest.fixture
def single_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield TPGroup(0, 1, None)
    dist.destroy_process_group()


def _meta_prefixes(loader: CheckpointLoader) -> set[str]:
    names = [n for n, p in loader.model.target.named_parameters() if p.is_meta]
    names += ["mtp." + n.split(".", 2)[1] for n, p in loader.model.mtp.named_parameters() if p.is_meta]
    return {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith(("layers", "mtp")) else "") for n in names}


@pytest.mark.parametrize("tie", [False, True])
def test_streaming_shard_loads_one_part_at_a_time(tmp_path: Path, single_rank: TPGroup, tie: bool) -> None:
    path = make_hf_checkpoint(tmp_path / "ckpt", num_mtp=2, num_layers=3, tie=tie, mtp_own_head=True)
    loader = CheckpointLoader(path, torch.float32, "cpu")
    seen: list[tuple[str, set[str]]] = []

    def fetch(prefix: str) -> None:
        seen.append((prefix, _meta_prefixes(loader)))
        loader.load(lambda name: name.startswith(prefix), "cpu")

    shard_model(loader.model.target, loader.model.mtp, single_rank, fetch, torch.device("cpu"))
    expected = ["layers.0.", "layers.1.", "layers.2.", "embed_tokens."] + ([] if tie else ["lm_head."])
    assert [p for p, _ in seen] == expected + ["norm.", "mtp.0.", "mtp.1."]
    # When layer 2 is fetched, everything after it is still unloaded.
    still_meta = dict(seen)["layers.2."]
    assert {"layers.2", "embed_tokens", "norm", "mtp.0", "mtp.1"} <= still_meta
    assert "layers.0" not in still_meta and "layers.1" not in still_meta
    assert not _meta_prefixes(loader)

    reference = load_model(path, torch.float32, "cpu")
    cfg = reference.config
    ids, positions, meta = make_batch([([3, 14, 15, 92, 6], 0, [2, 0]), ([53, 58, 9], 0, [1])], block_size=4)
    outs = []
    with torch.inference_mode():
        for m in (reference, loader.model):
            kv = make_kv_pool(cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim)
            outs.append(m.target.logits(m.target(ids, positions, meta, kv)))
    torch.testing.assert_close(outs[1], outs[0])


def test_uneven_heads_are_refused() -> None:
    from mtpserve.workers.models.config import ModelConfig
    from mtpserve.workers.models.train import tiny_config

    cfg = ModelConfig.from_dict(tiny_config())  # 4 heads, 2 KV heads
    check_shardable(cfg, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 does not divide this model's num_key_value_heads"):
        check_shardable(cfg, 4)
