"""Python clients of the mtpserve.v1 gRPC API: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("localhost:50051") as c:
        print(c.generate("Hello", SamplingParams(max_tokens=32, temperature=0)).text)
        for delta in c.stream([1, 2, 3], {"max_tokens": 8}):
            print(delta.text, end="", flush=True)

Sampling settings are a SamplingParams (validated here already) or a plain mapping of the same
names (sent as given: the server validates). Errors of the call surface as grpc.RpcError with the
server's status (INVALID_ARGUMENT names the field in its message and in the `mtpserve-field`
trailing metadata); a failure inside the server after admission raises GenerationError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtpserve.sampling_params import SPEC_AUTO, SPEC_AUTO_WIRE, SamplingParams
from mtpserve.v1 import generation_pb2 as pb
from mtpserve.v1 import generation_pb2_grpc as pb_grpc

Prompt = str | list[int]
Params = SamplingParams | Mapping[str, Any] | None


class GenerationError(RuntimeError):
    """The server accepted the request and then failed it (an `error` message on the stream)."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    accepted_draft_tokens: int
    steps: int  # verification steps that verified drafts

    @property
    def acceptance_length(self) -> float:
        """Tokens per verification step (accepted drafts + 1); 1.0 without speculation."""
        return 1.0 + self.accepted_draft_tokens / self.steps if self.steps else 1.0


@dataclass(frozen=True)
class StreamDelta:
    """One message of the stream: new tokens and text, or (last) the finish reason and usage."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass
class Generation:
    """A whole request's output, the streamed deltas put together."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, delta: StreamDelta) -> None:
        self.request_id = delta.request_id
        self.token_ids += delta.token_ids
        self.text += delta.text
        if delta.logprobs:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.usage = delta.finish_reason, delta.usage


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    vocab_size: int
    max_context: int
    num_mtp_modules: int
    default_num_speculative_tokens: int
    max_num_speculative_tokens: int
    tensor_parallel_size: int
    drafter_devices: int
    has_tokenizer: bool


# -- messages ---------------------------------------------------------------------------------------
def sampling_to_proto(params: Params) -> pb.SamplingParams:
    if params is None:
        return pb.SamplingParams()
    values = dataclasses.asdict(params) if isinstance(params, SamplingParams) else dict(params)
    values = {k: v for k, v in values.items() if v is not None}
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    if values.get("num_speculative_tokens") == SPEC_AUTO:
        values["num_speculative_tokens"] = SPEC_AUTO_WIRE  # the wire's int32 form of "auto"
    return pb.SamplingParams(**values)


def build_request(prompt: Prompt, params: Params = None, request_id: str | None = None) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id or "", sampling=sampling_to_proto(params))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    return req


def delta_of(msg: pb.GenerateResponse) -> StreamDelta:
    kind = msg.WhichOneof("kind")
    if kind == "chunk":
        c = msg.chunk
        logprobs = [{e.token_id: e.logprob for e in lp.entries} for lp in c.logprobs] or None
        return StreamDelta(msg.request_id, list(c.token_ids), c.text, logprobs)
    if kind == "complete":
        u = msg.complete.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.accepted_draft_tokens, u.steps)
        return StreamDelta(msg.request_id, finish_reason=msg.complete.finish_reason, usage=usage)
    raise GenerationError(f"request {msg.request_id}: {msg.error.message if kind == 'error' else 'empty response'}")


def model_info_of(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(ModelInfo)})


def _credentials(tls: bool, root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    return grpc.ssl_channel_credentials(root_certificates) if tls or root_certificates else None


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


# -- blocking -------------------------------------------------------------------------------------
class Client:
    """Blocking client. `token`: bearer token; `tls`/`root_certificates`: TLS (system roots or a PEM CA)."""

    def __init__(self, address: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, timeout: float | None = None) -> None:
        creds = _credentials(tls, root_certificates)
        self.channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata, self.timeout = _metadata(token), timeout

    def stream(self, prompt: Prompt, params: Params = None, *, request_id: str | None = None,
               timeout: float | None = None) -> Iterator[StreamDelta]:
        """Deltas as the server produces them; leaving the loop early cancels (aborts) the request."""
        call = self.stub.Generate(build_request(prompt, params, request_id), timeout=timeout or self.timeout,
                                  metadata=self.metadata)
        try:
            for msg in call:
                yield delta_of(msg)
        finally:
            call.cancel()  # no-op once the stream has ended

    def generate(self, prompt: Prompt, params: Params = None, *, request_id: str | None = None,
                 timeout: float | None = None) -> Generation:
        out = Generation()
        for delta in self.stream(prompt, params, request_id=request_id, timeout=timeout):
            out.add(delta)
        return out

    def abort(self, request_id: str) -> bool:
        """True when the request was still running or waiting."""
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout,
                               metadata=self.metadata).found

    def model_info(self) -> ModelInfo:
        return model_info_of(self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout,
                                                    metadata=self.metadata))

    def health(self, service: str = "") -> str:
        """The grpc.health.v1 status name, e.g. "SERVING"."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- asyncio --------------------------------------------------------------------------------------
class AsyncClient:
    """The asyncio twin of Client; create it inside the event loop that uses it."""

    def __init__(self, address: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, timeout: float | None = None) -> None:
        creds = _credentials(tls, root_certificates)
        self.channel = grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata, self.timeout = _metadata(token), timeout

    async def stream(self, prompt: Prompt, params: Params = None, *, request_id: str | None = None,
                     timeout: float | None = None) -> AsyncIterator[StreamDelta]:
        call = self.stub.Generate(build_request(prompt, params, request_id), timeout=timeout or self.timeout,
                                  metadata=self.metadata)
        try:
            async for msg in call:
                yield delta_of(msg)
        finally:
            call.cancel()

    async def generate(self, prompt: Prompt, params: Params = None, *, request_id: str | None = None,
                       timeout: float | None = None) -> Generation:
        out = Generation()
        async for delta in self.stream(prompt, params, request_id=request_id, timeout=timeout):
            out.add(delta)
        return out

    async def abort(self, request_id: str) -> bool:
        reply = await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout,
                                      metadata=self.metadata)
        return reply.found

    async def model_info(self) -> ModelInfo:
        return model_info_of(await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout,
                                                          metadata=self.metadata))

    async def health(self, service: str = "") -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
