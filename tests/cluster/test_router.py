"""The gRPC router on loopback with the real client (docs/design.md §7): streaming equals LLM.generate, abort
and cancellation free the KV, concurrency, every bad input's status, health, reflection, stub freshness."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from google.protobuf.descriptor_pool import DescriptorPool

from mtpserve import LLM, SamplingParams
from mtpserve.cluster.client import AsyncClient, Client, GenerationError, build_request
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.cluster.router import FIELD_METADATA_KEY
from mtpserve.cluster.serve import ServerOptions, ServerThread, load_engine
from mtpserve.v1 import generation_pb2 as pb
from mtpserve.v1 import generation_pb2_grpc as pb_grpc
from tests.checkpoints import write_tokenizer
from tests.conftest import prompts_of

REPO = Path(__file__).resolve().parents[2]
VOCAB = 64  # the session's trained_ckpt
ENGINE_ARGS = dict(num_kv_blocks=400, max_num_seqs=64, num_speculative_tokens=3)
LONG = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)  # runs for a second or more


@pytest.fixture(scope="module")
def ckpt(trained_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained tiny model plus a word-level tokenizer, so that text prompts and text deltas work."""
    path = tmp_path_factory.mktemp("router_ckpt") / "tiny-mtp"
    shutil.copytree(trained_ckpt, path)
    write_tokenizer(path, VOCAB)
    return path


def start(ckpt: Path, **options: Any) -> ServerThread:
    engine_args = {**ENGINE_ARGS, **options.pop("engine", {})}
    engine = load_engine(EngineConfig(model=str(ckpt), **engine_args))
    return ServerThread(engine, ServerOptions(host="127.0.0.1", port=0, metrics_port=-1, **options))


def metric(server: ServerThread, name: str, **labels: str) -> float:
    """A sample of the server's metrics registry (its HTTP endpoint is off here; test_metrics scrapes it)."""
    value = server.replica.engine_loop.logger.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def aborted(server: ServerThread) -> float:
    return metric(server, "mtpserve_request_success_total", finish_reason="abort")


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[ServerThread]:
    srv = start(ckpt)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[Client]:
    with Client(f"127.0.0.1:{server.port}", timeout=120) as c:
        yield c


def engine_state(server: ServerThread) -> tuple[bool, int, int]:
    """(all KV blocks free, requests in the scheduler, requests the worker still holds), read in the
    engine thread."""
    def read(engine: Any) -> tuple[bool, int, int]:
        return engine.blocks.all_free, len(engine.scheduler.requests), len(engine.executor.runner.requests)
    return server.replica.engine_loop.call(read).result(10)


def wait_until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


# -- API and stubs --------------------------------------------------------------------------------
def test_generated_stubs_are_current(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "tools" / "gen_proto.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    fresh = sorted((tmp_path / "mtpserve" / "v1").iterdir())
    assert fresh, "the generator wrote nothing"
    for f in fresh:
        committed = REPO / "mtpserve" / "v1" / f.name
        assert committed.is_file(), f"{f.name} is generated but not committed"
        assert committed.read_bytes() == f.read_bytes(), f"{f.name} is stale: run python tools/gen_proto.py"


def test_model_info(client: Client, ckpt: Path) -> None:
    info = client.model_info()
    assert (info.name, info.architecture, info.vocab_size, info.max_context) == ("tiny-mtp", "Qwen3ForCausalLM",
                                                                                 VOCAB, 512)
    assert (info.num_mtp_modules, info.default_num_speculative_tokens, info.max_num_speculative_tokens) == (3, 3, 8)
    assert (info.tensor_parallel_size, info.drafter_devices, info.has_tokenizer) == (1, 0, True)


# -- streaming output equals the offline API -----------------------------------------------------------
CASES = [
    ("greedy text", "w5 w6 w7 w8 w9", SamplingParams(max_tokens=40, temperature=0.0)),
    ("greedy ids, k=1", [7, 8, 9], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                  num_speculative_tokens=1)),
    ("no speculation", [3, 4], SamplingParams(max_tokens=20, temperature=0.0, num_speculative_tokens=0)),
    ("sampled, logprobs", "w10 w20 w30", SamplingParams(max_tokens=32, temperature=0.8, top_k=20, top_p=0.9,
                                                        min_p=0.02, seed=7, logprobs=3, ignore_eos=True)),
    ("penalties", [11, 12, 13, 14], SamplingParams(max_tokens=24, temperature=0.7, repetition_penalty=1.3,
                                                   presence_penalty=0.5, frequency_penalty=0.3, seed=3)),
    ("stop string", "w40 w41", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=["w25"])),
    ("stop token", [5, 6], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[40])),
]


