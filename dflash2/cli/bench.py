"""dflash2-bench: autoregressive vs speculative decoding on the same prompts in one process."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash2.cli.args import add_sampling_args, check_output_file, sampling_options
from dflash2.cli.run import draft_len_arg, draft_lens_arg
from dflash2.errors import Dflash2Error, require_extra
from dflash2.folders import write_atomic
from dflash2.cli.entry import cli_main


@cli_main("dflash2-bench", errors=(Dflash2Error, ValueError))
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash2-bench", description=__doc__)
    p.add_argument("folder", type=Path, nargs="?", help="export or engine folder")
    p.add_argument("--prompts", default="default",
                   help="'default' (the shipped set), 'sharegpt:eval:N' (held-out ShareGPT conversations "
                        ">= 15,000), or a file: JSON list or one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--raw", action="store_true", help="prompts as plain text, no chat template")
    p.add_argument("--repeats", type=int, default=1, help="interleaved AR/spec runs per prompt")
    p.add_argument("--policies", type=lambda v: tuple(v.split(",")),
                   help="draft paths whose acceptance is measured at K = S, from selector,top1,oracle, or none "
                        "(default: all the drafter supports)")
    p.add_argument("--draft-len", type=draft_len_arg, default="auto", metavar="auto|K",
                   help="the mode whose speedup is the headline: 'auto' (default) or a fixed K (timed too)")
    p.add_argument("--sweep-draft-len", type=draft_lens_arg, default=(),
                   metavar="K,K,...", help="also time these fixed draft lengths in the same interleaved run")
    p.add_argument("--json", type=Path, help="write the results as JSON here (rewritten after every prompt with "
                                              "\"complete\": false until the run ends)")
    p.add_argument("--plot", type=Path, help="write a PNG of acceptance per draft position")
    add_sampling_args(p, sweep=True)
    p.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                   help="instead of timing: combine bench JSONs of one prompt set split across runs")
    a = p.parse_args(argv)
    if a.combine:
        from dflash2.bench import bench as b

        from dflash2.bench.result import BenchResult

        check_output_file(a.json, "--json", [("--combine", f) for f in a.combine])  # before any is read
        try:
            c = b.combine([BenchResult.from_dict(_read_json(f), f) for f in a.combine])
        except (OSError, ValueError) as e:
            raise Dflash2Error(f"--combine: expected bench JSON files, {e}") from None
        print(b.combined_table(c))
        if a.json:
            write_atomic(a.json, json.dumps(c.to_dict(), indent=2))
        return 0 if c.lossless else 1
    if a.folder is None:
        p.error("the folder is required (unless --combine)")
    from dflash2.bench import bench as b
    from dflash2.bench.ratio import spread
    from dflash2.prompts import parse_spec

    if a.repeats < 1:
        raise Dflash2Error(f"--repeats: expected >= 1, found {a.repeats}")
    if a.plot is not None:  # before the run, not after it
        require_extra("dflash2-bench", "bench", "matplotlib")  # --plot
    for flag, path in (("--json", a.json), ("--plot", a.plot)):
        check_output_file(path, flag, {"FOLDER": a.folder})
    prompts = parse_spec(a.prompts, default_split="eval", log=print)
    temps = a.temperature or [None]  # None: the model's default
    if len(temps) > 1:
        return _temperature_sweep(a, b, prompts, temps)
    r = b.bench(a.folder, prompts, a.max_new_tokens, chat=not a.raw, policies=a.policies, repeats=a.repeats,
                draft_len=a.draft_len, sweep=a.sweep_draft_len,
                log=lambda line: print(line, file=sys.stderr, flush=True),
                partial=(lambda r: write_atomic(a.json, json.dumps(r.to_dict(), indent=2))) if a.json else None,
                sampling=sampling_options(a, temps[0]))
    print(b.table(r))
    if a.json:
        write_atomic(a.json, json.dumps(r.to_dict(), indent=2))
    if a.plot:
        b.plot(r, a.plot)
    print(json.dumps({"speedups": {m: round(w.speedup, 3) for m, w in r.modes.items()},
                      "speedup_ranges": {m: spread(w.speedup_samples) for m, w in r.modes.items() if m != "ar"},
                      "auto_vs_best": round(r.auto_vs_best, 3), "acceptance_length": r.acceptance_length,
                      "lossless": r.lossless, "host_overhead_share": r.host_overhead_share}))
    return 0 if r.lossless is not False else 1


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: expected UTF-8 JSON, found undecodable bytes ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: expected JSON, found a syntax error ({e})") from None


def _temperature_sweep(a, b, prompts, temps: list[float]) -> int:
    """One interleaved bench per temperature (AR vs speculative at the same options), one table."""
    from dflash2.bench.ratio import ratio_cell, spread

    rows = []
    for t in temps:
        print(f"[temperature {t:g}]", file=sys.stderr, flush=True)
        r = b.bench(a.folder, prompts, a.max_new_tokens, chat=not a.raw, policies=("none",), repeats=a.repeats,
                    draft_len=a.draft_len, log=lambda line: print(line, file=sys.stderr, flush=True),
                    sampling=sampling_options(a, t))
        rows.append({"temperature": t, "sampling": r.sampling, "acceptance_length": r.main_mode.acceptance_length,
                     "speedup": r.speedup, "speedup_range": spread(r.main_mode.speedup_samples),
                     "speedup_samples": r.main_mode.speedup_samples,
                     "autoregressive_tokens_per_second": r.autoregressive_tokens_per_second,
                     "speculative_tokens_per_second": r.speculative_tokens_per_second, "lossless": r.lossless})
    print("temperature   tau   AR tok/s  spec tok/s      speedup, range  lossless")
    for w in rows:
        print(f"{w['temperature']:>11g} {w['acceptance_length']:>5.2f} {w['autoregressive_tokens_per_second']:>10.1f} "
              f"{w['speculative_tokens_per_second']:>11.1f} {ratio_cell(w['speedup_samples'], w['speedup']):>19}  "
              f"{'by distribution' if w['lossless'] is None else w['lossless']}")
    if a.json:
        write_atomic(a.json, json.dumps({"temperature_sweep": rows}, indent=2))
    print(json.dumps({"temperature_sweep": rows}))
    return 0 if all(w["lossless"] is not False for w in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
