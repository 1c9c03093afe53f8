"""The OpenAI-compatible HTTP API on loopback with the official `openai` client, sync and async, streaming and
not (docs/design.md §7): outputs equal LLM.generate, usage and logprobs, every bad input of the gRPC
validation is a 400 with OpenAI's error body, aborts free the KV, shared admission, metrics and auth."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import openai
import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.cluster.client import build_request
from mtpserve.cluster.serve import ServerThread
from mtpserve.v1 import generation_pb2_grpc as pb_grpc
from tests.cluster.test_router import ENGINE_ARGS, LONG, VOCAB, aborted, engine_state, metric, start, wait_until
from tests.checkpoints import token_strings, write_tokenizer

MODEL = "tiny-mtp"
CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }} {{ m['content'] }} {{ eos_token }} "
                 "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant {% endif %}")


@pytest.fixture(scope="module")
def ckpt(trained_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained tiny model, a word-level tokenizer and a chat template in tokenizer_config.json."""
    path = tmp_path_factory.mktemp("http_ckpt") / MODEL
    shutil.copytree(trained_ckpt, path)
    write_tokenizer(path, VOCAB)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[ServerThread]:
    srv = start(ckpt, http_port=0)
    yield srv
    srv.stop()


def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.http_port}/v1"


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url(server), api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(str(ckpt), **ENGINE_ARGS)


def extras(params: SamplingParams) -> dict[str, Any]:
    """A SamplingParams as OpenAI arguments plus our extras in extra_body."""
    standard = dict(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                    presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                    seed=params.seed, stop=list(params.stop) or None)
    extra = dict(top_k=params.top_k, min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                 num_speculative_tokens=params.num_speculative_tokens, ignore_eos=params.ignore_eos)
    return {**{k: v for k, v in standard.items() if v is not None},
            "extra_body": {k: v for k, v in extra.items() if v is not None}}


# -- completions equal the offline API ----------------------------------------------------------------
CASES = [
    ("greedy text", "w5 w6 w7 w8 w9", SamplingParams(max_tokens=40, temperature=0.0)),
    ("greedy ids, k=1", [7, 8, 9], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                  num_speculative_tokens=1)),
    ("sampled, seed, logprobs", "w10 w20 w30", SamplingParams(max_tokens=32, temperature=0.8, top_k=20, top_p=0.9,
                                                              min_p=0.02, seed=7, logprobs=3, ignore_eos=True)),
    ("penalties", [11, 12, 13, 14], SamplingParams(max_tokens=24, temperature=0.7, repetition_penalty=1.3,
                                                   presence_penalty=0.5, frequency_penalty=0.3, seed=3)),
    ("stop string", "w40 w41", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=["w25"])),
]


def check_usage(usage: Any, want: Any) -> None:
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert (usage.accepted_draft_tokens, usage.steps) == (want.accepted_tokens, want.num_steps)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_completion_equals_llm_generate(client: openai.OpenAI, llm: LLM, case: int) -> None:
    _, prompt, params = CASES[case]
    want = llm.generate(prompt, params)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, logprobs=params.logprobs, **extras(params))
    choice = got.choices[0]
    assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason)
    check_usage(got.usage, want)
    if params.logprobs is not None:
        lp = choice.logprobs
        assert lp.tokens == [token_strings(VOCAB)[t] for t in want.token_ids]
        assert lp.token_logprobs == [step[t] for t, step in zip(want.token_ids, want.logprobs)]
        assert all(len(top) == params.logprobs for top in lp.top_logprobs)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    stream = client.completions.create(model=MODEL, prompt=prompt, logprobs=params.logprobs, stream=True,
                                       stream_options={"include_usage": True}, **extras(params))
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    check_usage(chunks[-1].usage, want)
    assert len(chunks) >= 2 + want.num_steps  # streamed step by step, not at the end


def test_same_seed_same_sample(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="w3 w4", max_tokens=24, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample(11) == sample(11)
    assert len({sample(s) for s in range(4)}) > 1


# -- chat -----------------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w10 w11 w12"},
            {"role": "assistant", "content": "w13"}, {"role": "user", "content": [{"type": "text", "text": "w14 w15"}]}]


def test_chat_completion_renders_the_template_like_transformers(client: openai.OpenAI, llm: LLM, ckpt: Path) -> None:
    from transformers import AutoTokenizer

    flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
            for m in MESSAGES]
    ids = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(flat, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    want = llm.generate(list(ids), params)[0]
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    choice = got.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", want.text, "length")
    check_usage(got.usage, want)
    assert [e.token for e in choice.logprobs.content] == [token_strings(VOCAB)[t] for t in want.token_ids]
    assert [e.logprob for e in choice.logprobs.content] == [s[t] for t, s in zip(want.token_ids, want.logprobs)]
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)


