"""The host's price of a draft from one probe, measured A/B/A (docs/design.md §9): the steps at k just before a
probe of k - 1 and just after it, against the probe's own steps.

A host line drawn through a window that holds two k (StepCosts._fit_slopes) reads the host's speed changes as
part of the price whenever the change of k follows a change of speed, and auto's choices follow them: a slower
host makes every step host-bound, where more drafts look free. At T = 1, c = 8 on the H200 such windows read
means of 81 us a request at k = 2 against 62 at k = 3, and half of them drew the price as 0 (run 301), where the
fixed cells' k = 1 and 2 differed by about 4 us a request beyond their tokens (run 302). A probe starts when the
chooser's dwell says so, not when the speed moves, and its neighbours on both sides share its speed to within a
few milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtpserve.cluster.device_costs import plain_median

SIDE = 8  # samples at k on each side of the probe (a probe lasts min_dwell = 8 steps)
LEAST = 4  # samples a side needs for a draw (some steps around a choice go untimed)
# Samples skipped after a step with prompt chunks or catch-ups: the first decode step after one took 7-8 % more host a
# request than its neighbours at T = 1, c = 128 on the H200 (run 357).
SETTLE = 1


@dataclass
class PairedProbe:
    """A probe of k - 1 from k in one batch bucket: its samples (host seconds and tokens, per request)."""

    k: int  # the k the probe left; its own steps run k - 1
    before: list[tuple[float, float]]  # the bucket's newest samples at k when the probe began (at most SIDE)
    probe: list[tuple[float, float]] = field(default_factory=list)
    after: list[tuple[float, float]] = field(default_factory=list)
    skip: int = 0  # samples at k still to skip before the after side (see restart_after)

    def add(self, k: int, host: float, tokens: float) -> bool | None:
        """The bucket's next sample (per request) -> None while the probe gathers, True once it is complete, False
        once it is void (a step at another k, or the choice stayed at k - 1)."""
        if k == self.k - 1 and not self.after and len(self.probe) < 4 * SIDE:
            self.probe.append((host, tokens))
        elif k == self.k:
            if self.probe and self.skip:
                self.skip -= 1
            elif self.probe:
                self.after.append((host, tokens))
            return True if len(self.after) >= SIDE else None
        else:
            return False
        return None

    def restart_after(self) -> None:
        """A catch-up ran once the probe was over (a probe below the modules leaves one behind for every request, run as
        k rises again, a few requests a step within the token budget): the after side starts anew past it."""
        self.after.clear()
        self.skip = SETTLE

    def draw(self, token_price: float) -> float | None:
        """Seconds per request of the draft the probe left out: the host's median at k around it less its median in
        it, less `token_price` for each token a request emitted more at k; None where a side has too few samples."""
        around = self.before + self.after
        if len(self.probe) < LEAST or len(self.before) < LEAST or len(self.after) < LEAST:
            return None
        more_tokens = _mean_tokens(around) - _mean_tokens(self.probe)
        return max(_median_host(around) - _median_host(self.probe) - token_price * more_tokens, 0.0)


def _median_host(samples: list[tuple[float, float]]) -> float:
    return plain_median([h for h, _ in samples])


def _mean_tokens(samples: list[tuple[float, float]]) -> float:
    return sum(t for _, t in samples) / len(samples)
