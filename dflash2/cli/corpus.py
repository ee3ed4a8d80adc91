"""dflash2-corpus: the id corpus in the repository (the target's greedy answers to ShareGPT, as token ids).

  dflash2-corpus grow  --target T --out data/corpus/NAME --minutes 150   # add shards; resumes; stops in time
  dflash2-corpus info  data/corpus/NAME [--json]                          # what it holds, per session
  dflash2-corpus verify data/corpus/NAME                                  # every shard against its sha256
  dflash2-corpus taps  data/corpus/NAME --target T --taps 5,15,25        # rebuild the taps into the local cache
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash2.cli import cli_main
from dflash2.cli.args import threads_arg
from dflash2.errors import require_extra


def _positive(kind):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, found {s!r}") from None
        if not v > 0 or v != v:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, found {s!r}")
        return v
    return parse


def _taps(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer ids like 1,15,28, found {s!r}") from None


def _range(s: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in s.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (conversation indices), found {s!r}") from None
    return a, b


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash2-corpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grow", help="answer the next shards of ShareGPT turns with the target")
    g.add_argument("--target", required=True, type=Path, help="target folder (Llama / Qwen3, safetensors)")
    g.add_argument("--out", required=True, type=Path, help="corpus folder (created, or grown when it exists)")
    g.add_argument("--minutes", type=_positive(float), default=60.0,
                   help="stop before this many minutes have passed (a shard is never cut)")
    g.add_argument("--max-shards", type=_positive(int), help="stop after this many new shards")
    g.add_argument("--shard-items", type=_positive(int), default=256, help="human turns per shard (the resume unit)")
    g.add_argument("--batch", type=_positive(int), default=128, help="prompts per generation batch")
    g.add_argument("--max-new-tokens", type=_positive(int), default=384)
    g.add_argument("--context-tokens", type=_positive(int), default=512,
                   help="prompt budget: earlier turns are dropped, oldest first, until the templated prompt fits")
    g.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    g.add_argument("--threads", type=threads_arg, help="torch threads (default: all cores)")
    g.add_argument("--conversations", type=_range, default=(0, 15_000),
                   help="ShareGPT conversations A:B to answer (inside 0:15000; 15,000+ are held out)")
    i = sub.add_parser("info", help="what a corpus holds")
    i.add_argument("corpus", type=Path)
    i.add_argument("--json", action="store_true")
    v = sub.add_parser("verify", help="check every shard against its sha256")
    v.add_argument("corpus", type=Path)
    t = sub.add_parser("taps", help="rebuild the taps of a corpus into the local cache (teacher-forced)")
    t.add_argument("corpus", type=Path)
    t.add_argument("--target", required=True, type=Path)
    t.add_argument("--taps", required=True, type=_taps, help="target layer ids to tap, e.g. 5,15,25")
    t.add_argument("--cache", type=Path, help="cache root (default ~/.cache/dflash2/taps)")
    t.add_argument("--shards", type=_positive(int), help="only the first N shards")
    t.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    t.add_argument("--threads", type=threads_arg)
    return p


def _info(corpus, as_json: bool) -> None:
    tot = corpus.totals()
    m = corpus.meta
    if as_json:
        print(json.dumps({"target": m["target"], "generation": m["generation"], "totals": tot,
                          "sessions": m["sessions"]}, indent=1))
        return
    print(f"{corpus.folder}: {tot['shards']} shards, {tot['rows']} answered turns, {tot['answer_tokens']:,} answer "
          f"tokens ({tot['prompt_tokens']:,} prompt tokens), conversations {tot['conversations']}")
    print(f"target {m['target']['name']} ({m['target']['family']}, vocab {m['target']['vocab_size']}), "
          f"{m['generation']['dtype']} greedy, up to {m['generation']['max_new_tokens']} new tokens")
    print("| session start | host | shards | answer tokens | tok/s |\n| --- | --- | ---: | ---: | ---: |")
    for s in m["sessions"]:
        print(f"| {s['started']} | {s['host']} | {s['shards']} | {s['answer_tokens']:,} | "
              f"{s.get('answer_tok_per_s', 0):.0f} |")


@cli_main("dflash2-corpus", "nothing is half-written (a grow rerun resumes at the first shard not yet written)")
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-corpus", "train", 'torch', 'transformers', 'safetensors')
    a = _parser().parse_args(argv)
    from dflash2.folders import check_apart
    from dflash2.inputs import check_input
    from dflash2.train.idcorpus import IdCorpus

    for flag in ("target", "corpus", "out", "cache"):  # FIFOs, link loops, folders named like files: refused first
        check_input(getattr(a, flag, None), f"--{flag}" if flag != "corpus" else "CORPUS")
    if a.cmd == "grow":
        check_apart(a.out, {"--target": a.target})
        from dflash2.train.grow import grow

        s = grow(a.target, a.out, a.minutes, a.shard_items, a.batch, a.max_new_tokens, a.context_tokens,
                 a.dtype, a.threads, a.conversations, a.max_shards)
        print(f"this run: {s['shards']} shards, {s['answer_tokens']:,} answer tokens, "
              f"{s.get('answer_tok_per_s', 0):.0f} tok/s")
        _info(IdCorpus(a.out), False)
    elif a.cmd == "info":
        _info(IdCorpus(a.corpus), a.json)
    elif a.cmd == "verify":
        c = IdCorpus(a.corpus)
        c.verify()
        print(f"{a.corpus}: {len(c.shards)} shards, every sha256 and offset checked")
    else:
        from dflash2.train.taps import build_taps

        out = build_taps(IdCorpus(a.corpus), a.target, list(a.taps), a.cache, a.shards, a.dtype, a.threads)
        print(f"taps of {a.corpus} in {out} (a corpus for dflash2-train --corpus)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
