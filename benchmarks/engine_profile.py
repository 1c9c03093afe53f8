"""Where an engine step's time goes, per (k, concurrency): step kinds, host phases and top device kernels.

    python benchmarks/engine_profile.py --ks 0,3 --concurrency 32 [--model PATH] [--device cuda]

For each cell the closed loop of spec_matrix.py runs once to warm up (Triton, graph captures) and once
measured. It prints how many steps took the uniform path (and of those, graph replays), how many
were launched overlapped, and the wall time per step split into the engine's phases (schedule,
launch, of it the general path and the uniform step's pack + graph replay, the wait for the device,
the read of the result, postprocess), all per step of the measured run. With --torch-profile it adds
torch.profiler tables of the top device kernels and host ops (the profiler inflates host time). It writes no RESULTS section: it is a diagnosis aid, the figures belong to spec_matrix.py.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import host  # noqa: E402
import spec_matrix  # noqa: E402
import workloads  # noqa: E402

from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint path (default: the embedded default model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--ks", default="0,3", help="comma-separated k's, 'auto' among them for adaptive speculation")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", default="32")
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--workload", choices=("text", "random"), default="text",
                   help="prompts: stdlib text, or random token ids (low acceptance), as spec_matrix.py's")
    p.add_argument("--random-prompt-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="the random prompts' seed")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--prefill-hold-steps", type=int, default=4)
    p.add_argument("--prefill-step-rows", type=int, default=None, help="EngineConfig.prefill_step_rows (0: off)")
    p.add_argument("--torch-profile", action="store_true", help="also a torch.profiler table (inflates host time)")
    p.add_argument("--python-profile", action="store_true",
                   help="also the top Python functions by cumulative time (cProfile; inflates host time)")
    p.add_argument("--python-sort", default="cumulative", help="pstats sort key of --python-profile (tottime, ...)")
    host.add_pin_arg(p)
    p.add_argument("--python-filter", default="",
                   help="regex a listed function's file:line(name) must match (e.g. cluster/)")
    return p.parse_args(argv)


class PhaseTimer:
    """Wall time spent in a few engine and executor methods, wrapped in place (seconds per name)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        ex, sched = engine.executor, engine.scheduler
        for owner, attr, name in ((sched, "schedule", "schedule"), (sched, "schedule_overlapped", "schedule"),
                                  (ex, "execute", "execute (sync)"), (ex, "submit", "submit (launch)"),
                                  (ex, "wait", "wait (device)"),
                                  (engine, "_postprocess", "postprocess")):
            common.time_in_place(owner, attr, partial(self._add, name))
        adaptive = getattr(engine, "adaptive", None)
        for owner, attr, name in ((engine.outputs, "process", "  outputs"), (sched, "update", "  scheduler update"),
                                  (getattr(adaptive, "acceptance", None), "observe", "    acceptance queue"),
                                  (getattr(adaptive, "acceptance", None), "flush", "    acceptance fold")):
            common.time_in_place(owner, attr, partial(self._add, name))
        self._by_kind(engine)
        runner = getattr(ex, "runner", None)  # in-process: the parts of a uniform step's launch and read
        for owner, attr, name in ((runner, "_launch_uniform", "  uniform launch"),
                                  (getattr(runner, "uniform", None), "run", "    pack+graph"),
                                  (runner, "_finish_uniform", "  uniform read"), (runner, "_run_general", "  general"),
                                  (runner, "_run_prefill", "  prefill"),
                                  (getattr(runner, "staging", None), "upload", "      upload"),
                                  (getattr(runner, "staging", None), "download", "    download"),
                                  (torch.cuda.CUDAGraph if runner is not None else None, "replay", "      graph replay")):
            common.time_in_place(owner, attr, partial(self._add, name))

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.kinds.clear()

    def _by_kind(self, engine: LLMEngine) -> None:
        """engine.step's wall, split by the kind of step whose outputs it returned: one that computed prompt
        tokens (a prefill, sync) or a decode step."""
        self.kinds: dict[str, list[float]] = {}
        step = engine.step

        def timed_step() -> Any:
            t0 = time.perf_counter()
            out = step()
            kind = "with prompts" if engine.last_stats.num_prompt_tokens else "decode"
            n, sec = self.kinds.get(kind, (0, 0.0))
            self.kinds[kind] = [n + 1, sec + time.perf_counter() - t0]
            return out

        engine.step = timed_step


