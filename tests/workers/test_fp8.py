"""Block-scaled FP8 checkpoints (DeepSeek-V3 style: float8_e4m3fn weights with weight_scale_inv per block).

Each checkpoint is quantised here from a tiny random model, beside the model the quantised weights
stand for (the same values dequantised in fp32 by this file's own block arithmetic). On CPU the FP8
checkpoint is served dequantised, so its outputs must equal that model's exactly. The MTP layers stay
BF16 in the FP8 checkpoint (seed 003's mixed layout) and the pair serves with speculation identically.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from mtpserve import LLM, SamplingParams
from mtpserve.errors import CheckpointError
from mtpserve.workers.models.loader import load_model
from tests.checkpoints import make_batch, model_kv_pool, read_config, read_tensors, write_config, write_tensors
from tests.conftest import prompts_of
from tests.moe_checkpoints import make_moe_checkpoint

FP8_MAX = 448.0  # largest finite float8_e4m3fn
VOCAB = 97


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [r, c] -> (fp8 [r, c], scale_inv [ceil(r/br), ceil(c/bc)], the fp32 values they stand for)."""
    (r, c), (br, bc) = w.shape, block
    nr, nc = math.ceil(r / br), math.ceil(c / bc)
    padded = torch.zeros(nr * br, nc * bc)
    padded[:r, :c] = w
    blocks = padded.view(nr, br, nc, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    values = (q.float() * scale[:, None, :, None]).view(nr * br, nc * bc)[:r, :c]
    return q.view(nr * br, nc * bc)[:r, :c].contiguous(), scale, values.contiguous()


def quantized_pair(src: Path, root: Path, block: tuple[int, int]) -> tuple[Path, Path]:
    """(FP8 checkpoint, its dequantised fp32 twin): target matrices quantised, MTP layers in BF16."""
    fp8_dir, deq_dir = root / "fp8", root / "dequantised"
    for d in (fp8_dir, deq_dir):
        shutil.copytree(src, d)
    raw = read_config(src)
    layers = raw["num_hidden_layers"]
    fp8, deq = {}, {}
    for name, t in read_tensors(src).items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer >= layers:  # an MTP layer: BF16 in the FP8 checkpoint
            fp8[name] = t.to(torch.bfloat16)
            deq[name] = fp8[name].float()
        elif layer >= 0 and name.endswith("_proj.weight"):
            fp8[name], fp8[name + "_scale_inv"], deq[name] = _quantize(t, block)
        else:
            fp8[name] = deq[name] = t
    write_tensors(fp8_dir / "model.safetensors", fp8)
    write_tensors(deq_dir / "model.safetensors", deq)
    write_config(fp8_dir, {**raw, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}})
    return fp8_dir, deq_dir


@pytest.fixture(scope="module", params=["glm4_moe", "deepseek_v3"])
def source(request, tmp_path_factory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param, num_mtp=2, seed=11,
                               predictable=True, tokenizer=True)


@pytest.mark.parametrize("block", [(16, 16), (128, 128)], ids=["16x16", "128x128"])
@torch.no_grad()
def test_fp8_checkpoint_equals_its_dequantised_model_exactly(source: Path, tmp_path: Path, block) -> None:
    fp8_dir, deq_dir = quantized_pair(source, tmp_path, block)
    stored = read_tensors(fp8_dir)
    assert stored["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.2.mlp.experts.0.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.3.self_attn.o_proj.weight"].dtype == torch.bfloat16  # MTP layer
    ours, twin, original = (load_model(p, torch.float32, "cpu") for p in (fp8_dir, deq_dir, source))
    assert ours.config.fp8 is not None and ours.config.fp8.block == block
    seqs = prompts_of(VOCAB, [13, 5, 30], seed=1)
    block_size = 8
    tables = [[3 * r + i for i in range(4)] for r in range(3)]
    ids, positions, meta = make_batch([(s, 0, t) for s, t in zip(seqs, tables)], block_size)
    logits = []
    for model in (ours, twin, original):
        kv = model_kv_pool(model.config, model.config.num_layers, 12, block_size)
        hidden = model.target(ids, positions, meta, kv)
        (mtp_kv,) = model_kv_pool(model.config, 1, 12, block_size, seed=1)
        g = model.mtp(0, ids, model.target.norm(hidden), positions, meta, mtp_kv, model.target.embed_tokens)
        logits.append((model.target.logits(hidden), model.mtp.logits(0, g, model.target.lm_head)))
    assert torch.equal(logits[0][0], logits[1][0]) and torch.equal(logits[0][1], logits[1][1])
    # The quantisation is real: the original (unquantised) model's logits differ.
    assert (logits[0][0] - logits[2][0]).abs().max() > 1e-4


