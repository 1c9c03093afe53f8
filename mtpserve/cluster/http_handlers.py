"""The OpenAI endpoints' bodies (mtpserve.cluster.http_server builds the app and serves it).

Each endpoint turns its body into (prompt, SamplingParams) with the same validation as the gRPC router,
and describes its answer twice: whole (`respond`, from all deltas) and as stream chunks (`chunks`, per
delta). The last delta of a request carries its finish reason and the usage figures.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mtpserve.cluster import openai_protocol as oa
from mtpserve.cluster.http_server import OpenAIServer
from mtpserve.cluster.router import Delta
from mtpserve.errors import InvalidRequestError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def add_routes(app: FastAPI, state: OpenAIServer) -> None:
    @app.get("/health")
    async def health() -> Response:
        """gRPC health's SERVING as 200; stopped, recovering from a worker fault, or failed as 503."""
        loop = state.servicer.engine_loop
        if loop.serving():
            return JSONResponse({"status": "ok"})
        status = loop.failure or ("recovering from a worker fault" if loop.recovering else "engine stopped")
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "mtpserve", "max_model_len": state.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: oa.CompletionRequest, request: Request) -> Response:
        state.check_model(body)
        prompt = body.the_prompt()
        params = body.sampling_params(body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS,
                                      body.logprobs)
        view = _CompletionView(state, body, params.logprobs)
        return await state.generate(request, prompt, params, view.respond, view.chunks if body.stream else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: oa.ChatCompletionRequest, request: Request) -> Response:
        state.check_model(body)
        num_logprobs = body.num_logprobs()
        prompt = state.chat_prompt(body)
        wanted = body.wanted_max_tokens()
        # No limit given: up to the context (the engine refuses a prompt that leaves no room).
        max_tokens = wanted if wanted is not None else max(state.max_model_len - len(prompt), 1)
        with _renamed("max_tokens", "max_completion_tokens" if body.max_completion_tokens is not None else None):
            params = body.sampling_params(max_tokens, num_logprobs)
            view = _ChatView(state, body, num_logprobs)
            return await state.generate(request, prompt, params, view.respond, view.chunks if body.stream else None)


@contextlib.contextmanager
def _renamed(field: str, as_given: str | None) -> Iterator[None]:
    """Errors about `field` name the request's own field for it (max_completion_tokens is max_tokens inside)."""
    try:
        yield
    except InvalidRequestError as e:
        if as_given is None or e.field != field:
            raise
        raise InvalidRequestError(as_given, str(e).removeprefix(f"{field}: ")) from e


class _View:
    def __init__(self, state: OpenAIServer, body: oa._Common, num_logprobs: int | None) -> None:
        self.state, self.body, self.num_logprobs = state, body, num_logprobs
        self.created = int(time.time())

    def with_ids(self, choice: dict[str, Any], delta: Delta) -> dict[str, Any]:
        return {**choice, "token_ids": delta.token_ids} if self.body.return_token_ids else choice

    def usage_chunk(self, request_id: str, kind: Any, delta: Delta) -> Iterator[dict[str, Any]]:
        if delta.finish_reason is not None and self.body.include_usage:
            yield {**oa.envelope(request_id, kind, self.state.model_name, [], self.created), "usage": oa.usage(delta)}


class _CompletionView(_View):
    text_offset = 0  # where the next chunk's tokens start in the completion (logprobs' text_offset)

    def logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        out = oa.completion_logprobs(delta, self.num_logprobs, self.state.token_text, self.text_offset)
        self.text_offset += sum(len(t) for t in out["tokens"])
        return out

    def respond(self, request_id: str, deltas: list[Delta]) -> dict[str, Any]:
        whole = _joined(deltas)
        choice = self.with_ids({"index": 0, "text": whole.text, "logprobs": self.logprobs(whole),
                                "finish_reason": whole.finish_reason}, whole)
        return {**oa.envelope(request_id, "text_completion", self.state.model_name, [choice], self.created),
                "usage": oa.usage(whole)}

    def chunks(self, request_id: str, delta: Delta) -> Iterator[dict[str, Any]]:
        choice = self.with_ids({"index": 0, "text": delta.text, "logprobs": self.logprobs(delta),
                                "finish_reason": delta.finish_reason}, delta)
        chunk = oa.envelope(request_id, "text_completion", self.state.model_name, [choice], self.created)
        yield {**chunk, "usage": None} if self.body.include_usage else chunk
        yield from self.usage_chunk(request_id, "text_completion", delta)


class _ChatView(_View):
    started = False  # the first chunk carries the role

    def logprobs(self, delta: Delta) -> dict[str, Any] | None:
        return None if self.num_logprobs is None else oa.chat_logprobs(delta, self.num_logprobs, self.state.token_text)

    def respond(self, request_id: str, deltas: list[Delta]) -> dict[str, Any]:
        whole = _joined(deltas)
        choice = self.with_ids({"index": 0, "message": {"role": "assistant", "content": whole.text},
                                "logprobs": self.logprobs(whole), "finish_reason": whole.finish_reason}, whole)
        return {**oa.envelope(request_id, "chat.completion", self.state.model_name, [choice], self.created),
                "usage": oa.usage(whole)}

    def chunks(self, request_id: str, delta: Delta) -> Iterator[dict[str, Any]]:
        message: dict[str, Any] = {} if self.started else {"role": "assistant"}
        if delta.text or delta.token_ids or not self.started:
            message["content"] = delta.text
        self.started = True
        choice = self.with_ids({"index": 0, "delta": message, "finish_reason": delta.finish_reason,
                                "logprobs": self.logprobs(delta) if delta.token_ids else None}, delta)
        chunk = oa.envelope(request_id, "chat.completion.chunk", self.state.model_name, [choice], self.created)
        yield {**chunk, "usage": None} if self.body.include_usage else chunk
        yield from self.usage_chunk(request_id, "chat.completion.chunk", delta)


def _joined(deltas: list[Delta]) -> Delta:
    """A request's deltas as one (the last carries the finish reason and the totals)."""
    last = deltas[-1]
    wanted = any(d.logprobs is not None for d in deltas)
    logprobs = [lp for d in deltas for lp in d.logprobs or []] if wanted else None
    return Delta([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), logprobs,
                 last.finish_reason, last.prompt_tokens, last.completion_tokens, last.accepted_draft_tokens,
                 last.steps)
