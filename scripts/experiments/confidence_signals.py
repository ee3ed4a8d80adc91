"""Which per-draft signal tells best whether a draft will be accepted (what `--draft-len auto` reads), offline:

    python scripts/experiments/confidence_signals.py --target T --corpus data/corpus/smollm2-135m-instruct DRAFTER [DRAFTER ...] \
        [--rows 32] [--threads 1] [--json out.json]

`data/` is not tracked: `dflash2-corpus grow` regenerates the corpus (docs/training.md), or
`git archive ad2524c2d0e37bfd1d1d668e3431dbd898bbf0e3 data/ | tar -x` restores it and the research drafters.

At every answer position of the first `--rows` held-out rows (whole conversations = 49 mod 50, never trained on),
each drafter drafts a block (teacher-forced, the taps bf16 as in training) and each signal of draft s is scored by
its AUC for "draft s matches the target's token", over the blocks whose drafts 1..s-1 all matched (the only ones the
schedule asks about): 0.5 = no information, 1 = a perfect ranking. Signals: `confidence` (the graph's output, the
selector's path probability: dflash2/ops/contract.py), and from the draft head's softmax over the draft vocabulary:
`p_walk` (the walked candidate's probability), `p_top1`, `margin` (top-1 minus top-2 logit), `entropy` (negated), and
`agree` (the walk took the head's top-1). How much a better signal could be worth end to end:
`scripts/experiments/replay_schedules.py bounds` (perfect confidence).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

SIGNALS = ("confidence", "p_walk", "p_top1", "margin", "entropy", "agree")


def auc(score: np.ndarray, y: np.ndarray) -> float:
    """Mann-Whitney AUC of `score` for the boolean labels `y`; tied scores share their average rank (`agree` is 0/1)."""
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    values, first, counts = np.unique(score[order], return_index=True, return_counts=True)
    for f, n in zip(first[counts > 1], counts[counts > 1]):  # a run of ties: every member gets the run's mean rank
        ranks[order[f:f + n]] = f + (n + 1) / 2
    pos = int(y.sum())
    neg = len(y) - pos
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg)) if pos and neg else float("nan")


def signals(d, recs: list[dict], chunk: int = 96) -> dict[str, np.ndarray]:
    """Every signal and the match, [blocks, S] each, at every anchor of `recs`."""
    import torch

    from dflash2.reference.drafter import _scaled
    from dflash2.train.objective import block_forward
    from dflash2.train.pool import anchor_range

    out = {k: [] for k in ("match", "labelled", *SIGNALS)}
    for rec in recs:
        lo, hi = anchor_range(rec)
        for j in range(lo, hi + 1, chunk):
            hidden, labels, anchor_ids = block_forward(d, rec, list(range(j, min(j + chunk, hi + 1))))
            sel = d.propose_batch(hidden, anchor_ids)
            logits, ids = d.draft_logits(hidden)
            p = torch.softmax(_scaled(logits.float(), d.config), -1)  # [nb, S, N]
            col = sel["draft_ids"].long() if ids is None else torch.searchsorted(ids, sel["draft_ids"].long())
            top2 = p.topk(2, -1).values
            out["match"].append(sel["draft_ids"].long() == labels)
            out["labelled"].append(labels >= 0)  # -100 past the sequence: nothing to match there
            out["confidence"].append(sel["confidence"])
            out["p_walk"].append(p.gather(-1, col[..., None])[..., 0])
            out["p_top1"].append(top2[..., 0])
            out["margin"].append(torch.log(top2[..., 0]) - torch.log(top2[..., 1]))  # = the logits' difference
            out["entropy"].append((p * torch.log(p.clamp_min(1e-30))).sum(-1))  # negated: higher = surer
            out["agree"].append((sel["draft_ids"] == sel["cand_ids"][..., 0]).float())
    return {k: torch.cat(v).numpy() for k, v in out.items()}


def scores(f: dict[str, np.ndarray], positions: int = 3) -> list[dict]:
    """Per draft position s (1-based): blocks asked about (drafts before it all matched, and a label to match: not
    past the answer's end), P(match), AUC per signal."""
    prefix = np.cumprod(f["match"], -1).astype(bool)
    rows = []
    for s in range(min(positions, f["match"].shape[1])):
        asked = f["labelled"][:, s] & (np.ones(len(prefix), bool) if s == 0 else prefix[:, s - 1])
        y = f["match"][asked, s].astype(bool)
        rows.append({"position": s + 1, "blocks": int(asked.sum()), "p_match": round(float(y.mean()), 4),
                     **{k: round(auc(f[k][asked, s], y), 4) for k in SIGNALS}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("drafters", nargs="+", type=Path)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--taps", default="1,14,27")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import torch

    from dflash2.reference.load import load_pair
    from dflash2.train.live import held_out_with_taps

    torch.set_num_threads(a.threads)
    taps = tuple(int(t) for t in a.taps.split(","))
    recs = held_out_with_taps(a.target, a.corpus, list(taps), a.rows, log=lambda m: print(m, flush=True))
    out = {"rows": len(recs), "drafters": {}}
    for folder in a.drafters:
        t0 = time.perf_counter()
        _, d = load_pair(folder, a.target)
        if tuple(d.config.target_layer_ids) != taps:  # the taps were computed once, for --taps
            raise SystemExit(f"{folder}: expected a drafter over --taps {a.taps}, found target_layer_ids "
                             f"{list(d.config.target_layer_ids)} (config.json): score it in a run of its own")
        with torch.no_grad():
            out["drafters"][str(folder)] = scores(signals(d, recs))
        print(f"{folder}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(json.dumps(out))
    print("| drafter | draft | blocks asked | P(match) | " + " | ".join(SIGNALS) + " |")
    print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in SIGNALS) + " |")
    for folder, rows in out["drafters"].items():
        for r in rows:
            print(f"| {Path(folder).name} | {r['position']} | {r['blocks']} | {r['p_match']:.3f} | "
                  + " | ".join(f"{r[k]:.3f}" for k in SIGNALS) + " |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
