"""The adaptive-speculation chooser's settings (docs/design.md §9), apart from the chooser (spec_chooser.py) so that
a reader finds every tunable, and the measurement behind its value, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveConfig:
    """AdaptiveSpec's settings; the engine builds one from EngineConfig (max_k, max_rows, modules)."""

    max_k: int  # the largest k any request may run (adaptive requests' cap)
    max_rows: int  # concurrent requests tracked (max_num_seqs)
    decay: float = 0.2  # weight of one observation in a request's estimate (a topic change shows in ~5 steps)
    # The weight of one observation in the engine-wide prior, once it has settled: a step moves the prior as
    # much as the observations it holds (about the last 500). Weighted 0.02 a step instead, with one request
    # running (concurrency 1) the prior followed that request alone; after a run of rejections the next
    # requests started at k = 0, where nothing is observed. Simulated one request at a time at 0.62 a
    # position (test_spec_chooser.py): 0.87-0.99 of the best k's rate per step, 0.99-1.0 per observation.
    prior_decay: float = 0.002
    prior_weight: float = 4.0  # the initial prior counts as this many observations (until then, a plain mean)
    # The prior before anything was observed: optimistic, because a k set too high shows at once (its drafts
    # get rejected) and going down is free, while a k set too low never sees the positions it skips.
    initial_acceptance: float = 0.8
    # What the chooser uses is a request's estimate shrunk toward the prior, as if the prior were this many
    # observations (a request's own count saturates at 1 / decay): a short run of rejections, common within
    # one request, must not send a whole step to k = 0, where nothing is observed until the next choice. This
    # is the strength until the acceptance table has scored enough observations to learn it (AcceptanceTable.
    # STRENGTHS).
    prior_strength: float = 5.0
    # A position no request has drafted for this many steps is drafted for one dwell (k + 1 where the choice stays
    # at k): the engine-wide prior learns only from drafted positions, and after requests whose drafts did not pay
    # it held every later request at k = 0 for good, though acceptance had risen (simulated, 0.1 a position for
    # eight requests and then 0.8: 0.74 of the best k's rate without probes, 0.96 with them).
    probe_after: int = 256
    # A probe whose k lost (the next choice went back) doubles the wait before the next probe, up to this many times
    # probe_after; one whose k won, or a choice that moved on its own, resets it. Each probe is three full choices
    # and min_dwell steps at a k the chooser did not pick: at T = 1, c = 8 on the H200, where auto held k = 2 and
    # probed k = 3 every 512 steps, its choices took 1.3 % of a cell (run 292).
    max_probe_wait: int = 8
    # The MTP modules (None: max_k). A k past them runs the last module again (the chain recurses), so going from
    # such a k to k - 1 and back leaves no module behind to catch up: there the chooser also probes k - 1 for one
    # dwell where a bucket's host line has seen its k alone for a while (see _probe_down).
    modules: int | None = None
    cost_window: int = 16  # a (bucket, k) cost is the median of its last this many timed steps
    per_draft_cost: float = 0.12  # cost(k) = cost(0) * (1 + c k) until measured (a module pass ~ 1/8 of the target)
    hysteresis: float = 0.05  # another k must beat the current one by this fraction (switches cost a catch-up)
    # ... and by this where both k's reach every module (past them the chain reruns the last one), and for newcomers
    # to an empty batch unless they would fall below the modules: such a switch catches nothing up. Held by the 5 %,
    # the host-only engine at c = 256 (a host price of 2 us a request and draft, T = 1-like acceptance) stayed at
    # k = 4 where its own prices put k = 3 4.3 % ahead, 0.932 of fixed k = 3.
    free_hysteresis: float = 0.01
    min_dwell: int = 8  # steps between two choices (noisy estimates must not flap; a choice costs host time)
    # A probe of k - 1 lasts this many steps: the host's price of a draft it draws below the modules stands for the
    # rest of the run once StepCosts.DRAFT_DRAWS probes drew it, and about half of a probe's steps are timed. Of
    # min_dwell (3 or 4 timed) the five draws at T = 1, c = 8 on the H200 read 0, 4.6, 7.2, 0 and 9.7 us a request,
    # where auto's own k = 2 and 3 differed by about 8 beyond their tokens, and k = 2 was priced 3-6 % dear from k = 3
    # (run 307). Each probe below the modules costs one catch-up whatever its length. Past them (drawn A/B/A since
    # session AL) probes of min_dwell drew nothing in 11 of 20 and 7 of 10 complete ones (too few timed steps; runs
    # 327 and 331 replayed).
    draw_dwell: int = 24
    max_dwell: int = 128  # the dwell doubles, up to this, while the choice holds
    # The dwell grows past min_dwell until a choice costs at most this share of the steps it covers: on the
    # H100's host one took ~0.4 ms, 0.1 ms per step at c = 1 every 8 steps (a fifth of a 0.55 ms step).
    choice_share: float = 0.01
    # The host's price of a token drawn within steps, from each request's share of a decode step's postprocessing
    # (token_price.py); False: across steps, from the least squares of each bucket's window of host samples, as before
    # session AM, where the host's drift read as up to 14 us a token (run 325) and held auto at k = 0 (run 332).
    token_price_within_steps: bool = True
    # The host's price of a draft past the modules at most the price below them, once a window or a probe drew that
    # above 0 (such a draft has no KV group of its own, and the host does the same for it as any other). Unbounded, the
    # probes past the modules drew 10.4 us a request at greedy c = 32 where those below drew 3.8, and the fixed cells'
    # k = 4 cost 4.7 us a request over k = 3 with its extra token: auto ran k = 3 in 96 of 114 full choices at 0.931 of
    # fixed k = 4 (H200, run 339). Bounded only once DRAFT_DRAWS probes had drawn the price below (session AN), the
    # bound rarely held: at random c = 128 (run 344) the fourth draft stood at 4.4 us against 1.9 and auto ran k = 3 in
    # 540 of 2086 full-batch steps, 13 % below k = 4's tokens a ms there (docs/adaptive-measurements.md, session AO).
    # False: as before session AN.
    bound_recursion: bool = True
    # The host's price of a draft, below the modules or past them, at most the price of a token drawn within steps
    # (token_price.py). A draft costs the host a few entries of the plan, the KV slots of its group and a column of the
    # result read back; a token all of that and its detokenization, output and block hashing. The probes' draws ran
    # several times what the fixed cells' laps put a draft at: at greedy c = 8 on the H200 the price past the modules
    # stood at 7.7 - 14.9 us a request where fixed k = 4's host share ran 30 us above k = 3's for 8 requests and 4.7
    # tokens more, about 2 us a draft (run 345). Replayed over 21 cells' dumps (sessions AL - AO), capped picks rated
    # 0.93 -> 0.98 at T = 1 c = 32 (run 346), 0.95 -> 0.98 and 0.99 at greedy c = 8 and random c = 128 (runs 345,
    # 344), and within 0.007 of uncapped in the other cells (docs/adaptive-measurements.md, session AO).
    cap_drafts: bool = True
    # No probe of k - 1 past the modules where k keeps the best rate with that draft's price at the most it can stand
    # at (the token's, by cap_drafts; at most the price below the modules, by bound_recursion): no draw can then move
    # the choice. At greedy c = 8 on the H200 all but one full choice kept k = 4, and the probes ran 456 of auto's
    # learned steps at k = 3, 8-14 % fewer tokens a ms (run 352). False: probed as before session AQ.
    skip_moot_probes: bool = True
    # A probe of k - 1 draws the host's price of a draft from steps in one clean stretch: its before side from the
    # bucket's samples at k since the last step with prompt chunks or catch-ups (StepCosts.clean_run), void where
    # requests join during it, its after side gathered anew past its own catch-up (StepCosts.interrupt). At T = 1,
    # c = 128 on the H200 the probes' before sides, taken from the previous wave's last steps, drew the fourth draft
    # at 1.59 us a request where the fixed cells' k = 3 and 4 differed by their tokens alone, and auto ran k = 3 at
    # 0.941 of fixed k = 4; the clean draws' median, 0.94, replayed picks k = 4 in 354 of 373 choices (run 357). On the
    # GPU (run 358) it did pick k = 4 (246 of 270 full choices, against 905 of 5657 full-batch steps off), but ran 0.952
    # and 0.954 of fixed k = 4 at c = 128 and 32 against 0.965 and 0.966 off: there k = 3 and 4 ran about alike and
    # auto's own k = 4 steps 3-6 % slower than fixed k = 4's. Off until an A/B shows it pays.
    clean_probes: bool = False
