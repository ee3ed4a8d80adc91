"""Draft-length schedules against each other and against plain decoding, in ONE interleaved run:

    git show bc2e7b6:dflash2/runtime/schedule.py > /tmp/schedule_before.py
    python scripts/experiments/bench_schedules.py EXPORT --schedule before=/tmp/schedule_before.py \
        --schedule now=dflash2/runtime/schedule.py [--prompts default|sharegpt:eval:24] [--threads 1] \
        [--repeats 2] [--json out.json]

Each `--schedule NAME=FILE` loads the `AutoSchedule` class of that file (another version of
dflash2/runtime/schedule.py, e.g. the one a change replaces) and keeps ONE instance for the whole run, as a
runtime session does. Per prompt, autoregressive and every schedule run in turns (the order rotates from
prompt to prompt; this machine's speed drifts between runs, not within one). Prints per prompt and overall
tok/s, the ratio to autoregressive, drafted / skipped rounds and acceptance, and checks every output equals the
autoregressive one. Besides wall time, every run is PRICED: its rounds at one cost table measured at the start
(`dflash2.bench.replay.cost_table`: median decode / draft / verify-of-k times), which removes this shared machine's
noise (one stall moves a prompt's wall-clock ratio by 30%) and keeps what the schedule decided; a draft after
skipped rounds catches up their context rows and costs more than the table's, so priced ratios flatter a
schedule that skips a little. This is the measurement behind docs/draft_len.md's "never loses" numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export")
    p.add_argument("--schedule", action="append", required=True, metavar="NAME=FILE")
    p.add_argument("--prompts", default="default")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompt set (one schedule instance each)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    from dflash2.prompts import parse_spec
    from dflash2.runtime.api import Runtime
    from dflash2.bench.replay import cost_table, load_schedules
    from dflash2.speculative import generate

    rt = Runtime(a.export, threads=a.threads)
    B = rt.session.block_size
    price = cost_table(rt.session, repeats=30)  # ms: decode, verify[n] (n = 1..B), draft_base + per row
    print(f"cost table (ms): {price['measured_ms']}", file=sys.stderr)
    prompts = parse_spec(a.prompts, default_split="eval")
    schedules = {name: cls(B) for name, cls in load_schedules(a.schedule).items()}
    modes = ["ar", *schedules]
    totals = {m: {"tokens": 0, "seconds": 0.0, "priced_ms": 0.0, "drafted": 0, "reused": 0, "rounds": 0,
                  "accepted": 0, "verified": 0}
              for m in modes}
    per_prompt, lossless = [], True
    for rep in range(a.repeats):
        for i, prompt in enumerate(prompts):
            ids = rt.prompt_ids(text=prompt, chat=True)
            row, out_ids = {}, {}
            j = (rep * len(prompts) + i) % len(modes)
            for m in modes[j:] + modes[:j]:
                g = generate(rt.session, ids, a.max_new_tokens, rt.eos_ids, speculative=m != "ar",
                             schedule=schedules.get(m))
                st, t = g.stats, totals[m]
                t["tokens"] += st.new_tokens - 1  # as Stats.tokens_per_second: after the first token,
                t["seconds"] += st.decode_seconds  # over the time after prefill
                t["rounds"] += st.rounds
                drew = [not (skip or reuse) for skip, reuse in zip(st.skipped, st.reused)]  # the drafter ran
                t["priced_ms"] += (price["decode"] * (st.new_tokens - 1) if m == "ar" else  # after the first token
                                   sum(price["verify"][k + 1] + (price["draft_base"] if d else 0.0)
                                       for k, d in zip(st.verified, drew)))
                t["drafted"] += sum(drew) if m != "ar" else 0
                t["reused"] += sum(st.reused) if m != "ar" else 0
                t["accepted"] += sum(st.accepted)
                t["verified"] += sum(st.verified)
                row[m] = st.tokens_per_second
                out_ids[m] = g.ids
            same = all(v == out_ids["ar"] for v in out_ids.values())
            lossless &= same
            per_prompt.append({"prompt": i, "repeat": rep, "tok_s": {m: round(v, 2) for m, v in row.items()},
                               "lossless": same})
            run = "  ".join(f"{m} {totals[m]['tokens'] / max(totals[m]['seconds'], 1e-9):.1f}" for m in modes)
            now = "  ".join(f"{m} {row[m] / row['ar']:.3f}x" for m in modes[1:])
            print(f"[{rep + 1}.{i + 1}/{len(prompts)}] {now}  | running tok/s: {run}", file=sys.stderr, flush=True)
    ar = totals["ar"]["tokens"] / totals["ar"]["seconds"]
    ar_priced = totals["ar"]["tokens"] / totals["ar"]["priced_ms"]
    summary = {}
    for m in modes:
        t = totals[m]
        tps = t["tokens"] / t["seconds"]
        summary[m] = {"tok_s": round(tps, 2), "vs_ar": round(tps / ar, 4),
                      "priced_vs_ar": round(t["tokens"] / t["priced_ms"] / ar_priced, 4), "rounds": t["rounds"],
                      "reused_rounds": t["reused"],
                      "drafted_rounds": t["drafted"], "drafts_verified": t["verified"],
                      "drafts_accepted": t["accepted"]}
    result = {"export": a.export, "cost_table_ms": price, "prompts": a.prompts, "n_prompts": len(prompts), "repeats": a.repeats,
              "threads": a.threads, "max_new_tokens": a.max_new_tokens, "schedules": dict(
                  s.split("=", 1) for s in a.schedule), "lossless": lossless, "summary": summary,
              "per_prompt": per_prompt, "state_after": {m: s.to_dict() for m, s in schedules.items()}}
    print(f"{'mode':>10} {'tok/s':>8} {'x AR':>7} {'priced':>7} {'rounds':>7} {'drafted':>8} {'verified':>9} "
          f"{'accepted':>9}")
    for m, s in summary.items():
        print(f"{m:>10} {s['tok_s']:8.1f} {s['vs_ar']:7.3f} {s['priced_vs_ar']:7.3f} {s['rounds']:7d} {s['drafted_rounds']:8d} "
              f"{s['drafts_verified']:9d} {s['drafts_accepted']:9d}")
    print(f"lossless (every output == autoregressive): {lossless}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({"summary": summary, "lossless": lossless}))
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