def test_mixed_fp8_target_bf16_mtp_serves_with_speculation(source: Path, tmp_path: Path) -> None:
    fp8_dir, deq_dir = quantized_pair(source, tmp_path, (16, 16))
    prompts = prompts_of(VOCAB, [4, 11, 19], seed=2)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    outs = [LLM(str(p), num_speculative_tokens=2, block_size=4).generate(prompts, params) for p in (fp8_dir, deq_dir)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert [o.accepted_per_step for o in outs[0]] == [o.accepted_per_step for o in outs[1]]
    assert sum(a for o in outs[0] for a in o.accepted_per_step) > 0, "the BF16 MTP layers must draft usefully"


def _broken(fp8_dir: Path, tmp_path: Path, name: str, edit) -> Path:
    dst = tmp_path / name
    shutil.copytree(fp8_dir, dst)
    tensors, raw = read_tensors(dst), read_config(dst)
    edit(tensors, raw)
    write_tensors(dst / "model.safetensors", tensors)
    write_config(dst, raw)
    return dst


def test_bad_fp8_checkpoints_are_refused_by_name(source: Path, tmp_path: Path) -> None:
    fp8_dir, _ = quantized_pair(source, tmp_path, (16, 16))
    w = "model.layers.1.self_attn.o_proj.weight"
    cases = {
        "no-scale": (lambda t, r: t.pop(w + "_scale_inv"), f"{w} is FP8 but has no {w}_scale_inv"),
        "scale-shape": (lambda t, r: t.__setitem__(w + "_scale_inv", torch.ones(1, 1)), f"{w}_scale_inv has shape"),
        "static": (lambda t, r: r["quantization_config"].__setitem__("activation_scheme", "static"), "activation_scheme"),
        "no-block": (lambda t, r: r["quantization_config"].pop("weight_block_size"), "weight_block_size"),
        "method": (lambda t, r: r.__setitem__("quantization_config", {"quant_method": "compressed-tensors"}),
                   "quantization method 'compressed-tensors' is not supported"),
        "unquantised-config": (lambda t, r: r.pop("quantization_config"), "FP8 but config.json has no quantization_config"),
    }
    for name, (edit, message) in cases.items():
        with pytest.raises(CheckpointError, match=message.replace(".", r"\.").replace("[", r"\[")):
            load_model(_broken(fp8_dir, tmp_path, name, edit), torch.float32, "cpu")
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


@torch.no_grad()
def test_scales_in_another_shard_than_their_weights(source: Path, tmp_path: Path) -> None:
    fp8_dir, _ = quantized_pair(source, tmp_path, (16, 16))
    tensors = read_tensors(fp8_dir)
    shards = {"scales.safetensors": {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}}
    shards["weights.safetensors"] = {n: t for n, t in tensors.items() if n not in shards["scales.safetensors"]}
    sharded = tmp_path / "sharded"
    shutil.copytree(fp8_dir, sharded)
    (sharded / "model.safetensors").unlink()
    for file, part in shards.items():
        write_tensors(sharded / file, part)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    whole, split = (load_model(p, torch.float32, "cpu") for p in (fp8_dir, sharded))
    for (name, a), (_, b) in zip(whole.target.named_parameters(), split.target.named_parameters()):
        assert torch.equal(a, b), name
