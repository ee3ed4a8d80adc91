"""Does an export's target give the same argmax for a position whether it runs in a 1-row decode or inside a
k-row verify? Speculative decoding is lossless only if it does (the verify stands in for k decodes).

    python scripts/row_invariance.py EXPORT [--rows 4] [--tokens 96]

Greedy-decodes a few fixed prompts one row at a time, then replays the same tokens through k-row verify calls
and counts the rows whose argmax differs. Measured on ONNX Runtime 1.32's CPU int4 kernels (accuracy level 4,
SmolLM2-135M): block 32 0/368, block 128 1/368 (and `dflash2-bench-quant` found its speculative output differ
from its autoregressive output), docs/quantization.md.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export")
    p.add_argument("--rows", type=int, default=4, help="rows per verify call (k)")
    p.add_argument("--tokens", type=int, default=96, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    from dflash2.runtime.api import Runtime
    from dflash2.speculative import generate

    s = Runtime(a.export, threads=a.threads).session
    total = bad = 0
    for j in range(4):
        prompt = [(7 * i + 3 * j) % 3000 + 10 for i in range(40)]
        seq = list(generate(s, prompt, a.tokens, speculative=False).ids)
        s.prefill(prompt)
        for p0 in range(0, len(seq) - a.rows, a.rows):
            got = list(s.verify(seq[p0:p0 + a.rows]).ids)[:a.rows]  # rows predict seq[p0+1 .. p0+k]
            want = seq[p0 + 1:p0 + a.rows + 1]
            total += len(want)
            bad += sum(x != y for x, y in zip(got, want))
            s.commit(a.rows)
        print(f"prompt {j + 1}/4: {bad}/{total} rows differ so far", file=sys.stderr, flush=True)
    print(f"{a.export}: {bad}/{total} verify rows of {a.rows} give another argmax than the 1-row decode")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
