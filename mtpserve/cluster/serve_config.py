"""A replica's configuration (docs/design.md §1): every EngineConfig and ServerOptions field is a YAML key
(`--config`) and a flag (`--tensor-parallel-size` for tensor_parallel_size); flags win over the file, and an
unknown key is an error naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.sampling_params import parse_spec_tokens

AUTH_TOKEN_ENV = "MTPSERVE_AUTH_TOKEN"


@dataclass(frozen=True)
class ServerOptions:
    host: str = "0.0.0.0"
    port: int = 50051  # gRPC; 0 picks a free port
    metrics_port: int = 9400  # Prometheus text endpoint; 0 picks a free port, -1 turns it off
    http_port: int = -1  # the OpenAI-compatible HTTP API; 0 picks a free port, -1 turns it off
    model_name: str | None = None  # reported by GetModelInfo; default: the checkpoint directory's name
    max_queue_size: int = 256  # requests waiting beyond max_num_seqs; more get RESOURCE_EXHAUSTED
    auth_token: str | None = None  # bearer token required on every RPC but health (or $MTPSERVE_AUTH_TOKEN)
    auth_token_file: str | None = None  # the token from a file (a mounted Kubernetes secret)
    tls_cert_file: str | None = None  # PEM certificate chain: serve TLS instead of plaintext
    tls_key_file: str | None = None
    shutdown_grace_seconds: float = 5.0
    log_level: str = "INFO"

    def token(self) -> str | None:
        if self.auth_token_file:
            return Path(self.auth_token_file).read_text().strip()
        return self.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None


# -- configuration: YAML < flags ------------------------------------------------------------------
def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _flag_type(f: dataclasses.Field) -> Any:
    """The argparse type of a dataclass field, from its (string) annotation."""
    annotation = str(f.type)
    if annotation == "SpecTokens":  # a number of drafts or "auto"
        return parse_spec_tokens
    if annotation.startswith("bool"):
        return bool
    if annotation.startswith(("dict", "list", "tuple")):
        return _structured  # e.g. --target-resources '{"accelerator_type:H200": 0.01}'
    for name, kind in (("int", int), ("float", float)):
        if annotation.startswith(name):
            return kind
    return str


def _structured(text: str) -> Any:
    """A mapping or list given on the command line, in YAML (so JSON works too)."""
    return yaml.safe_load(text)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every engine and server field; unset flags stay absent so the YAML can fill them."""
    parser.add_argument("--config", type=Path, help="YAML file with the same keys as the flags (flags win)")
    for group_name, cls in (("engine", EngineConfig), ("server", ServerOptions)):
        group = parser.add_argument_group(group_name)
        for name, f in _fields(cls).items():
            flag, kind = "--" + name.replace("_", "-"), _flag_type(f)
            default = f" (default: {f.default})" if f.default is not dataclasses.MISSING else ""
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                   help=f"{name}{default}")
            else:
                group.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=name.upper(),
                                   help=f"{name}{default}")


def load_config(path: Path | None, overrides: dict[str, Any]) -> tuple[EngineConfig, ServerOptions]:
    """Merge the YAML file (keys with '_' or '-') with flag overrides; unknown keys are errors."""
    values: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"config {path}: expected a mapping of keys to values")
        values = {str(k).replace("-", "_"): v for k, v in raw.items()}
    values.update(overrides)
    engine_keys, server_keys = _fields(EngineConfig), _fields(ServerOptions)
    unknown = sorted(set(values) - set(engine_keys) - set(server_keys))
    if unknown:
        raise ValueError(f"config: unknown keys {unknown}")
    engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_keys})
    server = ServerOptions(**{k: v for k, v in values.items() if k in server_keys})
    return engine, server


def config_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerOptions]:
    overrides = {k: v for k, v in vars(args).items() if k in _fields(EngineConfig) or k in _fields(ServerOptions)}
    return load_config(args.config, overrides)
