"""The held-out curve of a drafter's training.json: acceptance (selector / top-1 / oracle) and position-1
acceptance against the answer tokens seen, as JSON, a markdown table and a text plot.

    python scripts/train_curve.py dflash2/data/drafters/smollm2-135m-dflash2/training.json [--json out.json]

(the shipped drafter's phase-4 run; a run's own is `<dflash2-train --out>/training.json`).

Reads both layouts: a run's {"config", "history"} and a shipped drafter's {"phases": [{name, history}]}.
Entries without a `seen` count (runs before the id corpus) are plotted by step only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def points(doc: dict) -> list[dict]:
    phases = doc["phases"] if "phases" in doc else [{"name": "run", "history": doc["history"]}]
    out = []
    for ph in phases:
        for h in ph["history"]:
            pos = h.get("position_acceptance", {}).get("selector", [None])
            out.append({"phase": ph["name"], "step": h["step"], "answer_tokens": h.get("seen", {}).get("answer_tokens"),
                        "selector": h["selector"], "top1": h["top1"], "oracle": h["oracle"], "pos1": pos[0]})
    return out


def plot(rows: list[dict], width: int = 50) -> str:
    lo = 1.0  # acceptance is at least 1 (the target's own token): bars measured from there, not from the min
    span = max(max(r["selector"] for r in rows) - lo, 1e-9)
    lines = []
    for r in rows:
        x = f"{r['answer_tokens']:>11,}" if r["answer_tokens"] is not None else f"step {r['step']:>6}"
        lines.append(f"{x} | {'#' * round(width * (r['selector'] - lo) / span):<{width}} {r['selector']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("training_json", type=Path)
    p.add_argument("--json", type=Path, help="also write the points here")
    a = p.parse_args(argv)
    try:
        rows = points(json.loads(a.training_json.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"train_curve: error: {a.training_json}: expected a dflash2 training.json, found {e!r}", file=sys.stderr)
        return 2
    if not rows:
        print(f"train_curve: error: {a.training_json}: no held-out evaluations in it", file=sys.stderr)
        return 2
    print(json.dumps(rows))
    print("| step | answer tokens seen | selector | top-1 | oracle | position 1 |\n| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        seen = f"{r['answer_tokens']:,}" if r["answer_tokens"] is not None else "-"
        pos1 = f"{r['pos1']:.3f}" if r["pos1"] is not None else "-"
        print(f"| {r['step']} | {seen} | {r['selector']:.3f} | {r['top1']:.3f} | {r['oracle']:.3f} | {pos1} |")
    print("\nselector tau against answer tokens seen:\n" + plot(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
