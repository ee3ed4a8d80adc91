"""`--draft-len auto` against plain decoding and every fixed K at a drafter's PUBLISHED acceptance, replayed over one
export's measured cost table (issue 47: the reduced Qwen3.5-MoE pair's drafter is random, so its own trace says
nothing about what a trained drafter gains there):

    python scripts/experiments/replay_published.py --export EXPORT --threads 2 --repeats 20 \
        --tau 1,2,2.5,3.26,4,6 [--answers 32 --tokens 128 --seed 0] [--costs-json costs.json] [--json out.json]

The cost table (dflash2.bench.replay.cost_table: decode, the draft, verify of 1..B rows) is measured on EXPORT once
(or read back from --costs-json, which a run with --export writes); per tau, a seeded synthetic trace
(replay.synthetic_trace: each round of all B - 1 drafts yields tau tokens on average, no confidences) is replayed
through the runtime's AutoSchedule (one session over every answer, and a fresh session per answer as `dflash2-run`
does; each calibrating on drafted rounds, and each started from the export's prior, `AutoSchedule.from_prior`, as a
session on an export whose row check timed its calls does), every `--draft-len K`, and the oracle (replay.bound).
Speeds are over plain decoding (1.0 = autoregressive);
no timing noise: the only measurement is the cost table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def costed_backoff():
    """What is left of a proposal for dflash2/runtime/schedule.py, replayed here only. Its first part landed:
    `AutoSchedule.max_backoff` prices the back-off cap by draft / decode (a draft of a 248,320-word head costs 2-3
    decode steps, not the ~0.4 the 64-round cap was tuned at). The rest: a new answer's probe waits out the back-off
    while drafting has not paid in this session (value <= 0), and a probe verifies at least one draft (without
    confidences, a DFlash v1 drafter, a probe that verifies none learns nothing). Replayed on the committed traces of
    the shipped pair those two lose up to 2.6% (fp32_shipped4: 1.128x -> 1.099x; r3fp32_shipped: 1.144x -> 1.115x), so
    they stay a proposal."""
    from dflash2.runtime.schedule import AutoSchedule

    class CostedBackoff(AutoSchedule):
        name = "auto-costed-backoff"

        def start(self) -> None:
            if self.probing and self.value > 0:
                self.skip_left, self.backoff = 0, 1

        def choose(self, confidence, available: int) -> int:
            k = super().choose(confidence, available)
            return 1 if k == 0 and available and self.probing and not self.calibration.active else k
    return CostedBackoff


def prior(table: dict):
    """The cost model an export's row check records (dflash2.runtime.invariance.costs_ms), from the table: a draft
    catching up one context row."""
    from dflash2.runtime.schedule import CostModel

    return CostModel([v / 1e3 for v in table["verify"]], table["decode"] / 1e3,
                     (table["draft_base"] + table["draft_per_row"]) / 1e3)


def _fresh(make, t: dict) -> float:
    from dflash2.bench.replay import replay

    rs = [replay(make(), {**t, "answers": [a]}) for a in t["answers"]]
    return sum(r["tokens"] for r in rs) / sum(r["tokens"] / r["speed"] for r in rs)


def run(table: dict, block: int, taus: list[float], answers: int, tokens: int, seed: int) -> list[dict]:
    from dflash2.bench.replay import bound, replay, synthetic_trace
    from dflash2.runtime.schedule import AutoSchedule
    from dflash2.speculative import FixedSchedule

    proposal = costed_backoff()

    rows = []
    for tau in taus:
        t = synthetic_trace(tau, block, table, answers, tokens, seed=seed)
        m = [p["match"] for ans in t["answers"] for p in ans["positions"]]
        auto = replay(AutoSchedule(block), t)
        fresh_speed = _fresh(lambda: AutoSchedule(block), t)
        with_prior = replay(AutoSchedule.from_prior(block, prior(table)), t)
        fresh_prior = _fresh(lambda: AutoSchedule.from_prior(block, prior(table)), t)
        prop = replay(proposal(block), t)
        fixed = {k: replay(FixedSchedule(k), t)["speed"] for k in range(1, block)}
        best_k = max(fixed, key=fixed.get)
        rows.append({"tau": tau, "rate": t["synthetic"]["rate"], "tau_drawn": 1 + sum(min(x, block - 1) for x in m) / len(m),
                     "auto": auto["speed"], "auto_drafted_share": auto["drafted"] / auto["rounds"],
                     "auto_fresh_per_answer": fresh_speed, "auto_prior": with_prior["speed"],
                     "auto_prior_drafted_share": with_prior["drafted"] / with_prior["rounds"],
                     "auto_prior_fresh_per_answer": fresh_prior,
                     "proposal_costed_backoff": prop["speed"], "proposal_drafted_share": prop["drafted"] / prop["rounds"], "fixed": fixed, "best_k": best_k,
                     "best_fixed": fixed[best_k], "oracle": bound(t)["speed"]})
    return rows


def table_md(rows: list[dict], ks=(2, 4, 8, 15)) -> str:
    head = ("| tau | auto (one session) | auto (fresh per answer) | drafted rounds | auto, export's prior (one session) "
            "| auto, prior (fresh per answer) | proposal (costed back-off) | "
            + " | ".join(f"K = {k}" for k in ks) + " | best fixed K | auto / best fixed | oracle |")
    lines = [head, "|" + " ---: |" * (10 + len(ks))]
    for r in rows:
        lines.append(f"| {r['tau']:g} ({r['tau_drawn']:.2f} drawn) | {r['auto']:.3f}x | {r['auto_fresh_per_answer']:.3f}x | "
                     f"{r['auto_drafted_share']:.0%} | {r['auto_prior']:.3f}x | {r['auto_prior_fresh_per_answer']:.3f}x | "
                     f"{r['proposal_costed_backoff']:.3f}x | " + " | ".join(f"{r['fixed'][k]:.3f}x" for k in ks)
                     + f" | {r['best_fixed']:.3f}x (K = {r['best_k']}) | {r['auto'] / r['best_fixed']:.3f} | "
                     f"{r['oracle']:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", default=None, help="measure the cost table on this export")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--costs-json", default=None, help="with --export: write the table here; without: read it")
    p.add_argument("--tau", default="1,2,2.5,3.26,4,6")
    p.add_argument("--answers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.export:
        from dflash2.bench.replay import cost_table
        from dflash2.runtime.api import Runtime

        s = Runtime(a.export, threads=a.threads).session
        costs = {"export": a.export, "threads": a.threads, "repeats": a.repeats, "block_size": s.block_size,
                 "costs_ms": cost_table(s, repeats=a.repeats)}
        if a.costs_json:
            Path(a.costs_json).write_text(json.dumps(costs, indent=1))
    elif a.costs_json:
        costs = json.loads(Path(a.costs_json).read_text())
    else:
        p.error("expected --export or --costs-json")
    c = costs["costs_ms"]
    print(f"cost table (ms): decode {c['decode']:.2f}, draft {c['draft_base']:.2f} + {c['draft_per_row']:.3f} per "
          f"row, verify / decode {[round(v / c['decode'], 2) for v in c['verify'][1:]]}", file=sys.stderr)
    rows = run(c, costs["block_size"], [float(x) for x in a.tau.split(",")], a.answers, a.tokens, a.seed)
    out = {**costs, "answers": a.answers, "tokens": a.tokens, "seed": a.seed, "rows": rows}
    print(json.dumps(out, indent=1))
    print(table_md(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
