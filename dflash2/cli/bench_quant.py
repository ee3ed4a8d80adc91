"""dflash2-bench-quant: fp32 and quantized exports (autoregressive and speculative) against
onnxruntime-genai's own int4 model of the same target, in one interleaved run on the same prompts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash2.cli.args import check_output_file
from dflash2.cli.run import draft_len_arg
from dflash2.folders import write_atomic
from dflash2.errors import Dflash2Error, check_threads
from dflash2.cli.entry import cli_main


@cli_main("dflash2-bench-quant", errors=(Dflash2Error, ValueError))
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash2-bench-quant", description=__doc__)
    p.add_argument("folders", type=Path, nargs="+",
                   help="export folders of one target; the first (normally fp32) is the agreement reference")
    p.add_argument("--genai", type=Path, help="folder written by `python -m onnxruntime_genai.models.builder "
                                              "-i TARGET -o OUT -p int4 -e cpu` (optional)")
    p.add_argument("--prompts", default="default", help="as dflash2-bench: 'default', 'sharegpt:eval:N' or a file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-len", type=draft_len_arg, default=2, metavar="K|auto",
                   help="drafts verified per round, or auto: each export's runtime schedule (default 2)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, help="intra-op threads of every session (dflash2's and genai's)")
    p.add_argument("--raw", action="store_true", help="prompts as plain text, no chat template")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    a = p.parse_args(argv)
    from dflash2.prompts import parse_spec
    from dflash2.bench import quant as qb

    for flag, v in (("--repeats", a.repeats), ("--max-new-tokens", a.max_new_tokens), ("--threads", a.threads)):
        if v is not None and v < 1:
            raise Dflash2Error(f"{flag}: expected >= 1, found {v}")
    check_threads(a.threads)
    # the results file is checked before the run and never lies in an input (an export's manifest, say)
    check_output_file(a.json, "--json", [(f"FOLDER {i + 1}", f) for i, f in enumerate(a.folders)]
                      + [("--genai", a.genai)])
    prompts = parse_spec(a.prompts, default_split="eval", log=print)
    if not prompts:
        raise Dflash2Error(f"--prompts {a.prompts}: expected at least one prompt, found none")
    r = qb.bench_quant(a.folders, prompts, a.genai,
                       a.max_new_tokens, not a.raw, a.draft_len, a.repeats, a.threads,
                       log=lambda line: print(line, file=sys.stderr, flush=True))
    print(qb.table(r))
    if a.json:
        write_atomic(a.json, json.dumps(r.to_dict(), indent=2))  # a new file renamed over the old: never in place
    d = r.to_dict()
    print(json.dumps({k: d[k] for k in ("tokens_per_second", "lossless", "best")}))
    return 0 if all(r.lossless.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
