"""The `mtpserve` CLI (serve | generate | bench) as subprocesses, configuration precedence, bearer-token
auth and TLS, all against real servers on loopback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import yaml

from mtpserve import LLM, SamplingParams
from mtpserve.cluster.client import Client
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.cluster.serve import (ServerOptions, ServerThread, add_serve_arguments, config_from_args, load_config,
                                    load_engine)
from mtpserve.cluster.serve import main as serve_main
from tests.checkpoints import write_tokenizer

VOCAB = 64
CLI = [sys.executable, "-m", "mtpserve.cluster.cli"]
ENGINE_ARGS = dict(num_kv_blocks=400, num_speculative_tokens=3)


@pytest.fixture(scope="module")
def ckpt(trained_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli_ckpt") / "tiny-mtp"
    shutil.copytree(trained_ckpt, path)
    write_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[ServerThread]:
    engine = load_engine(EngineConfig(model=str(ckpt), **ENGINE_ARGS))
    srv = ServerThread(engine, ServerOptions(host="127.0.0.1", port=0, metrics_port=-1))
    yield srv
    srv.stop()


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def wait_for_line(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 90) -> re.Match:
    """Poll a process's log file for a line matching `pattern` (fails early if the process exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text())
        if match:
            return match
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before {pattern!r}:\n{log.read_text()}")
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n{log.read_text()}")


# -- generate and bench ---------------------------------------------------------------------------
def test_generate_streams_the_text(server: ServerThread, ckpt: Path) -> None:
    want = LLM(str(ckpt), **ENGINE_ARGS).generate("w5 w6 w7", SamplingParams(max_tokens=16, temperature=0.0,
                                                                              ignore_eos=True))[0]
    r = run_cli("generate", "--address", f"127.0.0.1:{server.port}", "w5 w6 w7", "--max-tokens", "16",
                "--temperature", "0", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want.text + "\n"
    assert "[length: 3 prompt + 16 generated tokens" in r.stderr


def test_generate_in_process_without_a_server(ckpt: Path) -> None:
    want = LLM(str(ckpt)).generate("w9 w10", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    r = run_cli("generate", "--model", str(ckpt), "w9 w10", "--max-tokens", "12", "--temperature", "0",
                "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want.text + "\n"
    assert re.search(r"loading .*tiny-mtp", r.stderr) and re.search(r"model loaded in [\d.]+ s", r.stderr)


def test_generate_reports_bad_input(server: ServerThread) -> None:
    r = run_cli("generate", "--address", f"127.0.0.1:{server.port}", "--token-ids", "5,6,99", "--max-tokens", "4")
    assert r.returncode == 1
    assert "INVALID_ARGUMENT: prompt_token_ids:" in r.stderr


def test_bench_reports_throughput_latency_and_acceptance(server: ServerThread) -> None:
    r = run_cli("bench", "--address", f"127.0.0.1:{server.port}", "--concurrency", "4", "--num-requests", "12",
                "--input-len", "10", "--output-len", "12", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["requests"], report["failed"], report["model"]) == (12, 0, "tiny-mtp")
    assert (report["prompt_tokens"], report["completion_tokens"]) == (12 * 10, 12 * 12)
    assert report["output_tok_per_s"] > 0 and report["total_tok_per_s"] > report["output_tok_per_s"]
    assert 0 < report["ttft_p50_s"] <= report["ttft_p99_s"] and 0 < report["tpot_p50_s"] <= report["tpot_p99_s"]
    assert report["acceptance_length"] > 1.5  # the trained modules are right most of the time
    table = run_cli("bench", "--address", f"127.0.0.1:{server.port}", "--num-requests", "2", "--output-len", "4")
    assert table.returncode == 0, table.stderr
    for row in ("output throughput", "TTFT p50 / p99", "TPOT p50 / p99", "acceptance length"):
        assert row in table.stdout
    failing = run_cli("bench", "--address", f"127.0.0.1:{server.port}", "--num-requests", "2", "--temperature", "-1")
    assert failing.returncode == 1 and "requests (failed)  2 (2)" in failing.stdout
    assert "error: temperature: must be finite and >= 0" in failing.stderr


# -- serve ----------------------------------------------------------------------------------------
def test_serve_with_config_file_and_flags(ckpt: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"model": str(ckpt), "model-name": "from-yaml", "num_speculative_tokens": 1,
                                      "num_kv_blocks": 200, "host": "127.0.0.1", "port": 1, "metrics_port": -1}))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*CLI, "serve", "--config", str(config), "--port", "0",
                                 "--num-speculative-tokens", "2"], stdout=out, stderr=subprocess.STDOUT)
    try:
        port = int(wait_for_line(log, r"serving gRPC on 127\.0\.0\.1:(\d+)", proc).group(1))
        with Client(f"127.0.0.1:{port}", timeout=30) as c:
            info = c.model_info()
            assert info.name == "from-yaml"  # from the file ...
            assert info.default_num_speculative_tokens == 2  # ... and the flag wins over the file's 1
            assert len(c.generate("w5 w6", {"max_tokens": 6, "ignore_eos": True}).token_ids) == 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert re.search(r"loading .*tiny-mtp", text) and re.search(r"model loaded in [\d.]+ s", text)
    assert "shutting down" in text and "stopped" in text


