"""Start-up timing of the captured uniform-step graphs, the first estimates of adaptive speculation's
step-cost table (docs/design.md §9); real steps replace them as they run.

Right after the start-up capture every graph's static inputs still point at the pad slot (capture runs
pad rows only), so replaying one changes nothing but the pad slot's own state, as its warm-up did.
"""

from __future__ import annotations

import torch

from mtpserve.workers.uniform_graphs import UniformGraphs


@torch.inference_mode()
def time_start_graphs(uniform: UniformGraphs, replays: int = 3) -> list[tuple[int, int, bool, float]]:
    """(batch bucket, k, greedy, seconds per replay) of every steady-state graph (window = 1 + chain) of a
    plain batch: all greedy, or sampled without penalties, top-k, top-p or min-p (the captures at start)."""
    out = []
    for (batch, shape), g in uniform.graphs.items():
        plain = shape.flags == type(shape.flags)(all_greedy=shape.flags.all_greedy)
        if not plain or shape.window != 1 + shape.chain:
            continue
        g.graph.replay()  # the first replay after other work may pay for cold caches
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.graph.replay()
        end.record()
        end.synchronize()
        out.append((batch, shape.chain, shape.flags.all_greedy, start.elapsed_time(end) / 1e3 / replays))
    return out
