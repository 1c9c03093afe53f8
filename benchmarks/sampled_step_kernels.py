#!/usr/bin/env python
"""Sampled steps at a large vocabulary (issue 12): the draft and verification kernels against the torch forms
they replaced, in one run.

    python benchmarks/sampled_step_kernels.py [--device cuda] [--batch 1,8,64,256] [--vocab 151936] [--k 3]

draft:  one draft position from [B, V] float32 logits under temperature. The former torch form (the
        tempered softmax over the vocabulary, its top M renormalised, a counter-based uniform, the inverse
        CDF, greedy rows' argmax; copied inline here) against sampling.sample_draft (a topk, then
        kernels/draft_sample.py on CUDA).
verify: k drafts per request against the target's p [B, k + 1, V]: rejection.verify with its uniforms (the
        torch form) against rejection.verify_seeded (kernels/rejection_verify.py on CUDA: one program per
        request scans the vocabulary, so a large vocabulary at a small batch is its hard case).
On CUDA each call is captured in a CUDA graph (as a step runs it) and the replays are timed with CUDA
events; elsewhere both sides are torch and eager (a smoke run). Checks first that both sides emit the same
tokens (draft rows may differ where float rounding decides an inverse-CDF draw: at most 1 %).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Table  # noqa: E402
from sampling_benchmark import graphed  # noqa: E402

from mtpserve.workers.rejection import verify, verify_seeded  # noqa: E402
from mtpserve.workers.sampling import (STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE, SamplingTensors, sample,  # noqa: E402
                                       sample_draft, to_probs, top_m, uniforms)


def temperature_settings(temperature: torch.Tensor, seed: torch.Tensor) -> SamplingTensors:
    """Rows [B] sampled under temperature alone."""
    b, dev = temperature.shape[0], temperature.device
    ones, zeros = torch.ones(b, device=dev), torch.zeros(b, device=dev)
    return SamplingTensors(
        temperature=temperature, top_k=torch.zeros(b, dtype=torch.long, device=dev), top_p=ones, min_p=zeros,
        repetition=ones, presence=zeros, frequency=zeros, greedy=torch.zeros(b, dtype=torch.bool, device=dev),
        seed=seed, use_penalties=False, use_top_k=False, use_top_p=False, use_min_p=False, all_greedy=False)


def torch_draft(logits: torch.Tensor, st: SamplingTensors, m: int, index: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft as the chain sampled it before 5fe290d."""
    ids, probs = top_m(to_probs(logits, st), m)
    sampled = ids.gather(1, sample(probs, uniforms(st.seed, index, STREAM_DRAFT))[:, None]).squeeze(1)
    return torch.where(st.greedy, logits.argmax(-1), sampled), ids, probs


def torch_verify(p: torch.Tensor, args: tuple, seed: torch.Tensor, frontier: torch.Tensor):
    """rejection.verify with the uniforms drawn as the step drew them (part of its cost)."""
    k, index = p.shape[1] - 1, frontier[:, None] + torch.arange(p.shape[1], device=p.device)
    return verify(p, *args, uniforms(seed[:, None], index[:, :k], STREAM_ACCEPT),
                  uniforms(seed[:, None], index, STREAM_SAMPLE))


def verify_case(batch: int, k: int, vocab: int, m: int, gen: torch.Generator, device: torch.device):
    """p from random logits, drafts drawn from a top-m proposal of a nearby distribution."""
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 3
    p = torch.softmax(logits, -1)
    values, q_ids = (logits[:, :k] + 0.5 * torch.randn(batch, k, vocab, generator=gen)).topk(m, dim=-1)
    q_probs = torch.softmax(values, -1)
    pick = torch.multinomial(q_probs.reshape(-1, m), 1, generator=gen).view(batch, k)
    drafts = q_ids.gather(2, pick[..., None])[..., 0]
    args = (logits.argmax(-1), drafts, q_ids, q_probs, torch.full((batch,), k), torch.zeros(batch, dtype=torch.bool))
    return p.to(device), tuple(a.to(device) for a in args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.add_argument("--batch", default="1,8,64,256", help="requests per call, comma-separated")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=int, default=3, help="drafts verified per request")
    p.add_argument("--top-m", type=int, default=32, help="proposal entries per draft (EngineConfig.draft_top_m)")
    common.add_timing_args(p)
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, batch="1,8", vocab=4096, iters=5)
    device = common.pick_device(args.device, args.tiny)
    table = Table(f"sampled step parts over a {args.vocab}-token vocabulary (ms per call, median of {args.iters})",
                  ["batch", "draft torch ms", "draft kernel ms", "ratio", "verify torch ms", "verify kernel ms",
                   "ratio"])
    gen = torch.Generator().manual_seed(0)
    differ = 0
    for b in common.parse_ints(args.batch):
        logits = (torch.randn(b, args.vocab, generator=gen) * 3).to(device)
        st = temperature_settings((0.5 + torch.rand(b, generator=gen)).to(device),
                                  torch.randint(0, 1 << 40, (b,), generator=gen).to(device))
        index = torch.randint(16, 4096, (b,), generator=gen).to(device)
        old, new = torch_draft(logits, st, args.top_m, index), sample_draft(logits, st, args.top_m, index)
        differ += int((old[0] != new[0]).sum())
        common.check(int((old[0] != new[0]).sum()) <= max(1, b // 100), f"batch {b}: the drafts differ")
        probs, pargs = verify_case(b, args.k, args.vocab, args.top_m, gen, device)
        seed, frontier = st.seed, index
        want, got = torch_verify(probs, pargs, seed, frontier), verify_seeded(probs, *pargs, seed, frontier)
        common.check(torch.equal(want[1], got[1]), f"batch {b}: the verifications accepted different drafts")
        times = [common.median(common.time_ms(graphed(fn, device), device, args.warmup, args.iters)) for fn in (
            lambda: torch_draft(logits, st, args.top_m, index), lambda: sample_draft(logits, st, args.top_m, index),
            lambda: torch_verify(probs, pargs, seed, frontier), lambda: verify_seeded(probs, *pargs, seed, frontier))]
        table.add(str(b), times[0], times[1], f"{times[0] / times[1]:.2f}x", times[2], times[3],
                  f"{times[2] / times[3]:.2f}x")
    how = "CUDA-graph replays" if device.type == "cuda" else "eager calls (both sides torch: a smoke run)"
    common.report(args, "sampled_step_kernels", device, [table], [
        f"device: {common.device_name(device)}", f"timed: {how}", f"k = {args.k} drafts, top-M {args.top_m}",
        "ratio: torch ms / kernel ms (> 1: the kernel is faster)",
        f"draft rows whose token differed (float rounding in the inverse CDF): {differ}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