def test_async_client_streams_chat_concurrently(server: ServerThread, llm: LLM) -> None:
    conversations = [[{"role": "user", "content": f"w{5 + i} w{6 + i}"}] for i in range(12)]

    async def one(c: openai.AsyncOpenAI, messages: list[dict], stream: bool) -> tuple[str, str | None]:
        kwargs = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            r = await c.chat.completions.create(**kwargs)
            return r.choices[0].message.content, r.choices[0].finish_reason
        chunks = [ch async for ch in await c.chat.completions.create(stream=True, **kwargs)]
        assert chunks[0].choices[0].delta.role == "assistant"
        return "".join(ch.choices[0].delta.content or "" for ch in chunks), chunks[-1].choices[0].finish_reason

    async def run_all() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, m, i % 2 == 0) for i, m in enumerate(conversations)))

    got = asyncio.run(run_all())
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [llm_prompt(m) for m in conversations]
    want = llm.generate(prompts, [params] * len(prompts))
    assert got == [(w.text, "length") for w in want]
    assert engine_state(server)[:2] == (True, 0)


def llm_prompt(messages: list[dict]) -> str:
    """CHAT_TEMPLATE by hand for single-turn conversations (the transformers comparison is above)."""
    return "".join(f"<s>{m['role']} {m['content']} </s> " for m in messages) + "<s>assistant "


# -- bad input: 400 with OpenAI's error body naming the field, and the server keeps serving ----------------
def _c(prompt: Any = (5, 6), **body: Any) -> tuple[str, dict[str, Any]]:
    return "/completions", {"model": MODEL, "prompt": list(prompt) if not isinstance(prompt, str) else prompt, **body}


def _chat(**body: Any) -> tuple[str, dict[str, Any]]:
    return "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], **body}


