"""Recovery time after the loss of a worker (mtpserve/cluster/recovery.py): tp=1 on Ray, default model.

Runs a batch of greedy streams on a Ray replica, kills the target worker's process (SIGKILL) once every
stream has tokens, and steps on. Per fault it reports: detection (kill to the executor noticing),
recovery (noticing to the replacement workers being ready: process start, weight load, channel, KV),
the pause the streams see (kill to their next token, recomputation of the KV included) and the requests
resumed. The outputs must equal an undisturbed run's (checked), else the numbers mean nothing.

    python benchmarks/recovery.py [--device cuda] [--faults 3] [--requests 12] [--max-tokens 192]
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from common import REPO, Table, add_common_args, check, pick_device, report  # noqa: F401 (REPO: sys.path)

from mtpserve import SamplingParams
from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.engine_config import EngineConfig

TARGET = "target worker (rank 0)"


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams, kill_after: int | None) -> tuple[dict[str, list[int]], list[dict[str, float]]]:
    """Generate; with kill_after, kill the target worker whenever every stream has gained that many more
    tokens since the last fault (until the faults wanted are spent). Returns outputs and per-fault timings."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    faults, pending, mark = [], None, {k: 0 for k in tokens}
    while engine.has_unfinished_requests():
        before = len(engine.recoveries)
        outs = engine.step()
        now = time.monotonic()
        if len(engine.recoveries) > before:
            pending["recovered"] = now
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
            if pending is not None and out.new_token_ids and "resumed" not in pending:
                pending["resumed"] = now  # the first token any stream sees after the fault
        if pending is not None and "resumed" in pending:
            faults.append(pending)
            pending = None
            mark = {k: len(v) for k, v in tokens.items()}
        live = [k for k in tokens if k in engine.scheduler.requests]
        if (kill_after is not None and pending is None and len(faults) < kill_after and live
                and all(len(tokens[k]) - mark[k] >= 8 for k in live)):
            pending = {"killed": time.monotonic()}
            os.kill(engine.executor.worker_pids[TARGET], signal.SIGKILL)
    for f, event in zip(faults, engine.recoveries):
        f["recovery"], f["resumed_requests"] = event.seconds, event.requests_resumed
    return tokens, faults


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--faults", type=int, default=3)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--dtype", default="auto", help="float32 on a GPU: the output check is exact only there "
                   "(bf16 logits depend on the batch's shape, and a resumed request is re-prefilled)")
    args = p.parse_args()
    device = pick_device(args.device)
    config = EngineConfig(use_ray=True, device=device.type, dtype=args.dtype, max_faults=args.faults + 1)
    prompts = [f"Story number {i}: once upon a time" for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.monotonic()
    engine = LLMEngine(config)
    start_s = time.monotonic() - t0
    try:
        expected, _ = run(engine, prompts, params, None)
        got, faults = run(engine, prompts, params, args.faults)
    finally:
        engine.shutdown()
    check(len(faults) == args.faults, f"{len(faults)} of {args.faults} faults struck mid-stream")
    check(got == expected, "outputs after recovery differ from the undisturbed run")
    table = Table("Recovery from a killed target worker (tp=1, default model)",
                  ["fault", "detect s", "recovery s", "pause seen by streams s", "requests resumed"])
    for i, f in enumerate(faults):
        detect = f["recovered"] - f["killed"] - f["recovery"]
        table.add(str(i + 1), detect, f["recovery"], f["resumed"] - f["killed"], str(f["resumed_requests"]))
    notes = [f"dtype {args.dtype}", f"{args.requests} greedy streams of {args.max_tokens} tokens; the replica's first start took "
             f"{start_s:.1f} s; outputs equal the undisturbed run's"]
    report(args, "recovery", device, [table], notes)


if __name__ == "__main__":
    main()
