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
        self.i += 1
        t0 = time.perf_counter()
        if not self.quiet:
            print(f"[{self.i}/{self.total}] {what} ...", file=self.stream, flush=True)
        yield
        if not self.quiet:
            print(f"[{self.i}/{self.total}] {what}: done in {time.perf_counter() - t0:.1f} s", file=self.stream,
                  flush=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start