BAD = [  # the gRPC router's cases (tests/cluster/test_router.py BAD), then the HTTP API's own
    ("empty text", _c(""), "prompt"),
    ("blank text", _c("   "), "prompt"),
    ("empty ids", _c([]), "prompt"),
    ("no prompt", ("/completions", {"model": MODEL}), "prompt"),
    ("prompt longer than context", _c([5] * 600), "prompt"),
    ("prompt fills the context", _c([5] * 512), "prompt"),
    ("token id = vocab", _c([5, VOCAB]), "prompt_token_ids"),
    ("negative token id", _c([5, -1]), "prompt_token_ids"),
    ("max_tokens 0", _c(max_tokens=0), "max_tokens"),
    ("max_tokens negative", _c(max_tokens=-4), "max_tokens"),
    ("max_tokens beyond context", _c(max_tokens=511), "max_tokens"),
    ("temperature < 0", _c(temperature=-0.1), "temperature"),
    ("top_p 0", _c(top_p=0.0), "top_p"),
    ("top_p > 1", _c(top_p=1.5), "top_p"),
    ("top_k 0", _c(top_k=0), "top_k"),
    ("top_k -2", _c(top_k=-2), "top_k"),
    ("min_p < 0", _c(min_p=-0.1), "min_p"),
    ("min_p > 1", _c(min_p=1.1), "min_p"),
    ("repetition_penalty 0", _c(repetition_penalty=0.0), "repetition_penalty"),
    ("repetition_penalty > 10", _c(repetition_penalty=11.0), "repetition_penalty"),
    ("presence_penalty > 2", _c(presence_penalty=2.5), "presence_penalty"),
    ("frequency_penalty < -2", _c(frequency_penalty=-3.0), "frequency_penalty"),
    ("num_speculative_tokens < 0", _c(num_speculative_tokens=-1), "num_speculative_tokens"),
    ("num_speculative_tokens > limit", _c(num_speculative_tokens=9), "num_speculative_tokens"),
    ("logprobs > 20", _c(logprobs=21), "logprobs"),
    ("negative seed", _c(seed=-1), "seed"),
    ("empty stop string", _c(stop=[""]), "stop"),
    ("request id too long", ("/completions", {"model": MODEL, "prompt": [5], "x-request-id": "x" * 300}), "request_id"),
    # the HTTP API's own
    ("n = 2", _c(n=2), "n"),
    ("two prompts", _c(["w5", "w6"]), "prompt"),
    ("echo", _c(echo=True), "echo"),
    ("unknown field", _c(best_guess=1), "best_guess"),
    ("wrong type", _c(max_tokens="many"), "max_tokens"),
    ("stream_options without stream", _c(stream_options={"include_usage": True}), "stream_options"),
    ("chat: no messages", _chat(messages=[]), "messages"),
    ("chat: max_completion_tokens 0", _chat(max_completion_tokens=0), "max_completion_tokens"),
    ("chat: top_logprobs without logprobs", _chat(top_logprobs=2), "top_logprobs"),
    ("chat: top_logprobs > 20", _chat(logprobs=True, top_logprobs=21), "logprobs"),
    ("chat: image part", _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content"),
    ("chat: bad message", _chat(messages=[{"content": "w5"}]), "messages.0.role"),
]


def post(client: openai.OpenAI, path: str, body: dict[str, Any]) -> Any:
    headers = {"x-request-id": body.pop("x-request-id")} if "x-request-id" in body else {}
    return client.post(path, body=body, cast_to=object, options={"headers": headers})


def assert_bad_request(call: Callable[[], Any], field: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    e = err.value
    assert e.status_code == 400
    assert e.body["type"] == "invalid_request_error" and e.body["param"] == field, e.body
    assert e.body["message"].startswith(f"{field}: "), e.body


@pytest.mark.parametrize("case", range(len(BAD)), ids=[b[0] for b in BAD])
def test_bad_input_is_400_naming_the_field(client: openai.OpenAI, case: int) -> None:
    _, (path, body), field = BAD[case]
    assert_bad_request(lambda: post(client, path, dict(body)), field)


def test_server_keeps_serving_after_bad_input(client: openai.OpenAI, server: ServerThread) -> None:
    for _, (path, body), field in BAD:
        assert_bad_request(lambda: post(client, path, dict(body)), field)
        if field != "stream_options":  # the same refusals before a stream starts
            assert_bad_request(lambda: post(client, path, {**body, "stream": True}), field)
    out = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    assert engine_state(server)[:2] == (True, 0)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="w5")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_template_refusal_is_400(ckpt: Path, tmp_path: Path) -> None:
    path = tmp_path / MODEL
    shutil.copytree(ckpt, path)
    (path / "chat_template.jinja").write_text("{% if messages[0]['role'] != 'user' %}"
                                              "{{ raise_exception('the first message must be the user\\'s') }}"
                                              "{% endif %}{{ messages[0]['content'] }}")
    srv = start(path, http_port=0)
    try:
        with openai.OpenAI(base_url=base_url(srv), api_key="unused", max_retries=0, timeout=60) as c:
            assert_bad_request(lambda: c.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": "w5"}]), "messages")
            ok = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=3)
            assert ok.choices[0].message.content is not None
    finally:
        srv.stop()


# -- models, health, aborts, shared admission, metrics, auth ---------------------------------------------
def test_models_and_health(client: openai.OpenAI, server: ServerThread) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].max_model_len == 512
    assert client.get("/../health", cast_to=object) == {"status": "ok"}


def test_closing_a_stream_aborts_and_frees_kv(client: openai.OpenAI, server: ServerThread) -> None:
    before = aborted(server)
    stream = client.completions.create(model=MODEL, prompt=[8, 9], stream=True, **extras(LONG))
    assert next(iter(stream)).choices[0].text
    stream.close()
    wait_until(lambda: engine_state(server) == (True, 0, 0), what="the abandoned stream's request to be freed")
    assert aborted(server) == before + 1


def test_client_timeout_aborts_and_frees_kv(client: openai.OpenAI, server: ServerThread) -> None:
    before = aborted(server)
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).completions.create(model=MODEL, prompt=[10, 11], **extras(LONG))
    wait_until(lambda: engine_state(server) == (True, 0, 0), what="the abandoned request to be freed")
    assert aborted(server) == before + 1


