"""The gRPC router (docs/design.md §2, §7): an asyncio servicer in front of one engine thread.

The engine is not thread-safe, so one thread owns it (EngineLoop). The asyncio side talks to it
through an inbox (add / abort / call / stop); the engine thread answers each request through a sink
that hops back onto the event loop with call_soon_threadsafe into that request's asyncio.Queue.
What crosses the thread boundary is a Delta snapshot, never the live RequestOutput, which the
engine keeps mutating on later steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, NoReturn

import grpc

from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.metrics import PrometheusLogger
from mtpserve.errors import InvalidRequestError, ReplicaFailed
from mtpserve.outputs import RequestOutput
from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS, SPEC_AUTO, SPEC_AUTO_WIRE, SamplingParams
from mtpserve.v1 import generation_pb2 as pb
from mtpserve.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

FIELD_METADATA_KEY = "mtpserve-field"  # trailing metadata naming the invalid field
MAX_REQUEST_ID_LEN = 256
ABORT_TIMEOUT_S = 30.0  # an engine step never takes this long; past it the engine thread is gone
RETRY_METADATA_KEY = "mtpserve-retry-after-ms"  # on UNAVAILABLE while the replica recovers
RECOVERY_RETRY_MS = 5000


@dataclass(frozen=True)
class Delta:
    """One step's output of one request, copied out of the RequestOutput in the engine thread."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    accepted_draft_tokens: int
    steps: int

    @staticmethod
    def of(out: RequestOutput) -> "Delta":
        return Delta(list(out.new_token_ids), out.new_text,
                     list(out.new_logprobs) if out.new_logprobs is not None else None, out.finish_reason,
                     len(out.prompt_token_ids), len(out.token_ids), out.accepted_tokens, out.num_steps)


class EngineFailed(RuntimeError):
    """The engine step raised; every request in flight gets this instead of further output."""


class ReplicaUnavailable(EngineFailed):
    """The replica gave up after worker faults (ReplicaFailed): UNAVAILABLE, another replica may serve."""


Sink = Callable[[Any], None]  # receives Delta, InvalidRequestError or EngineFailed


