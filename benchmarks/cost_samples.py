"""What an engine's step-cost model was fed and what its chooser saw, recorded for offline replay (replay_costs.py).

`SampleLog` wraps StepCosts.observe of each engine it is given (in place) and, once, spec_chooser.choose_k. It
records in one list, each with the variant and round it belongs to and the time:
  * every sample: batch, k, lap, host and device seconds, tokens, and the engine's steps and admissions so far;
  * every choice: the gains, base, floor and cost row it priced, the host line it read, and the k it kept or took;
  * every probe of k - 1 (StepCosts.begin_probe; past the modules too since session AL), which a replay starts
    where the engine did;
  * every draw of the host's price of a token within steps (TokenPrice.add_draw, since session AM);
  * every step with prompt chunks or catch-ups (StepCosts.interrupt, since session AR), where probes start afresh;
  * each cost model's state when wrapped (pickled).
`--dump-samples PATH` in cell_phases.py and interleaved.py writes it as JSON. A GPU run's stream can then be priced
again on the CPU by another cost model and set against the fixed-k cells of the same rounds (replay_costs.py), or
its untimed steps around auto's choices counted (choice_windows.py).
"""

from __future__ import annotations

import base64
import gzip
import json
import pickle
import time
from pathlib import Path
from typing import Any

from mtpserve.cluster import spec_chooser
from mtpserve.cluster.engine import LLMEngine


class SampleLog:
    """Samples and choices of the engines it wraps, tagged with the variant and round set last (`at`)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.variant: str = ""
        self.round: int = 0
        self._engines: dict[str, LLMEngine] = {}  # per variant (the chooser's batch is read from its engine)
        self._choose = spec_chooser.choose_k
        spec_chooser.choose_k = self._traced_choose

    def at(self, variant: str, round_: int) -> None:
        """What the records that follow belong to."""
        self.variant, self.round = variant, round_

    def wrap(self, engine: LLMEngine, variant: str = "") -> None:
        """Record every sample this engine's step costs are fed (nothing where it has no adaptive speculation);
        `variant`: the engine's alone (interleaved.py), or "" where one engine runs every variant (cell_phases.py)."""
        if engine.adaptive is None:
            return
        self._engines[variant] = engine
        costs = engine.adaptive.costs
        # Where the replay starts from: the start-up seeds and what the warm-up taught.
        self._add("state", costs=base64.b64encode(pickle.dumps(costs)).decode(), variant=variant)
        observe, admit, admitted = costs.observe, engine.adaptive.admit, [0]

        def counted(*args: Any, **kwargs: Any) -> int:  # requests admitted so far (their prompt steps, untimed)
            admitted[0] += 1
            return admit(*args, **kwargs)

        def traced(batch: int, k: int, device: float, host: float = 0.0, overlapped: bool = False,
                   tokens: float = 0.0, greedy: bool = True, lap: float = 0.0) -> None:
            # step: steps the engine has planned so far (untimed steps between two samples show as a jump)
            self._add("sample", batch=batch, k=k, lap=lap, host=host, device=device, tokens=tokens,
                      overlapped=overlapped, greedy=greedy, step=engine.scheduler.num_steps, admitted=admitted[0])
            observe(batch, k, device, host, overlapped, tokens, greedy, lap)

        begin_probe = costs.begin_probe

        def probed(batch: int, k: int) -> None:  # a probe of k - 1 that draws the host's price of a draft (replayed)
            self._add("probe", batch=batch, k=k)
            begin_probe(batch, k)

        add_draw = costs.tokens.add_draw

        def token_drawn(drawn: float) -> None:  # a draw of the host's price of a token within steps (replayed)
            self._add("token_price", drawn=drawn)
            add_draw(drawn)

        interrupt = costs.interrupt

        def interrupted(admitted: bool) -> None:  # a step with prompt chunks or catch-ups (replayed)
            self._add("interrupt", admitted=admitted)
            interrupt(admitted)

        costs.observe = traced
        costs.begin_probe = probed
        costs.interrupt = interrupted
        costs.tokens.add_draw = token_drawn
        engine.adaptive.admit = counted

    def _traced_choose(self, gains: list[float], base: float, floor: int, cost: Any, current: int, *rest: Any) -> int:
        k = self._choose(gains, base, floor, cost, current, *rest)  # rest: the hysteresis and what it depends on
        engine = self._engines.get(self.variant) or self._engines.get("")
        batch = engine.adaptive._batch if engine is not None else -1
        # The host line as the row read it (a, b, the drafts' prices per k, the median): what a replay checks against.
        line = _host_line(engine.adaptive.costs, batch) if engine is not None and batch > 0 else None
        self._add("choice", batch=batch, gains=list(gains), base=base, floor=floor, cost=[float(c) for c in cost],
                  current=current, chosen=k, line=line)
        return k

    def _add(self, kind: str, **fields: Any) -> None:
        self.records.append({"kind": kind, "variant": self.variant, "round": self.round, "t": time.monotonic(),
                             **fields})

    def write(self, path: str | Path) -> None:
        """The records as JSON, gzipped where the path ends in .gz (a GPU run's files come back up to 16 MiB)."""
        spec_chooser.choose_k = self._choose
        text = json.dumps(self.records).encode()
        Path(path).write_bytes(gzip.compress(text) if str(path).endswith(".gz") else text)


def _host_line(costs: Any, batch: int) -> list[Any]:
    a, slope, price, median, _ = costs._host_fit(batch, refit=False)
    return [float(a), float(slope), [float(p) for p in price], float(median)]


def load(path: str | Path) -> list[dict[str, Any]]:
    """What SampleLog.write wrote."""
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)
