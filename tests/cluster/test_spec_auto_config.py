"""num_speculative_tokens = "auto" in every form it can be given (docs/design.md §9): SamplingParams, the engine
config and its YAML and flags, gRPC (the int32 field's -1), the client CLI and the OpenAI extra field; bad
values are refused naming the field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pydantic
import pytest

from mtpserve import SamplingParams
from mtpserve.cluster import cli
from mtpserve.cluster.client import sampling_to_proto
from mtpserve.cluster.engine_config import EngineConfig, ResolvedConfig
from mtpserve.cluster.openai_protocol import CompletionRequest
from mtpserve.cluster.router import sampling_params_from_proto
from mtpserve.cluster.serve import add_serve_arguments, config_from_args, load_config
from mtpserve.errors import InvalidRequestError
from mtpserve.v1 import generation_pb2 as pb

REPO = Path(__file__).resolve().parents[2]


def test_sampling_params_take_auto_a_number_or_nothing() -> None:
    for value in ("auto", 0, 3, 8, None):
        assert SamplingParams(num_speculative_tokens=value).num_speculative_tokens == value
    for bad in ("fast", -1, 9, 2.5):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(num_speculative_tokens=bad)
        assert e.value.field == "num_speculative_tokens" and '"auto"' in str(e.value)


def test_engine_config_defaults_to_auto_and_checks_values() -> None:
    assert EngineConfig().num_speculative_tokens == "auto"
    for bad in ("fast", 9, -1):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            EngineConfig(num_speculative_tokens=bad)
    with pytest.raises(ValueError, match="max_auto_speculative_tokens"):
        EngineConfig(max_auto_speculative_tokens=0)


def test_resolved_auto_captures_every_k_it_may_choose() -> None:
    auto = ResolvedConfig.resolve(EngineConfig(device="cpu"))  # the default model: 3 MTP modules
    assert (auto.default_auto, auto.adaptive, auto.max_auto_spec, auto.default_num_spec) == (True, True, 4, 4)
    assert auto.runner_config().capture_at_start == (0, 1, 2, 3, 4)
    fixed = ResolvedConfig.resolve(EngineConfig(device="cpu", num_speculative_tokens=2))
    assert (fixed.default_auto, fixed.default_num_spec) == (False, 2)
    assert fixed.runner_config().capture_at_start == (0, 2)
    capped = ResolvedConfig.resolve(EngineConfig(device="cpu", max_auto_speculative_tokens=2))
    assert capped.max_auto_spec == 2
    # A drafter group runs the chain in other processes: "auto" there means the upper bound, fixed.
    grouped = ResolvedConfig.resolve(EngineConfig(device="cpu", drafter_devices=1))
    assert (grouped.adaptive, grouped.default_num_spec) == (False, 4)


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_flags_and_yaml_say_auto() -> None:
    engine, _ = config_from_args(_serve_args("--num-speculative-tokens", "auto"))
    assert engine.num_speculative_tokens == "auto"
    engine, _ = config_from_args(_serve_args("--num-speculative-tokens", "2"))
    assert engine.num_speculative_tokens == 2
    with pytest.raises(SystemExit):
        _serve_args("--num-speculative-tokens", "fast")
    engine, _ = load_config(REPO / "deploy" / "local.yaml", {})
    assert engine.num_speculative_tokens == "auto"


def test_grpc_says_auto_with_minus_one() -> None:
    assert sampling_to_proto({"num_speculative_tokens": "auto"}).num_speculative_tokens == -1
    assert sampling_to_proto(SamplingParams(num_speculative_tokens="auto")).num_speculative_tokens == -1
    assert sampling_params_from_proto(pb.SamplingParams(num_speculative_tokens=-1)).num_speculative_tokens == "auto"
    assert sampling_params_from_proto(pb.SamplingParams(num_speculative_tokens=2)).num_speculative_tokens == 2
    assert sampling_params_from_proto(pb.SamplingParams()).num_speculative_tokens is None
    with pytest.raises(InvalidRequestError) as e:
        sampling_params_from_proto(pb.SamplingParams(num_speculative_tokens=-2))
    assert e.value.field == "num_speculative_tokens"


def test_client_cli_flag_says_auto() -> None:
    parser = argparse.ArgumentParser()
    cli._add_sampling_arguments(parser)
    assert cli._sampling(parser.parse_args(["--num-speculative-tokens", "auto"])) == {"num_speculative_tokens": "auto"}
    assert cli._sampling(parser.parse_args(["--num-speculative-tokens", "1"])) == {"num_speculative_tokens": 1}


def test_openai_extra_field_says_auto() -> None:
    body = CompletionRequest(model="m", prompt="hi", num_speculative_tokens="auto")
    assert body.sampling_params(4, None).num_speculative_tokens == "auto"
    assert CompletionRequest(model="m", prompt="hi", num_speculative_tokens=1).sampling_params(4, None) \
        .num_speculative_tokens == 1
    with pytest.raises(pydantic.ValidationError, match="num_speculative_tokens"):
        CompletionRequest(model="m", prompt="hi", num_speculative_tokens="fast")
    with pytest.raises(InvalidRequestError) as e:
        CompletionRequest(model="m", prompt="hi", num_speculative_tokens=12).sampling_params(4, None)
    assert e.value.field == "num_speculative_tokens"


def test_model_info_reports_an_auto_default_as_minus_one() -> None:
    from types import SimpleNamespace

    from mtpserve.cluster.router import model_info

    auto = SimpleNamespace(resolved=ResolvedConfig.resolve(EngineConfig(device="cpu")), tokenizer=None)
    assert model_info(auto).default_num_speculative_tokens == -1
    fixed = SimpleNamespace(resolved=ResolvedConfig.resolve(EngineConfig(device="cpu", num_speculative_tokens=2)),
                            tokenizer=None)
    assert model_info(fixed).default_num_speculative_tokens == 2
