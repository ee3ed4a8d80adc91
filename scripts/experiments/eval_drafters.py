"""Several drafters on the same held-out blocks of the id corpus, offline (teacher-forced), one table:

    python scripts/experiments/eval_drafters.py --target T --corpus data/corpus/smollm2-135m-instruct \
        DRAFTER [DRAFTER ...] [--rows 192] [--anchors 16] [--loop-rows 64] [--threads 1] [--json out.json]

`data/` is not tracked: `dflash2-corpus grow` regenerates the corpus (docs/training.md), or
`git archive ad2524c2d0e37bfd1d1d668e3431dbd898bbf0e3 data/ | tar -x` restores it and the research drafters.

The trainer's own evaluation (`training.json`) reads 48 held-out rows (768 blocks): neighbouring evaluations of one
run move by ~0.04, too much to tell two drafters ~0.05 apart. This reads the first `--rows` held-out rows
(whole conversations = 49 mod 50, never trained on, dflash2/train/live.py), computes their taps once (bf16, as
training does) and scores every drafter at the same random anchors (`offline_acceptance`, seeded per half of
the rows): selector / top-1 / oracle acceptance length and per-position acceptance, and the selector on each half
of the rows apart, which shows the comparison's noise. Offline numbers run above `dflash2-bench`'s online ones (the loop's anchors sit where
drafts fail more often), but the order of two drafters is what this is for. `--loop-rows N` also scores the first
N rows at the anchors the speculative loop itself visits (`loop_accepted`: every position scored, then each path's
chain walked; what `dflash2-bench` measures online, less the target's own quantization): a drafter whose gain sits
at easy positions shows it at uniform anchors only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("drafters", nargs="+", type=Path)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--taps", default="1,14,27")
    p.add_argument("--rows", type=int, default=192)
    p.add_argument("--anchors", type=int, default=16, help="random anchors per row")
    p.add_argument("--loop-rows", type=int, default=0, help="also score this many rows at the loop's own anchors")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import torch

    from dflash2.reference.load import load_pair
    from dflash2.train.live import held_out_with_taps
    from dflash2.train.objective import loop_acceptance, offline_acceptance

    torch.set_num_threads(a.threads)
    recs = held_out_with_taps(a.target, a.corpus, [int(t) for t in a.taps.split(",")], a.rows,
                              log=lambda m: print(m, flush=True))
    half = len(recs) // 2
    out = {"rows": len(recs), "anchors_per_row": a.anchors, "drafters": {}}
    for folder in a.drafters:
        _, d = load_pair(folder, a.target)
        with torch.no_grad():  # each half at its own seeded anchors; the whole is their block-weighted mean
            parts = [offline_acceptance(d, part, a.anchors) for part in (recs[:half], recs[half:])]
        n = [x["blocks"] for x in parts]
        mean = lambda f: (f(parts[0]) * n[0] + f(parts[1]) * n[1]) / sum(n)  # noqa: E731
        row = {k: round(mean(lambda x: x[k]), 4) for k in ("selector", "top1", "oracle")}
        halves = [x["selector"] for x in parts]
        row |= {"blocks": sum(n), "layers": d.config.num_layers, "selector_halves": [round(h, 4) for h in halves],
                "position_acceptance": {k: [round(mean(lambda x: x["position_acceptance"][k][i]), 4)
                                            for i in range(len(parts[0]["position_acceptance"][k]))]
                                        for k in parts[0]["position_acceptance"]}}
        if a.loop_rows:
            t1 = time.perf_counter()
            loop = loop_acceptance(d, recs[: a.loop_rows])
            row["loop"] = {k: round(loop[k], 4) for k in ("selector", "top1", "oracle")} | {
                "rounds": loop["blocks"], "position_1": round(loop["position_acceptance"]["selector"][0], 4)}
            print(f"{folder}: at the loop's anchors ({a.loop_rows} rows, {time.perf_counter() - t1:.0f} s): selector "
                  f"{loop['selector']:.3f}  top-1 {loop['top1']:.3f}  oracle {loop['oracle']:.3f}", flush=True)
        out["drafters"][str(folder)] = row
        print(f"{folder}: selector {row['selector']:.3f} (halves {halves[0]:.3f} / {halves[1]:.3f})  top-1 "
              f"{row['top1']:.3f}  oracle {row['oracle']:.3f}  position 1 {row['position_acceptance']['selector'][0]:.3f}",
              flush=True)
    print(json.dumps(out))
    print("| drafter | layers | blocks | selector | halves | top-1 | oracle | position 1 | position 2 |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for k, r in out["drafters"].items():
        pa = r["position_acceptance"]["selector"]
        print(f"| {k} | {r['layers']} | {r['blocks']} | {r['selector']:.3f} | {r['selector_halves'][0]:.3f} / "
              f"{r['selector_halves'][1]:.3f} | {r['top1']:.3f} | {r['oracle']:.3f} | {pa[0]:.3f} | {pa[1]:.3f} |")
    if a.loop_rows:
        print("\n| drafter | at the loop's anchors: selector | top-1 | oracle | rounds (selector) | position 1 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for k, r in out["drafters"].items():
            lp = r["loop"]
            print(f"| {k} | {lp['selector']:.3f} | {lp['top1']:.3f} | {lp['oracle']:.3f} | {lp['rounds']['selector']} | "
                  f"{lp['position_1']:.3f} |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
