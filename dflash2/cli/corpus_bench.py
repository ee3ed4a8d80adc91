"""dflash2-corpus-bench: corpus generation tokens/s against transformers' own `generate`, same run
(dflash2.bench.genbench: the contenders interleaved round by round; a table and JSON)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash2.cli.entry import cli_main
from dflash2.cli.args import threads_arg
from dflash2.errors import require_extra


@cli_main("dflash2-corpus-bench", "nothing was written")
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-corpus-bench", "train", 'torch', 'transformers')
    from dflash2.bench import genbench

    p = argparse.ArgumentParser(prog="dflash2-corpus-bench", description=genbench.__doc__)
    p.add_argument("--target", required=True, type=Path)
    p.add_argument("--prompts", default="sharegpt:256", help="as dflash2-train --prompts (default sharegpt:256)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--taps", default="1,14,27")
    p.add_argument("--threads", type=threads_arg)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    import torch

    from dflash2.train.data import corpus_prompts

    if a.threads:
        torch.set_num_threads(a.threads)
    r = genbench.bench(a.target, corpus_prompts(a.prompts), a.batch, a.max_new_tokens, a.repeats,
                       [int(x) for x in a.taps.split(",")])
    print(genbench.table(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    print(json.dumps({k: r[k] for k in ("tok_per_s", "ours_vs_best_transformers", "same_answers_fp32",
                                        "same_answers_bf16")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