def test_serve_exits_non_zero_with_a_bad_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    r = run_cli("serve", "--model", str(missing), "--port", "0", "--metrics-port", "-1")
    assert r.returncode == 1
    assert "cannot load the model" in r.stderr and str(missing) in r.stderr


def test_serve_rejects_unknown_config_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("modle: /x\n")
    assert serve_main(["--config", str(config)]) == 2
    assert "unknown keys ['modle']" in caplog.text


def test_load_config_precedence(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("tensor-parallel-size: 2\nmax_num_seqs: 7\nport: 6000\nkv_cache_memory_gb: 3\n")
    engine, server = load_config(config, {"max_num_seqs": 9, "metrics_port": 9999})
    assert (engine.tensor_parallel_size, engine.max_num_seqs, engine.kv_cache_memory_gb) == (2, 9, 3)
    assert (server.port, server.metrics_port, server.max_queue_size) == (6000, 9999, 256)
    engine, server = load_config(None, {})
    assert engine == EngineConfig() and server == ServerOptions()


def test_every_config_field_is_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for cls in (EngineConfig, ServerOptions):
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in parser._option_string_actions, f.name
    structured = [f.name for f in dataclasses.fields(EngineConfig) if str(f.type).startswith("dict")]
    for name in structured:  # mappings (e.g. Ray resources) are given as YAML/JSON on the command line
        args = parser.parse_args(["--" + name.replace("_", "-"), '{"node:x": 0.5}'])
        assert getattr(config_from_args(args)[0], name) == {"node:x": 0.5}


# -- auth and TLS ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def secure_server(ckpt: Path, tls_files: tuple[Path, Path]) -> Iterator[ServerThread]:
    cert, key = tls_files
    engine = load_engine(EngineConfig(model=str(ckpt), **ENGINE_ARGS))
    srv = ServerThread(engine, ServerOptions(host="127.0.0.1", port=0, metrics_port=-1, auth_token="s3cret",
                                             tls_cert_file=str(cert), tls_key_file=str(key)))
    yield srv
    srv.stop()


def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_bearer_token_and_tls(secure_server: ServerThread, tls_files: tuple[Path, Path]) -> None:
    address, ca = f"127.0.0.1:{secure_server.port}", tls_files[0].read_bytes()
    with Client(address, root_certificates=ca, token="s3cret", timeout=30) as good:
        assert len(good.generate([5, 6], {"max_tokens": 3, "ignore_eos": True}).token_ids) == 3
        assert good.model_info().vocab_size == VOCAB and good.abort("nothing") is False
    for token in (None, "wrong"):
        with Client(address, root_certificates=ca, token=token, timeout=30) as bad:
            assert _code(lambda: bad.generate([5], {"max_tokens": 2})) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(bad.model_info) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: bad.abort("x")) == grpc.StatusCode.UNAUTHENTICATED
            assert bad.health() == "SERVING"  # probes carry no credentials
    with Client(address, token="s3cret", timeout=10) as plaintext:
        assert _code(plaintext.model_info) == grpc.StatusCode.UNAVAILABLE


def test_cli_uses_token_and_ca(secure_server: ServerThread, tls_files: tuple[Path, Path]) -> None:
    address = f"127.0.0.1:{secure_server.port}"
    r = run_cli("generate", "--address", address, "--tls-ca-file", str(tls_files[0]), "w5", "--max-tokens", "3")
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr
    env = {**os.environ, "MTPSERVE_AUTH_TOKEN": "s3cret"}
    r = subprocess.run([*CLI, "generate", "--address", address, "--tls-ca-file", str(tls_files[0]), "w5",
                        "--max-tokens", "3", "--ignore-eos"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 3
