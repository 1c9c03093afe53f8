"""deploy/: the serve configs load, the manifests parse, the Grafana dashboard uses only metrics a real
server exports, and `ray job submit` on a local Ray head serves a request and stops cleanly."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mtpserve.cluster.client import Client
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.cluster.serve import RayServeReplica, ServerOptions, ServerThread, load_config, load_engine

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}
LABELS_PROMETHEUS_ADDS = {"instance", "job"}


def free_ports(n: int) -> list[int]:
    """n distinct ports that were free a moment ago (bound together, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


# -- configs and manifests --------------------------------------------------------------------------
@pytest.mark.parametrize("config", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_deploy_serve_configs_load(config: Path) -> None:
    engine, server = load_config(config, {})
    assert server.port == 50051 and server.metrics_port == 9400 and server.http_port == 8080


def test_kuberay_manifests_run_the_serve_entrypoint() -> None:
    job, job_service = yaml.safe_load_all((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job_service["kind"] == "Service"
    entry = job["spec"]["entrypoint"].split()
    assert entry[:3] == ["python", "-m", "mtpserve.cluster.serve"]
    assert (DEPLOY / Path(entry[entry.index("--config") + 1]).relative_to("/app/deploy")).is_file()
    service, svc = yaml.safe_load_all((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService" and svc["kind"] == "Service"
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    module, attr = app["import_path"].split(":")
    assert module == "mtpserve.cluster.serve" and attr == "build_ray_serve_app"
    assert (DEPLOY / Path(app["args"]["config"]).relative_to("/app/deploy")).is_file()
    for manifest in (job["spec"]["rayClusterSpec"], service["spec"]["rayClusterConfig"]):
        head = manifest["headGroupSpec"]["template"]
        assert head["metadata"]["annotations"]["prometheus.io/port"] == "9400"
        assert {p["containerPort"] for p in head["spec"]["containers"][0]["ports"]} >= {50051, 8080, 9400}
    for service_ports in (job_service["spec"]["ports"], svc["spec"]["ports"]):
        assert {p["port"] for p in service_ports} == {50051, 8080, 9400}


def test_ray_serve_replica_body(trained_ckpt: Path, tmp_path: Path) -> None:
    """What the RayService deployment runs, without Ray Serve (test_ray_serve.py runs it under Serve): load, serve, health."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": str(trained_ckpt), "num_kv_blocks": 64, "host": "127.0.0.1"}))
    replica = RayServeReplica(str(config), port=0, metrics_port=-1)
    try:
        replica.check_health()
        with Client(f"127.0.0.1:{replica.server.port}", timeout=30) as c:
            assert len(c.generate([5, 6], {"max_tokens": 3, "ignore_eos": True}).token_ids) == 3
    finally:
        replica.shutdown()
    with pytest.raises(RuntimeError):
        replica.check_health()


def test_prometheus_config_scrapes_the_metrics_port() -> None:
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["mtpserve"]["static_configs"][0]["targets"] == ["localhost:9400"]
    assert jobs["mtpserve"]["metrics_path"] == "/metrics"


# -- the Grafana dashboard against a real scrape ------------------------------------------------------
@pytest.fixture(scope="module")
def scrape(trained_ckpt: Path) -> tuple[set[str], set[str]]:
    """Sample names and label names of a real server's /metrics after one request."""
    engine = load_engine(EngineConfig(model=str(trained_ckpt), num_kv_blocks=64))
    with ServerThread(engine, ServerOptions(host="127.0.0.1", port=0, metrics_port=0)) as srv:
        with Client(f"127.0.0.1:{srv.port}", timeout=30) as c:
            c.generate([5, 6, 7], {"max_tokens": 8, "temperature": 0})
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return {s.name for s in samples}, {label for s in samples for label in s.labels}


def dashboard_queries() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "mtpserve-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression refers to; a small PromQL tokenizer, enough for dashboards."""
    labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"", expr))
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels |= {g.strip() for g in group.split(",") if g.strip()}
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)  # matchers, ranges, strings
    bare = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", bare)
    bare = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)", lambda m: f" {m.group(1)} ", bare)
    if "label_values(" in expr:
        labels |= set(re.findall(r"label_values\([^,]+,\s*(\w+)\s*\)", expr))
    tokens = re.findall(r"[a-zA-Z_:][\w:]*(?!\w)(?!\s*\()", bare)
    return {t for t in tokens if t.lower() not in PROMQL_WORDS}, labels


def test_dashboard_uses_only_exported_metrics(scrape: tuple[set[str], set[str]]) -> None:
    exported, exported_labels = scrape
    queries = dashboard_queries()
    assert len(queries) >= 15
    used: set[str] = set()
    for expr in queries:
        assert expr.count("(") == expr.count(")"), expr
        metrics, labels = promql_names(expr)
        assert metrics, f"no metric in {expr!r}"
        assert metrics <= exported, f"{expr!r} uses {sorted(metrics - exported)}, not in the scrape"
        assert labels <= exported_labels | LABELS_PROMETHEUS_ADDS, f"{expr!r}: labels {labels - exported_labels}"
        used |= metrics
    # Every kind of metric the issue asks for is on the dashboard.
    for needed in ("running", "waiting", "kv_cache", "prompt_tokens", "generation_tokens", "success",
                   "time_to_first_token", "inter_token", "e2e", "queue_time", "step_duration", "batch_size",
                   "num_drafts", "draft_tokens", "accepted_tokens_per_pos", "acceptance_length", "preemptions",
                   "prefix_cache_hits", "prefix_cache_queries", "chosen_k", "acceptance_estimate"):
        assert any(needed in m for m in used), f"no panel shows {needed}"


def test_the_promql_tokenizer_sees_foreign_metrics() -> None:
    assert promql_names('rate(vllm:num_requests_running{instance=~"$i"}[5m])')[0] == {"vllm:num_requests_running"}
    metrics, labels = promql_names("sum by (le, group) (rate(mtpserve_x_bucket[1m])) / on (le) mtpserve_y")
    assert metrics == {"mtpserve_x_bucket", "mtpserve_y"} and labels == {"le", "group"}


# -- ray job submit on a local head -----------------------------------------------------------------
@dataclass(frozen=True)
class RayHead:
    address: str  # the dashboard's HTTP address (job submission)
    env: dict[str, str]  # what a Ray CLI talking to this head needs (its auth token)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], capture_output=True, text=True,
                              timeout=timeout, env=self.env)

    def api(self, path: str) -> Any:
        """GET the dashboard's REST API (plain HTTP here: Ray's in-process clients cache auth state)."""
        request = urllib.request.Request(self.address + path,
                                         headers={"authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())


def _ray_env(token: str) -> dict[str, str]:
    """Token auth pinned on, with our own token: Ray 2.60 turns auth on for a new head whenever
    ~/.ray/auth_token exists (any local ray.init() may have written it) while its clients stay off unless
    RAY_AUTH_MODE says otherwise, so an unpinned test would depend on what ran before it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH"))}
    return env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    """A local Ray head of our own: its temp dir and every port given explicitly (other runs may have Ray
    heads on this machine), started with --block so that terminating this one process stops exactly
    the processes it started (`ray stop` would stop every Ray on the machine)."""
    temp = Path(tempfile.mkdtemp(prefix="mtpray", dir="/tmp"))  # short: Ray's socket paths must stay short
    gcs, dash, client, agent_http, agent_grpc, env_agent, metrics, node_mgr, obj_mgr = free_ports(9)
    head_info = RayHead(f"http://127.0.0.1:{dash}", _ray_env(secrets.token_hex(32)))
    log = open(temp / "ray-start.log", "w")
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={gcs}",
         "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
         f"--metrics-export-port={metrics}", f"--node-manager-port={node_mgr}", f"--object-manager-port={obj_mgr}",
         f"--object-store-memory={200 * 1024 ** 2}", f"--temp-dir={temp}", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=head_info.env, start_new_session=True)
    try:
        def dashboard_up() -> bool:
            if head.poll() is not None:
                log_text = (temp / "ray-start.log").read_text()
                raise AssertionError(f"ray start exited with {head.returncode}:\n{log_text}")
            try:
                return bool(head_info.api("/api/version"))
            except OSError:
                return False

        wait_until(dashboard_up, 120, "the Ray dashboard (job submission) to answer")
        yield head_info
    finally:
        head.send_signal(signal.SIGTERM)  # --block: the head shuts down the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(10)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_job_submit_serves_and_stops(ray_head: RayHead, trained_ckpt: Path, tmp_path: Path) -> None:
    """The job's driver runs the router; `use_ray` puts the model on a worker actor of the cluster."""
    job_dir = tmp_path / "job"  # the working dir that gets uploaded: just the config
    job_dir.mkdir()
    port, metrics_port = free_ports(2)
    (job_dir / "serve.yaml").write_text(yaml.safe_dump({
        "model": str(trained_ckpt), "num_kv_blocks": 128, "use_ray": True, "host": "127.0.0.1", "port": port,
        "metrics_port": metrics_port, "shutdown_grace_seconds": 1.0}))
    job_id = f"mtpserve-test-{uuid.uuid4().hex[:8]}"
    r = ray_head.cli("job", "submit", "--address", ray_head.address, "--submission-id", job_id, "--working-dir",
                     str(job_dir), "--no-wait", "--", sys.executable, "-m", "mtpserve.cluster.serve",
                     "--config", "serve.yaml")
    assert r.returncode == 0, r.stdout + r.stderr

    def status() -> str:
        return ray_head.api(f"/api/jobs/{job_id}")["status"]

    def logs() -> str:
        return ray_head.api(f"/api/jobs/{job_id}/logs")["logs"]

    def serving() -> bool:
        assert status() in ("PENDING", "RUNNING"), f"job ended ({status()}):\n{logs()}"
        try:
            with Client(f"127.0.0.1:{port}", timeout=2) as c:
                return c.health() == "SERVING"
        except grpc.RpcError:
            return False

    wait_until(serving, 180, "the job's gRPC server to report SERVING")
    with Client(f"127.0.0.1:{port}", timeout=60) as c:
        out = c.generate([5, 6, 7], {"max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        assert 'mtpserve_request_success_total{finish_reason="length"} 1.0' in reply.read().decode()

    r = ray_head.cli("job", "stop", "--address", ray_head.address, job_id)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_until(lambda: status() in ("STOPPED", "SUCCEEDED", "FAILED"), 60, "the job to end")
    assert status() == "STOPPED"
    text = logs()
    assert re.search(r"model loaded in .*RayExecutor", text), text
    assert "shutting down" in text and "mtpserve.serve: stopped" in text, text

    def port_closed() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) != 0

    wait_until(port_closed, 30, "the gRPC port to close")
