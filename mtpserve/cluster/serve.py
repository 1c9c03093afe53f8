"""Serve one replica: `python -m mtpserve.cluster.serve --config deploy/<name>.yaml [flags]`.

This is also the entrypoint of `ray job submit ... -- python -m mtpserve.cluster.serve` (deploy/): the
engine runs inside this process (the Ray job's driver), and on Ray workers only when the engine
configuration asks for them (tensor_parallel_size > 1, drafter_devices > 0 or use_ray). It serves
until SIGTERM or SIGINT (what `ray job stop` and Kubernetes send), then shuts down gracefully:
health turns NOT_SERVING, in-flight streams get `shutdown_grace_seconds` to finish, the rest are aborted.

Configuration (serve_config.py): every EngineConfig field and every ServerOptions field is a YAML key (`--config`)
and a flag (`--tensor-parallel-size` for tensor_parallel_size); flags win over the file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.cluster.serve_config import (  # noqa: F401 (re-exported: the replica's configuration)
    ServerOptions, add_serve_arguments, config_from_args, load_config)

log = logging.getLogger("mtpserve.serve")

# -- start-up ---------------------------------------------------------------------------------------
def load_engine(config: EngineConfig, heartbeat_seconds: float = 10.0):
    """Build the engine (reads the checkpoint, loads weights, sizes the KV cache), logging progress."""
    from mtpserve.cluster.engine import LLMEngine  # torch and the model code: only once we need them

    where = config.model or "the default model (mtpserve/default_model)"
    log.info("loading %s (tp=%d, drafter_devices=%d)", where, config.tensor_parallel_size, config.drafter_devices)
    t0, done = time.monotonic(), threading.Event()

    def heartbeat() -> None:  # weight loading of a large checkpoint takes minutes: show that it is alive
        while not done.wait(heartbeat_seconds):
            log.info("still loading the model (%.0f s)", time.monotonic() - t0)

    threading.Thread(target=heartbeat, name="mtpserve-load-progress", daemon=True).start()
    try:
        engine = LLMEngine(config)
    finally:
        done.set()
    r = engine.resolved
    log.info("model loaded in %.1f s: %s, vocab %d, context %d, %d MTP modules (%d in use, %d draft tokens "
             "by default), %d KV blocks of %d per group, %s %s, %s", time.monotonic() - t0,
             r.model_config.architecture, r.model_config.vocab_size, r.max_model_len, r.model_config.mtp.num_modules,
             r.num_mtp_modules, r.default_num_spec, r.num_blocks, config.block_size, r.device,
             str(r.dtype).removeprefix("torch."), type(engine.executor).__name__)
    return engine


class Replica:
    """One serving replica in the running event loop: the engine thread, the gRPC server (Generation,
    health, reflection) and the metrics HTTP server."""

    def __init__(self, engine: Any, options: ServerOptions) -> None:
        self.engine, self.options = engine, options
        self.engine_loop: Any = None
        self.grpc_server: Any = None
        self.health: Any = None
        self.metrics_http: Any = None
        self.http: Any = None
        self.watchdog: asyncio.Task | None = None
        self.servicer: Any = None
        self.port = 0
        self.metrics_port = -1
        self.http_port = -1

    async def start(self) -> "Replica":
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        from mtpserve.cluster.metrics import PrometheusLogger
        from mtpserve.cluster.router import BearerAuthInterceptor, EngineLoop, GenerationServicer, model_info
        from mtpserve.v1 import generation_pb2, generation_pb2_grpc

        o, r = self.options, self.engine.resolved
        logger = PrometheusLogger(r.num_mtp_modules, r.config.mtp_chain)
        self.engine_loop = EngineLoop(self.engine, logger)
        self.engine_loop.start()
        loop = asyncio.get_running_loop()
        # Worker faults: NOT_SERVING while the replica recovers (or for good once it gave up).
        self.engine_loop.on_health = lambda serving: asyncio.run_coroutine_threadsafe(
            self._set_health(serving), loop)
        token = o.token()
        # so_reuseport off: a port already taken must fail loudly instead of being shared silently.
        self.grpc_server = grpc.aio.server(interceptors=[BearerAuthInterceptor(token)] if token else [],
                                           options=[("grpc.so_reuseport", 0)])
        self.servicer = servicer = GenerationServicer(self.engine_loop, model_info(self.engine, o.model_name),
                                                      r.config.max_num_seqs + o.max_queue_size)
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, self.grpc_server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        names = [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.grpc_server)
        self.port = self._bind(grpc)
        await self.grpc_server.start()
        for service in ("", names[0]):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.watchdog = asyncio.create_task(self._watch_engine(["", names[0]]))
        if o.metrics_port >= 0:
            from prometheus_client import start_http_server

            self.metrics_http, _ = start_http_server(o.metrics_port, addr=o.host, registry=logger.registry)
            self.metrics_port = self.metrics_http.server_port
        if o.http_port >= 0:
            await self._start_http(servicer, token)
        log.info("serving gRPC on %s:%d (%s%s), metrics on %s, OpenAI HTTP API on %s", o.host, self.port,
                 "TLS" if o.tls_cert_file else "plaintext", ", bearer auth" if token else "",
                 f"http://{o.host}:{self.metrics_port}/metrics" if self.metrics_http else "off",
                 f"http://{o.host}:{self.http_port}/v1" if self.http else "off")
        return self

    async def _set_health(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        from mtpserve.v1 import generation_pb2

        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name):
            await self.health.set(service, status)

    async def _start_http(self, servicer: Any, token: str | None) -> None:
        """The OpenAI-compatible API on the same engine loop, admission limit, metrics and token as gRPC."""
        from mtpserve.cluster.chat_template import ChatTemplate
        from mtpserve.cluster.http_server import HttpServer, OpenAIServer

        o, r = self.options, self.engine.resolved
        state = OpenAIServer(servicer, servicer.info.name, self.engine.tokenizer,
                             ChatTemplate.from_checkpoint(r.model_path), r.max_model_len, token)
        self.http = HttpServer(state, o.host, o.http_port, "warning")
        self.http_port = await self.http.start()

    async def _watch_engine(self, services: list[str], period: float = 1.0) -> None:
        """Health turns NOT_SERVING if the engine thread ends, so load balancers and probes stop routing here."""
        from grpc_health.v1 import health_pb2

        while self.engine_loop.is_alive():
            await asyncio.sleep(period)
        log.error("the engine thread has stopped: health is NOT_SERVING")
        for service in services:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _bind(self, grpc: Any) -> int:
        o, address = self.options, f"{self.options.host}:{self.options.port}"
        if not o.tls_cert_file:
            port = self.grpc_server.add_insecure_port(address)
        else:
            if not o.tls_key_file:
                raise ValueError("tls_key_file: required with tls_cert_file")
            creds = grpc.ssl_server_credentials([(Path(o.tls_key_file).read_bytes(),
                                                  Path(o.tls_cert_file).read_bytes())])
            port = self.grpc_server.add_secure_port(address, creds)
        if port == 0:
            raise OSError(f"port: cannot bind {address}")
        return port

    async def stop(self, grace: float | None = None) -> None:
        grace = self.options.shutdown_grace_seconds if grace is None else grace
        log.info("shutting down (grace %.1f s)", grace)
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        # Both APIs drain together, then cancel what is left: those streams abort their requests.
        await asyncio.gather(*([self.grpc_server.stop(grace)] if self.grpc_server is not None else []),
                             *([self.http.stop(grace)] if self.http is not None else []))
        if self.engine_loop is not None:
            await asyncio.to_thread(self.engine_loop.stop)
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()
        self.engine.shutdown()
        log.info("stopped")


class ServerThread:
    """A replica on an event loop of its own in a background thread (tests, embedding in a program)."""

    def __init__(self, engine: Any, options: ServerOptions, start_timeout: float = 60.0) -> None:
        self.loop = asyncio.new_event_loop()
        self.replica = Replica(engine, options)
        self._thread = threading.Thread(target=self.loop.run_forever, name="mtpserve-grpc", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.replica.start(), self.loop).result(start_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def port(self) -> int:
        return self.replica.port

    @property
    def metrics_port(self) -> int:
        return self.replica.metrics_port

    @property
    def http_port(self) -> int:
        return self.replica.http_port

    def healthy(self) -> bool:
        """False once the engine stopped or gave up after worker faults (not while it recovers: a
        supervisor restarting the replica then would only lose the requests it is resuming)."""
        loop = self.replica.engine_loop
        return self._thread.is_alive() and loop is not None and loop.is_alive() and loop.failure is None

    def stop(self, grace: float = 0.0, timeout: float = 60.0) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.replica.stop(grace), self.loop).result(timeout)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            self.loop.close()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class RayServeReplica:
    """The body of the Ray Serve deployment that a KubeRay RayService runs (deploy/kuberay/rayservice.yaml).

    Ray Serve only supervises here: it places the replicas, replaces one whose process dies or whose
    check_health fails, and rolls them on upgrades. Requests do not pass through Serve's proxies; each
    replica serves its own gRPC, OpenAI HTTP and metrics ports, as `python -m mtpserve.cluster.serve` does
    (`endpoints()` tells which, for replicas that picked free ports).
    """

    def __init__(self, config: str | None = None, **overrides: Any) -> None:
        engine_config, options = load_config(Path(config) if config else None, overrides)
        setup_logging(options.log_level)
        self.server = ServerThread(load_engine(engine_config), options, start_timeout=600.0)

    def endpoints(self) -> dict[str, int]:
        return {"pid": os.getpid(), "grpc_port": self.server.port, "http_port": self.server.http_port,
                "metrics_port": self.server.metrics_port}

    def check_health(self) -> None:
        if not self.server.healthy():
            raise RuntimeError("the engine or gRPC thread has stopped")

    def shutdown(self) -> None:
        self.server.stop(grace=self.server.replica.options.shutdown_grace_seconds)

    def __del__(self) -> None:  # Ray Serve deletes the replica object on scale-down and upgrades
        if hasattr(self, "server"):
            self.shutdown()


def ray_serve_deployment() -> Any:
    """The Serve deployment of RayServeReplica (`.options(num_replicas=...)` to change its settings)."""
    from ray import serve  # needs ray[serve]; only RayService deployments use it

    return serve.deployment(name="mtpserve", num_replicas=1, health_check_period_s=10, health_check_timeout_s=30,
                            graceful_shutdown_timeout_s=30)(RayServeReplica)


def build_ray_serve_app(args: dict[str, Any]) -> Any:
    """Ray Serve application builder (`import_path: mtpserve.cluster.serve:build_ray_serve_app`); args are
    `config` (a YAML path) plus any config keys, which override the file's."""
    return ray_serve_deployment().bind(**dict(args))


# -- the process ------------------------------------------------------------------------------------
async def serve_until_signalled(engine: Any, options: ServerOptions) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    replica = await Replica(engine, options).start()
    await stop.wait()
    await replica.stop()


def run(engine_config: EngineConfig, options: ServerOptions) -> int:
    """Load, serve until signalled; returns the exit status (1, with the reason logged, if start-up fails)."""
    try:
        engine = load_engine(engine_config)
    except Exception as e:  # a bad path, a broken checkpoint, no memory: say what, exit non-zero
        log.error("cannot load the model: %s: %s", type(e).__name__, e)
        return 1
    try:
        asyncio.run(serve_until_signalled(engine, options))
    except Exception as e:  # e.g. the port is taken
        log.error("cannot serve: %s: %s", type(e).__name__, e)
        return 1
    return 0


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        engine_config, options = config_from_args(args)
    except (ValueError, TypeError, OSError, yaml.YAMLError) as e:
        setup_logging("INFO")
        log.error("invalid configuration: %s", e)
        return 2
    setup_logging(options.log_level)
    return run(engine_config, options)


if __name__ == "__main__":
    sys.exit(main())
