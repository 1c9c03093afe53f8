"""The switches that show where a replica with worker actors hangs (deploy/README.md): a worker's stack dump when
one driver message takes too long (MTPSERVE_HANG_DUMP_S), and the trace of every point-to-point op
(MTPSERVE_TRACE_P2P)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mtpserve.workers import group_links

REPO = Path(__file__).resolve().parents[2]

# A worker (rank 1: it answers nothing) whose runner takes 1.5 s over one plan, served over a loopback TCP
# connection; the driver's end sends that plan, then "stop".
_SLOW_WORKER = textwrap.dedent("""
    import socket, time
    from mtpserve.boundary.channel import Channel
    from mtpserve.boundary.messages import StepPlan
    from mtpserve.workers.worker import Worker, WorkerSpec

    class SlowRunner:
        def execute(self, plan):
            stuck_in_a_step()

        def finish_step(self):
            pass

    def stuck_in_a_step():
        time.sleep(1.5)

    listener = socket.create_server(("127.0.0.1", 0))
    driver_end = socket.create_connection(listener.getsockname())
    worker_end = listener.accept()[0]
    worker = Worker(WorkerSpec("target", 1, 2, 0, None, None, 5.0))
    worker.runner, worker.channel = SlowRunner(), Channel(worker_end)
    driver = Channel(driver_end)
    driver.send(("plan", StepPlan(req_ids=["r"], num_tokens=[1], num_drafts=[0])))
    driver.send(("stop", None))
    worker.serve()
""")


def _serve_slow_plan(dump_after: str) -> str:
    env = {"PYTHONPATH": str(REPO), "MTPSERVE_HANG_DUMP_S": dump_after, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", _SLOW_WORKER], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_worker_stuck_in_a_step_prints_where() -> None:
    err = _serve_slow_plan("0.3")
    assert "Timeout (0:00:00" in err, err
    assert "stuck_in_a_step" in err and "execute" in err, err


def test_no_dump_unless_asked() -> None:
    assert "Timeout" not in _serve_slow_plan("")


def test_p2p_trace_names_each_op(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    sent, received = [], []
    monkeypatch.setattr(group_links, "_TRACE", True)
    monkeypatch.setattr(group_links.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(group_links.dist, "send", lambda t, dst: sent.append((tuple(t.shape), dst)))
    monkeypatch.setattr(group_links.dist, "recv", lambda t, src: received.append((tuple(t.shape), src)))
    group_links.send([torch.zeros(4, 5, dtype=torch.long), torch.zeros(0)], 0)  # an empty tensor travels not
    group_links.recv([torch.zeros(4, 3, 8, dtype=torch.bfloat16)], 0)
    assert sent == [((4, 5), 0)] and received == [((4, 3, 8), 0)]
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[p2p] rank 1 send to 0: (4, 5) int64", "[p2p] rank 1 recv from 0: (4, 3, 8) bfloat16"]
