"""One rule for every speed ratio the demo and the benches print: the ratio carries its spread, and a gain (or a
loss) is claimed only when the spread cannot explain it.

Why: on a machine shared with other work, two modes that did nearly the same work (the drafter skipped in 100 of
108 rounds) printed `1.28x`, noise shown as a gain. Each sample here is one independent measurement of the same
ratio (one ABBA pair of the demo, one repeat or one half of the prompts of a bench); the range is their min-max.
A ratio is *measurable* when the range excludes 1.0 and its width is no larger than the claimed change, so the
printed change is never smaller than its own printed spread. Otherwise the line says `no measurable difference`.
More samples only widen a min-max range, so nothing here reruns until a result looks good.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Ratio:
    center: float  # the headline: pooled over every sample's work where the caller has it, else the median
    lo: float
    hi: float
    n: int  # samples behind lo / hi
    ceiling: float | None = None  # the most the work done allows (a speedup: the acceptance length), if known

    @property
    def above_ceiling(self) -> bool:
        """A gain larger than the work done allows. A speculative round costs at least one target pass, and a
        target pass at least one decode step, so speculation over target-only is at most its acceptance length
        (tokens per target pass). A busy machine printed 1.10x, both ABBA pairs alike, at acceptance 1.01 with
        the drafter skipped in 105 of 109 rounds: the same work, the gain the machine's."""
        return bool(self.ceiling) and self.center > 1.0 and self.center > self.ceiling  # 0 / None: unknown

    @property
    def measurable(self) -> bool:
        if self.n < 2 or self.above_ceiling:
            return False  # one sample has no spread to compare against; a gain the work cannot explain
        outside = self.lo > 1.0 or self.hi < 1.0
        return outside and (self.hi - self.lo) <= abs(self.center - 1.0)


def ratio_of(samples: Sequence[float], center: float | None = None, ceiling: float | None = None) -> Ratio:
    s = [float(x) for x in samples if x is not None and x > 0]  # 0: a mode that produced nothing, no sample
    if not s:
        c = float(center or 0.0)
        return Ratio(c, c, c, 0, ceiling)
    return Ratio(statistics.median(s) if center is None else float(center), min(s), max(s), len(s), ceiling)


def describe_ratio(samples: Sequence[float], center: float | None = None, over: str = "runs",
                   ceiling: float | None = None) -> str:
    """`1.31x (range 1.27-1.35x over 2 ABBA pairs)`, or `no measurable difference (0.97-1.09x over 2 ABBA pairs)`
    when the range covers 1.0 or is wider than the change, or the gain is above `ceiling` (Ratio.above_ceiling);
    fewer than two samples: the number, saying it has no spread."""
    r = ratio_of(samples, center, ceiling)
    if r.above_ceiling:
        return (f"no measurable difference ({r.center:.2f}x, above the {r.ceiling:.2f}x its acceptance length "
                f"allows: the machine's noise)")
    if r.n < 2:  # one sample (one prompt, one repeat), or none (a result file written before the spread)
        return f"{r.center:.2f}x ({'one run: no spread measured' if r.n else 'no spread recorded'})"
    span = f"{r.lo:.2f}-{r.hi:.2f}x over {r.n} {over}"
    return f"{r.center:.2f}x (range {span})" if r.measurable else f"no measurable difference ({span})"


def ratio_cell(samples: Sequence[float], center: float | None = None, ceiling: float | None = None) -> str:
    """The same rule in a table cell: `1.31x 1.27-1.35`, `no diff 0.97-1.09`, `1.31x ?` (one
    sample), `no diff 1.10>1.01` (above the ceiling)."""
    r = ratio_of(samples, center, ceiling)
    if r.above_ceiling:
        return f"no diff {r.center:.2f}>{r.ceiling:.2f}"
    if r.n < 2:
        return f"{r.center:.2f}x ?"
    return f"{r.center:.2f}x {r.lo:.2f}-{r.hi:.2f}" if r.measurable else f"no diff {r.lo:.2f}-{r.hi:.2f}"


def spread(samples: Sequence[float]) -> list[float]:
    """[lo, hi] for a JSON field (empty with fewer than two samples)."""
    r = ratio_of(samples)
    return [round(r.lo, 4), round(r.hi, 4)] if r.n >= 2 else []


def pass_of(prompt: int, repeat: int, repeats: int) -> int:
    """Which independent sample a generation belongs to: its repeat when a run has several (the same prompts each
    time: pure noise), else the half of the prompts (even / odd), so a one-repeat run still has two samples."""
    return repeat if repeats > 1 else prompt % 2
