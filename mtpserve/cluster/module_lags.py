"""Which MTP modules of a request lag behind its target, from where, and what a rise of k rewinds (design §9).

A step at k below the modules leaves the modules past k behind; a later rise makes the workers rewind the
request over the lag of the highest module it reaches. The scheduler keeps the lags on each Request
(live_spec, lag_from) so that it can count those rewinds against the step's token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtpserve.cluster.request import Request


@dataclass(frozen=True)
class ModuleLags:
    num_modules: int

    def modules(self, spec: int) -> int:
        """The MTP modules a chain of `spec` drafts runs: past the last one the chain runs it again, so a k
        that differs from another only past the modules leaves none of them behind (no catch-up, no drain)."""
        return min(spec, self.num_modules)

    def within(self, req: Request, k: int, max_catch_up: int) -> int:
        """The highest spec up to k whose modules lag at most `max_catch_up` positions, or are owed a catch-up (at
        least live_spec): a higher module has lagged at least as long as a lower one, since a module runs only with
        every lower one."""
        floor = req.live_spec if req.live_spec > req.catch_up_owed else req.catch_up_owed
        while k > floor and req.num_computed - req.lag_from[self.modules(k) - 1] > max_catch_up:
            k -= 1
        return k

    def catch_up(self, req: Request, spec: int, budget: int) -> tuple[int, int]:
        """(spec, the positions the workers recompute for it this step) within `budget` tokens: where k rises
        past modules that lagged, the workers rewind the request over about the highest one's lag, which the budget
        must hold with the request's own token; else the request keeps its live modules' drafts for now and
        catches up in a later step. Uncounted, 32 requests rising together, each up to MAX_CATCH_UP positions
        behind, recomputed up to 8192 positions in one step against the default budget of 2048, past the largest
        prefill graph (4096 rows) and so through the eager general path."""
        if not 0 <= req.live_spec < spec:
            req.catch_up_owed = 0
            return spec, 0
        # From where the highest module it catches up began to lag (the lower ones began then or later), and
        # module m commits m positions behind the target. A fall planned while a step is in flight notes that step's
        # start, and the workers commit its modules short by that one step: exact, since one step at most is in flight.
        rewind = req.num_computed - req.lag_from[self.modules(spec) - 1] + self.num_modules - 1
        # Owed until done or k falls again, however far its modules up to spec lag meanwhile: where a step holds a
        # few catch-ups, the last requests' lags would otherwise grow past MAX_CATCH_UP while they wait their turn (at
        # c = 256 and the default budget, 256 requests 200 positions behind caught up over 54 steps on the H200, run
        # 316).
        req.catch_up_owed = spec if rewind >= budget else 0
        return (spec, rewind) if rewind < budget else (req.live_spec, 0)

    def settle(self, req: Request, spec: int) -> None:
        """A step that ran `spec` drafts for `req` has completed. Where it ran every module of the request's chain
        (a catch-up rewound those that lagged) and no step planned since left one behind, every module is committed
        to the frontier again, and its blocks may be offered to the prefix cache past the first lag. Offered only
        below that lag, an auto request that ever ran fewer drafts than its cap (a prompt prefilled at k = 1, say)
        offered no module block past it, and a request repeating its prompt then reused nothing in any group."""
        if req.modules_exact_upto is not None and req.live_spec < 0 and self.modules(spec) >= self.modules(
                req.num_spec):
            req.modules_exact_upto = None

    def advance(self, req: Request, spec: int) -> None:
        """Note a step that runs `spec` drafts for `req`: the modules past spec that ran until now begin to lag
        here, and those up to it are committed to the frontier (caught up, where k rose)."""
        if self.modules(spec) >= self.modules(req.num_spec):
            req.live_spec, req.lag_from = -1, None
            return
        if req.modules_exact_upto is None:
            # Module m (0-based) has committed only up to N - m - 1 of N verified tokens (in decode N - 1 is
            # num_computed; a fall planned while a step is in flight sees that step's start, and the step commits
            # module m to at least one position past it, less m): past that its entries came from drafts, and stay
            # so once it stops.
            req.modules_exact_upto = max(0, req.num_computed - (self.num_modules - 1))
        ran = req.live_spec if req.live_spec >= 0 else self.modules(req.num_spec)
        if spec < ran:
            req.catch_up_owed = 0  # k fell again (also in an overlapped step, which plans no catch-up)
            if req.lag_from is None:
                req.lag_from = [0] * self.num_modules
            req.lag_from[spec:ran] = [req.num_computed] * (ran - spec)
        req.live_spec = spec
