"""Compile before serving what a replica without prefill steps would otherwise compile while serving.

A replica whose prompts take the eager general path (a drafter group: its prefill steps would have to hand
their rows to the group; or `prefill_step_rows=0`) launches its Triton kernels with tiles that follow the
prompt chunk (attention's M tile grows with the chunk's queries) and with the request's sampling features.
Each new combination compiled inside a served step: on two H100s a lone k = 0 request in a group replica ran
at 0.06 of the in-process engine's tok/s, target rank 0 caught compiling attention under `_run_general`
(benchmarks/RESULTS.md, run 223). So before serving, the engine sends every rank, through its ordinary
executor and so in the same order on all of them, a few synthetic prompts whose lengths step through every
attention tile (and one batch of several, one sampled request with penalties and logprobs), each freed by
the next plan. Nothing of the scheduler sees them: their blocks are taken from a pool that nothing uses yet
(at start; after a recovery, which freed every block and forgot the prefix cache, the new workers warm up too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mtpserve.boundary.messages import NewRequest, StepPlan, StepResult
from mtpserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mtpserve.cluster.engine_config import ResolvedConfig

# Prompt lengths: 2^i + 1 crosses into the next M tile of attention for any GQA group up to 16 (the tile is the
# next power of two of queries x heads per KV head); Triton compiles an integer argument apart where it is 1 or a
# multiple of 16 (token counts: 1, 16, 64), and 250 fills 16 blocks of 16 (a block table's width).
LENGTHS = (1, 2, 3, 5, 9, 16, 17, 33, 64, 65, 129, 250)
BATCH_LENGTHS = (3, 9, 17, 40)  # one step of several requests: attention's K/V tile follows the program count
WARMUP_PREFIX = "__warmup"  # the synthetic requests' ids (freed before any client's request arrives)


class _Executes(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


def wanted(r: "ResolvedConfig") -> bool:
    """Whether this replica warms up: `compile_warmup` if set; by default where prompts take the general path
    on a GPU (a drafter group, prefill or uniform steps turned off) and graphs are captured at start."""
    c = r.config
    if c.compile_warmup is not None:
        return c.compile_warmup
    eager_prompts = c.drafter_devices > 0 or c.prefill_step_rows == 0 or not c.uniform_steps
    return r.device.type == "cuda" and c.capture_graphs_at_start and eager_prompts


def plans(r: "ResolvedConfig") -> list[StepPlan]:
    """The warm-up's plans, in order: each prompt alone then freed, a batch then freed, a sampled one then freed."""
    # The replica's default k (a drafter group's "auto" drafts its upper bound): the chain drafts from the prefill,
    # past the last module too where it recurses.
    k = r.default_num_spec if r.num_mtp_modules else 0
    out: list[StepPlan] = []
    for i, requests in enumerate(_batches(r, k)):
        new = _new_requests(r, k, i, requests)
        if new:
            ids, groups = [q.request_id for q in new], 1 + r.num_mtp_modules
            out += [StepPlan(new, ids, [q.num_prompt_tokens for q in new], [0] * len(new),
                             [[[] for _ in range(groups)] for _ in new]),
                    StepPlan(freed_ids=ids)]
    return out


def _batches(r: "ResolvedConfig", k: int) -> list[list[tuple[int, SamplingParams]]]:
    """Each step's requests as (prompt length, sampling), within the context and the step's token budget."""
    c = r.config
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
    sampled = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.2,
                             presence_penalty=0.3, frequency_penalty=0.2, ignore_eos=True, logprobs=2,
                             num_speculative_tokens=k)
    fits = [n for n in LENGTHS if n + k + 1 < r.max_model_len and n <= c.max_num_batched_tokens]
    if not fits:
        return []
    batches = [[(n, greedy)] for n in fits]
    batch = [n for n in BATCH_LENGTHS if n + k + 1 < r.max_model_len][: c.max_num_seqs]
    if sum(batch) <= c.max_num_batched_tokens:
        batches.append([(n, greedy) for n in batch])
    return batches + [[(fits[len(fits) // 2], sampled)]]


def _new_requests(r: "ResolvedConfig", k: int, step: int, requests: list[tuple[int, SamplingParams]]
                  ) -> list[NewRequest]:
    """One step's synthetic requests, each on its own blocks (the same ids in every KV group) from block 0 up;
    those past the pool are left out."""
    new, first, vocab = [], 0, r.model_config.vocab_size
    for j, (n, params) in enumerate(requests):
        blocks = -(-(n + k + 1) // r.config.block_size)  # the prompt and its first step's drafts
        if first + blocks > r.num_blocks:
            break
        tokens = [(17 * t + 3) % vocab for t in range(n)]
        new.append(NewRequest(f"{WARMUP_PREFIX}-{step}-{j}", tokens, n, params, k, seed=step,
                              block_ids=[list(range(first, first + blocks))] * (1 + r.num_mtp_modules)))
        first += blocks
    return new


def run(executor: _Executes, r: "ResolvedConfig") -> int:
    """Execute the warm-up's plans on every rank (results dropped) -> how many ran. An executor with a hang
    detector (`compiling`) gives these steps the start-up timeout: each may compile several kernels, and none
    says how long a serving step takes."""
    steps = plans(r)
    before = getattr(executor, "compiling", None)
    if before is not None:
        executor.compiling = True
    try:
        for plan in steps:
            executor.execute(plan)
    finally:
        if before is not None:
            executor.compiling = before
    return len(steps)