class EngineLoop:
    """Owns the engine in one thread: admits and aborts requests, steps while there is work, feeds
    the metrics logger and hands each request's output to its sink."""

    def __init__(self, engine: LLMEngine, logger: PrometheusLogger | None = None) -> None:
        self.engine, self.logger = engine, logger
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # requests admitted and not yet finished
        self._flush = False  # aborted outputs wait in the engine for the next step
        self.failure: str | None = None  # why the replica failed (it then refuses every request)
        self.recovering = False  # replacing lost workers: requests wait in the inbox meanwhile
        self.on_health: Callable[[bool], None] | None = None  # told when the replica stops or resumes serving
        engine.on_serving = self._serving_changed
        self._thread = threading.Thread(target=self._run, name="mtpserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def serving(self) -> bool:
        return self._thread.is_alive() and self.failure is None and not self.recovering

    def _serving_changed(self, serving: bool) -> None:
        self.recovering = not serving and self.failure is None
        if self.on_health is not None:
            self.on_health(self.serving())

    # -- called from any thread -------------------------------------------------------------------
    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float,
            sink: Sink) -> None:
        self._inbox.put(("add", request_id, prompt, params, arrival_time, sink))

    def abort(self, request_id: str, reply: Callable[[bool], None] | None = None, owner: Sink | None = None) -> None:
        """Abort by id; with `owner`, only if that sink's request holds the id (a stream ending must not
        abort another stream's request that happens to use the same id)."""
        self._inbox.put(("abort", request_id, reply, owner))

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run fn(engine) in the engine thread (reads of engine state that must not race a step)."""
        future: Future = Future()
        self._inbox.put(("call", fn, future))
        return future

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is in flight, flush it to the streams, and end the thread."""
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as e:  # a bug here must not leave streams waiting forever (health turns NOT_SERVING)
            log.exception("the engine thread failed")
            self._fail_all(EngineFailed(f"engine thread failed: {type(e).__name__}: {e}"))

    def _serve(self) -> None:
        while True:
            busy = (self.engine.has_unfinished_requests() or self._flush) and self.failure is None
            commands = [self._inbox.get()] if not busy else []  # idle: sleep until a command arrives
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command[0] == "stop":
                    self._abort_all()
                    return
                self._handle(command)
            if (self.engine.has_unfinished_requests() or self._flush) and self.failure is None:
                self._step()

    def _handle(self, command: tuple) -> None:
        kind, *args = command
        if kind == "add":
            self._add(*args)
        elif kind == "abort":
            request_id, reply, owner = args
            found = request_id in self._sinks and (owner is None or self._sinks[request_id] is owner)
            if found:
                self.engine.abort_request(request_id)
                self._flush = True
            if reply is not None:
                reply(found)
        elif kind == "call":
            fn, future = args
            try:
                future.set_result(fn(self.engine))
            except Exception as e:  # the caller sees it; the engine thread goes on
                future.set_exception(e)

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival: float,
             sink: Sink) -> None:
        if self.failure is not None:
            sink(ReplicaUnavailable(self.failure))
            return
        try:
            if request_id in self._sinks:  # also covers an aborted request whose final output is pending
                raise InvalidRequestError("request_id", f"a request with id {request_id!r} is already running")
            self.engine.add_request(request_id, prompt, params, arrival)
        except InvalidRequestError as e:
            sink(e)
            return
        except Exception as e:  # not the client's fault: fail this request, keep serving the others
            log.exception("adding request %s failed", request_id)
            sink(EngineFailed(f"cannot add the request: {type(e).__name__}: {e}"))
            return
        self._sinks[request_id] = sink

    def _step(self) -> None:
        self._flush = False
        try:
            outputs = self.engine.step()
        except ReplicaFailed as e:
            log.error("%s", e)
            self.failure = str(e)
            self._serving_changed(False)
            self._fail_all(ReplicaUnavailable(str(e)))
            return
        except Exception as e:
            log.exception("engine step failed; failing the %d requests in flight", len(self._sinks))
            self._fail_all(EngineFailed(f"engine step failed: {type(e).__name__}: {e}"))
            return
        if self.logger is not None:
            self.logger.record_step(self.engine.last_stats, outputs)
            for event in self.engine.recoveries:
                self.logger.record_recovery(event)
        self.engine.recoveries.clear()
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(Delta.of(out))
            if out.finished:
                self._sinks.pop(out.request_id, None)

    def _fail_all(self, error: EngineFailed) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine is already broken; the stream still learns why
                log.exception("abort of %s after a failed step", request_id)
            sink(error)
        self._sinks.clear()

    def _abort_all(self) -> None:
        for request_id in list(self._sinks):
            self.engine.abort_request(request_id)
        if self._sinks:
            self._step()  # delivers the abort outputs and lets the workers drop the requests


# -- API messages <-> engine objects ----------------------------------------------------------------
_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "logprobs", "num_speculative_tokens")


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset fields keep SamplingParams' defaults; raises InvalidRequestError naming the field."""
    kwargs: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_PARAMS if msg.HasField(name)}
    if kwargs.get("num_speculative_tokens") == SPEC_AUTO_WIRE:
        kwargs["num_speculative_tokens"] = SPEC_AUTO
    return SamplingParams(stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos, **kwargs)


def prompt_from_proto(msg: pb.GenerateRequest) -> str | list[int]:
    which = msg.WhichOneof("prompt")
    if which == "text":
        return msg.text
    if which == "token_ids":
        return list(msg.token_ids.ids)
    raise InvalidRequestError("prompt", "set either text or token_ids")


def responses_of(request_id: str, delta: Delta) -> list[pb.GenerateResponse]:
    out = []
    if delta.token_ids or delta.text:
        logprobs = [pb.Logprobs(entries=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in step.items()])
                    for step in delta.logprobs or []]
        out.append(pb.GenerateResponse(request_id=request_id, chunk=pb.Chunk(
            token_ids=delta.token_ids, text=delta.text, logprobs=logprobs)))
    if delta.finish_reason is not None:
        usage = pb.Usage(prompt_tokens=delta.prompt_tokens, completion_tokens=delta.completion_tokens,
                         accepted_draft_tokens=delta.accepted_draft_tokens, steps=delta.steps)
        out.append(pb.GenerateResponse(request_id=request_id, complete=pb.Complete(
            finish_reason=delta.finish_reason, usage=usage)))
    return out


