"""Step-by-step progress lines with timings for long jobs (export, build, train)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Progress:
    def __init__(self, total: int, quiet: bool = False, stream=None, release: bool = False):
        """release: after each step, hand the memory it freed back to the OS (release_freed; the export's peaks)."""
        self.total, self.quiet, self.i, self.release = total, quiet, 0, release
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
        if self.release:
            release_freed()
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


def release_freed() -> None:
    """Unreachable objects collected, and the heap pages glibc keeps after a free handed back to the OS
    (malloc_trim). Freed arrays of a step stay resident otherwise: glibc serves allocations past its mmap threshold
    from the heap once that threshold has grown, and keeps the freed top of the heap, so the next step starts
    from the last one's peak. Nothing is freed that is still referenced; elsewhere than glibc, a no-op."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl without it)
        pass
