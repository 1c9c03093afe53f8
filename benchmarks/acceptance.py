#!/usr/bin/env python
"""Speculation quality of a checkpoint: acceptance length and per-position acceptance for k = 1..4.

    python benchmarks/acceptance.py                                 # the embedded default model, GPU if any
    python benchmarks/acceptance.py --model DIR --prompts prompts.jsonl --temperature 0.8
    python benchmarks/acceptance.py --tiny --device cpu             # a tiny code model trained now, seconds

Prompts: for the default model, the first --prompt-lines lines of functions from the standard-library
files tools/train_default_model.py held out (its own hash split), so the drafts are judged on code
the model never saw; or --prompts FILE (one prompt per line, or .jsonl of strings / {"prompt": ...}).

For each mode (greedy, and sampling at --temperature unless it is 0) and each k (plus k = 0 as the
reference) all prompts run together through the in-process engine (LLMEngine.step driven here):
  AL        acceptance length: tokens per verify step = 1 + accepted drafts / verify steps
  acc@j     fraction of verify steps whose draft j was accepted (needs every earlier draft accepted)
  steps/tok target passes that emitted tokens for a request / its tokens (k = 0: 1.0; ~1/AL)
  tok/s     generated tokens / wall time of the whole batch; speedup is against k = 0 in the same mode
  =k0       greedy only: fraction of requests whose output equals k = 0's token for token (lossless
            speculation makes this 1.0 up to floating-point ties in low precision)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import workloads  # noqa: E402
from common import Table, check  # noqa: E402

from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    common.add_model_prompt_args(p)
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--prompt-lines", type=int, default=2, help="lines of each held-out function in its prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="sampled mode's temperature; 0 = greedy only")
    p.add_argument("--ks", default="1,2,3,4", help="draft tokens per step to measure (k = 0 always runs)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, num_prompts=12, max_tokens=32)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device, args.tiny)
    ks = sorted(set([0] + common.parse_ints(args.ks)))
    with tempfile.TemporaryDirectory(prefix="mtpserve-acceptance-") as tmp:
        model = workloads.resolve_model(args.model, args.tiny, Path(tmp))
        engine = LLMEngine(EngineConfig(model=str(model), device=str(device), dtype=args.dtype,
                                        max_num_seqs=max(args.max_num_seqs, 1), seed=args.seed))
        prompts = workloads.get_prompts(args.prompts, args.num_prompts, args.prompt_lines)
        check(engine.tokenizer is not None, f"{model} has no tokenizer.json: text prompts cannot be encoded")
        modules = engine.model_config.mtp.num_modules
        check(modules > 0, f"{model} has no MTP modules")
        print(f"model {model}: {modules} MTP modules; {len(prompts)} prompts; device {common.device_name(device)}")

        modes = [("greedy", 0.0)] + ([(f"T={args.temperature:g}", args.temperature)] if args.temperature > 0 else [])
        # Warm-up (Triton compilation, allocator): a few prompts per k, not measured.
        for k in ks:
            warm = [workloads.Job(p, _params(0.0, 8, k, args.seed)) for p in prompts[:4]]
            workloads.drive(engine, warm, len(warm), f"warm{k}")

        table = Table(f"acceptance: {model.name}, {len(prompts)} prompts x {args.max_tokens} tokens",
                      ["mode", "k", "AL", *[f"acc@{j + 1}" for j in range(max(ks))], "steps/tok", "tok/s",
                       "speedup", "=k0"])
        for mode, temperature in modes:
            base_rate, base_tokens = 0.0, None
            for k in ks:
                jobs = [workloads.Job(p, _params(temperature, args.max_tokens, k, args.seed + i))
                        for i, p in enumerate(prompts)]
                run = workloads.drive(engine, jobs, len(jobs), f"{mode}-{k}")
                tokens = [t.token_ids for t in run.traces]
                check(all(len(t) == args.max_tokens for t in tokens), "every request must emit max_tokens")
                if k == 0:
                    check(run.spec.num_drafts == 0, "k = 0 must verify no drafts")
                    base_rate, base_tokens = run.tokens_per_s, tokens
                else:
                    check(run.spec.num_drafts > 0, f"k = {k} verified no drafts")
                    check(run.spec.num_accepted_tokens <= run.spec.num_draft_tokens, "accepted > drafted")
                same = sum(a == b for a, b in zip(tokens, base_tokens)) / len(tokens) if temperature == 0 else None
                rates = run.position_rates(k) + [float("nan")] * (max(ks) - k)
                table.add(mode, str(k), run.spec.acceptance_length, *rates, run.steps_per_token,
                          f"{run.tokens_per_s:.1f}", run.tokens_per_s / base_rate, same)
        engine.shutdown()

    notes = [f"model: {args.model or ('tiny code model trained by the script' if args.tiny else 'default model')}",
             f"prompts: {args.prompts} ({len(prompts)}, {args.prompt_lines} lines each)" if args.prompts == "stdlib"
             else f"prompts: {args.prompts}",
             "all prompts in flight together; AL = 1 + accepted/verify steps; acc@j = P(draft j accepted)"]
    common.report(args, "acceptance", device, [table], notes)
    return 0


def _params(temperature: float, max_tokens: int, k: int, seed: int) -> SamplingParams:
    # ignore_eos: every request emits exactly max_tokens, so rows with different k compare like for like.
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                          num_speculative_tokens=k, seed=seed)


if __name__ == "__main__":
    sys.exit(main())
