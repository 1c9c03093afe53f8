"""benchmarks/host_parts.py: a real engine's steps split into their host parts."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_parts  # noqa: E402
import interleaved  # noqa: E402
import spec_matrix  # noqa: E402
import workloads  # noqa: E402


def test_every_step_is_split_into_parts_within_its_own_time() -> None:
    args = interleaved.parse_args(["--tiny", "--device", "cpu", "--ks", "2", "--concurrency", "4", "--max-tokens",
                                   "16", "--no-results"])
    with tempfile.TemporaryDirectory() as tmp:
        engine = interleaved.build_engines(args, torch.device("cpu"), Path(tmp), [2], 4)[2]
        parts = host_parts.HostParts(engine)
        prompts = interleaved.round_prompts(args, engine.model_config.vocab_size, 8)[0]
        run = workloads.drive(engine, spec_matrix.matrix_jobs(args, prompts, 2, 8, 16), 4, "parts")
        engine.shutdown()
    assert run.num_tokens == 8 * 16 and len(parts.steps) >= 16 // 3  # at least a step per three tokens a request
    for step in parts.steps:
        inside = sum(step.get(name, 0.0) for name in host_parts.NAMES)
        assert 0 < inside <= step["step"] and step.get("update", 0.0) > 0  # every step's result updates the scheduler
        assert step.get("detok", 0.0) <= step.get("emit", 0.0)  # an inner part lies within its outer one
    means = host_parts.part_means(parts.steps)
    assert len(means) == len(host_parts.NAMES) + 1 + len(host_parts.INNER)
    assert means[host_parts.NAMES.index("schedule")] > 0 and means[host_parts.NAMES.index("launch")] > 0
    table = host_parts.parts_table("t", {"MTP2": (1e-3, [{**s, "faults": 2} for s in parts.steps]), "none": (0.0, [])})
    assert [row[0] for row in table.rows] == ["MTP2"]  # a variant without steps is left out
    assert table.rows[0][-3:-1] == ["0.0", "2.00"]  # no step carried garbage collection; two faults each
    probed = [i for i, step in enumerate(parts.steps) if "probe" in step]
    assert probed == list(range(0, len(parts.steps), host_parts.PROBE_EVERY))  # every PROBE_EVERY-th, from the first
    assert all(0 < parts.steps[i]["probe"] < 0.05 for i in probed)
    assert float(table.rows[0][-1]) > 0


def test_a_row_without_probes_shows_none() -> None:
    table = host_parts.parts_table("t", {"MTP1": (1e-3, [{"step": 1e-3, "schedule": 1e-4}])})
    assert table.rows[0][-1] == "-"
