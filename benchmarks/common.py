"""Helpers shared by the benchmark scripts: devices, timing, tables, RESULTS.md sections, bandwidth.

Not part of the test suite. Every script imports this module by path (`sys.path` holds benchmarks/
when a script runs as `python benchmarks/NAME.py`) and puts the repository root on `sys.path` too, so
the scripts work from a plain checkout on the GPU hosts, where mtpserve is not pip-installed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

DEFAULT_RESULTS = REPO / "benchmarks" / "RESULTS.md"


# --- arguments and devices ---------------------------------------------------------------------


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="tiny shapes, CPU-friendly, seconds (a smoke run)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help="markdown file to append a results section to (default benchmarks/RESULTS.md)")
    p.add_argument("--no-results", action="store_true", help="print only; do not append to --results")
    p.add_argument("--commit", default=None,
                   help="commit to record (default: git rev-parse HEAD; for copies of the tree without .git)")


def add_timing_args(p: argparse.ArgumentParser, iters: int = 20) -> None:
    """--iters timed calls after --warmup untimed ones (common.time_ms)."""
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--warmup", type=int, default=3)


def tiny_defaults(p: argparse.ArgumentParser, args: argparse.Namespace, **values: Any) -> None:
    """With --tiny, replace the defaults of these options, but never a value given on the command line."""
    if args.tiny:
        for name, value in values.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)


def pick_device(name: str, tiny: bool = False) -> torch.device:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available on this machine")
    if tiny and device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops lose to intra-op threading; one thread also times steadier
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB, torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu} x{torch.get_num_threads()} threads (torch {torch.__version__})"


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_ks(text: str) -> list[int | str]:
    """--ks: comma-separated draft counts, "auto" among them for adaptive speculation."""
    return [part.strip() if part.strip() == "auto" else int(part) for part in text.split(",") if part.strip()]


def balanced_order(items: Sequence[Any], r: int) -> list[Any]:
    """Round r's order of the cells `items`: row r of a Williams design (0, 1, n-1, 2, n-2, ..., each shifted by r).
    Over n rounds every item runs once in every position and, for an even n, right after every other item once.
    A plain rotation keeps each item behind the same neighbour in every round: in spec_matrix.py's 0..4 + auto,
    auto always ran right after k = 4, the best fixed k of the greedy and random matrices, so whatever the cell
    before leaves (or a drift of the host's speed within a round) fell on auto alone. The H100 runs after the
    change (251-252) showed no such effect beyond their noise: the design rules it out rather than fixing one."""
    n, base, low, high = len(items), [0], 1, len(items) - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    return [items[(b + r) % n] for b in base]


# --- timing ------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Per-call wall times in ms. CUDA: events around each call (the call's own host syncs included,
    because those are part of what a serving step costs); elsewhere perf_counter."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def measure_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Memory bandwidth in bytes/s from a large same-device copy: (bytes read + bytes written) / time.

    The copy is the simplest kernel that streams at the memory's rate; it is what the §6 floor is
    compared against, so a step at ratio 1.0 would be as fast as copying its bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)  # touch the pages on the CPU, so the first timed copy does not pay for faults
    dst = torch.empty_like(src)
    dst.fill_(0)
    times = time_ms(lambda: dst.copy_(src), device, warmup=2, iters=iters)
    del src, dst
    return 2 * nbytes / (median(times) / 1e3)


# --- tables and RESULTS.md ---------------------------------------------------------------------


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{digits}f}"
    return str(x)


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.headers):
            raise ValueError(f"{self.title}: row has {len(cells)} cells for {len(self.headers)} columns")
        self.rows.append([c if isinstance(c, str) else fmt(c) for c in cells])

    def text(self) -> str:
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h)
                  for i, h in enumerate(self.headers)]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        out = [self.title, line(self.headers), line(["-" * w for w in widths])]
        return "\n".join(out + [line(r) for r in self.rows])

    def markdown(self) -> str:
        out = [f"**{self.title}**", "", "| " + " | ".join(self.headers) + " |",
               "|" + "|".join("---:" for _ in self.headers) + "|"]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in self.rows])


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + (" (uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def report(args: argparse.Namespace, name: str, device: torch.device, tables: list[Table],
           notes: Sequence[str] = ()) -> None:
    """Print the tables (last thing on stdout) and append a section to args.results."""
    for note in notes:
        print(f"note: {note}")
    for t in tables:
        print()
        print(t.text())
    if args.no_results:
        return
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## {name}: {now}{' (tiny smoke run)' if getattr(args, 'tiny', False) else ''}", "",
             f"- device: {device_name(device)}", f"- python: {platform.python_version()}",
             f"- commit: {args.commit or git_commit()}", f"- command: `{command_line()}`"]
    lines += [f"- {n}" for n in notes]
    for t in tables:
        lines += ["", t.markdown()]
    path: Path = args.results
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a") as f:
        if new:
            f.write("# Benchmark results\n\nAppended by the scripts in benchmarks/ (see benchmarks/README.md).\n")
        f.write("\n" + "\n".join(lines) + "\n")
    print(f"\n(appended to {path})")


def check(cond: bool, message: str) -> None:
    """A benchmark's sanity check: a failure means the numbers would be meaningless, so stop."""
    if not cond:
        raise SystemExit(f"CHECK FAILED: {message}")


def gb(nbytes: float) -> float:
    return nbytes / 1e9


def add_llama8b_shape_args(p: argparse.ArgumentParser) -> None:
    """Target shape flags; the defaults are Llama-3-8B's."""
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)


def add_model_prompt_args(p: argparse.ArgumentParser) -> None:
    """Which checkpoint to serve and where its prompts come from."""
    p.add_argument("--model", default=None, help="checkpoint dir (default: mtpserve/default_model)")
    p.add_argument("--prompts", default="stdlib", help="'stdlib' (held-out functions) or a prompt file")


def time_in_place(owner: Any, attr: str, add: Callable[[float], None]) -> None:
    """Wrap owner.attr in place so that each call's wall seconds go to add(seconds), raised or not (nothing where
    owner is None or has no such attribute). Callers that look the method up at each call then run the wrapper."""
    if owner is None or not hasattr(owner, attr):
        return
    call = getattr(owner, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            add(time.perf_counter() - t0)

    setattr(owner, attr, timed)