def model_info(engine: LLMEngine, name: str | None = None) -> pb.ModelInfo:
    r = engine.resolved
    return pb.ModelInfo(
        name=name or r.model_path.name, architecture=r.model_config.architecture,
        vocab_size=r.model_config.vocab_size, max_context=r.max_model_len,
        num_mtp_modules=r.model_config.mtp.num_modules,
        default_num_speculative_tokens=SPEC_AUTO_WIRE if r.default_auto else r.default_num_spec,
        max_num_speculative_tokens=MAX_SPECULATIVE_TOKENS, tensor_parallel_size=r.config.tensor_parallel_size,
        drafter_devices=r.config.drafter_devices, has_tokenizer=engine.tokenizer is not None)


# -- the servicer ---------------------------------------------------------------------------------
class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine_loop: EngineLoop, info: pb.ModelInfo, max_outstanding: int) -> None:
        self.engine_loop, self.info = engine_loop, info
        self.max_outstanding = max_outstanding  # running batch + queue; beyond it: RESOURCE_EXHAUSTED
        self.outstanding = 0  # touched only on the event loop

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if len(request_id) > MAX_REQUEST_ID_LEN:
                raise InvalidRequestError("request_id", f"longer than {MAX_REQUEST_ID_LEN} characters")
            params, prompt = sampling_params_from_proto(request.sampling), prompt_from_proto(request)
        except InvalidRequestError as e:
            await _abort_invalid(context, e)
        if not self.engine_loop.is_alive() or self.engine_loop.failure:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.engine_loop.failure or "the engine has stopped")
        if self.outstanding >= self.max_outstanding and self.engine_loop.recovering:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "queue full while the replica recovers from a worker "
                                f"fault: retry in {RECOVERY_RETRY_MS / 1000:g} s",
                                trailing_metadata=((RETRY_METADATA_KEY, str(RECOVERY_RETRY_MS)),))
        if self.outstanding >= self.max_outstanding:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"queue full: {self.outstanding} requests in flight (limit {self.max_outstanding})")
        items: asyncio.Queue = asyncio.Queue()
        sink = _sink_for(items)
        self.outstanding += 1
        live = True  # the engine may hold the request: abort it if the stream ends early
        try:
            self.engine_loop.add(request_id, prompt, params, arrival, sink)
            while True:
                item = await items.get()
                if isinstance(item, InvalidRequestError):
                    live = False  # refused: never admitted (and the id may belong to another stream)
                    await _abort_invalid(context, item)
                if isinstance(item, EngineFailed):
                    live = False
                    yield pb.GenerateResponse(request_id=request_id, error=pb.Error(message=str(item)))
                    code = grpc.StatusCode.UNAVAILABLE if isinstance(item, ReplicaUnavailable) else grpc.StatusCode.INTERNAL
                    await context.abort(code, str(item))
                for response in responses_of(request_id, item):
                    yield response
                if item.finish_reason is not None:
                    live = False
                    return
        finally:  # runs on normal end, client cancellation, deadline and server shutdown alike
            self.outstanding -= 1
            if live:
                self.engine_loop.abort(request_id, owner=sink)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
        self.engine_loop.abort(request.request_id, lambda found: loop.call_soon_threadsafe(done.set_result, found))
        try:
            return pb.AbortResponse(found=await asyncio.wait_for(done, ABORT_TIMEOUT_S))
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine did not answer")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return self.info


def _sink_for(items: asyncio.Queue) -> Sink:
    loop = asyncio.get_running_loop()

    def sink(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening any more
            pass

    return sink


async def _abort_invalid(context: grpc.aio.ServicerContext, error: InvalidRequestError) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error),
                        trailing_metadata=((FIELD_METADATA_KEY, error.field),))


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every RPC except health checks (probes carry no
    credentials)."""

    def __init__(self, token: str, exempt_prefixes: Iterable[str] = ("/grpc.health.v1.Health/",)) -> None:
        self._expected = f"Bearer {token}"
        self._exempt = tuple(exempt_prefixes)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._exempt):
            return handler
        if dict(details.invocation_metadata or ()).get("authorization") == self._expected:
            return handler
        return _unauthenticated_like(handler)


def _unauthenticated_like(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that refuses the call with UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await refuse(request, context)
        yield  # makes this an async generator, as a server-streaming handler must be

    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kind[(handler.request_streaming, handler.response_streaming)]
    behaviour = refuse_stream if handler.response_streaming else refuse
    return make(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
