"""OpenAI API request bodies and response objects (docs/design.md §7), and their mapping to SamplingParams.

Bodies are pydantic models that refuse unknown fields, so a misspelt option is a 400 naming it
instead of being silently ignored. Our own sampling extras (top_k, min_p, repetition_penalty,
num_speculative_tokens, ignore_eos, stop_token_ids) are accepted as extra body fields, as vLLM does
(`extra_body=` in the openai client). Values are range-checked by SamplingParams and the engine,
the same checks the gRPC router applies.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mtpserve.cluster.router import Delta
from mtpserve.errors import InvalidRequestError
from mtpserve.sampling_params import SamplingParams

TokenText = Any  # callable int -> str: a token's text as the tokenizer decodes it alone


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-monitoring tag
    # mtpserve / vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    num_speculative_tokens: int | Literal["auto"] | None = None  # "auto": the engine chooses per step
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False  # vLLM extra: each choice also carries its token ids

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError naming the field, as the gRPC router does."""
        if self.n != 1:
            raise InvalidRequestError("n", f"only n = 1 is supported, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "only allowed with stream = true")
        optional = {name: getattr(self, name) for name in (
            "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
            "repetition_penalty", "num_speculative_tokens") if getattr(self, name) is not None}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=self.stop_token_ids or (),
                              ignore_eos=self.ignore_eos, logprobs=logprobs, **optional)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def the_prompt(self) -> str | list[int]:
        """One prompt, as text or token ids (a batch of several is refused: n = 1, one choice)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequestError("prompt", f"one prompt per request is supported, got {len(p)}")
            p = p[0]
        if self.echo:
            raise InvalidRequestError("echo", "echo is not supported")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of", f"only best_of = 1 is supported, got {self.best_of}")
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template as they are
    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as a chat template reads it: content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidRequestError(f"messages[{index}].content", "only text content parts are supported")
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extra
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra: more variables for the template

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "requires logprobs = true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses --------------------------------------------------------------------------------------
def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(delta: Delta) -> dict[str, Any]:
    """OpenAI's usage plus the speculative figures (accepted drafts, verification steps)."""
    return {"prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens,
            "total_tokens": delta.prompt_tokens + delta.completion_tokens,
            "accepted_draft_tokens": delta.accepted_draft_tokens, "steps": delta.steps}


def _top(entries: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entries.items(), key=lambda kv: -kv[1])[:n]


def completion_logprobs(delta: Delta, n: int, token_text: TokenText, offset: int) -> dict[str, Any]:
    """The legacy completions format: tokens, their logprobs, the top n of each, text offsets."""
    tokens = [token_text(t) for t in delta.token_ids]
    offsets, at = [], offset
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    steps = delta.logprobs or []
    return {"tokens": tokens, "token_logprobs": [lp[t] for t, lp in zip(delta.token_ids, steps)],
            "top_logprobs": [{token_text(t): v for t, v in _top(lp, n)} for lp in steps], "text_offset": offsets}


def chat_logprobs(delta: Delta, n: int, token_text: TokenText) -> dict[str, Any]:
    """The chat format: per token its text, logprob, UTF-8 bytes and the top n alternatives."""
    def entry(t: int, lp: float) -> dict[str, Any]:
        text = token_text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**entry(t, lp[t]), "top_logprobs": [entry(a, v) for a, v in _top(lp, n)]}
                        for t, lp in zip(delta.token_ids, delta.logprobs or [])]}


def envelope(request_id: str, kind: Literal["text_completion", "chat.completion", "chat.completion.chunk"],
             model: str, choices: list[dict[str, Any]], created: int | None = None) -> dict[str, Any]:
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {"id": f"{prefix}-{request_id}", "object": kind, "created": created or int(time.time()), "model": model,
            "choices": choices}
