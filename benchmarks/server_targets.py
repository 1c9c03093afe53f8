"""spec_matrix.py's targets that are running servers: its closed loop over gRPC (--grpc) or the OpenAI HTTP API
(--http), each a (drive, model name, close, vocabulary size) as the in-process engine's target."""

from __future__ import annotations

import argparse
import os
from typing import Callable

import workloads
from common import check

Driver = Callable[[list[workloads.Job], int, str], workloads.Run]  # (jobs, concurrency, cell name) -> the run
Target = tuple[Driver, str, Callable[[], None], "int | None"]  # drive, model name, close, vocabulary size


def grpc_target(args: argparse.Namespace, max_k: int) -> Target:
    """The matrix driven against a running gRPC server (--grpc): its model's facts checked first."""
    from mtpserve.cluster.client import Client

    token = args.token or os.environ.get("MTPSERVE_AUTH_TOKEN")
    with Client(args.grpc, token=token, timeout=30) as client:
        info = client.model_info()
    check(info.has_tokenizer, f"the server's model {info.name} has no tokenizer: text prompts cannot be sent")
    check(info.num_mtp_modules > 0 or max_k == 0, f"the server's model {info.name} has no MTP modules")
    check(max_k <= info.max_num_speculative_tokens,
          f"the server allows at most {info.max_num_speculative_tokens} drafts")
    return ((lambda jobs, c, _prefix: workloads.drive_grpc(args.grpc, jobs, c, token)), info.name, lambda: None,
            info.vocab_size)


def http_target(args: argparse.Namespace) -> Target:
    """The matrix driven against a running server's OpenAI HTTP API (--http)."""
    import openai

    token = args.token or os.environ.get("MTPSERVE_AUTH_TOKEN")
    with openai.OpenAI(base_url=f"http://{args.http}/v1", api_key=token or "none", max_retries=0, timeout=30) as c:
        name = c.models.list().data[0].id
    return (lambda jobs, c, _prefix: workloads.drive_http(args.http, name, jobs, c, token)), name, lambda: None, None
