"""Step-by-step progress lines with timings for long jobs (export, build, train)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Progress:
    def __init__(self, total: int, quiet: bool = False, stream=None):
        self.total, self.quiet, self.i = total, quiet, 0
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()

    @contextmanager
    def step(self, what: str):
        """Yields the step; setting its `outcome` replaces "done" in the closing line (e.g. "NOT validated")."""
        self.i += 1
        t0 = time.perf_counter()
        if not self.quiet:
            print(f"[{self.i}/{self.total}] {what} ...", file=self.stream, flush=True)
        step = _Step(self, f"[{self.i}/{self.total}] {what}", t0)
        yield step
        if not self.quiet:
            print(f"[{self.i}/{self.total}] {what}: {step.outcome} in {time.perf_counter() - t0:.1f} s",
                  file=self.stream, flush=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class _Step:
    """One step; `layer(i, n)` prints per-layer progress with an ETA, at most every EVERY seconds."""

    EVERY = 5.0

    def __init__(self, progress: Progress, label: str, t0: float):
        self.outcome, self.progress, self.label, self.t0 = "done", progress, label, t0
        self.last = t0

    def layer(self, i: int, n: int) -> None:
        now = time.perf_counter()
        if self.progress.quiet or i == 0 or now - self.last < self.EVERY:
            return
        self.last = now
        eta = (now - self.t0) / i * (n - i)
        print(f"{self.label}: layer {i}/{n}, {now - self.t0:.0f} s, about {eta:.0f} s left",
              file=self.progress.stream, flush=True)
