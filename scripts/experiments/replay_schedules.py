"""Draft-length schedules compared without timing noise (dflash2/bench/replay.py says why it is exact):

    python scripts/experiments/replay_schedules.py record EXPORT --prompts default --out int4_shipped.json [--threads 1]
    python scripts/experiments/replay_schedules.py costs EXPORT --into int4_shipped.json ...   # re-measure, machine quiet
    python scripts/experiments/replay_schedules.py replay int4_shipped.json [more traces] \
        --schedule before=/tmp/schedule_before.py --schedule now=dflash2/runtime/schedule.py [--json out.json]

`record` runs each answer once with the drafter at every position (traces: JSON, `.gz` compressed) and measures
the export's cost table (decode, verify of 2..B rows, the draft and what each context row it catches up after
skipped rounds adds). `costs` re-measures that table into traces (a table taken while the machine was busy prices
every round wrong; the drafts do not depend on timing). `replay` loads `AutoSchedule` from each FILE (another
version of dflash2/runtime/schedule.py, e.g. `git show HEAD~1:dflash2/runtime/schedule.py > /tmp/before.py`),
keeps one instance per trace (a session) and prints each one's speed over plain decoding and the share of
rounds that ran the drafter, beside the oracle bound (`replay.bound`: the least time knowing every match);
`--exact-costs` adds each schedule with the trace's own cost table once its calibration rounds are done (what a
perfect cost model would reach).
`thresholds` prices, per trace, every schedule that drafts each round and verifies the leading drafts whose
confidences exceed t1 (the first) and t2 (the rest), on a grid, and prints the best: what a confidence rule could
reach if its thresholds were chosen knowing the answers (an upper bound for schedules that read confidences only).
`bounds` prices the schedule, perfect confidence (the best schedule that drafts every round, knowing which drafts
match once drafted) and the oracle (the best of all, `replay.bound`) at the trace's costs with the draft cheaper and
the verify flatter by given factors:

    python scripts/experiments/replay_schedules.py bounds TRACE... [--draft 1,0.5,0.25,0] [--verify 1,0.5,0] [--lift 0.1,0.2]
        [--json out.json]

and, with `--lift`, at today's costs over traces whose drafts were turned right at random (`lifted`), roughly what
acceptance a speed would need.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path


def read_trace(path: str) -> dict:
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)


def write_trace(path: str, trace: dict) -> None:
    raw = json.dumps(trace).encode()
    Path(path).write_bytes(gzip.compress(raw, mtime=0) if path.endswith(".gz") else raw)


def _table_line(t: dict) -> str:
    return (f"cost table (ms): decode {t['decode']:.2f}, draft {t['draft_base']:.2f} + {t['draft_per_row']:.3f} per "
            f"caught-up row, verify / decode {[round(v / t['decode'], 2) for v in t['verify'][1:]]}")


def record(a) -> int:
    from dflash2.prompts import parse_spec
    from dflash2.runtime.api import Runtime
    from dflash2.bench.replay import cost_table, record as record_answers

    rt = Runtime(a.export, threads=a.threads)
    print("measuring the cost table ...", file=sys.stderr, flush=True)
    table = cost_table(rt.session)
    print(_table_line(table), file=sys.stderr, flush=True)
    answers = record_answers(rt, parse_spec(a.prompts, default_split="eval"), a.max_new_tokens,
                             log=lambda m: print(m, file=sys.stderr, flush=True))
    write_trace(a.out, {"export": a.export, "prompts": a.prompts, "threads": a.threads,
                        "block_size": rt.session.block_size, "costs_ms": table, "answers": answers})
    return 0


def costs(a) -> int:
    from dflash2.runtime.api import Runtime
    from dflash2.bench.replay import cost_table

    table = cost_table(Runtime(a.export, threads=a.threads).session, repeats=a.repeats)
    print(_table_line(table), file=sys.stderr)
    for path in a.into:
        write_trace(path, {**read_trace(path), "costs_ms": table})
    return 0


def _pooled(runs: list[dict]) -> dict:
    """Sessions pooled: speed = total plain-decoding time over total time (as one run over all answers)."""
    plain = sum(r["tokens"] for r in runs)  # in decode steps
    spent = sum(r["tokens"] / r["speed"] for r in runs)
    out = {k: sum(r[k] for r in runs) for k in ("rounds", "drafted", "reused", "accepted", "tokens")}
    return {**out, "speed": plain / spent}


def _exact_costs(cls, table: dict):
    """`cls` whose cost model becomes the trace's own table once its calibration rounds are done: what the schedule
    would reach with a perfect cost model (`replay --exact-costs`)."""

    class Exact(cls):
        def observe(self, r) -> None:
            calibrating = self.calibration.active
            super().observe(r)
            if calibrating and not self.calibration.active:
                self.costs = type(self.costs)([v / 1e3 for v in table["verify"]], table["decode"] / 1e3,
                                              table["draft_base"] / 1e3)
    return Exact


def replay(a) -> int:
    from dflash2.bench.replay import load_schedules, replay as replay_trace

    loaded = load_schedules(a.schedule)
    names = [*loaded, *(f"{n}/exact" for n in loaded if a.exact_costs), "oracle"]
    rows = {}
    print(f"{'trace':>34} " + " ".join(f"{n:>15}" for n in names) + "   (speed over plain decoding, drafted share)")
    for path in a.traces:
        t = lifted(read_trace(path), a.lift) if a.lift else read_trace(path)
        classes = dict(loaded)
        if a.exact_costs:
            classes |= {f"{n}/exact": _exact_costs(cls, t["costs_ms"]) for n, cls in loaded.items()}
        classes["oracle"] = lambda block_size: None  # knows every position's match: what no schedule can beat
        if a.fresh:  # one answer per session (the README's main command): a new schedule for each answer
            rows[path] = {n: _pooled([replay_trace(cls(t["block_size"]), {**t, "answers": [ans]})
                                      for ans in t["answers"]]) for n, cls in classes.items()}
        else:
            rows[path] = {n: replay_trace(cls(t["block_size"]), t) for n, cls in classes.items()}
        print(f"{Path(path).name[-34:]:>34} " + " ".join(f"{r['speed']:7.3f}x {r['drafted'] / r['rounds']:6.1%}"
                                                         for r in rows[path].values()))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


def _empty(trace: dict, path: str) -> bool:
    """A trace without a round to price (no answer past its first token) is said, not divided by."""
    if any(ans["positions"] for ans in trace["answers"]):
        return False
    print(f"{path}: no rounds to price (an empty trace)", file=sys.stderr)
    return True


def thresholds(a) -> int:
    from dflash2.bench.replay import Thresholds, replay as replay_trace

    grid = [round(0.05 * i, 2) for i in range(1, 20)]
    rows = {}
    for path in a.traces:
        t = read_trace(path)
        if _empty(t, path):
            return 2
        runs = {(t1, t2): replay_trace(Thresholds(t1, t2), t) for t1 in grid for t2 in grid}
        (t1, t2), best = max(runs.items(), key=lambda kv: kv[1]["speed"])
        rows[path] = {"t1": t1, "t2": t2, **best}
        print(f"{Path(path).name:>34}  best thresholds t1 {t1:.2f} t2 {t2:.2f}: {best['speed']:.3f}x "
              f"({best['drafted'] / best['rounds']:.1%} of rounds drafted)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


def lifted(trace: dict, q: float, seed: int = 0) -> dict:
    """A crude stand-in for a drafter that accepts more (`bounds --lift`): at every position each draft after the
    matching prefix is turned right in turn with probability min(1, 2 q c), c its confidence (a better drafter's gains
    sit where it is already surer), seeded. Not a drafter: what acceptance a speed would need, roughly."""
    import copy
    import random

    rng, S, t = random.Random(seed), trace["block_size"] - 1, copy.deepcopy(trace)
    for ans in t["answers"]:
        for p in ans["positions"]:
            while p["match"] < S and rng.random() < min(1.0, 2 * q * (p["confidence"] or [0.5] * S)[p["match"]]):
                p["match"] += 1
    return t


def _best_fixed(trace: dict) -> dict:
    """The best `--draft-len K` over the trace (one K for all of its answers, chosen knowing them)."""
    from dflash2.bench.replay import replay as replay_trace
    from dflash2.speculative import FixedSchedule

    speed, k = max((replay_trace(FixedSchedule(k), trace)["speed"], k) for k in range(1, trace["block_size"]))
    return {"best_fixed": speed, "best_k": k}


def bounds(a) -> int:
    """Per trace, at the draft cost times each of --draft and the verify's cost beyond a decode step times each of
    --verify: the schedule (auto), perfect confidence (the best of the schedules that draft every round and then
    verify any of the drafts that will match) and the oracle (the best of all schedules: `replay.bound`): what a
    cheaper drafter or a flatter verify is worth at this drafter's acceptance."""
    from dflash2.bench.replay import bound, load_schedules, replay as replay_trace, scaled_costs

    (name, cls), = load_schedules([a.schedule]).items()
    draft, verify = ([float(x) for x in v.split(",")] for v in (a.draft, a.verify))
    rows = {}
    for path in a.traces:
        t = read_trace(path)
        if _empty(t, path):
            return 2
        rows[path] = []
        print(f"{Path(path).name}: {_table_line(t['costs_ms'])}")
        print(f"| draft cost x | verify beyond decode x | {name} | best fixed K | perfect confidence | oracle |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for fd in draft:
            for fv in verify:
                s = {**t, "costs_ms": scaled_costs(t["costs_ms"], fd, fv)}
                r = {"draft": fd, "verify": fv, name: replay_trace(cls(t["block_size"]), s)["speed"],
                     **_best_fixed(s), "perfect_confidence": bound(s, skip=False)["speed"], "oracle": bound(s)["speed"]}
                rows[path].append(r)
                print(f"| {fd:g} | {fv:g} | {r[name]:.3f}x | {r['best_fixed']:.3f}x (K = {r['best_k']}) | "
                      f"{r['perfect_confidence']:.3f}x | {r['oracle']:.3f}x |")
        if a.lift:
            print(f"| lift q | acceptance (all drafts, every position) | P(first draft) | {name} | best fixed K | "
                  "perfect confidence |")
            print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for q in (float(x) for x in a.lift.split(",") if x):
            s = lifted(t, q)
            m = [p["match"] for ans in s["answers"] for p in ans["positions"]]
            r = {"lift": q, "acceptance": 1 + sum(m) / len(m), "p_first": sum(x > 0 for x in m) / len(m),
                 name: replay_trace(cls(t["block_size"]), s)["speed"], **_best_fixed(s),
                 "perfect_confidence": bound(s, skip=False)["speed"]}
            rows[path].append(r)
            print(f"| {q:g} | {r['acceptance']:.2f} | {r['p_first']:.2f} | {r[name]:.3f}x | {r['best_fixed']:.3f}x "
                  f"(K = {r['best_k']}) | {r['perfect_confidence']:.3f}x |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("export")
    r.add_argument("--prompts", default="default")
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--threads", type=int, default=None)
    r.add_argument("--out", required=True)
    c = sub.add_parser("costs")
    c.add_argument("export")
    c.add_argument("--into", nargs="+", required=True, metavar="TRACE")
    c.add_argument("--threads", type=int, default=None)
    c.add_argument("--repeats", type=int, default=40)
    q = sub.add_parser("replay")
    q.add_argument("traces", nargs="+")
    q.add_argument("--schedule", action="append", required=True, metavar="NAME=FILE")
    q.add_argument("--json", default=None)
    q.add_argument("--fresh", action="store_true", help="a new schedule (session) per answer, as the main command")
    q.add_argument("--lift", type=float, default=0.0, help="replay over the traces' drafts turned right at random "
                   "(lifted(): a stand-in for a drafter that accepts more)")
    q.add_argument("--exact-costs", action="store_true",
                   help="also each schedule with the trace's own cost table once calibrated (a perfect cost model)")
    h = sub.add_parser("thresholds")
    h.add_argument("traces", nargs="+")
    h.add_argument("--json", default=None)
    b = sub.add_parser("bounds")
    b.add_argument("traces", nargs="+")
    b.add_argument("--schedule", default=f"auto={Path(__file__).resolve().parents[2]}/dflash2/runtime/schedule.py",
                   metavar="NAME=FILE")
    b.add_argument("--draft", default="1,0.5,0.25,0", help="draft cost factors")
    b.add_argument("--verify", default="1,0.5,0", help="factors of what a verify costs beyond a decode step")
    b.add_argument("--lift", default="", help="also these q: drafts turned right at random (lifted(), a stand-in "
                   "for a drafter that accepts more), priced at today's costs")
    b.add_argument("--json", default=None)
    a = p.parse_args(argv)
    return {"record": record, "costs": costs, "replay": replay, "thresholds": thresholds, "bounds": bounds}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
