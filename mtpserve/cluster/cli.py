"""The `mtpserve` command: serve | generate | bench.

    mtpserve serve --model ./ckpt --port 50051 --metrics-port 9400 --http-port 8080 [--config serve.yaml]
    mtpserve generate --address localhost:50051 "Once upon a time" --max-tokens 64 --temperature 0
    mtpserve generate "def fibonacci(n):"     # no --address: the default model, in this process
    mtpserve bench --address localhost:50051 --concurrency 16 --num-requests 128 --output-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

DEFAULT_ADDRESS = "localhost:50051"
AUTH_TOKEN_ENV = "MTPSERVE_AUTH_TOKEN"  # same as serve_config.AUTH_TOKEN_ENV (not imported: it pulls in torch)


# -- shared client flags ----------------------------------------------------------------------------
def _add_client_arguments(p: argparse.ArgumentParser, address: str | None = DEFAULT_ADDRESS) -> None:
    where = f"default {address}" if address else "default: no server, run the model in this process"
    p.add_argument("--address", default=address, help=f"server host:port ({where})")
    p.add_argument("--token", default=None, help=f"bearer token (default: ${AUTH_TOKEN_ENV})")
    p.add_argument("--tls-ca-file", type=Path, default=None, help="PEM CA certificate: connect with TLS")
    p.add_argument("--timeout", type=float, default=None, help="deadline per request, seconds")


def _add_sampling_arguments(p: argparse.ArgumentParser, with_max_tokens: bool = True) -> None:
    if with_max_tokens:
        p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate")
    for name, kind in (("temperature", float), ("top-p", float), ("top-k", int), ("min-p", float),
                       ("repetition-penalty", float), ("presence-penalty", float), ("frequency-penalty", float),
                       ("seed", int), ("logprobs", int), ("num-speculative-tokens", _spec_tokens)):
        p.add_argument(f"--{name}", type=kind, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _spec_tokens(text: str) -> int | str:
    """--num-speculative-tokens: a number of drafts or "auto" (as mtpserve.sampling_params.parse_spec_tokens;
    not imported: this module stays light for the client commands)."""
    return "auto" if text.strip().lower() == "auto" else int(text)


def _client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"token": args.token or os.environ.get(AUTH_TOKEN_ENV),
            "root_certificates": args.tls_ca_file.read_bytes() if args.tls_ca_file else None,
            "timeout": args.timeout}


def _sampling(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """The sampling flags that were given (the server fills in the rest), as the API's field names."""
    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "logprobs", "num_speculative_tokens", "stop")
    return {n: getattr(args, n, None) for n in names if getattr(args, n, None) is not None} | extra


# -- generate -------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one completion: from the server at --address, or (without it) from an engine in this process."""
    import grpc

    from mtpserve.errors import MTPServeError

    prompt: str | list[int] = [int(t) for t in args.prompt.replace(",", " ").split()] if args.token_ids \
        else args.prompt
    params = _sampling(args, ignore_eos=True) if args.ignore_eos else _sampling(args)
    try:
        if args.address is None:
            return _generate_in_process(args, prompt, params)
        from mtpserve.cluster.client import Client

        with Client(args.address, **_client_kwargs(args)) as client:
            return _print_stream(client.model_info().has_tokenizer, client.stream(prompt, params))
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
    except (MTPServeError, ValueError, OSError) as e:  # in process: bad settings, a checkpoint that won't load
        print(f"\nerror: {e}", file=sys.stderr)
    return 1


def _generate_in_process(args: argparse.Namespace, prompt: str | list[int], params: dict[str, Any]) -> int:
    from mtpserve.cluster.client import StreamDelta, Usage
    from mtpserve.cluster.engine_config import EngineConfig
    from mtpserve.cluster.serve import load_engine, setup_logging
    from mtpserve.sampling_params import SamplingParams

    sampling = SamplingParams(**params)  # validate before the (slow) model load
    setup_logging("INFO")  # start-up progress on stderr; the completion alone goes to stdout
    engine = load_engine(EngineConfig(model=args.model, device=args.device))

    def deltas() -> Iterator[StreamDelta]:
        engine.add_request("generate", prompt, sampling)
        while engine.has_unfinished_requests():
            for out in engine.step():
                usage = Usage(len(out.prompt_token_ids), len(out.token_ids), out.accepted_tokens, out.num_steps)
                yield StreamDelta(out.request_id, out.new_token_ids, out.new_text, out.new_logprobs,
                                  out.finish_reason, usage if out.finished else None)

    try:
        return _print_stream(engine.tokenizer is not None, deltas())
    finally:
        engine.shutdown()


def _print_stream(as_text: bool, deltas: Iterable[Any]) -> int:
    """Text as it arrives (token ids for a model without tokenizer.json); the usage line on stderr."""
    last = None
    for delta in deltas:
        sys.stdout.write(delta.text if as_text else "".join(f"{t} " for t in delta.token_ids))
        sys.stdout.flush()
        last = delta
    sys.stdout.write("\n")
    if last is not None and last.usage is not None:
        u = last.usage
        print(f"[{last.finish_reason}: {u.prompt_tokens} prompt + {u.completion_tokens} generated tokens, "
              f"acceptance length {u.acceptance_length:.2f} over {u.steps} steps]", file=sys.stderr)
    return 0


