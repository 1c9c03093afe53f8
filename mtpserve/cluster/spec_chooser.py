"""Adaptive speculation (docs/design.md §9): how many drafts each step makes, chosen from measurements.

Three pieces (their settings: AdaptiveConfig, spec_config.py), numpy over a large batch and plain Python over a few
rows or samples (inside the engine a numpy call costs several microseconds; no per-request Python work of any weight
at 256 requests):

* `AcceptanceTable` (acceptance.py): per request (a row), the conditional acceptance probability of each draft
  position (p_j: draft j is accepted given drafts 0..j-1 were), decayed so that a change of topic
  shows within a few steps; a new row starts from the engine-wide prior, itself a slower average of
  every observation.
* `StepCosts` (step_costs.py): seconds per decode step per (batch bucket, k), the host's share now
  combined with the device's at k (medians of recent timed steps, seeded by timing the captured graphs
  at start where the runner can, estimated where not measured).
* `choose_k`: the step's k maximising expected emitted tokens per second of the whole batch, where an
  adaptive request runs min(k, cap) drafts and a fixed one its own number; with hysteresis, a probe of a
  position no request has drafted for a while (what the engine-wide prior cannot learn otherwise), and past
  the MTP modules a probe of k - 1 (what a draft costs the host, which a window of one k cannot show).
"""

from __future__ import annotations

import math
import time
from itertools import accumulate
from operator import mul
from typing import NamedTuple

import numpy as np

from mtpserve.cluster.acceptance import AcceptanceTable
from mtpserve.cluster.paired_probe import SIDE
from mtpserve.cluster.spec_config import AdaptiveConfig
from mtpserve.cluster.spec_rate import choose_k, rates
from mtpserve.cluster.step_costs import StepCosts


class _Held(NamedTuple):
    """A bucket's last choice: its k, the k a probe of it left (-1: none), the step it was made at, its dwell."""

    k: int
    probed_from: int
    made_at: int
    dwell: int