@pytest.fixture(scope="module")
def expected(ckpt: Path) -> list[Any]:
    llm = LLM(str(ckpt), **ENGINE_ARGS)
    return [llm.generate(prompt, params)[0] for _, prompt, params in CASES]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_stream_equals_llm_generate(client: Client, expected: list[Any], case: int) -> None:
    _, prompt, params = CASES[case]
    want = expected[case]
    deltas = list(client.stream(prompt, params))
    got = [t for d in deltas for t in d.token_ids]
    assert got == want.token_ids
    assert "".join(d.text for d in deltas) == want.text
    assert deltas[-1].finish_reason == want.finish_reason and all(d.finish_reason is None for d in deltas[:-1])
    if params.logprobs is not None:
        assert [lp for d in deltas for lp in d.logprobs or []] == want.logprobs
    usage = deltas[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    assert (usage.accepted_draft_tokens, usage.steps) == (want.accepted_tokens, want.num_steps)
    # Tokens arrive step by step: one chunk from the prefill and at least one per verification step.
    assert len(deltas) >= 2 + usage.steps


def test_fifty_concurrent_streams(server: ServerThread, ckpt: Path) -> None:
    prompts = prompts_of(VOCAB, [3 + i % 17 for i in range(50)], seed=11)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=10, temperature=0.9, seed=i, ignore_eos=True) for i in range(50)]
    want = LLM(str(ckpt), **ENGINE_ARGS).generate(prompts, params)

    async def run_all() -> list[Any]:
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=120) as c:
            return await asyncio.gather(*(c.generate(p, sp) for p, sp in zip(prompts, params)))

    def big_batches() -> float:
        return metric(server, "mtpserve_batch_size_count") - metric(server, "mtpserve_batch_size_bucket", le="16.0")

    before = big_batches()
    got = asyncio.run(run_all())
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert big_batches() > before, "the streams must have run batched together"
    assert [g.finish_reason for g in got] == ["length"] * 50
    assert len({g.request_id for g in got}) == 50
    assert engine_state(server)[:2] == (True, 0)


# -- abort, cancellation, deadlines free the KV -------------------------------------------------------
def test_abort_rpc_ends_the_stream_and_frees_kv(server: ServerThread, client: Client) -> None:
    stream = client.stream([5, 6, 7], LONG, request_id="to-abort")
    first = next(stream)
    assert first.request_id == "to-abort" and first.token_ids
    assert engine_state(server)[0] is False  # it holds KV now
    assert client.abort("to-abort") is True
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in [first, *rest]) < LONG.max_tokens
    assert engine_state(server) == (True, 0, 0)
    assert client.abort("to-abort") is False and client.abort("never-existed") is False


def test_closing_the_stream_aborts_and_frees_kv(server: ServerThread, client: Client) -> None:
    before = aborted(server)
    stream = client.stream([8, 9], LONG)
    assert next(stream).token_ids
    stream.close()  # cancels the RPC
    wait_until(lambda: engine_state(server) == (True, 0, 0), what="the cancelled request to be freed")
    assert aborted(server) == before + 1  # aborted, not run to its end


def test_deadline_aborts_and_frees_kv(server: ServerThread, client: Client) -> None:
    before = aborted(server)
    with pytest.raises(grpc.RpcError) as err:
        client.generate([10, 11], LONG, timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: engine_state(server) == (True, 0, 0), what="the expired request to be freed")
    assert aborted(server) == before + 1