def profile_cell(engine: LLMEngine, timer: PhaseTimer, k: int | str, c: int, args: argparse.Namespace,
                 prompts: list[str] | list[list[int]]) -> None:
    n = max(8, args.requests_per_slot * c)
    jobs = [workloads.Job(p, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True,
                                            num_speculative_tokens=k)) for p in prompts[:n]]
    workloads.drive(engine, jobs, c, f"warm-k{k}c{c}")
    runner = getattr(engine.executor, "runner", None)
    uniform = getattr(runner, "uniform", None)
    runs0, replays0 = (uniform.runs, uniform.replays) if uniform else (0, 0)
    overlapped0 = engine.num_overlapped_steps
    timer.reset()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities) if args.torch_profile else contextlib.nullcontext()
    py_prof = cProfile.Profile() if args.python_profile else None
    with prof, (py_prof or contextlib.nullcontext()):
        t0 = time.perf_counter()
        run = workloads.drive(engine, jobs, c, f"k{k}c{c}")
        wall = time.perf_counter() - t0
    steps = run.engine_steps
    runs, replays = (uniform.runs - runs0, uniform.replays - replays0) if uniform else (0, 0)
    phases = ", ".join(f"{name} {sec / steps * 1e3:.3f}" for name, sec in timer.seconds.items())
    print(f"\n== k={k} c={c}: {run.tokens_per_s:.1f} tok/s, AL {run.spec.acceptance_length:.2f}, {steps} steps, "
          f"{wall / steps * 1e3:.3f} ms/step ({phases} ms/step), uniform {runs} (replayed {replays}), "
          f"overlapped {engine.num_overlapped_steps - overlapped0}, general steps "
          f"{timer.calls.get('  general', 0)}, prefill steps {timer.calls.get('  prefill', 0)}; wall by step kind: "
          + ", ".join(f"{kind} {n} x {sec / n * 1e3:.3f} ms" for kind, (n, sec) in timer.kinds.items()))
    if py_prof is not None:
        pstats.Stats(py_prof).sort_stats(args.python_sort).print_stats(args.python_filter, args.top)
    if not args.torch_profile:
        return
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    if torch.cuda.is_available():
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                        max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device)
    ks = common.parse_ks(args.ks)
    concurrency = common.parse_ints(args.concurrency)
    with tempfile.TemporaryDirectory(prefix="mtpserve-engine-profile-") as tmp:
        model = workloads.resolve_model(args.model, False, Path(tmp))
        engine = LLMEngine(EngineConfig(model=str(model), device=str(device), dtype=args.dtype,
                                        max_num_seqs=max(concurrency),
                                        prefill_hold_steps=args.prefill_hold_steps,
                                        **({} if args.prefill_step_rows is None else
                                           {"prefill_step_rows": args.prefill_step_rows})))
        timer = PhaseTimer(engine)
        if device.type == "cuda":  # on the CPU the model's threads would inherit the one core
            print(host.pin_cpu(args.pin_cpu))
        args.prompts, args.prompt_lines = "stdlib", 2  # the text workload: spec_matrix.py's default prompts
        prompts = spec_matrix.matrix_prompts(args, max(8, args.requests_per_slot * max(concurrency)),
                                             engine.model_config.vocab_size)
        for c in concurrency:
            for k in ks:
                profile_cell(engine, timer, k, c, args, prompts)
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
