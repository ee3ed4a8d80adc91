"""The session's own Python per step, without the engines: every ONNX Runtime call is replaced by a no-op, so
what remains is what the runtime does around a graph call (binding, buffer views, dict building, pulls).

    python scripts/experiments/host_overhead.py EXPORT [EXPORT ...] [--steps 2000] [--json out.json]

Per export: microseconds of host work per target decode step (1 row), per verify of B rows and per draft.
Runs on any dflash2 with the same session API, so one checkout measures before and another after.
"""

from __future__ import annotations

import argparse
import json
import time


class _NoRun:
    """An InferenceSession whose run does nothing (the binding calls before it still happen)."""

    def __init__(self, session):
        self._s = session

    def run_with_iobinding(self, binding, *args, **kw):
        return None

    def __getattr__(self, name):
        return getattr(self._s, name)


def _no_engine(engine) -> None:
    inner = getattr(engine, "engine", engine)  # a bench's TimedEngine wraps the engine
    inner.session = _NoRun(inner.session)


def measure(folder: str, steps: int) -> dict:
    from dflash2.runtime.api import Runtime

    rt = Runtime(folder)
    s = rt.session
    B = s.block_size
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    s.prefill(ids)  # real: the buffers hold something
    _no_engine(s.target)
    _no_engine(s.drafter)
    out = {"export": folder, "target_attention": getattr(rt.manifest.kv, "target_attention", "plain")}
    for name, fn in (("decode_us", lambda: s.decode(3)), ("verify_us", lambda: s.verify(ids[:B])),
                     ("draft_us", lambda: s.draft(3))):
        best = float("inf")
        for _ in range(5):  # the minimum of 5 repeats: this machine is shared
            s.pos = s.ctx_pos = 16
            s.pending = 1
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
                s.pos, s.ctx_pos, s.pending = 16, 16, 1
            best = min(best, (time.perf_counter() - t0) / steps * 1e6)
        out[name] = round(best, 1)
    out["round_us"] = round(out["draft_us"] + out["verify_us"], 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("exports", nargs="+")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--json")
    a = p.parse_args()
    rows = [measure(f, a.steps) for f in a.exports]
    print("| export | target graph | decode step (us) | verify B rows (us) | draft (us) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['export']} | {r['target_attention']} | {r['decode_us']} | {r['verify_us']} | {r['draft_us']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