async def _cancel_async(port: int) -> None:
    async with AsyncClient(f"127.0.0.1:{port}") as c:
        async for delta in c.stream([12, 13], LONG):
            assert delta.token_ids
            break  # leaving the loop closes the generator, which cancels the call


def test_async_client_cancellation_frees_kv(server: ServerThread) -> None:
    before = aborted(server)
    asyncio.run(_cancel_async(server.port))
    wait_until(lambda: engine_state(server) == (True, 0, 0), what="the cancelled request to be freed")
    assert aborted(server) == before + 1


# -- bad input: INVALID_ARGUMENT naming the field, and the server keeps serving --------------------------
def _raw(prompt: Any = (5, 6), **sampling: Any) -> pb.GenerateRequest:
    """A request as the wire carries it: the settings go out unvalidated (a mapping, not SamplingParams)."""
    return build_request(list(prompt) if not isinstance(prompt, str) else prompt, sampling)


BAD = [
    ("empty text", _raw(""), "prompt"),
    ("blank text", _raw("   "), "prompt"),
    ("empty ids", _raw([]), "prompt"),
    ("no prompt", pb.GenerateRequest(), "prompt"),
    ("prompt longer than context", _raw([5] * 600), "prompt"),
    ("prompt fills the context", _raw([5] * 512), "prompt"),
    ("token id = vocab", _raw([5, VOCAB]), "prompt_token_ids"),
    ("negative token id", _raw([5, -1]), "prompt_token_ids"),
    ("max_tokens 0", _raw(max_tokens=0), "max_tokens"),
    ("max_tokens negative", _raw(max_tokens=-4), "max_tokens"),
    ("max_tokens beyond context", _raw(max_tokens=511), "max_tokens"),
    ("temperature < 0", _raw(temperature=-0.1), "temperature"),
    ("temperature nan", _raw(temperature=float("nan")), "temperature"),
    ("temperature inf", _raw(temperature=float("inf")), "temperature"),
    ("top_p 0", _raw(top_p=0.0), "top_p"),
    ("top_p > 1", _raw(top_p=1.5), "top_p"),
    ("top_k 0", _raw(top_k=0), "top_k"),
    ("top_k -2", _raw(top_k=-2), "top_k"),
    ("min_p < 0", _raw(min_p=-0.1), "min_p"),
    ("min_p > 1", _raw(min_p=1.1), "min_p"),
    ("repetition_penalty 0", _raw(repetition_penalty=0.0), "repetition_penalty"),
    ("repetition_penalty > 10", _raw(repetition_penalty=11.0), "repetition_penalty"),
    ("presence_penalty > 2", _raw(presence_penalty=2.5), "presence_penalty"),
    ("frequency_penalty < -2", _raw(frequency_penalty=-3.0), "frequency_penalty"),
    ("num_speculative_tokens < -1", _raw(num_speculative_tokens=-2), "num_speculative_tokens"),  # -1: auto
    ("num_speculative_tokens > limit", _raw(num_speculative_tokens=9), "num_speculative_tokens"),
    ("logprobs > 20", _raw(logprobs=21), "logprobs"),
    ("negative seed", _raw(seed=-1), "seed"),
    ("empty stop string", _raw(stop=[""]), "stop"),
    ("too many stop strings", _raw(stop=[f"s{i}" for i in range(17)]), "stop"),
    ("stop string too long", _raw(stop=["x" * 257]), "stop"),
    ("request id too long", pb.GenerateRequest(request_id="x" * 300, token_ids=pb.TokenIds(ids=[5])), "request_id"),
]


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.GenerationStub(channel)


