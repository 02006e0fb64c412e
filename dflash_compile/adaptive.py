"""Adaptive verify width: how many of the drafter's tokens to verify each step, none included (plain decoding).

The drafter always proposes its full block; the step verifies the first `width - 1` drafts (width 1 = the anchor
only, and the drafter is not even run). For each candidate width the controller keeps

    alpha_j      acceptance of draft j given drafts 1 .. j-1 were accepted (counts from the steps that verified j)
    tau(w)       = 1 + sum_{j < w} prod_{i <= j} alpha_i      expected tokens committed by a step of width w
    t(w)         measured wall time of a step of width w: the median of the recent ones (a stray slow step does
                 not count; their least did, the other way: on a 2-core CPU whose block-8 steps took 6-8 ms it
                 priced them at 6 and speculated at 0.79x of plain decoding), or their mean where steps vary by
                 themselves (offloaded experts: a step's rare cache misses are part of its expected cost). Only
                 steps that follow a step of the same width are timed: the first after a switch pays for it (a
                 drafting step adds the context of every plain step before it; the CPU's caches held the other
                 width's work), which kept in the window favours whichever width runs most (the bundled pair,
                 compiled on a 2-core CPU: width-1 probes between block-8 steps timed 3.2 ms against 2.1 ms in a
                 run of them, so block 8 won at 0.88x of plain decoding). Neither are the first UNTIMED_STEPS of a
                 width (the first compiles it, the second records its CUDA graphs under mode="reduce-overhead")

and picks the width with the most expected tokens per second, with the alphas drawn from their Beta posteriors
(Thompson sampling): a width whose payoff is uncertain keeps being tried in proportion to its chance of being the best,
so a few unlucky early steps cannot switch a good drafter off for good (on the H200, picking by the posterior means
after a poor start kept an oracle that accepts 70% per draft at plain decoding for a whole generation: 0.71x of
block 8), while a drafter that never pays is soon tried almost never. Until a width has timings it is tried; then
the width tried longest ago runs for two steps (the second is timed) after `probe_every` steps, and after twice as
many steps each time the best width (by the posterior means) stays the same (back to `probe_every` when it
changes), so its timings do not go stale.
Greedy and sampled outputs do not depend on the width: every committed token is verified by the target.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Callable, Sequence


UNTIMED_STEPS = 2


class WidthChooser:
    def __init__(self, block_size: int, widths: tuple[int, ...] | None = None, probe_every: int = 16,
                 window: int = 8, step_time: Callable[[int], float] | None = None, timing: str = "median",
                 seed: int = 0):
        """`step_time(width)`, when given, replaces measured times (e.g. the cost model's predictions); `timing`
        ("median" or "mean") summarises the measured ones; `seed` seeds the posterior draws."""
        if timing not in ("median", "mean"):
            raise ValueError(f"timing must be 'median' or 'mean', got {timing!r}")
        self.timing = timing
        self.block_size = block_size
        self.widths = tuple(sorted(set(widths or (1, block_size))))
        if not all(1 <= w <= block_size for w in self.widths):
            raise ValueError(f"verify widths {self.widths} must lie in 1 .. block_size {block_size}")
        self.probe_every = probe_every
        self.accepted = [0] * block_size  # accepted[j]: steps in which draft j was verified and accepted
        self.tried = [0] * block_size  # tried[j]: steps in which draft j was verified after 1 .. j-1 were accepted
        self.times = {w: deque(maxlen=window) for w in self.widths}
        self.seen = dict.fromkeys(self.widths, 0)
        self.last_used = dict.fromkeys(self.widths, 0)
        self.step = 0
        self.step_time = step_time
        self.best: int | None = None
        self.interval = self.next_probe = probe_every
        self.previous: int | None = None  # the last observed step's width
        self.probe_again: int | None = None  # a probe's width, for its second (timed) step
        self.random = random.Random(seed)

    def _posterior(self, j: int) -> tuple[int, int]:
        """Beta(successes, failures) of draft j's acceptance given the earlier ones, with one prior success and
        failure (a fresh width is neither hopeless nor certain)."""
        return self.accepted[j] + 1, self.tried[j] - self.accepted[j] + 1

    def alpha(self, j: int) -> float:
        """The posterior mean acceptance of draft j given the earlier ones."""
        successes, failures = self._posterior(j)
        return successes / (successes + failures)

    def sampled_alphas(self) -> list[float]:
        """One draw of every alpha_j from its posterior."""
        return [self.random.betavariate(*self._posterior(j)) for j in range(self.block_size)]

    def expected_tokens(self, width: int, alphas: Sequence[float] | None = None) -> float:
        """tau(width) at the posterior means of the alphas, or at the given ones."""
        tau, survive = 1.0, 1.0
        for j in range(1, width):
            survive *= alphas[j] if alphas else self.alpha(j)
            tau += survive
        return tau

    def seconds(self, width: int) -> float:
        if self.step_time:
            return self.step_time(width)
        times = self.times[width]
        return statistics.median(times) if self.timing == "median" else statistics.fmean(times)

    def choose(self) -> int:
        untimed = [w for w in self.widths if not self.step_time and len(self.times[w]) == 0]
        if untimed:
            return untimed[-1]  # widest first: it is the one that teaches the acceptance estimates
        self.step += 1
        if self.probe_again is not None:
            width, self.probe_again = self.probe_again, None
            return width
        best = self._fastest(self.expected_tokens)
        if best != self.best:  # the picture changed: look at the other widths sooner again
            self.best, self.interval = best, self.probe_every
        if self.step >= self.next_probe:
            self.next_probe = self.step + self.interval
            self.interval = min(2 * self.interval, 256)
            self.probe_again = min(self.widths, key=self.last_used.get)
            return self.probe_again
        alphas = self.sampled_alphas()
        return self._fastest(lambda w: self.expected_tokens(w, alphas))

    def _fastest(self, tokens: Callable[[int], float]) -> int:
        """The width with the most tokens per second when a step of width w commits tokens(w)."""
        return max(self.widths, key=lambda w: tokens(w) / self.seconds(w))

    def observe(self, width: int, accepted: list[int], seconds: float) -> None:
        """One step's result: accepted drafts of each active row, and the step's wall time."""
        for count in accepted:
            for j in range(1, width):
                self.tried[j] += 1
                if count >= j:
                    self.accepted[j] += 1
                else:
                    break
        self.seen[width] += 1
        self.last_used[width] = self.step
        if self.seen[width] > UNTIMED_STEPS and width == self.previous:
            self.times[width].append(seconds)
        self.previous = width