class AdaptiveSpec:
    """The scheduler's view: a row per running request, the chosen k per step, and what it learns."""

    def __init__(self, config: AdaptiveConfig) -> None:
        self.acceptance = AcceptanceTable(config)
        self.costs = StepCosts(config.max_k, config.max_rows, config.cost_window, config.per_draft_cost, config.modules)
        self.config = config
        self.k = config.max_k  # the last choice (hysteresis starts from full speculation)
        self._probed_from = -1  # the k a probe of k + 1 left (hysteresis holds to it), -1 after any other choice
        self._probe_wait = 1  # probe_after is multiplied by this (see AdaptiveConfig.max_probe_wait)
        self._chosen = [0] * (config.max_k + 1)  # steps planned at each k (a list: a numpy element += every
        # step cost auto's held step more than the rest of it, inside the engine)
        self._held = config.min_dwell  # steps since the last full choice (the first call makes one)
        self.dwell = config.min_dwell  # steps the last choice holds
        self.active = False  # whether the last choice had an adaptive request to choose for
        self.greedy = True  # whether every request of the last call's batch samples greedily (its step costs)
        self._bucket = -len(self.costs.buckets)  # the batch bucket of the last full choice (none yet: far)
        # The rows of the last call, their bucket and whether any is adaptive (numpy calls cost ~3 us each on
        # the H100's host: per step only when the running set changed).
        self._rows: np.ndarray | None = None
        self._rows_active = False
        self._batch, self._rows_bucket = -1, -1  # the batch size priced, and its bucket
        # Per bucket, its last choice: a batch that returns to a bucket whose choice still holds takes it up
        # again. At c = 1 the next request joins while the last one finishes: the batch went 1 -> 2 -> 1 and
        # made two full choices per request (run 171).
        self._held_of: dict[int, _Held] = {}
        self._probed_down_at: dict[int, int] = {}  # per bucket, the step of its last probe below k
        self._newcomers_of: dict[int, tuple[int, int]] = {}  # per bucket, the last newcomers' choice: (k, step)
        self._flushed_at = -(10**9)  # the step whose _prepare folded the observations ahead of a due choice (never)
        self._due: tuple[int, int, np.ndarray] | None = None  # (steps to the full choice, batch, rows): prepare_due
        self._priced: tuple | None = None  # (rows, (batch, greedy, step), prices) taken one step ahead of a choice
        self._prepared_seconds = 0.0  # host seconds the due choice's work took in the steps before it
        self._spent = 0.0  # host seconds of choices and their preparation since the engine last took them

    @property
    def config(self) -> AdaptiveConfig:
        return self._config

    @config.setter
    def config(self, config: AdaptiveConfig) -> None:
        """The settings, and those the step costs read go with them (an A/B variant's: benchmarks/interleaved.py)."""
        self._config = config
        self.costs.bound_recursion, self.costs.cap_drafts = config.bound_recursion, config.cap_drafts
        self.costs.clean_probes = config.clean_probes

    @property
    def _modules(self) -> int:
        """The MTP modules: past them a draft reruns the last one (config.modules, or max_k where None)."""
        return self.config.max_k if self.config.modules is None else self.config.modules

    @property
    def choosing(self) -> bool:
        """Whether the last call made a choice (a full one, or the newcomers'), rather than keep its dwell's k."""
        return self._held == 0

    @property
    def chosen(self) -> np.ndarray:
        """[K + 1] steps planned at each k (for reports)."""
        return np.array(self._chosen)

    def admit(self, cap: int, adaptive: bool, greedy: bool = True) -> int:
        """A row for a request joining the batch: cap = its upper bound (adaptive) or its fixed k; greedy: it
        samples greedily."""
        return self.acceptance.acquire(min(cap, self.config.max_k), adaptive, greedy)

    def release(self, row: int) -> None:
        self.acceptance.release(row)

    def choose(self, rows: np.ndarray, batch: int | None = None, newcomers_adaptive: bool = True) -> int:
        """The step's k for the requests in `rows` (each adaptive one then runs min(k, its cap)), priced at the
        batch size the decode steps will run at (`batch`, at least rows.size: the running requests and the
        waiting ones that will join them). While a closed loop ramps up, a few dozen requests join per step;
        chosen for the few that ran, k dipped to 1 or 2, the joining requests prefilled with part of their
        chains, and every one of them was caught up when k rose again (196 catch-ups a cell at c = 256, T = 1,
        run 72 on the H100). `newcomers_adaptive`: whether any waiting request that joins chooses its k (where
        none runs and none of them does, nothing is chosen: a fixed-k cell at c = 1 made a full choice per
        request, about 1.5 % of its time on the H100's host, run 180)."""
        t = self.acceptance
        t.now += 1
        self._due = None  # a piece the last call left and nothing ran (two steps planned at once) is dropped
        self._held += 1
        batch = rows.size if batch is None else max(batch, rows.size)
        if batch != self._batch:
            self._batch, self._rows_bucket = batch, self.costs.bucket(batch)
        if rows is not self._rows:  # the scheduler passes the same array until its running set changes
            self._rows = rows
            self._rows_active = rows.size > 0 and bool(t.adaptive.take(rows).any())
            greedy = bool(t.greedy.take(rows).all()) if rows.size else self.greedy  # none running: keep the mode
            if greedy != self.greedy:  # another mode, other costs: choose again now
                self.greedy, self._held = greedy, self.dwell
                self._held_of.clear()  # the buckets' choices were made for the other mode
                self._newcomers_of.clear()
        self.active, bucket = self._rows_active, self._rows_bucket
        kept = self._held_of.get(bucket) if batch > 0 and bucket != self._bucket else None
        if kept is not None and t.now - kept.made_at < kept.dwell:  # a probe taken up again returns to its k
            self.k, self._bucket, self._probed_from = kept.k, bucket, kept.probed_from
            self._held, self.dwell = t.now - kept.made_at, kept.dwell
        if rows.size == 0 and batch > 0 and newcomers_adaptive:  # only newcomers: they start from the prior
            return self._for_newcomers(batch, bucket)
        if not self.active:
            return self.k
        # The dwell holds a choice for its batch only: one made while the batch ramps up (requests admitted a
        # few dozen a step) was priced for a smaller bucket (the T = 1 matrix at c = 256 on the H100 ran k = 0
        # for 55 to 104 steps, then caught up every request). A batch two or more buckets away (about 2x) is
        # chosen for at once: the k a drained batch of one chose would otherwise prefill the next 256
        # prompts with part of their chains, and all of them were caught up when k rose (a choice trace on
        # the H100, T = 1, c = 256).
        moved = abs(bucket - self._bucket)
        if self._held >= self.dwell or (moved and (self._held >= self.config.min_dwell or moved >= 2)):
            self._bucket = bucket
            t0 = time.perf_counter()
            priced, self._priced = self._priced, None
            if priced is not None and priced[0] is rows and priced[1] == (batch, self.greedy, t.now - 1):
                gains, base, floor, costs = priced[2]  # priced by the step before, once launched (_prepare)
            else:
                gains, base, floor, costs = self._price(rows, batch)
            # Explored where its samples will land: the running rows' bucket (waiting requests that cannot be
            # admitted, e.g. with the KV cache full, would otherwise make k - 1 look untimed for good).
            origin = self._probed_from  # a probe lasts one dwell: the k it left (-1: the last choice was none)
            current = self.k if origin < 0 else origin
            c = self.config
            k = self._explore(choose_k(gains, base, floor, costs, current, c.hysteresis, self._modules,
                                       c.free_hysteresis), rows.size)
            self._back_off(origin, current, k)
            probe = self._probe_up(k, gains)
            if probe == k:
                probe = self._probe_down(k, rows.size, floor, (batch, gains, base))
            self._probed_from = k if probe != k else -1
            k = probe
            # The dwell paces every full choice, kept k or not (a choice that kept k once reset nothing, so the
            # chooser chose every step and auto's step took twice the fixed-k step on the H100). A return from a
            # probe to the k it left is no new k: it holds as a kept one does.
            changed, self.k, self._held = k != self.k and k != origin, k, 0
            # A probe lasts min_dwell steps, whatever the dwell has grown to (up to max_dwell): held for a
            # long dwell, probes every probe_after steps ran a third of a simulated c = 8 at the probed k.
            # So does a new k: it is checked again soon. A k that holds then holds for as long as its choice's
            # cost allows: doubled from min_dwell instead, a c = 8 cell made 13-20 full choices of about 1.1 ms
            # each on the H100's host, each in a step of 0.5 ms (runs 167-168, T = 1).
            spent = time.perf_counter() - t0
            self._spent += spent
            if changed or self._probed_from >= 0:
                drawing = k == self._probed_from - 1  # see draw_dwell
                self.dwell = self.config.draw_dwell if drawing else self.config.min_dwell
            else:
                self.dwell = self._dwell(spent + self._prepared_seconds, float(costs[k]))
            self._prepared_seconds = 0.0
            self._remember()
        elif self.dwell - self._held <= 3:
            self._due = (self.dwell - self._held, batch, rows)  # see prepare_due
        self._chosen[self.k] += 1
        return self.k

    def prepare_due(self) -> None:
        """The piece of the next full choice this step's call left (see _prepare), done now: the engine calls this once
        the step is launched and before it waits for the one in flight, so that where the device is the slower the
        piece runs in that wait instead of ahead of the launch."""
        if self._due is not None:
            due, self._due = self._due, None
            self._prepare(*due)

    def _price(self, rows: np.ndarray, batch: int) -> tuple[list[float], float, int, np.ndarray]:
        """A full choice's (gains, base, floor) for these rows and its cost row at this batch."""
        t = self.acceptance
        # Folded at most min_dwell steps ago (by _prepare three steps ahead of a due choice, or by a choice the batch
        # moving buckets made): those estimates, as old as a choice held for its dwell reads. A drain crosses a bucket
        # every few steps, and each crossing's fold was most of its choice: 0.79 of 1.15 ms at c = 128 in the CPU's
        # host-only engine (a drain's choices took 0.93 ms each at random c = 128 on the H200, run 357).
        stale = t.now - self._flushed_at > self.config.min_dwell
        gains, base, floor = t.fold(rows, flush=stale)
        if stale:
            self._flushed_at = t.now
        return gains, base, floor, self.costs.costs(batch, _tokens(gains, base, batch / rows.size), self.greedy)

    def _prepare(self, due_in: int, batch: int, rows: np.ndarray) -> None:
        """A piece of the full choice due in `due_in` steps, in each of the three steps before it: the queued
        observations folded, the host line fitted again where due, the rows priced (the choice takes the prices where
        its rows, batch and sampling mode are still those and it comes in the next step). An overlapped step leaves
        the host some slack while the device runs (at c = 1 on the H200, a host share of 0.25 ms in 0.33 ms laps),
        and a choice made whole overran it: inside the engine there a fold took about 0.1 ms, a refit 0.1-0.2
        and the costs 0.17-0.32, and the laps that chose ran 1.0-1.2 ms against a median of 0.39-0.45, auto
        0.97 of fixed k = 4 at c = 1 (runs 274-276). Run from prepare_due, after the step's launch: where the host
        then waits for the device, the piece costs the step nothing (the three pieces took 1-1.8 laps of a
        host-bound c = 8 step on the H200, session AF)."""
        t0 = time.perf_counter()
        if due_in == 3:
            self.acceptance.flush()
            self._flushed_at = self.acceptance.now
        elif due_in == 2:
            self.costs.refit(batch)
        elif due_in == 1 and rows.size:
            self._priced = (rows, (batch, self.greedy, self.acceptance.now), self._price(rows, batch))
        spent = time.perf_counter() - t0
        self._prepared_seconds += spent  # the choice's cost, which paces the dwell
        self._spent += spent

    def take_spent(self) -> float:
        """Host seconds the chooser's choices (and their preparation) took since the last call. The engine learns
        no step cost from a lap that carried much of it: it costs every k alike and is paced by the dwell, while
        kept in a few laps' host shares it widens the host's spread of speeds (StepCosts._host_fit), which lifts
        the price of a k whose host is about as slow as its device more than the others'. At T = 1, c = 8 on the
        H200 the choices priced host-bound k = 2 at 0.53-0.71 ms where its steps took 0.49, and auto ran k = 3,
        15 % slower (run 279); how much of that this accounts for has not been measured."""
        spent, self._spent = self._spent, 0.0
        return spent

    def _for_newcomers(self, batch: int, bucket: int) -> int:
        """The k for newcomers to an empty batch: the bucket's last choice for newcomers while it is under
        max_dwell steps old, else a new one. At c = 1 every request arrives to an empty batch, and a full choice
        for each (about 0.5 ms on the H100's host) cost auto 3-5 % (run 96); but the k the last request's own
        estimates chose is not theirs: after a request whose drafts were rejected (k = 0), the next one started at
        k = 0 for its prefill and its first dwell (simulated: 30 of its 150 steps), observing nothing there. At
        T = 1, c = 1 auto ran 621 steps of a round at k = 0 where fixed k = 2 was best (run 237). A probe of a
        position that is due (see _probe_newcomers) is taken here, where it is free."""
        made = self._newcomers_of.get(bucket)
        if made is None or self.acceptance.now - made[1] >= self.config.max_dwell:
            t0 = time.perf_counter()
            k = self._choose_for_newcomers(batch)
            self._spent += time.perf_counter() - t0
        else:
            k = made[0]
        probe = self._probe_newcomers(k)
        return self._hold(probe, k if probe != k else -1)

    def _choose_for_newcomers(self, batch: int) -> int:
        """The k for a batch of `batch` requests that are all waiting to start (a burst after an idle spell),
        each taken as adaptive with the engine-wide prior as its acceptance. The k left over from the last
        batch (a drained one of one or two requests) had been their prefills' k: on the H100 at T = 1 and
        c = 256 the first wave of each closed loop prefilled at k = 2 or 3 and 196 requests were caught up
        when k rose to 4 (run 73). Held for the next min_dwell steps, by then chosen for its own rows."""
        gains = [batch * reach for reach in accumulate(self.acceptance.prior_list[: self.config.max_k], mul)]
        tokens = list(accumulate(gains, initial=float(batch)))  # per k, as in choose
        current = self._newcomers_of.get(self._rows_bucket, (self.k, 0))[0]  # the hysteresis holds the last such k
        # Nothing of theirs has run, so no switch from the last newcomers' k catches any of them up: the free
        # hysteresis holds it. Held by the 5 % of a switch within the modules, the T = 1, c = 256 cells on the H200
        # started each round from the ninth on at k = 2, the newcomers' k carried over from round to round, where
        # k = 3 was priced 2-3 % ahead; every request then lagged a module from its first position, and rising later
        # cost a catch-up of each (run 318: 0.930 of fixed k = 3). A fall that leaves a module behind for the whole
        # batch keeps the 5 %.
        # The host line as last fitted: newcomers to an empty batch run alone, and their first full choice refits.
        c, costs = self.config, self.costs.costs(batch, tokens, self.greedy, refit=False)
        k = choose_k(gains, float(batch), 0, costs, current, c.free_hysteresis)
        if k < min(current, self._modules):
            k = choose_k(gains, float(batch), 0, costs, current, c.hysteresis, self._modules, c.free_hysteresis)
        self._newcomers_of[self._rows_bucket] = (k, self.acceptance.now)
        return k

    def _probe_newcomers(self, k: int) -> int:
        """k + 1 where no request has drafted position k + 1 for probe_after steps: newcomers prefill the chain
        they start with, so drafting one more position costs them no catch-up. Later in a request the same probe
        rewinds it to where its module began to lag: at T = 1, c = 1 on the H200 the probes of position 3 were 11
        dwells at k = 3 and 13 catch-ups of about 1.2 ms each, 1 % of a cell (run 267)."""
        t = self.acceptance
        if k >= self.config.max_k or t.now - t.drafted_at[k] <= self.config.probe_after:
            return k
        t.drafted_at[k] = t.now
        return k + 1

    def _hold(self, k: int, probed_from: int = -1) -> int:
        """Newcomers start at k, held for min_dwell steps: by then it is chosen for their own rows (with the
        hysteresis held to probed_from where k is a probe)."""
        self._bucket, self.k, self._probed_from = self._rows_bucket, k, probed_from
        self._held, self.dwell = 0, self.config.min_dwell
        self._remember()
        self._chosen[k] += 1
        return k

    def _remember(self) -> None:
        """Keep the choice just made as its bucket's."""
        self._held_of[self._bucket] = _Held(self.k, self._probed_from, self.acceptance.now - self._held, self.dwell)

    def _dwell(self, choice_seconds: float, step_seconds: float) -> int:
        """The longest dwell of a choice that holds: min_dwell, or more where a choice would cost more than
        choice_share of the steps it covers (step_seconds is the cost table's: a unitless prior before any step
        is timed). A choice that changes k holds for min_dwell only: on the H100 a choice costs ~0.4 ms, so
        at c = 8 (0.3 ms steps) a dwell paced by its cost alone held the first choice of a greedy cell, k = 2,
        for 128 of its ~320 steps before k = 4, where fixed k = 4 ran 20 % faster (run 140)."""
        c = self.config
        return min(max(math.ceil(choice_seconds / (c.choice_share * step_seconds)), c.min_dwell), c.max_dwell)

    def _back_off(self, origin: int, held: int, k: int) -> None:
        """After a full choice of k where the k held was `held` and a probe had left `origin` (-1: none): probes wait
        twice as long once a probe's k lost, up to max_probe_wait times probe_after, and at the base rate again once
        the choice moves (the probed k won, or acceptance or costs moved it)."""
        if origin >= 0 and k == origin:
            self._probe_wait = min(2 * self._probe_wait, self.config.max_probe_wait)
        elif k != held or origin >= 0:
            self._probe_wait = 1

    def _explore(self, k: int, batch: int) -> int:
        """Staying at k while k - 1 was never timed in this bucket (nor seeded at start): time k - 1 once.
        Going down costs nothing and gives the bucket's cost line a second point; a k extrapolated from
        the prior slope alone could otherwise look worse than it is, forever."""
        if k == self.k and k > 0 and not self.costs.timed(batch, k - 1, self.greedy):
            return k - 1
        return k

    def _probe_up(self, k: int, gains: list[float]) -> int:
        """k + 1 for one dwell where the choice stays at k and no request has drafted position k + 1 for
        probe_after steps (see AdaptiveConfig.probe_after); the next choice holds to k unless, with what the
        probe observed, k + 1 beats it by the hysteresis. A probe counts as drafting the position: where no
        request reaches it (its catch-up too long), the next one waits its turn."""
        t = self.acceptance
        # Within the modules such a probe rewinds every running request to where its module began to lag (a
        # catch-up each): it waits twice as long, for newcomers to take it at no cost (_probe_newcomers).
        due = self.config.probe_after * (2 if k < self._modules else 1) * self._probe_wait
        if k != self.k or k >= len(gains) or gains[k] <= 0.0 or t.now - t.drafted_at[k] <= due:
            return k
        t.drafted_at[k] = t.now
        return k + 1

    def _probe_down(self, k: int, batch: int, floor: int, priced: tuple[int, list[float], float] | None = None) -> int:
        """k - 1 for one dwell where the choice stays at k and the bucket's host line has seen k alone for
        HOST_WINDOW samples (past the modules, SIDE): a window of one k cannot draw what a draft costs the host,
        which then priced every k at the host level of its own. At c = 128 on the H100, auto dwelt on k = 4 while
        fixed k = 3 ran 5 % faster, greedy (run 214), and on k = 4 where k = 1 ran 10 % faster at T = 1 (run 205).
        * Past the modules (the chain recurses on the last one) a probe leaves no module behind: probe_after apart
          once the price is settled, since each probe draws it anew, A/B/A as below them (since session AL: a window
          of k and k - 1 read the host's drift as the price, StepCosts._recursion_paired), wherever SIDE samples at
          k precede it, settled or not (HOST_WINDOW apart until settled).
        * At or below them, k - 1 leaves module k - 1 behind, and every request is caught up when k rises again
          (a general-path step): only until DRAFT_DRAWS such probes drew the price below the modules, each from
          its own steps against those at k around it (StepCosts.begin_probe), which the line then keeps. At T = 1,
          c = 8 on a slow H200 host auto dwelt on k = 3 (3 modules), host-bound, and never drew it: k = 1 and 2
          were priced 1.17x and 1.12x their real laps (run 300).
        Not where a fixed request runs k or more (floor): the step would still run k. Probes of a bucket are `due`
        steps apart however many samples they gave (steps with prompt chunks are not timed). Nor where that price
        cannot move k's cost or k - 1's (StepCosts.draft_price_moot: the host waits for the device at both): at
        c = 1, greedy on the H200 such probes ran 3 % of auto's steps at k = 3 (16 a cell of about 500, run 275). Nor,
        past the modules, where no price that draft can stand at would make k - 1 win (`priced`: (batch, gains, base)
        of the choice; see _wins_at_dearest)."""
        if k != self.k or k - 1 < floor or self.costs.draft_price_moot(batch, k, self.greedy):
            return k
        costs, now, bucket = self.costs, self.acceptance.now, self.costs.bucket(batch)
        past = k > self._modules
        if not past and costs.knows_draft_price(batch):
            return k
        due = self.config.probe_after * self._probe_wait if past and costs.knows_recursion(batch) else costs.HOST_WINDOW
        # Past the modules a probe is paired, A/B/A: it needs SIDE samples at k before it, not a window of k alone.
        # Waiting for one, three early probes' price of 4 us a request (about twice the fixed cells') held auto between
        # k = 3 and 4 at greedy c = 256, and no later probe drew it again (H200, run 332).
        # With clean_probes its before side is the bucket's clean run at k (no prompt step or catch-up since,
        # StepCosts.interrupt): a probe waits for SIDE samples of one.
        if costs.one_k_run(batch, k) < (SIDE if past else due) or now - self._probed_down_at.get(bucket, -due) < due \
                or costs.clean_probes and costs.clean_run(batch, k) < SIDE:
            return k
        self._probed_down_at[bucket] = now
        moot = past and priced is not None and self.config.skip_moot_probes
        if moot and self._wins_at_dearest(k, batch, floor, *priced):  # see AdaptiveConfig.skip_moot_probes
            return k  # looked at again `due` steps on
        costs.begin_probe(batch, k)  # drawn A/B/A from its steps and those at k around it
        return k - 1

    def _wins_at_dearest(self, k: int, rows: int, floor: int, batch: int, gains: list[float], base: float) -> bool:
        """Whether k keeps the best rate of every k up to it with each draft past the modules priced at the most its
        price can stand at (StepCosts.dearest_costs: a draft costs the host at most a token, cap_drafts): then no
        probe of k - 1 can move the choice, and one costs its steps' tokens and three full choices. At greedy c = 8 on
        the H200, where every full choice but one kept k = 4, probes ran 456 of its learned steps at k = 3, 8-14 % fewer
        tokens a ms there (run 352). `batch`, `gains`, `base`: as the choice priced them for its `rows` requests."""
        cost = self.costs.dearest_costs(batch, _tokens(gains, base, batch / max(rows, 1)), self.greedy)
        if cost is None:
            return False
        rate = rates(gains, base, floor, cost)
        return rate[k] >= max(rate[:k])

    def estimates(self) -> list[float]:
        """The engine-wide acceptance estimate per draft position (for metrics), as of the last fold: at
        most min_dwell steps old while adaptive requests run (folding every step would cost what queueing
        saves)."""
        return self.acceptance.prior_list[: self.config.max_k]


def _tokens(gains: list[float], base: float, scale: float) -> list[float]:
    """[K + 1] a step's tokens at each k for the priced batch: the running rows' (base, then each position's gain)
    scaled by batch / rows, as many tokens per request as the running rows emit."""
    return [g * scale for g in accumulate(gains, initial=base)]
