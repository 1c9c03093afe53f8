#!/usr/bin/env python
"""One verify step of an 8B-shaped target + 3 MTP modules against the docs/design.md §6 floor.

    python benchmarks/step_benchmark.py                      # Llama-3-8B shapes, bf16, on cuda (~17.5 GB)
    python benchmarks/step_benchmark.py --tiny --device cpu  # tiny shapes, seconds

Random weights are made on the device (modules built on the meta device, materialised with
to_empty, then filled): nothing 16 GB ever exists on the host. ModelRunner.execute is driven
directly with hand-built StepPlans, as the scheduler would send them: B new requests with --context
random prompt tokens are prefilled (that step samples one token and drafts k), then every timed step
verifies a window of 1 + k tokens per request (num_tokens 1, num_drafts k), and drafts k again.
Weights are random, so drafts are rejected and each step emits one token per request; the work a
step does (target over B*(k+1) rows, k drafter passes) does not depend on acceptance.

Columns: step (median, CUDA events around one step launched and read alone: the device also idles
while the host prepares it); overlapped (ms per step of steps launched the way the engine's async
scheduling launches them, step n + 1 before step n is read: what a step costs in serving when the
device is the bottleneck, as it is at 8B); lean = the same-run plain-PyTorch reference (benchmarks/lean_step.py:
a dense-KV SDPA verify step of k + 1 tokens plus k one-module + LM-head draft steps, each one CUDA
graph, over the same weights) and step/lean, the ratio the project is held to; the floor =
(bytes a step must read) / (bandwidth measured here by a large device-to-device copy), and
step/floor and overlapped/floor. Bytes read: every target weight but the embedding table (rows are gathered), plus per
draft j the MTP module's weights and the shared LM head again (each draft is its own head matmul),
plus the KV the target and each drafting module attend over. A torch.profiler table splits one
verify step (--profile-batch, --profile-k) into its top kernels by self device time.

A verify window alone (issue 12's second target, "verify windows of 4 tokens"): a step of window k + 1 that
drafts none (chain 0), against a k = 0 step's floor over the window's KV; the k-draft rows above also hold
the chain. One draft position (issue 12's third target): a step that verifies one draft and drafts one (window 2,
chain 1: MTP module 0 over the window's rows, the LM head, draft sampling) minus a step of the same
window that drafts none, against its own floor: module 0's weights + the LM head + module 0's KV. (A
step that drafts pads its verify window to its chain: measured against the k = 0 step, as before
f5bb8b8, the row also held a second target row per request.)
--skinny-gemm off,auto (a list) times every row once per linear dispatch mode
(mtpserve/kernels/linear_dispatch.py), recapturing the graphs in between: an A/B in one run;
--skinny-table loads a benchmarks/gemm_benchmark.py table first (else auto measures shapes itself).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Table, check, gb  # noqa: E402
from lean_step import LeanStep  # noqa: E402
from step_profile import dispatch_table, draft_profile_table, profile_table  # noqa: E402
from step_windows import draft_position_ms, verify_window_ms  # noqa: E402
from mtpserve.kernels import linear_dispatch, pdl  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from mtpserve.boundary.messages import NewRequest, StepPlan, StepResult  # noqa: E402
from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS, SamplingParams  # noqa: E402
from mtpserve.workers.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from mtpserve.workers.models.config import ModelConfig  # noqa: E402
from mtpserve.workers.models.decoder import TargetModel  # noqa: E402
from mtpserve.workers.models.loader import LoadedModel  # noqa: E402
from mtpserve.workers.models.mtp import MTPStack  # noqa: E402

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    common.add_llama8b_shape_args(p)
    p.add_argument("--mtp", type=int, default=3, help="MTP modules")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--drafts", default="0,1,2,3", help="k values: windows of k + 1 tokens")
    p.add_argument("--context", type=int, default=1024, help="prefilled tokens per request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-tokens", type=int, default=16384, help="prompt tokens per prefill step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--bandwidth-gb", type=float, default=4.0, help="size of the copy that measures bandwidth")
    p.add_argument("--profile-batch", type=int, default=32)
    p.add_argument("--profile-k", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled; the table is per step")
    p.add_argument("--top", type=int, default=15, help="rows of the profile table")
    p.add_argument("--profile-draft", action="store_true",
                   help="also profile one draft position at --profile-batch: the kernels of step(window 2, chain 1) "
                        "beyond step(window 2, chain 0)")
    p.add_argument("--no-lean", action="store_true",
                   help="skip the lean reference (its dense KV would not fit beside the paged pool)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skinny-gemm", default="off",
                   help="linear dispatch mode(s), comma-separated from off,on,auto: each row is timed per mode")
    p.add_argument("--skinny-table", type=Path, default=None, help="gemm_benchmark.py --table-out JSON to load")
    p.add_argument("--shape", choices=("llama8b", "glm45-air", "dsv3"), default="llama8b",
                   help="llama8b (the size flags above), or an FP8 MoE slice of GLM-4.5-Air / DeepSeek-V3 "
                        "(benchmarks/moe_shapes.py: real widths, 4 layers + 1 MTP module; size flags and --mtp unused)")
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                         vocab=512, batches="1,4", context=64, iters=5, warmup=1, bandwidth_gb=0.1,
                         profile_batch=4, profile_steps=1)
    return args


def hf_config(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "vocab_size": a.vocab, "hidden_size": a.hidden,
        "intermediate_size": a.intermediate, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim, "rms_norm_eps": 1e-5,
        "max_position_embeddings": max(8192, a.context + 1024), "rope_theta": 500000.0,
        "tie_word_embeddings": False, "num_nextn_predict_layers": a.mtp,
    }


@torch.no_grad()
def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> LoadedModel:
    """Random weights straight on the device: meta modules -> to_empty -> fill (no default init, no host copy)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            target = TargetModel(cfg)
            mtp = MTPStack(cfg, target.rotary)
    finally:
        torch.set_default_dtype(old)
    target.to_empty(device=device)
    mtp.to_empty(device=device)
    target.rotary.reset()
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in (target, mtp):
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:  # std 0.02 like HF's init: bounded activations, no inf/nan through 32 layers
                param.normal_(0.0, 0.02, generator=gen)
    return LoadedModel(cfg, target.eval(), mtp.eval())


def nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class Driver:
    """Builds the StepPlans the scheduler would send, for one runner reused across configurations."""

    def __init__(self, runner: ModelRunner, cfg: ModelConfig, blocks_per_req: int, seed: int) -> None:
        self.runner, self.cfg, self.blocks_per_req = runner, cfg, blocks_per_req
        self.groups = 1 + runner.config.num_mtp_modules
        self.rng = np.random.default_rng(seed)
        self.live: list[str] = []
        self.serial = 0

    def prefill(self, batch: int, k: int, context: int, chunk_tokens: int) -> None:
        """Drop the previous configuration's requests, add `batch` new ones and prefill them."""
        freed, self.live = self.live, []
        per_step = max(1, chunk_tokens // context)
        for lo in range(0, batch, per_step):
            new = []
            for i in range(lo, min(batch, lo + per_step)):
                blocks = list(range(i * self.blocks_per_req, (i + 1) * self.blocks_per_req))
                rid = f"r{self.serial}"
                self.serial += 1
                tokens = self.rng.integers(0, self.cfg.vocab_size, context).tolist()
                new.append(NewRequest(rid, tokens, context, GREEDY, k, self.serial, [blocks] * self.groups))
            ids = [n.request_id for n in new]
            plan = StepPlan(new, ids, [context] * len(new), [0] * len(new),
                            [[[] for _ in range(self.groups)] for _ in new], freed_ids=freed)
            result = self.runner.execute(plan)
            check(result.req_ids == ids, "every prefilled request samples its first token")
            self.live += ids
            freed = []

    def plan(self, k: int, chain: int | None = None) -> StepPlan:
        """Every live request verifies k drafts and drafts `chain` (None: its own k)."""
        n = len(self.live)
        return StepPlan([], list(self.live), [1] * n, [k] * n, [[[] for _ in range(self.groups)] for _ in range(n)],
                        num_spec=[] if chain is None else [chain] * n)

    def verify_step(self, k: int, chain: int | None = None) -> None:
        """Verify k drafts per request and draft `chain` (None: the requests' own k). Verifying a draft and
        making none (chain 0) is the step after k fell to 0: here it repeats, verifying a stale draft, to time
        a verify window without its chain."""
        result = self.runner.execute(self.plan(k, chain))
        self._validate(result, k)

    def overlapped_ms(self, k: int, device: torch.device, warmup: int, iters: int, chain: int | None = None) -> float:
        """ms per step of verify steps launched as the engine's async scheduling does (design §8): step n + 1
        submitted before step n is read, so the host's share of a step hides behind the device's."""
        plan = self.plan(k, chain)

        def advance(handle: Any) -> Any:  # launch the next step, then read the one in flight
            following = self.runner.submit(plan)
            self._validate(self.runner.wait(handle), k)
            return following

        handle = self.runner.submit(plan)
        for _ in range(warmup):
            handle = advance(handle)
        common.sync(device)  # the step in flight finishes here, before the clock starts: it is not counted
        t0 = time.perf_counter()
        for _ in range(iters):
            handle = advance(handle)
        self._validate(self.runner.wait(handle), k)
        common.sync(device)
        # The clock saw the iters steps launched after it started (until 2026-11-28 this divided by iters + 1,
        # and every overlapped figure read 1 / (iters + 1) low: 2.4 % at 40 iters, 9 % at 10).
        return (time.perf_counter() - t0) * 1e3 / iters

    def _validate(self, result: StepResult, k: int) -> None:
        check(result.req_ids == self.live, "every request verifies")
        check(all(0 <= a <= k and len(t) == a + 1 for a, t in zip(result.num_accepted, result.token_ids)),
              f"a window of {k} drafts emits accepted + 1 tokens")
        check(all(0 <= x < self.cfg.vocab_size for t in result.token_ids for x in t), "token ids in the vocabulary")
        self.last = result


def floor_bytes(model: LoadedModel, batch: int, k: int, context: int, dtype_size: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one verify step with k drafts must read (see the module docstring)."""
    cfg, target = model.config, model.target
    weights = nbytes(target) - target.embed_tokens.weight.numel() * dtype_size
    modules = [min(j, len(model.mtp) - 1) for j in range(k)]  # depth chain, recursing on the last module
    head = target.lm_head.weight.numel() * dtype_size
    weights += sum(nbytes(model.mtp.mtp[m]) + head for m in modules)
    kv_token_layer = 2 * cfg.num_kv_heads * cfg.head_dim * dtype_size
    kv = batch * (context + k + 1) * kv_token_layer * (cfg.num_layers + len(modules))
    return weights, kv


def window_floor_bytes(model: LoadedModel, batch: int, k: int, context: int, dtype_size: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) of a verify window of k + 1 tokens without its chain: a k = 0 step's weights, and
    the target's KV over the window's positions (no module's)."""
    return floor_bytes(model, batch, 0, context + k, dtype_size)


def draft_floor_bytes(model: LoadedModel, batch: int, context: int, dtype_size: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) of one draft position: MTP module 0, the LM head, module 0's KV."""
    cfg = model.config
    weights = nbytes(model.mtp.mtp[0]) + model.target.lm_head.weight.numel() * dtype_size
    return weights, batch * (context + 1) * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_size


def use_gemm(runner: ModelRunner, mode: str) -> None:
    """Switch the linear dispatch; graphs captured under another mode are dropped (they hold its kernels)."""
    if linear_dispatch.mode() != mode:
        linear_dispatch.set_mode(mode)
        if runner.uniform is not None:  # a pool whose graphs are all gone must not be captured into again
            runner.uniform.graphs.clear()
            runner.uniform.pool = torch.cuda.graph_pool_handle() if runner.uniform.use_graphs else None


def time_step(driver: Driver, batch: int, spec: int, drafts: int, device: torch.device,
              args: argparse.Namespace) -> list[float]:
    """Prefill `batch` requests that draft `spec` tokens, then time steps verifying `drafts` each."""
    driver.prefill(batch, spec, args.context, args.prefill_tokens)
    return common.time_ms(lambda: driver.verify_step(drafts), device, args.warmup, args.iters)


def lean_ms(model: LoadedModel, batch: int, context: int, window: int, draft: bool, device: torch.device,
            args: argparse.Namespace) -> float:
    """Median time of the lean reference step (freed again afterwards: its dense KV is large); NaN with
    --no-lean, or where its dense KV does not fit beside the runner's paged pool (on the H100, batch 32 at
    context 8192 ran out of memory and took the rows already timed down with it)."""
    if args.no_lean:
        return float("nan")
    try:
        lean = LeanStep(model, batch, context, window, draft)
        ms = common.median(common.time_ms(lean.runner(), device, args.warmup, args.iters))
    except torch.OutOfMemoryError:
        print(f"lean reference, batch {batch}, window {window}: out of memory beside the runner's KV pool (-)")
        ms = float("nan")
    lean = None  # its dense KV goes before the next allocation
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ms


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.shape != "llama8b":
        import moe_shapes  # it builds on this module's driver and profile table

        return moe_shapes.main(args)
    device = common.pick_device(args.device, args.tiny)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches, ks = common.parse_ints(args.batches), sorted(set(common.parse_ints(args.drafts)))
    check(max(ks) <= MAX_SPECULATIVE_TOKENS and min(ks) >= 0, "--drafts must be in [0, 8]")
    cfg = ModelConfig.from_dict(hf_config(args))
    torch.manual_seed(args.seed)
    modes = [m.strip() for m in args.skinny_gemm.split(",") if m.strip()]
    check(bool(modes) and all(m in linear_dispatch.MODES for m in modes), "--skinny-gemm: a list of off, on, auto")
    if args.skinny_table is not None:
        print(f"dispatch table: {linear_dispatch.load_table(args.skinny_table)} entries from {args.skinny_table}")

    bw = common.measure_bandwidth(device, int(args.bandwidth_gb * 1e9))
    model = build_model(cfg, dtype, device, args.seed)
    dsize = torch.finfo(dtype).bits // 8
    print(f"device {common.device_name(device)}; copy bandwidth {bw / 1e12:.3f} TB/s; weights: target "
          f"{gb(nbytes(model.target)):.2f} GB, MTP {gb(nbytes(model.mtp)):.2f} GB ({dtype})")

    steps_total = 2 * (args.warmup + args.iters + 2) + max(args.profile_steps, 0)  # serial, then overlapped
    # Room for the context, every timed step's window, and the drafter's writes past the frontier.
    positions = args.context + steps_total * (max(ks) + 1) + 2 * MAX_SPECULATIVE_TOKENS
    blocks_per_req = math.ceil(positions / args.block_size)
    max_batch = max(batches + [args.profile_batch])
    runner = ModelRunner(model, RunnerConfig(blocks_per_req * max_batch, args.block_size, max_batch, len(model.mtp),
                                             "depth", 32), dtype, device)
    driver = Driver(runner, cfg, blocks_per_req, args.seed)
    use_gemm(runner, modes[0])

    # Warm-up of every window shape once (Triton compiles per tile shape, the allocator grows, host
    # pages are first touched), so the first timed configuration pays for none of it.
    for k in ks:
        driver.prefill(min(2, max_batch), k, args.context, args.prefill_tokens)
        for _ in range(max(args.warmup, 1)):
            driver.verify_step(k)

    table = Table(f"verify step, context {args.context}, bandwidth {bw / 1e12:.2f} TB/s (copy)",
                  ["gemm", "batch", "k", "window", "step ms", "lean ms", "step/lean", "vs k=0", "weights GB", "KV GB",
                   "floor ms", "step/floor", "overlapped ms", "overlapped/floor", "tok/s @AL=k+1"])
    lean_table = Table("same-run lean reference (plain PyTorch, dense KV, SDPA, one CUDA graph each)",
                       ["batch", "verify w=1 ms", "verify w=k+1 ms (k=max)", "draft step ms"])
    draft_table = Table("one draft position: step(window 2, chain 1) - step(window 2, chain 0), i.e. MTP module 0 "
                        "over the window's rows + LM head + draft sampling; floor = module 0 + LM head + module 0's KV",
                        ["gemm", "batch", "draft ms", "lean draft ms", "draft/lean", "weights GB", "KV GB",
                         "floor ms", "draft/floor", "overlapped draft ms", "overlapped/floor"])
    window_table = Table("verify window alone: step(window k + 1, chain 0), i.e. the target over the window's rows, "
                         "LM head and verification without the MTP chain; floor = target weights + target KV",
                         ["gemm", "batch", "window", "step ms", "weights GB", "KV GB", "floor ms", "step/floor",
                          "overlapped ms", "overlapped/floor"])
    for batch in batches:
        lean_draft = lean_ms(model, batch, args.context, 1, True, device, args)
        lean_verify = {k: lean_ms(model, batch, args.context, k + 1, False, device, args) for k in ks}
        lean_table.add(str(batch), lean_verify[min(ks)], lean_verify[max(ks)], lean_draft)
        for mode in modes:
            use_gemm(runner, mode)
            base = None
            for k in ks:
                times = time_step(driver, batch, k, k, device, args)
                ms = common.median(times)
                overlapped = driver.overlapped_ms(k, device, args.warmup, args.iters)
                base = ms if k == 0 else base
                lean = lean_verify[k] + k * lean_draft
                w, kv = floor_bytes(model, batch, k, args.context, dsize)
                floor_ms = (w + kv) / bw * 1e3
                table.add(mode, str(batch), str(k), str(k + 1), ms, lean, ms / lean, ms / base if base else None,
                          gb(w), gb(kv), floor_ms, ms / floor_ms, overlapped, overlapped / floor_ms,
                          f"{batch * (k + 1) / ms * 1e3:.0f}")
                print(f"[{mode}] batch {batch:3d} k {k}: step {ms:8.2f} ms (min {min(times):.2f}), lean {lean:.2f} ms, "
                      f"floor {floor_ms:.2f} ms")
            for k in [k for k in ks if k > 0] if len(model.mtp) else []:
                ms, overlapped = verify_window_ms(driver, batch, k, device, args)
                w, kv = window_floor_bytes(model, batch, k, args.context, dsize)
                floor_ms = (w + kv) / bw * 1e3
                window_table.add(mode, str(batch), str(k + 1), ms, gb(w), gb(kv), floor_ms, ms / floor_ms, overlapped,
                                 overlapped / floor_ms)
            if len(model.mtp):
                draft, overlapped = draft_position_ms(driver, batch, device, args)
                w, kv = draft_floor_bytes(model, batch, args.context, dsize)
                floor_ms = (w + kv) / bw * 1e3
                draft_table.add(mode, str(batch), draft, lean_draft, draft / lean_draft, gb(w), gb(kv), floor_ms,
                                draft / floor_ms, overlapped, overlapped / floor_ms)
                print(f"[{mode}] batch {batch:3d} one draft position: {draft:.3f} ms, floor {floor_ms:.3f} ms")

    tables, profile_notes = [table, lean_table] + ([window_table, draft_table] if len(model.mtp) else []), []
    if linear_dispatch.table():  # which GEMM each shape ran and how near its floor, for the profile
        tables.append(dispatch_table(bw))
    if args.profile_steps > 0:
        driver.prefill(args.profile_batch, args.profile_k, args.context, args.prefill_tokens)
        for _ in range(args.warmup):
            driver.verify_step(args.profile_k)
        tables.append(profile_table(driver, device, args.profile_k, args.profile_steps, args.top))
        tables[-1].title += f"; linear dispatch {linear_dispatch.mode()}"
        if args.profile_draft and len(model.mtp):
            tables.append(draft_profile_table(driver, device, args.profile_batch, args))
        w, kv = floor_bytes(model, args.profile_batch, args.profile_k, args.context, dsize)
        profile_notes.append(f"profiled step's floors: weights {w / bw * 1e3:.2f} ms (what [all GEMM] could reach), "
                             f"KV {kv / bw * 1e3:.2f} ms ([all attention + KV store]); the step's own time (kernels "
                             "and the gaps between them) is in the first table")
        if pdl.enabled(device):
            profile_notes.append("with programmatic dependent launch a kernel's time includes its wait for the one "
                                 "before it: MTPSERVE_PDL=0 profiles each kernel alone")

    notes = [f"target: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads, "
             f"head_dim {cfg.head_dim}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}; "
             f"{len(model.mtp)} MTP modules; {dtype}; random weights",
             f"measured copy bandwidth {bw / 1e12:.3f} TB/s ((read + write) / time, {args.bandwidth_gb:g} GB copy)",
             f"step = median of {args.iters} after {args.warmup} warm-up (each step launched and read alone); "
             f"overlapped = mean over {args.iters} steps, each launched before the previous one is read; "
             "lean = lean verify (k+1 tokens) + k lean draft steps, timed in this run; tok/s @AL=k+1 is the "
             "ceiling if every draft were accepted",
             "floor = (target weights w/o embedding + per draft (module + LM head) + KV read) / bandwidth",
             "gemm = linear dispatch mode (MTPSERVE_SKINNY_GEMM; off = cuBLAS everywhere); modes timed: "
             + args.skinny_gemm + (f", table {args.skinny_table}" if args.skinny_table else ""),
             f"programmatic dependent launch (MTPSERVE_PDL): {'on' if pdl.enabled(device) else 'off'}"] + profile_notes
    common.report(args, "step_benchmark", device, tables, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