def assert_invalid(call: Callable[[], Any], field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    e = err.value
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert e.details().startswith(f"{field}: "), e.details()
    assert (FIELD_METADATA_KEY, field) in [(m.key, m.value) for m in e.trailing_metadata()]


@pytest.mark.parametrize("case", range(len(BAD)), ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument(stub: pb_grpc.GenerationStub, case: int) -> None:
    _, request, field = BAD[case]
    assert_invalid(lambda: list(stub.Generate(request, timeout=30)), field)


def test_server_keeps_serving_after_bad_input(client: Client, stub: pb_grpc.GenerationStub,
                                              server: ServerThread) -> None:
    for _, request, field in BAD:
        assert_invalid(lambda: list(stub.Generate(request, timeout=30)), field)
    out = client.generate([5, 6], {"max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert engine_state(server)[:2] == (True, 0)


def test_duplicate_id_of_a_running_request(client: Client, server: ServerThread) -> None:
    stream = client.stream([5, 6, 7], LONG, request_id="dup")
    assert next(stream).token_ids
    assert_invalid(lambda: client.generate([9], {"max_tokens": 2}, request_id="dup"), "request_id")
    # A refused duplicate that goes away (its stream ends) aborts only a request it owns, not this one.
    found = Future()
    server.replica.engine_loop.abort("dup", reply=found.set_result, owner=lambda item: None)
    assert found.result(10) is False
    assert client.abort("dup") is True  # the original is unharmed by the refused duplicate ...
    assert list(stream)[-1].finish_reason == "abort"
    again = client.generate([9], {"max_tokens": 2}, request_id="dup")  # ... and the id is free again
    assert again.request_id == "dup" and again.finish_reason is not None


def test_full_queue_is_resource_exhausted(ckpt: Path) -> None:
    srv = start(ckpt, engine={"max_num_seqs": 1}, max_queue_size=1)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            running = stub.Generate(build_request([5, 6], LONG), timeout=60)
            next(running)
            waiting = stub.Generate(build_request([7, 8], LONG), timeout=60)
            wait_until(lambda: srv.replica.engine_loop.call(lambda e: len(e.scheduler.waiting)).result(10) == 1,
                       what="the second request to wait")
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(build_request([9], {"max_tokens": 2}), timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            running.cancel()
            waiting.cancel()
            wait_until(lambda: engine_state(srv) == (True, 0, 0), what="the cancelled requests to be freed")
            assert len(list(stub.Generate(build_request([9], {"max_tokens": 2}), timeout=30))) >= 2
    finally:
        srv.stop()


def test_engine_failure_becomes_an_error_message(ckpt: Path) -> None:
    srv = start(ckpt)
    try:
        def break_step(engine: Any) -> None:
            def boom() -> list:
                raise RuntimeError("injected failure")
            engine.step = boom
        srv.replica.engine_loop.call(break_step).result(10)
        with Client(f"127.0.0.1:{srv.port}", timeout=30) as c:
            with pytest.raises(GenerationError, match="injected failure"):
                c.generate([5, 6], {"max_tokens": 4})
            srv.replica.engine_loop.call(lambda e: delattr(e, "step")).result(10)  # the class's step again
            assert len(c.generate([5, 6], {"max_tokens": 4, "ignore_eos": True}).token_ids) == 4
    finally:
        srv.stop()


def test_engine_thread_death_turns_health_not_serving(ckpt: Path) -> None:
    srv = start(ckpt)
    try:
        def break_loop(engine: Any) -> None:
            def boom() -> bool:
                raise RuntimeError("injected engine-thread failure")
            engine.has_unfinished_requests = boom
        srv.replica.engine_loop.call(break_loop).result(10)
        with Client(f"127.0.0.1:{srv.port}", timeout=30) as c:
            wait_until(lambda: c.health() == "NOT_SERVING", what="health to report NOT_SERVING")
            assert c.health("mtpserve.v1.Generation") == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as err:
                c.generate([5, 6], {"max_tokens": 2})
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


# -- health and reflection ------------------------------------------------------------------------
def test_health(server: ServerThread) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "mtpserve.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection(server: ServerThread) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"mtpserve.v1.Generation", "grpc.health.v1.Health"} <= services
        service = DescriptorPool(db).FindServiceByName("mtpserve.v1.Generation")
        assert {m.name for m in service.methods} == {"Generate", "Abort", "GetModelInfo"}
        assert service.methods_by_name["Generate"].server_streaming
