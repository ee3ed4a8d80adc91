"""Depth study report: drafters of different depths trained with the same budget, compared on
held-out blocks (acceptance length and per-position acceptance), as a markdown table and a PNG.

    python -m dflash2.bench.study RUN_DIR [RUN_DIR ...] --png docs/depth_study.png

Each RUN_DIR is a dflash2-train output (its training.json holds the held-out evaluations).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash2.speculative import gap_closed


def load_run(folder: Path) -> dict:
    t = json.loads((folder / "training.json").read_text())
    last = t["history"][-1]
    cfg = json.loads((folder / "config.json").read_text())
    size = (folder / "model.safetensors").stat().st_size
    return {"name": folder.name, "layers": t["config"]["layers"], "steps": t["config"]["steps"],
            "rank": t["config"]["rank"], "top_k": t["config"]["top_k"], "mb": size / 2**20,
            "output_multiplier": cfg["dflash_config"].get("output_multiplier", 1.0), **last,
            "curve": [(h["step"], h["selector"]) for h in t["history"]]}


def table(runs: list[dict]) -> str:
    S = len(runs[0]["position_acceptance"]["selector"])
    head = ("| layers | steps | MB (fp16) | tau selector | tau top-1 | tau oracle | gap closed | "
            + " | ".join(f"p{k + 1}" for k in range(S)) + " |")
    sep = "|" + "---|" * (7 + S)
    rows = []
    for r in runs:
        share = gap_closed(r["selector"], r["top1"], r["oracle"])
        closed = f"{100 * share:.0f}%" if share is not None else "-"
        pos = " | ".join(f"{x:.2f}" for x in r["position_acceptance"]["selector"])
        rows.append(f"| {r['layers']} | {r['steps']} | {r['mb']:.1f} | {r['selector']:.2f} | {r['top1']:.2f} | "
                    f"{r['oracle']:.2f} | {closed} | {pos} |")
    return "\n".join([head, sep, *rows])


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in runs:
        pos = r["position_acceptance"]["selector"]
        a.plot(range(1, len(pos) + 1), pos, marker="o", label=f"{r['layers']} layer(s), tau {r['selector']:.2f}")
        steps, taus = zip(*r["curve"])
        b.plot(steps, taus, label=f"{r['layers']} layer(s)")
    a.set(xlabel="draft position", ylabel="acceptance rate (held-out)", ylim=(0, 1), title="per-position acceptance")
    b.set(xlabel="training step", ylabel="tau (selector path)", title="held-out tau during training")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash2.bench.study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--png", type=Path, help="write the plot here")
    a = p.parse_args(argv)
    runs = sorted((load_run(r) for r in a.runs), key=lambda r: r["layers"])
    print(table(runs))
    if a.png:
        plot(runs, a.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
