"""What `--draft-len auto` learned about one export on this machine, kept for the next session.

An `AutoSchedule` calibrates its cost model in a session's first rounds, then learns acceptance per confidence and
whether drafting pays at all (`value`) from its own rounds. A session that answers once (`dflash2-run`,
`dflash2-demo`) paid all of that again every time: on the int4 default here, where drafting does not pay,
calibration and the first drafted rounds cost ~4-5% of a 128-token answer (`scripts/experiments/replay_schedules.py
replay --fresh`, docs/draft_len.md). Like TensorRT's timing cache, the learned state is kept per export (its
manifest hash), backend, provider, thread count and machine (CPU model, ONNX Runtime version) in
`$DFLASH2_CACHE/schedule/` (default ~/.cache/dflash2), written atomically after each answer; the next session
starts calibrated and knowing. The cost model keeps following the machine's speed round by round, so a state saved
under another load is corrected within a few rounds. A state that cannot be read is ignored (it only saves time);
`DFLASH2_SCHEDULE_CACHE=0` or `Runtime(..., schedule_cache=False)` turns it off (dflash2-bench measures cold
sessions).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

from dflash2.folders import cache_root


def enabled() -> bool:
    return os.environ.get("DFLASH2_SCHEDULE_CACHE", "1") not in ("0", "false", "no", "off")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def key(manifest_sha256: str, backend: str, provider: str | None, threads: int | None,
        drafter_threads: int | None = None) -> str:
    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:  # a TensorRT-only deployment
        ort = None
    what = {"export": manifest_sha256, "backend": backend, "provider": provider, "threads": threads,
            "cpus": os.cpu_count(), "cpu": _cpu_model(), "machine": platform.machine(), "onnxruntime": ort}
    if drafter_threads is not None:  # (absent otherwise: the keys of caches written before stay the same)
        what["drafter_threads"] = drafter_threads
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def path(k: str) -> Path:
    return cache_root() / "schedule" / f"{k}.json"


def load(k: str) -> dict | None:
    try:
        state = json.loads(path(k).read_text())
        return state if isinstance(state, dict) else None
    except (OSError, ValueError, RuntimeError):  # RuntimeError: Path.home() without a home
        return None


def save(k: str, state: dict) -> None:
    """Atomically (a reader never sees half a file); a cache that cannot be written is skipped."""
    tmp = None
    try:
        p = path(k)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, p)
    except (OSError, RuntimeError, ValueError):  # ValueError: a state json cannot write (never expected)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
