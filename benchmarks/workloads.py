"""Workloads for the engine-level benchmarks (acceptance.py, spec_matrix.py): prompts, a tiny trained
checkpoint for --tiny runs, and a closed-loop driver of LLMEngine.step that timestamps every token.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import importlib.util
import json
import sysconfig
import textwrap
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Awaitable, Callable

import common  # also puts the repository root on sys.path
import torch

from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.engine_config import DEFAULT_MODEL_DIR
from mtpserve.cluster.stats import SpecCounters
from mtpserve.sampling_params import SamplingParams

TRAIN_TOOL = common.REPO / "tools" / "train_default_model.py"


# --- prompts -----------------------------------------------------------------------------------


def load_train_tool() -> ModuleType | None:
    """tools/train_default_model.py as a module (it is a script, not a package), or None if absent."""
    if not TRAIN_TOOL.is_file():
        return None
    spec = importlib.util.spec_from_file_location("train_default_model", TRAIN_TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def heldout_function_prompts(n: int, num_lines: int) -> list[str]:
    """The first `num_lines` lines of functions from the stdlib files the default model never trained on.

    Uses the training tool's own split (sha256 of the relative path), "test" half first, then "val"
    (val only chose which weights to keep). One function per file per round, so the prompts spread
    over many modules instead of coming from the first file's first n methods.
    """
    tool = load_train_tool()
    if tool is None:
        raise SystemExit(f"{TRAIN_TOOL} is missing: pass --prompts FILE")
    files = tool.stdlib_files(Path(sysconfig.get_paths()["stdlib"]))
    per_file: list[deque[str]] = []
    for split in ("test", "val"):
        for rel, text in files:
            if tool.split_of(rel) != split:
                continue
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            lines = text.splitlines()
            found = deque()
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    head = lines[node.lineno - 1 : node.lineno - 1 + num_lines]
                    if len(head) == num_lines:
                        found.append(textwrap.dedent("\n".join(head)) + "\n")
            if found:
                per_file.append(found)
    prompts: list[str] = []
    while len(prompts) < n and any(per_file):
        for q in per_file:
            if q and len(prompts) < n:
                prompts.append(q.popleft())
    if len(prompts) < n:
        raise SystemExit(f"only {len(prompts)} held-out function prompts found, {n} asked for")
    return prompts


def file_prompts(path: Path, n: int) -> list[str]:
    """Prompts from a file: .jsonl (a JSON string or {"prompt": ...} per line) or one prompt per line."""
    out: list[str] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            item = json.loads(line)
            out.append(item["prompt"] if isinstance(item, dict) else str(item))
        else:
            out.append(line)
    if not out:
        raise SystemExit(f"--prompts {path}: no prompts in the file")
    return [out[i % len(out)] for i in range(n)]  # cycle when the file has fewer than n


def get_prompts(source: str, n: int, num_lines: int) -> list[str]:
    return heldout_function_prompts(n, num_lines) if source == "stdlib" else file_prompts(Path(source), n)


# --- checkpoints -------------------------------------------------------------------------------


def resolve_model(model: str | None, tiny: bool, workdir: Path) -> Path:
    """--model, else the embedded default model, else (with --tiny) a tiny code model trained now."""
    if model:
        return Path(model)
    if tiny:
        return tiny_code_checkpoint(workdir / "tiny_code_model")
    if DEFAULT_MODEL_DIR.is_dir():
        return DEFAULT_MODEL_DIR
    raise SystemExit(f"no default model at {DEFAULT_MODEL_DIR}: train it (tools/train_default_model.py) "
                     "or pass --model DIR")


def tiny_code_checkpoint(path: Path, steps: int = 60) -> Path:
    """A tiny Qwen3 + 3 MTP modules with a byte-level BPE tokenizer, trained for seconds on stdlib
    code through the training tool, so --tiny runs the same text path as the default model. One already trained
    at `path` (a second engine of the same run) is used again."""
    if (path / "tokenizer.json").is_file():
        return path
    from mtpserve.workers.models import train as T
    from mtpserve.workers.models.writer import save_checkpoint

    tool = load_train_tool()
    if tool is None:
        raise SystemExit(f"{TRAIN_TOOL} is missing: --tiny needs it to build a tiny code model")
    files = tool.stdlib_files(Path(sysconfig.get_paths()["stdlib"]))
    texts = [t for rel, t in tool._prefix_by_bytes([f for f in files if tool.split_of(f[0]) == "train"], 300_000)]
    tok = tool.train_tokenizer(texts, 512)
    eot = tok.token_to_id(tool.EOT)
    cfg = T.tiny_config(vocab_size=tok.get_vocab_size(), num_mtp=3, eos_token_id=eot)
    cfg["max_position_embeddings"] = 1024
    target, mtp = T.train_tiny(tool.encode_stream(tok, texts, eot), cfg, steps=steps, seed=0, seq_len=64,
                               batch_size=16, lr=1e-2)
    save_checkpoint(path, cfg, target, mtp, dtype=torch.float32)
    tok.save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eot}) + "\n")
    return path


# --- the engine loop ---------------------------------------------------------------------------


@dataclass
class Job:
    prompt: str | list[int]
    params: SamplingParams


@dataclass
class Trace:
    """One request as the caller of LLMEngine.step sees it (perf_counter seconds)."""

    submitted: float
    token_times: list[float] = field(default_factory=list)  # one per token, tokens of a step share a time
    sampled_steps: int = 0  # steps in which this request emitted tokens (target passes that sampled)
    token_ids: list[int] = field(default_factory=list)
    finished: float | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for single-token outputs)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


@dataclass
class Run:
    traces: list[Trace]
    wall: float
    engine_steps: int
    spec: SpecCounters

    @property
    def num_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.traces)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall

    @property
    def steps_per_token(self) -> float:
        """Per request: target passes that emitted tokens / tokens emitted (1 / tokens per pass)."""
        return sum(t.sampled_steps for t in self.traces) / max(1, self.num_tokens)

    def position_rates(self, k: int) -> list[float]:
        """Per draft position j: fraction of verify steps with a j-th draft in which it was accepted
        (accepting position j requires every earlier one; vLLM's per-position acceptance rate)."""
        s = self.spec
        return [s.accepted_per_position[j] / s.drafted_per_position[j] if s.drafted_per_position[j] else float("nan")
                for j in range(k)]


def drive(engine: LLMEngine, jobs: list[Job], concurrency: int, prefix: str) -> Run:
    """Closed loop: keep `concurrency` requests in flight, submitting the next job when one finishes.

    Timestamps come from this loop (the moment step() returns the tokens), i.e. what a streaming
    client of an in-process engine would see.
    """
    pending = deque(enumerate(jobs))
    traces: dict[str, Trace] = {}
    before = copy.deepcopy(engine.spec)
    in_flight = 0

    def submit() -> None:
        nonlocal in_flight
        i, job = pending.popleft()
        rid = f"{prefix}-{i}"
        traces[rid] = Trace(time.perf_counter())
        engine.add_request(rid, job.prompt, job.params)
        in_flight += 1

    t0 = time.perf_counter()
    while pending and in_flight < concurrency:
        submit()
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            tr = traces[o.request_id]
            if o.new_token_ids:
                tr.token_times += [now] * len(o.new_token_ids)
                tr.token_ids += o.new_token_ids
                tr.sampled_steps += 1
            if o.finished:
                tr.finished, in_flight = now, in_flight - 1
                if pending:
                    submit()
    wall = time.perf_counter() - t0
    spec = copy.deepcopy(engine.spec)
    spec.num_drafts -= before.num_drafts
    spec.num_draft_tokens -= before.num_draft_tokens
    spec.num_accepted_tokens -= before.num_accepted_tokens
    for j in range(len(spec.accepted_per_position)):
        spec.accepted_per_position[j] -= before.accepted_per_position[j]
        spec.drafted_per_position[j] -= before.drafted_per_position[j]
    ordered = [traces[f"{prefix}-{i}"] for i in range(len(jobs))]
    return Run(ordered, wall, steps, spec)


def drive_grpc(address: str, jobs: list[Job], concurrency: int, token: str | None = None) -> Run:
    """The closed loop of `drive`, through a running server's gRPC API (mtpserve.cluster.client).

    Timestamps are taken when each streamed chunk arrives. Per-position acceptance is not in the
    API's usage (only accepted drafts and verify steps per request), so `spec` carries totals only.
    """
    from mtpserve.cluster.client import AsyncClient

    async def run() -> Run:
        async with AsyncClient(address, token=token) as client:
            async def one(job: Job, tr: Trace, spec: SpecCounters) -> None:
                async for delta in client.stream(job.prompt, job.params):
                    _arrived(tr, delta.token_ids)
                    if delta.finish_reason is not None:
                        tr.finished = time.perf_counter()
                        if delta.usage is not None:
                            spec.num_drafts += delta.usage.steps
                            spec.num_accepted_tokens += delta.usage.accepted_draft_tokens

            return await _closed_loop(jobs, concurrency, one)

    return asyncio.run(run())


def drive_http(address: str, model: str, jobs: list[Job], concurrency: int, token: str | None = None) -> Run:
    """The closed loop of `drive`, through a running server's OpenAI HTTP API (the official `openai` client,
    streaming /v1/completions with our extras and `return_token_ids`). Timestamps: as in drive_grpc."""
    import openai

    async def run() -> Run:
        async with openai.AsyncOpenAI(base_url=f"http://{address}/v1", api_key=token or "none", max_retries=0,
                                      timeout=600) as client:
            async def one(job: Job, tr: Trace, spec: SpecCounters) -> None:
                p = job.params
                stream = await client.completions.create(
                    model=model, prompt=job.prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                    seed=p.seed, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": p.ignore_eos, "num_speculative_tokens": p.num_speculative_tokens,
                                "return_token_ids": True})
                async for chunk in stream:
                    if chunk.choices:
                        _arrived(tr, chunk.choices[0].token_ids)
                    if chunk.usage is not None:  # the last chunk
                        tr.finished = time.perf_counter()
                        spec.num_drafts += chunk.usage.steps
                        spec.num_accepted_tokens += chunk.usage.accepted_draft_tokens

            return await _closed_loop(jobs, concurrency, one)

    return asyncio.run(run())


def _arrived(tr: Trace, token_ids: list[int]) -> None:
    if token_ids:
        tr.token_times += [time.perf_counter()] * len(token_ids)
        tr.token_ids += token_ids
        tr.sampled_steps += 1  # a chunk per engine step that emitted tokens


async def _closed_loop(jobs: list[Job], concurrency: int, one: Callable[[Job, Trace, SpecCounters], Awaitable[None]]
                       ) -> Run:
    """Keep `concurrency` of `one(job, trace, spec)` in flight until every job ran."""
    pending = deque(enumerate(jobs))
    traces: list[Trace | None] = [None] * len(jobs)
    spec = SpecCounters()

    async def worker() -> None:
        while pending:  # single-threaded event loop: check-then-pop cannot race
            i, job = pending.popleft()
            traces[i] = Trace(time.perf_counter())
            await one(job, traces[i], spec)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)))))
    return Run([t for t in traces if t is not None], time.perf_counter() - t0, 0, spec)
