"""Host time of lossless sampling per round (dflash2.sampling.verify_round) on V-wide logits rows, no model:
the work the runtime does between the target's verify and the next draft at T > 0.

    python scripts/experiments/bench_sampling_host.py [--vocab 49152] [--rounds 300] [--against 14300d3] [--json out.json]

Rows are random logits of a realistic spread (std 3); the drafts are each row's argmax, so most rounds
accept several drafts and process several rows (the costly case). Prints ms per round for each option set.
`--against REV` loads `dflash2/sampling.py` of that git revision as a second module and times both on the
same rows, interleaved pass by pass (the minimum of 5 passes each: the machine is shared), with the ratio;
14300d3 is the dense float64 code before the runtime-house issue's sampling work.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

from dflash2 import sampling as current
from dflash2.sampling import Sampling

CASES = [Sampling(0.7), Sampling(0.7, top_k=50), Sampling(0.7, top_p=0.9), Sampling(0.7, top_k=50, top_p=0.9)]
ROOT = Path(__file__).resolve().parents[2]


def load_revision(rev: str) -> types.ModuleType:
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:dflash2/sampling.py"], check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType(f"sampling_{rev}")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, f"{rev}:dflash2/sampling.py", "exec"), mod.__dict__)
    return mod


def one_pass(mod, rows: np.ndarray, drafts: np.ndarray, s: Sampling) -> tuple[float, int, list]:
    t0, done, out = time.perf_counter(), 0, []
    for r in range(rows.shape[0]):
        acc, tok = mod.verify_round(rows[r], drafts[r].tolist(), None, None, 100,
                                    mod.Sampling(s.temperature, s.top_k, s.top_p, seed=r))
        done += acc + 1
        out.append((acc, tok))
    return time.perf_counter() - t0, done, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--drafts", type=int, default=7)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--against", metavar="REV", help="a git revision whose sampling.py is timed beside this one")
    p.add_argument("--json")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((a.rounds, a.drafts + 1, a.vocab)) * 3).astype(np.float32)  # [R, K+1, V]
    drafts = rows[:, :-1].argmax(-1)  # [R, K]
    mods = {"new": current} | ({"old": load_revision(a.against)} if a.against else {})
    out = []
    for s in CASES:
        best = {k: float("inf") for k in mods}
        rows_done, same = {}, True
        for i in range(a.passes):
            results = {}
            for name, mod in mods.items():
                secs, rows_done[name], results[name] = one_pass(mod, rows, drafts, s)
                best[name] = min(best[name], secs)
            if "old" in results:  # the same draws up to fp32 / float64 rounding at a uniform's boundary
                same = same and sum(x != y for x, y in zip(results["new"], results["old"])) <= a.rounds // 100
            print(f"  {s.describe()}: pass {i + 1}/{a.passes}", file=sys.stderr, flush=True)
        row = {"sampling": s.describe(), "ms_per_round": round(1e3 * best["new"] / a.rounds, 3),
               "rows_per_round": round(rows_done["new"] / a.rounds, 2)}
        if "old" in mods:
            row |= {"old_ms_per_round": round(1e3 * best["old"] / a.rounds, 3),
                    "old_over_new": round(best["old"] / best["new"], 2), "same_draws": same}
        out.append(row)
    if "old" in mods:
        print(f"| options | {a.against} ms / round | now ms / round | old / new | rows per round | same draws |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
        for r in out:
            print(f"| {r['sampling']} | {r['old_ms_per_round']} | {r['ms_per_round']} | {r['old_over_new']}x | "
                  f"{r['rows_per_round']} | {r['same_draws']} |")
    else:
        print("| options | ms per round | rows processed per round |\n| --- | ---: | ---: |")
        for r in out:
            print(f"| {r['sampling']} | {r['ms_per_round']} | {r['rows_per_round']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"vocab": a.vocab, "rounds": a.rounds, "against": a.against,
                                            "cases": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
