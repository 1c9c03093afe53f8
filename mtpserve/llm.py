"""The offline API users know from vLLM: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from typing import Any, Sequence

from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.outputs import RequestOutput
from mtpserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs the engine in this process (or on Ray when tensor_parallel_size / drafter_devices ask for it).

    Keyword arguments are EngineConfig fields: dtype, device, num_speculative_tokens, mtp_chain,
    block_size, num_kv_blocks, max_num_seqs, max_num_batched_tokens, tensor_parallel_size, ...
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params):
            ids.append(str(self._next_id))
            self._next_id += 1
            self.engine.add_request(ids[-1], prompt, p)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in self.engine.step() if o.finished)
        return [done[i] for i in ids]

    def shutdown(self) -> None:
        self.engine.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
