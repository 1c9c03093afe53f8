"""Where an engine step's time goes, per (k, concurrency): step kinds, host phases and top device kernels.

    python benchmarks/engine_profile.py --ks 0,3 --concurrency 32 [--model PATH] [--device cuda]

For each cell the closed loop of spec_matrix.py runs once to warm up (Triton, graph captures) and once
measured. It prints how many steps took the uniform path (and of those, graph replays), how many
were launched overlapped, the wall time per step, the host's share of it (engine.step minus the
wait for the device), and a torch.profiler table of the measured run's top device kernels and host
ops. It writes no RESULTS section: it is a diagnosis aid, the figures belong to spec_matrix.py.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import workloads  # noqa: E402

from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint path (default: the embedded default model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--ks", default="0,3")
    p.add_argument("--concurrency", default="32")
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=20)
    return p.parse_args(argv)


def _wrap_wait(engine: LLMEngine) -> list[float]:
    """Time spent blocked on the device (executor.wait), accumulated into the returned list's cell."""
    waited = [0.0]
    inner = engine.executor.wait

    def wait(handle):  # noqa: ANN001, ANN202 - the executor's handle type
        t0 = time.perf_counter()
        try:
            return inner(handle)
        finally:
            waited[0] += time.perf_counter() - t0

    engine.executor.wait = wait
    return waited


def profile_cell(engine: LLMEngine, k: int, c: int, args: argparse.Namespace, prompts: list[str]) -> None:
    n = max(8, args.requests_per_slot * c)
    jobs = [workloads.Job(p, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                            num_speculative_tokens=k)) for p in prompts[:n]]
    workloads.drive(engine, jobs, c, f"warm-k{k}c{c}")
    runner = getattr(engine.executor, "runner", None)
    uniform = getattr(runner, "uniform", None)
    runs0, replays0 = (uniform.runs, uniform.replays) if uniform else (0, 0)
    overlapped0, waited = engine.num_overlapped_steps, _wrap_wait(engine)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run = workloads.drive(engine, jobs, c, f"k{k}c{c}")
        wall = time.perf_counter() - t0
    steps = run.engine_steps
    runs, replays = (uniform.runs - runs0, uniform.replays - replays0) if uniform else (0, 0)
    print(f"\n== k={k} c={c}: {run.tokens_per_s:.1f} tok/s, AL {run.spec.acceptance_length:.2f}, {steps} steps, "
          f"{wall / steps * 1e3:.3f} ms/step, host {(wall - waited[0]) / steps * 1e3:.3f} ms/step, "
          f"uniform {runs} (replayed {replays}), overlapped {engine.num_overlapped_steps - overlapped0}")
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    if torch.cuda.is_available():
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                        max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device)
    ks, concurrency = common.parse_ints(args.ks), common.parse_ints(args.concurrency)
    with tempfile.TemporaryDirectory(prefix="mtpserve-engine-profile-") as tmp:
        model = workloads.resolve_model(args.model, False, Path(tmp))
        engine = LLMEngine(EngineConfig(model=str(model), device=str(device), dtype=args.dtype,
                                        max_num_seqs=max(concurrency)))
        prompts = workloads.get_prompts("stdlib", max(8, args.requests_per_slot * max(concurrency)), 2)
        for c in concurrency:
            for k in ks:
                profile_cell(engine, k, c, args, prompts)
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