def test_http_and_grpc_share_the_admission_limit_and_metrics(ckpt: Path) -> None:
    srv = start(ckpt, engine={"max_num_seqs": 1}, max_queue_size=1, http_port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel, \
                openai.OpenAI(base_url=base_url(srv), api_key="unused", max_retries=0, timeout=60) as c:
            running = pb_grpc.GenerationStub(channel).Generate(build_request([5, 6], LONG), timeout=60)
            next(running)
            waiting = c.completions.create(model=MODEL, prompt=[7, 8], stream=True, **extras(LONG))
            wait_until(lambda: srv.replica.engine_loop.call(lambda e: len(e.scheduler.waiting)).result(10) == 1,
                       what="the HTTP request to wait behind the gRPC one")
            with pytest.raises(openai.RateLimitError) as err:
                c.completions.create(model=MODEL, prompt=[9], max_tokens=2)
            assert err.value.status_code == 429 and "queue full" in err.value.body["message"]
            running.cancel()
            waiting.close()
            wait_until(lambda: engine_state(srv) == (True, 0, 0), what="both requests to be freed")
            done = metric(srv, "mtpserve_request_success_total", finish_reason="length")
            assert c.completions.create(model=MODEL, prompt=[9], max_tokens=2).usage.completion_tokens == 2
            assert metric(srv, "mtpserve_request_success_total", finish_reason="length") == done + 1
    finally:
        srv.stop()


def test_bearer_token(ckpt: Path) -> None:
    srv = start(ckpt, http_port=0, auth_token="s3cret")
    try:
        with openai.OpenAI(base_url=base_url(srv), api_key="wrong", max_retries=0, timeout=60) as bad:
            with pytest.raises(openai.AuthenticationError) as err:
                bad.models.list()
            assert err.value.body["code"] == "invalid_api_key"
            assert bad.get("/../health", cast_to=object) == {"status": "ok"}  # probes carry no token
        with openai.OpenAI(base_url=base_url(srv), api_key="s3cret", max_retries=0, timeout=60) as good:
            assert good.completions.create(model=MODEL, prompt=[5], max_tokens=2).choices[0].finish_reason
    finally:
        srv.stop()


def test_engine_failure_is_500_and_the_server_recovers(ckpt: Path) -> None:
    srv = start(ckpt, http_port=0)
    try:
        def break_step(engine: Any) -> None:
            def boom() -> list:
                raise RuntimeError("injected failure")
            engine.step = boom
        with openai.OpenAI(base_url=base_url(srv), api_key="unused", max_retries=0, timeout=60) as c:
            chunks = iter(c.completions.create(model=MODEL, prompt=[5, 6], stream=True, **extras(LONG)))
            assert next(chunks).choices[0].text
            srv.replica.engine_loop.call(break_step).result(10)
            with pytest.raises(openai.APIError, match="injected failure"):  # an error event: the status is sent
                list(chunks)
            with pytest.raises(openai.InternalServerError, match="injected failure") as err:
                c.completions.create(model=MODEL, prompt=[5, 6], max_tokens=4)
            assert err.value.status_code == 500 and err.value.body["type"] == "server_error"
            srv.replica.engine_loop.call(lambda e: delattr(e, "step")).result(10)  # the class's step again
            assert c.completions.create(model=MODEL, prompt=[5, 6], max_tokens=4,
                                        extra_body={"ignore_eos": True}).usage.completion_tokens == 4
    finally:
        srv.stop()


def test_a_failed_replica_is_503_naming_the_cause(ckpt: Path) -> None:
    """Past its fault budget the engine raises ReplicaFailed (mtpserve/cluster/recovery.py): HTTP answers 503,
    as gRPC answers UNAVAILABLE, so a client or balancer tries another replica; /health turns 503 too."""
    from mtpserve.errors import ReplicaFailed

    srv = start(ckpt, http_port=0)
    cause = "the replica failed after 3 worker faults within 600 s; the last: target worker (rank 0) died"
    try:
        def fail_step(engine: Any) -> None:
            def give_up() -> list:
                raise ReplicaFailed(cause)
            engine.step = give_up
        with openai.OpenAI(base_url=base_url(srv), api_key="unused", max_retries=0, timeout=60) as c:
            chunks = iter(c.completions.create(model=MODEL, prompt=[5, 6], stream=True, **extras(LONG)))
            assert next(chunks).choices[0].text
            srv.replica.engine_loop.call(fail_step).result(10)
            with pytest.raises(openai.APIError, match="worker faults"):  # mid-stream: an error event
                list(chunks)
            for stream in (False, True):
                with pytest.raises(openai.APIStatusError, match="target worker") as err:
                    c.completions.create(model=MODEL, prompt=[5, 6], max_tokens=4, stream=stream)
                assert err.value.status_code == 503 and err.value.body["type"] == "server_error"
            with pytest.raises(openai.APIStatusError) as err:
                c.get("/../health", cast_to=object)
            assert err.value.status_code == 503
    finally:
        srv.stop()


def test_http_port_flag_and_yaml_key(tmp_path: Path) -> None:
    import argparse

    from mtpserve.cluster.serve import add_serve_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = tmp_path / "serve.yaml"
    config.write_text("http-port: 8081\n")
    assert config_from_args(parser.parse_args(["--config", str(config)]))[1].http_port == 8081
    assert config_from_args(parser.parse_args(["--config", str(config), "--http-port", "9090"]))[1].http_port == 9090
    assert config_from_args(parser.parse_args([]))[1].http_port == -1  # off unless asked for
