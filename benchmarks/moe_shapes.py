"""MoE slices for step_benchmark.py --shape glm45-air | dsv3: one verify step against its floor.

    python benchmarks/step_benchmark.py --shape glm45-air               # H100: ~12 GB of FP8 weights
    python benchmarks/step_benchmark.py --shape dsv3                    # H100: ~50 GB of FP8 weights
    python benchmarks/step_benchmark.py --shape dsv3 --tiny --device cpu   # seconds

A slice is the released model's real widths (hidden size, heads, expert count and width, MLA ranks,
vocabulary) with few layers: the first dense layer and three MoE layers, plus one MoE MTP module as
both checkpoints ship. Random weights are made on the device, block-quantised FP8 as DeepSeek ships
them (every *_proj matrix with 128x128 scales; MLA's kv_b_proj is served dequantised, norms, router,
embedding and LM head stay bf16), and they take the same path a real FP8 checkpoint takes on CUDA:
models/fp8_linear.py picks and swaps the FP8 modules. On a CPU (--tiny) the weights are plain, as
the loader dequantises there.

Floor (docs/design.md §6) = bytes the step must read / measured copy bandwidth, where the routed
experts count only as far as this step's tokens reach them: a hook on every router counts the
distinct experts each MoE pass routes to (it runs inside the captured CUDA graphs too: an index_fill
and a sum per pass), and each such expert adds its FP8 bytes and scales. Everything else a pass reads
is counted whole: attention (MLA's projections incl. the dequantised kv_b_proj), shared experts, the
dense layer, routers, norms, the LM head; per draft the MTP module's non-expert weights + LM head;
and the KV the target and the drafting module attend over (GQA K and V; MLA's one latent entry).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import common
from common import Table, check, gb
import step_benchmark as sb
from step_profile import profile_table
import torch
from torch import nn

from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS
from mtpserve.workers.model_runner import ModelRunner, RunnerConfig
from mtpserve.workers.models import fp8_linear
from mtpserve.workers.models.config import ModelConfig
from mtpserve.workers.models.decoder import TargetModel
from mtpserve.workers.models.loader import LoadedModel, default_dtype
from mtpserve.workers.models.moe import Experts, Router
from mtpserve.workers.models.mtp import MTPStack
from mtpserve.workers.models.weight_names import mtp_specs, target_specs

_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

# zai-org/GLM-4.5-Air config.json (as printed by ms-swift's Glm4MoeConfig dump of GLM-4.5-Air;
# the same numbers in slime's scripts/models/glm4.5-106B-A12B.sh): 46 layers, the first dense.
# GLM-4.5-Air-FP8 is not block-scaled; the slice is, so that it runs the kernels served here.
GLM45_AIR: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 4096, "intermediate_size": 10944,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
    "attention_bias": True, "use_qk_norm": False, "n_routed_experts": 128, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "n_group": 1,
    "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-5,
    "rope_theta": 1000000, "vocab_size": 151552, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
}
# deepseek-ai/DeepSeek-V3 config.json (DeepSeek-R1 shares it; vendored verbatim as config_Deepseek_R1 in a
# public parameter-counting test): 61 layers, the first 3 dense; shipped FP8 with 128x128 blocks.
DSV3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "attention_bias": False,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                          "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "original_max_position_embeddings": 4096},
    "vocab_size": 129280, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
}
SHAPES = {"glm45-air": GLM45_AIR, "dsv3": DSV3}
# The slice: one dense layer, then MoE (DeepSeek-V3's first 3 dense layers would leave one MoE layer).
SLICE = {"num_hidden_layers": 4, "first_k_dense_replace": 1}
# --tiny: the same architecture at toy widths (block 16x16 so every quantised matrix has whole blocks).
TINY = {
    "glm45-air": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "vocab_size": 512, "num_hidden_layers": 3},
    "dsv3": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 4,
             "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
             "v_head_dim": 16, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
             "moe_intermediate_size": 32, "vocab_size": 512, "num_hidden_layers": 3},
}


def hf_config(shape: str, tiny: bool, context: int) -> dict[str, Any]:
    raw = {**SHAPES[shape], **SLICE, **(TINY[shape] if tiny else {})}
    raw["quantization_config"] = {**_FP8, "weight_block_size": [16, 16] if tiny else [128, 128]}
    # Positions the run reaches, not the released 128k/160k: the rope table and graph block tables.
    raw["max_position_embeddings"] = max(8192, context + 1024)
    return raw


@torch.no_grad()
def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int,
                fp8: bool | None = None) -> LoadedModel:
    """Random weights on the device; FP8 (as a block-scaled checkpoint is served) on CUDA, or as `fp8` says."""
    with torch.device("meta"), default_dtype(dtype):
        model = LoadedModel(cfg, TargetModel(cfg).eval(), None)  # type: ignore[arg-type]
        model.mtp = MTPStack(cfg, model.target.rotary).eval()
        if (device.type == "cuda" if fp8 is None else fp8) and cfg.fp8 is not None:  # the modules a checkpoint quantised so would get
            specs = target_specs(cfg) + mtp_specs(cfg)
            params = fp8_linear.servable(specs, {s.ckpt_name for s in specs if s.ckpt_name.endswith("_proj.weight")},
                                         cfg.fp8.block)
            fp8_linear.swap_in(model.target, {p for p in params if not p.startswith("mtp.")}, cfg.fp8.block)
            fp8_linear.swap_in(model.mtp, {p for p in params if p.startswith("mtp.")}, cfg.fp8.block)
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in (model.target.to_empty(device=device), model.mtp.to_empty(device=device)):
        for name, param in module.named_parameters():
            _fill(name, param, gen)
    model.target.rotary.reset()
    return model


_FP8_SPREAD = 32.0  # fp8 values ~ N(0, 32^2) (within e4m3's 448); the scale brings them to std 0.02


def _fill(name: str, param: torch.Tensor, gen: torch.Generator) -> None:
    if name.endswith("norm.weight"):
        param.fill_(1.0)
    elif name.endswith(fp8_linear.SCALE_SUFFIX):
        param.uniform_(0.75, 1.25, generator=gen).mul_(0.02 / _FP8_SPREAD)
    elif param.dtype == torch.float8_e4m3fn:
        rows = param.view(-1, param.shape[-1])  # in chunks: the fp32 draw of a whole expert stack is GBs
        for lo in range(0, rows.shape[0], 8192):
            chunk = rows[lo:lo + 8192]
            draw = torch.randn(chunk.shape, generator=gen, device=chunk.device) * _FP8_SPREAD
            chunk.copy_(draw.clamp(-448, 448).to(torch.float8_e4m3fn))
    elif name.endswith("e_score_correction_bias"):
        param.zero_()
    else:  # std 0.02 like HF's init
        param.normal_(0.0, 0.02, generator=gen)


class RoutedExperts:
    """Counts, per router, the distinct experts each forward pass routes to and the passes, in device
    counters [routers, 2] (hooks recorded into CUDA graphs as they are captured, so replays count too)."""

    def __init__(self, model: LoadedModel) -> None:
        routers = [(n, m) for root in (model.target, model.mtp) for n, m in root.named_modules()
                   if isinstance(m, Router)]
        self.names = [n for n, _ in routers]
        device = model.target.embed_tokens.weight.device
        self.counts = torch.zeros(len(routers), 2, dtype=torch.long, device=device)
        for i, (_, router) in enumerate(routers):
            router.register_forward_hook(self._hook(i, router.moe.num_experts))

    def _hook(self, i: int, num_experts: int):
        def hook(module: nn.Module, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            experts = output[1].reshape(-1)
            hit = torch.zeros(num_experts, dtype=torch.long, device=experts.device).index_fill_(0, experts, 1)
            self.counts[i].add_(torch.stack((hit.sum(), torch.ones_like(hit[0]))))
        return hook

    def reset(self) -> None:
        self.counts.zero_()

    def read(self) -> dict[str, tuple[int, int]]:
        """router name -> (experts routed to, summed over passes; passes)."""
        return {n: (int(h), int(c)) for n, (h, c) in zip(self.names, self.counts.tolist())}


def nbytes_experts(module: nn.Module) -> int:
    return sum(sb.nbytes(m) for m in module.modules() if isinstance(m, Experts))


def floor_bytes(model: LoadedModel, routed: dict[str, tuple[int, int]], batch: int, k: int, context: int,
                dsize: int) -> tuple[int, int, float]:
    """(weight bytes, KV bytes, mean experts routed to per target MoE layer) of one verify step with k drafts."""
    cfg, target, moe = model.config, model.target, model.config.moe
    assert moe is not None
    expert = sb.nbytes(next(m for m in target.modules() if isinstance(m, Experts))) // moe.num_experts
    head = target.lm_head.weight.numel() * dsize
    weights = sb.nbytes(target) - nbytes_experts(target) - target.embed_tokens.weight.numel() * dsize
    target_hits = [h for n, (h, _) in routed.items() if not n.startswith("mtp.")]
    weights += expert * sum(target_hits)
    module = model.mtp.mtp[0]
    weights += k * (sb.nbytes(module) - nbytes_experts(module) + head)
    # Draft passes: the experts they route to. The chain may run the module over more rows than the
    # k drafts need (e.g. the verified window); only k passes' worth counts, at their mean reach.
    hits, passes = map(sum, zip(*[v for n, v in routed.items() if n.startswith("mtp.")] or [(0, 0)]))
    weights += expert * (hits * k // passes if passes else 0)
    kv = batch * (context + k + 1) * cfg.kv_bytes_per_token * dsize * (cfg.num_layers + k)
    return weights, kv, sum(target_hits) / max(len(target_hits), 1)


def _runner(model: LoadedModel, args: argparse.Namespace, ks: list[int], batches: list[int], dtype: torch.dtype,
            device: torch.device) -> tuple[ModelRunner, sb.Driver]:
    steps_total = args.warmup + args.iters + 3 + max(args.profile_steps, 0)
    positions = args.context + steps_total * (max(ks) + 1) + 2 * MAX_SPECULATIVE_TOKENS
    blocks_per_req = math.ceil(positions / args.block_size)
    max_batch = max(batches + [args.profile_batch])
    # max_model_len = what the run reaches: graphs size MLA's torch-reference gather by it (not by seq_lens).
    config = RunnerConfig(blocks_per_req * max_batch, args.block_size, max_batch, len(model.mtp), "depth", 32,
                          max_model_len=positions)
    runner = ModelRunner(model, config, dtype, device)
    return runner, sb.Driver(runner, model.config, blocks_per_req, args.seed)


def main(args: argparse.Namespace) -> int:
    """step_benchmark.py's run for an MoE slice (its parsed arguments; --mtp and the size flags are the shape's)."""
    device = common.pick_device(args.device, args.tiny)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches, ks = common.parse_ints(args.batches), sorted(set(common.parse_ints(args.drafts)))
    check(max(ks) <= MAX_SPECULATIVE_TOKENS and min(ks) >= 0, "--drafts must be in [0, 8]")
    cfg = ModelConfig.from_dict(hf_config(args.shape, args.tiny, args.context))
    if cfg.mla is not None:
        # MLA attends through the torch reference on CUDA too (attention.attend_latent): its prefill scores
        # are [requests, heads x tokens, context] fp32, 8.6 GB for 16 prompts of 1k at 128 heads.
        args.prefill_tokens = min(args.prefill_tokens, 4096)
    torch.manual_seed(args.seed)
    bw = common.measure_bandwidth(device, int(args.bandwidth_gb * 1e9))
    model = build_model(cfg, dtype, device, args.seed)
    dsize = torch.finfo(dtype).bits // 8
    fp8_modules = sum(isinstance(m, (fp8_linear.FP8Linear, fp8_linear.FP8Experts)) for m in model.target.modules())
    print(f"device {common.device_name(device)}; copy bandwidth {bw / 1e12:.3f} TB/s; {args.shape} slice weights: "
          f"target {gb(sb.nbytes(model.target)):.2f} GB ({gb(nbytes_experts(model.target)):.2f} GB routed experts), "
          f"MTP {gb(sb.nbytes(model.mtp)):.2f} GB; {fp8_modules} FP8 modules in the target")
    counter = RoutedExperts(model)  # before the runner: graphs captured from now on record the hooks
    runner, driver = _runner(model, args, ks, batches, dtype, device)
    sb.use_gemm(runner, args.skinny_gemm.split(",")[0].strip())
    for k in ks:  # warm-up of every window shape (Triton compiles, graph captures, allocator)
        driver.prefill(min(2, max(batches)), k, args.context, args.prefill_tokens)
        for _ in range(max(args.warmup, 1)):
            driver.verify_step(k)

    table = Table(f"{args.shape} slice verify step, context {args.context}, bandwidth {bw / 1e12:.2f} TB/s (copy)",
                  ["batch", "k", "window", "step ms", "vs k=0", "experts/layer", "weights GB", "KV GB", "floor ms",
                   "step/floor", "tok/s @AL=k+1"])
    for batch in batches:
        base = None
        for k in ks:
            ms = common.median(sb.time_step(driver, batch, k, k, device, args))
            base = ms if k == 0 else base
            counter.reset()
            driver.verify_step(k)  # one more step, its routing counted
            w, kv, hits = floor_bytes(model, counter.read(), batch, k, args.context, dsize)
            floor_ms = (w + kv) / bw * 1e3
            table.add(str(batch), str(k), str(k + 1), ms, ms / base if base else None, f"{hits:.1f}", gb(w), gb(kv),
                      floor_ms, ms / floor_ms, f"{batch * (k + 1) / ms * 1e3:.0f}")
            print(f"batch {batch:3d} k {k}: step {ms:8.2f} ms, {hits:.1f} experts/layer, floor {floor_ms:.2f} ms")
    tables = [table]
    if args.profile_steps > 0:
        driver.prefill(args.profile_batch, args.profile_k, args.context, args.prefill_tokens)
        for _ in range(args.warmup):
            driver.verify_step(args.profile_k)
        tables.append(profile_table(driver, device, args.profile_k, args.profile_steps, args.top))
    common.report(args, f"step_benchmark --shape {args.shape}", device, tables, notes(cfg, model, args, bw, dtype))
    return 0


def notes(cfg: ModelConfig, model: LoadedModel, args: argparse.Namespace, bw: float, dtype: torch.dtype) -> list[str]:
    moe = cfg.moe
    assert moe is not None
    attn = (f"MLA q_lora {cfg.mla.q_lora_rank}, kv_lora {cfg.mla.kv_lora_rank}, {cfg.num_heads} heads"
            if cfg.mla else f"{cfg.num_heads}/{cfg.num_kv_heads} heads, head_dim {cfg.head_dim}")
    fp8 = "FP8 128x128-block weights (Triton GEMMs)" if dtype == torch.bfloat16 else "plain weights (CPU path)"
    return [f"{args.shape} slice: hidden {cfg.hidden_size}, {cfg.num_layers} layers ({moe.first_dense_layers} dense), "
            f"{attn}, {moe.num_experts} experts x {moe.intermediate_size} top-{moe.top_k} + {moe.num_shared_experts} "
            f"shared, vocab {cfg.vocab_size}; {len(model.mtp)} MoE MTP module; {fp8}; {dtype} activations; random",
            f"measured copy bandwidth {bw / 1e12:.3f} TB/s; step = median of {args.iters} after {args.warmup} warm-up",
            "floor = (weights read: non-expert target weights w/o embedding + experts routed to in the step x expert "
            "bytes + per draft (MTP module w/o experts + LM head + its routed experts) + KV read) / bandwidth; "
            "experts/layer = distinct experts the step's tokens reach per target MoE layer"]
