"""Does torch.compile speed up the trainer's taps (`dflash2-train --live-taps`)? Eager against compiled, in turns:

    python scripts/experiments/bench_taps_compile.py --target ~/.cache/dflash2/smollm2-135m-instruct [--threads 1] [--rounds 3]

The taps model is transformers' target cut after the last tapped layer, cast to bf16 (dflash2/train/live.py), run on
six random-id sequences of 380-700 tokens (chat turns' lengths; the time does not depend on the ids). The compiled
model (`dynamic=True`: every drawn sequence has another length) is compiled before the timed rounds; the compile
time is printed apart. Each round times eager then compiled over the same sequences; the table gives medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

LENGTHS = (420, 610, 380, 700, 520, 455)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--taps", default="1,14,27")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import numpy as np
    import torch

    from dflash2.train.live import TapsModel

    torch.set_num_threads(a.threads)
    m = TapsModel(a.target, [int(t) for t in a.taps.split(",")], "bf16")
    rng = np.random.default_rng(0)
    seqs = [torch.from_numpy(rng.integers(0, 1000, n)) for n in LENGTHS]
    tokens = sum(LENGTHS)
    eager = m.base

    def rate(model) -> float:
        m.base = model
        t = time.perf_counter()
        for s in seqs:
            m.taps(s)
        return tokens / (time.perf_counter() - t)

    rate(eager)  # warm
    t = time.perf_counter()
    compiled = torch.compile(eager, dynamic=True)
    rate(compiled)
    compile_s = time.perf_counter() - t
    rows = {"eager": [], "compiled": []}
    for i in range(a.rounds):
        rows["eager"].append(rate(eager))
        rows["compiled"].append(rate(compiled))
        print(f"[round {i + 1}/{a.rounds}] eager {rows['eager'][-1]:.0f}  compiled {rows['compiled'][-1]:.0f} tok/s",
              flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    out = {"threads": a.threads, "tokens": tokens, "compile_and_first_pass_s": round(compile_s, 1),
           "tok_s": {k: [round(x) for x in v] for k, v in rows.items()},
           "median_tok_s": {k: round(v) for k, v in med.items()},
           "compiled_over_eager": round(med["compiled"] / med["eager"], 3)}
    print(json.dumps(out))
    print("| taps model | median tok/s | / eager |\n| --- | ---: | ---: |")
    for k, v in med.items():
        print(f"| {k} | {v:.0f} | {v / med['eager']:.3f} |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
