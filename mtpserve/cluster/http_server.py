"""The OpenAI-compatible HTTP API (docs/design.md §7), served by the same replica as the gRPC router.

FastAPI on uvicorn, on the replica's event loop: requests go into the same EngineLoop as gRPC ones,
count against the same admission limit (the servicer's `outstanding`, touched only on this loop),
share the metrics the engine loop records and the bearer token. Endpoints: POST /v1/completions,
POST /v1/chat/completions (server-sent events with stream = true), GET /v1/models, GET /health.
Errors carry OpenAI's error body: 400 bad input (naming the field as gRPC's INVALID_ARGUMENT does),
401 wrong token, 404 unknown model, 429 queue full, 503 engine stopped, replica failed after worker faults
or queue full while it recovers (with Retry-After), 500 engine failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from functools import lru_cache
from typing import Any, AsyncIterator, Callable, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtpserve.cluster import openai_protocol as oa
from mtpserve.cluster.chat_template import ChatTemplate
from mtpserve.cluster.router import (MAX_REQUEST_ID_LEN, RECOVERY_RETRY_MS, Delta, EngineFailed, EngineLoop,
                                     GenerationServicer, ReplicaUnavailable, _sink_for)
from mtpserve.errors import InvalidRequestError
from mtpserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
UNAUTHENTICATED_PATHS = ("/health",)  # probes carry no credentials


class APIError(Exception):
    """An error answered with OpenAI's error body and this HTTP status."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, oa.error_body(message, kind, param, code), headers

    @staticmethod
    def invalid(e: InvalidRequestError) -> "APIError":
        return APIError(400, str(e), "invalid_request_error", e.field)

    @staticmethod
    def failed(e: EngineFailed) -> "APIError":
        """A replica that gave up after worker faults is unavailable (503: another one may serve, as gRPC's
        UNAVAILABLE says); any other engine failure is an internal error (500)."""
        return APIError(503 if isinstance(e, ReplicaUnavailable) else 500, str(e), "server_error")

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


ADMITTED = None  # what engine_stream yields first: the engine took the request (its refusals come before)