# -- bench ----------------------------------------------------------------------------------------
@dataclass
class RequestTiming:
    ok: bool
    start: float
    first_token: float | None = None
    end: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    accepted: int = 0
    steps: int = 0
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[str | list[int]]:
    if args.prompt_file:
        lines = [ln.strip() for ln in Path(args.prompt_file).read_text().splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"prompt file {args.prompt_file} has no prompts")
        return [lines[i % len(lines)] for i in range(args.num_requests)]
    rng = random.Random(args.bench_seed)
    # Ids from 3 up: low ids are usually special tokens (pad, bos, eos) in small vocabularies.
    low = min(3, vocab_size - 1)
    return [[rng.randrange(low, vocab_size) for _ in range(args.input_len)] for _ in range(args.num_requests)]


async def _one(client: Any, prompt: str | list[int], params: dict[str, Any], sem: asyncio.Semaphore) -> RequestTiming:
    import grpc

    async with sem:
        t = RequestTiming(ok=True, start=time.perf_counter())
        try:
            async for delta in client.stream(prompt, params):
                if delta.token_ids and t.first_token is None:
                    t.first_token = time.perf_counter()
                if delta.usage is not None:
                    u = delta.usage
                    t.prompt_tokens, t.completion_tokens, t.accepted, t.steps = (
                        u.prompt_tokens, u.completion_tokens, u.accepted_draft_tokens, u.steps)
        except (grpc.RpcError, RuntimeError) as e:
            t.ok, t.error = False, e.details() if isinstance(e, grpc.RpcError) else str(e)
        t.end = time.perf_counter()
        return t


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from mtpserve.cluster.client import AsyncClient

    async with AsyncClient(args.address, **_client_kwargs(args)) as client:
        info = await client.model_info()
        prompts = make_prompts(args, info.vocab_size)
        params = _sampling(args, max_tokens=args.output_len, ignore_eos=args.ignore_eos)
        sem = asyncio.Semaphore(args.concurrency)
        t0 = time.perf_counter()
        timings = await asyncio.gather(*(_one(client, p, params, sem) for p in prompts))
        wall = time.perf_counter() - t0
    return summarize(timings, wall, args.concurrency, info.name)


def summarize(timings: list[RequestTiming], wall: float, concurrency: int, model: str) -> dict[str, Any]:
    ok = [t for t in timings if t.ok]
    ttft = [t.first_token - t.start for t in ok if t.first_token is not None]
    tpot = [(t.end - t.first_token) / (t.completion_tokens - 1) for t in ok
            if t.first_token is not None and t.completion_tokens > 1]
    out_tokens, steps, accepted = (sum(t.completion_tokens for t in ok), sum(t.steps for t in ok),
                                   sum(t.accepted for t in ok))
    return {
        "model": model, "concurrency": concurrency, "requests": len(timings), "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if not t.ok})[:5], "duration_s": wall,
        "prompt_tokens": sum(t.prompt_tokens for t in ok), "completion_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall if wall > 0 else 0.0,
        "total_tok_per_s": (out_tokens + sum(t.prompt_tokens for t in ok)) / wall if wall > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "verification_steps": steps, "accepted_draft_tokens": accepted,
        "acceptance_length": 1.0 + accepted / steps if steps else 1.0,
    }


def print_report(r: dict[str, Any]) -> None:
    rows = [("model", r["model"]), ("requests (failed)", f"{r['requests']} ({r['failed']})"),
            ("concurrency", r["concurrency"]), ("duration", f"{r['duration_s']:.2f} s"),
            ("output throughput", f"{r['output_tok_per_s']:.1f} tok/s"),
            ("total throughput", f"{r['total_tok_per_s']:.1f} tok/s"),
            ("TTFT p50 / p99", f"{1e3 * r['ttft_p50_s']:.1f} / {1e3 * r['ttft_p99_s']:.1f} ms"),
            ("TPOT p50 / p99", f"{1e3 * r['tpot_p50_s']:.2f} / {1e3 * r['tpot_p99_s']:.2f} ms"),
            ("acceptance length", f"{r['acceptance_length']:.2f} tokens/step "
                                  f"({r['accepted_draft_tokens']} accepted over {r['verification_steps']} steps)")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for e in r["errors"]:
        print(f"error: {e}", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> int:
    import grpc

    try:
        report = asyncio.run(run_bench(args))
    except (grpc.RpcError, ValueError, OSError) as e:
        details = e.details() if isinstance(e, grpc.RpcError) else str(e)
        print(f"error: {details}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["failed"] == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtpserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    # `serve` has its own parser (serve.main): its flags come from EngineConfig, whose module imports
    # torch, which the client commands should not wait for.
    sub.add_parser("serve", add_help=False, help="serve a model over gRPC (and the OpenAI HTTP API with --http-port), with Prometheus metrics "
                   "(mtpserve serve --help for its flags)")

    p = sub.add_parser("generate", help="stream one completion to the terminal")
    p.add_argument("prompt", help="prompt text (or token ids with --token-ids)")
    p.add_argument("--token-ids", action="store_true", help="the prompt is token ids: '1 2 3' or '1,2,3'")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--model", default=None, help="in process (no --address): checkpoint directory "
                   "(default: the embedded default model)")
    p.add_argument("--device", default="auto", help="in process: cpu, cuda or auto")
    _add_client_arguments(p, address=None)
    _add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="load generator against a running server")
    _add_client_arguments(p)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32, help="random prompt length (without --prompt-file)")
    p.add_argument("--prompt-file", type=Path, default=None, help="text prompts, one per line (cycled)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --output-len tokens (default: on)")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_sampling_arguments(p, with_max_tokens=False)  # --output-len is max_tokens
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from mtpserve.cluster import serve

        return serve.main(argv[1:], prog="mtpserve serve")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