async def engine_stream(servicer: GenerationServicer, request_id: str, prompt: str | list[int],
                        params: SamplingParams) -> AsyncIterator[Delta | None]:
    """ADMITTED, then a request's deltas from the shared engine loop; raises InvalidRequestError or EngineFailed.
    Ending the iteration early (a client gone, a cancelled task) aborts the request, as a gRPC stream's end does."""
    engine_loop: EngineLoop = servicer.engine_loop
    if not engine_loop.is_alive() or engine_loop.failure:
        raise APIError(503, engine_loop.failure or "the engine has stopped", "server_error")
    if servicer.outstanding >= servicer.max_outstanding and engine_loop.recovering:
        raise APIError(503, f"queue full while the replica recovers from a worker fault: retry in "
                            f"{RECOVERY_RETRY_MS / 1000:g} s", "server_error",
                       headers={"Retry-After": str(-(-RECOVERY_RETRY_MS // 1000))})
    if servicer.outstanding >= servicer.max_outstanding:
        raise APIError(429, f"queue full: {servicer.outstanding} requests in flight "
                            f"(limit {servicer.max_outstanding})", "rate_limit_error")
    items: asyncio.Queue = asyncio.Queue()
    sink = _sink_for(items)
    servicer.outstanding += 1
    live = True
    try:
        engine_loop.add(request_id, prompt, params, time.monotonic(), sink)
        # The engine thread takes commands in order: once this no-op has run, the add was handled, and a
        # refusal is already in `items` (the sink hops onto this loop before the future's callback does).
        await asyncio.wrap_future(engine_loop.call(lambda engine: None))
        pending = [] if items.empty() else [items.get_nowait()]
        if not (pending and isinstance(pending[0], (InvalidRequestError, EngineFailed))):
            yield ADMITTED
        while True:
            item = pending.pop() if pending else await items.get()
            if isinstance(item, (InvalidRequestError, EngineFailed)):
                live = False
                raise item
            if item.finish_reason is not None:
                live = False
            yield item
            if not live:
                return
    finally:
        servicer.outstanding -= 1
        if live:
            engine_loop.abort(request_id, owner=sink)


class OpenAIServer:
    """The app's state: what it shares with the gRPC router, and the model's tokenizer and chat template."""

    def __init__(self, servicer: GenerationServicer, model_name: str, tokenizer: Any, template: ChatTemplate | None,
                 max_model_len: int, token: str | None) -> None:
        self.servicer, self.model_name, self.tokenizer = servicer, model_name, tokenizer
        self.template, self.max_model_len, self.token = template, max_model_len, token
        self.token_text: Callable[[int], str] = lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        # Special tokens keep their text here: a logprob entry must say which token it is.
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- request -> engine ---------------------------------------------------------------------------------
    def check_model(self, body: oa._Common) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def chat_prompt(self, body: oa.ChatCompletionRequest) -> list[int]:
        if self.template is None or self.tokenizer is None:
            raise InvalidRequestError("messages", "this model has no chat template (use /v1/completions)")
        if not body.messages:
            raise InvalidRequestError("messages", "at least one message is required")
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        text = self.template.render(messages, body.add_generation_prompt, **(body.chat_template_kwargs or {}))
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens

    async def generate(self, request: Request, prompt: str | list[int], params: SamplingParams,
                       respond: Callable[[str, list[Delta]], dict[str, Any]],
                       chunks: Callable[[str, Delta], Iterator[dict[str, Any]]] | None) -> Response:
        """Run one request: the whole answer as JSON, or (with `chunks`) server-sent events."""
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        if len(request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequestError("request_id", f"longer than {MAX_REQUEST_ID_LEN} characters")
        stream = engine_stream(self.servicer, request_id, prompt, params)
        try:
            await anext(stream)  # refusals (bad prompt, duplicate id) become a status, not an event
        except EngineFailed as e:
            raise APIError.failed(e) from e
        if chunks is None:
            return JSONResponse(respond(request_id, await _all_unless_gone(request, stream)))
        return StreamingResponse(_events(request_id, stream, chunks), media_type="text/event-stream")


async def _all_unless_gone(request: Request, stream: AsyncIterator[Delta]) -> list[Delta]:
    """All deltas; if the client goes away first, the request is aborted (its KV freed) instead."""
    async def rest() -> list[Delta]:
        return [d async for d in stream]

    collect = asyncio.ensure_future(rest())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()  # its stream's finally aborts the request
            await asyncio.gather(collect, return_exceptions=True)
            await stream.aclose()
    try:
        return collect.result()
    except asyncio.CancelledError:
        raise APIError(499, "the client closed the request", "invalid_request_error") from None
    except EngineFailed as e:
        raise APIError.failed(e) from e


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(request_id: str, stream: AsyncIterator[Delta],
                  chunks: Callable[[str, Delta], Iterator[dict[str, Any]]]) -> AsyncIterator[str]:
    try:
        async for delta in stream:
            for chunk in chunks(request_id, delta):
                yield _sse(chunk)
    except EngineFailed as e:  # mid-stream: the status is sent already, so the error is an event
        yield _sse(oa.error_body(str(e), "server_error"))
    finally:
        await stream.aclose()  # the client went away: abort the request
    yield "data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# -- the endpoints ------------------------------------------------------------------------------------
def build_app(state: OpenAIServer) -> FastAPI:
    from mtpserve.cluster.http_handlers import add_routes  # the endpoints' bodies

    app = FastAPI(title="mtpserve OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(InvalidRequestError)
    async def invalid(_: Request, e: InvalidRequestError) -> JSONResponse:
        return APIError.invalid(e).response()

    @app.exception_handler(RequestValidationError)
    async def malformed(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid body"}
        where = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        return APIError(400, f"{where}: {first['msg']}", "invalid_request_error", where).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail), "invalid_request_error").response()

    if state.token:
        app.add_middleware(BearerAuth, token=state.token)
    add_routes(app, state)
    return app


class BearerAuth:
    """Plain ASGI middleware (BaseHTTPMiddleware would get between streams and client disconnects)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in UNAUTHENTICATED_PATHS:
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                refusal = APIError(401, "missing or wrong bearer token", "invalid_request_error", None,
                                   "invalid_api_key")
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn on a loop it does not own: the replica handles SIGTERM/SIGINT, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """The app under uvicorn as a task of the running event loop."""

    def __init__(self, state: OpenAIServer, host: str, port: int, log_level: str = "warning") -> None:
        self.config = uvicorn.Config(build_app(state), host=host, port=port, lifespan="off", access_log=False,
                                     log_level=log_level.lower(), timeout_graceful_shutdown=5)
        self.server = _EmbeddedServer(self.config)
        self.task: asyncio.Task | None = None
        self.port = 0

    async def start(self) -> int:
        sock = self.config.bind_socket()  # binds now: a port already taken fails here, loudly
        # Accepted connections inherit this (Linux): without it, Nagle holds a stream's small chunk until the
        # client's delayed ACK of the previous one, some 40 ms on a kept-alive connection.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.port = sock.getsockname()[1]
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:  # start-up, once: no request can be waiting yet
            if self.task.done():
                self.task.result()
                raise OSError(f"http_port: the HTTP server did not start on {self.config.host}:{self.port}")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop accepting, give requests in flight `grace` seconds, then cancel them (aborting their requests)."""
        if self.task is None:
            return
        self.config.timeout_graceful_shutdown = max(grace, 0.01)
        self.server.should_exit = True
        await asyncio.gather(self.task, return_exceptions=True)
