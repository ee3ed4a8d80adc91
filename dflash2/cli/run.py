"""dflash2-run: generate with speculative decoding from an export folder (ONNX Runtime) or an
engine folder (TensorRT); text streams as it is accepted, then a stats table."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dflash2.cli import cli_main
from dflash2.cli.args import add_sampling_args, negative_ids_joined, parse_ids, read_prompt, sampling_of, utf8_arg
from dflash2.errors import Dflash2Error


def check_flags(a: argparse.Namespace) -> None:
    """Flags that would have no effect in this combination are errors, not silently ignored."""
    if getattr(a, "check_rows", False):
        used = [f for f, on in (("--chat", a.chat), ("--system", a.system is not None), ("--no-spec", a.no_spec),
                                ("--draft-len", a.draft_len is not None), ("--stop", bool(a.stop)),
                                ("--json", a.json), ("--max-new-tokens", a.max_new_tokens != 128),
                                ("--temperature", a.temperature is not None), ("--top-k", a.top_k is not None),
                                ("--top-p", a.top_p is not None), ("--seed", a.seed is not None)) if on]
        if used:
            raise Dflash2Error(f"--check-rows: generates nothing, so {', '.join(used)} would have no effect; drop "
                               f"{'it' if len(used) == 1 else 'them'} (it always prints one JSON line)")
    if a.system is not None and not a.chat:
        raise Dflash2Error("--system: only used with --chat (it is the chat template's system message); add --chat")
    if a.chat and a.prompt_ids is not None:
        raise Dflash2Error("--chat: applies to a text --prompt; --prompt-ids are used as given")
    if a.system is not None:
        utf8_arg(a.system, "--system")
    for s in a.stop:
        utf8_arg(s, "--stop")
    if any(s == "" for s in a.stop):
        raise Dflash2Error("--stop: expected a non-empty string, found '' (it would stop before the first token)")
    if a.max_new_tokens < 1:
        raise Dflash2Error(f"--max-new-tokens: expected >= 1, found {a.max_new_tokens}")


def draft_len_arg(v: str) -> int | str:
    """--draft-len: 'auto' or a positive integer (range checked against the drafter later)."""
    from dflash2.speculative import parse_draft_len

    try:
        return parse_draft_len(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def draft_lens_arg(v: str) -> tuple[int, ...]:
    """--sweep-draft-len: fixed draft lengths like 1,2,7."""
    from dflash2.speculative import parse_draft_lens

    try:
        return parse_draft_lens(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


DRAFT_LEN_HELP = ("drafts verified per round: 'auto' (default) picks K in 0..block_size-1 each round from the "
                  "drafter's confidence and this machine's measured verify cost (0 = a plain decode step; "
                  "the drafter is skipped while drafting does not pay), or a fixed K in 1..block_size-1")


def k_histogram_text(h: dict) -> str:
    return " ".join(f"{k}:{v}" for k, v in h.items() if v)


def stats_table(stats: dict, backend: str, schedule: dict | None = None) -> str:
    s = stats["seconds"]
    rows = [("backend", backend), ("new tokens", stats["new_tokens"]), ("rounds", stats["rounds"]),
            ("acceptance length", f"{stats['acceptance_length']:.2f}"),
            ("tokens/s (after first)", f"{stats['tokens_per_second']:.1f}"),
            ("prefill s", f"{s['prefill']:.3f}"), ("draft+select s", f"{s['draft']:.3f}"),
            ("verify s", f"{s['verify']:.3f}"), ("decode s (no-spec)", f"{s['decode']:.3f}"),
            ("host s", f"{s['host']:.3f}"), ("total s", f"{s['total']:.3f}")]
    out = "\n".join(f"{k:<24}{v:>12}" for k, v in rows)
    if stats.get("rounds"):
        out += f"\n{'K per round':<24}{k_histogram_text(stats['k_histogram'])}"
    if schedule is not None:
        c = schedule["costs"]
        out += (f"\n{'cost model ms':<24}decode {c['decode_ms']:.1f}, draft {c['draft_ms']:.1f}, verify "
                + "/".join(f"{v:.1f}" for v in c["verify_ms"])
                + (f" (measured by the first {c['calibration_rounds']} rounds, +{c['calibration_seconds']:.3f} s)"
                   if c["calibration_rounds"] else ""))
    return out


# ValueError: what the tokenizer and the sampling settings refuse, answered as refused input too
@cli_main("dflash2-run", errors=(Dflash2Error, ValueError))
def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    p = argparse.ArgumentParser(prog="dflash2-run", description=__doc__)
    p.add_argument("folder", type=Path, help="export folder (dflash2-export) or engine folder (dflash2-build)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="text prompt ('-': read it from stdin)")
    g.add_argument("--prompt-ids", type=parse_ids, help="comma-separated token ids")
    g.add_argument("--check-rows", action="store_true",
                   help="instead of generating: check that this machine's kernels give a k-row verify the bitwise "
                        "logits of k 1-row decode steps (what losslessness rests on; the export checked its own "
                        "machine); exit 1 if not")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-spec", action="store_true", help="target-only autoregressive decoding (baseline)")
    p.add_argument("--draft-len", type=draft_len_arg, metavar="auto|K", help=DRAFT_LEN_HELP)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--backend", choices=["onnxruntime", "tensorrt"], help="override the automatic choice")
    p.add_argument("--json", action="store_true", help="print ids and stats as one JSON object")
    p.add_argument("--verify-files", action="store_true",
                   help="hash every file against the manifest (default: only files changed since their last check)")
    add_sampling_args(p)
    a = p.parse_args(negative_ids_joined(sys.argv[1:] if argv is None else argv))
    from dflash2.quant_manifest import describe, label
    from dflash2.runtime.api import Runtime

    check_flags(a)
    prompt = None if a.prompt is None else read_prompt(a.prompt)
    log = None if a.json else (lambda line: print(f"dflash2-run: {line}", file=sys.stderr))
    rt = Runtime(a.folder, backend=a.backend, log=log, verify="full" if a.verify_files else True)
    if a.check_rows:
        return _check_rows(rt)
    start_s = rt.checked_at - t_start  # the imports, the manifest, the checks, the files: before any session
    if a.draft_len is not None and a.no_spec:
        rt.schedule(a.draft_len)  # a value out of range is named first
        raise Dflash2Error(f"--draft-len {a.draft_len}: no effect with --no-spec (target-only decoding drafts "
                           "nothing); drop one of them")
    a.draft_len = "auto" if a.draft_len is None else a.draft_len
    ids = rt.prompt_ids(text=prompt, ids=a.prompt_ids, chat=a.chat, system=a.system)
    stream = None if a.json or a.prompt is None else (lambda t: print(t, end="", flush=True))
    sampling = sampling_of(rt, a)
    unused = [f for f, v in (("--top-k", a.top_k), ("--top-p", a.top_p), ("--seed", a.seed)) if v is not None]
    if sampling.greedy and unused:
        raise Dflash2Error(f"{', '.join(unused)}: no effect at temperature 0 (greedy decoding"
                           f"{', the model default' if a.temperature is None else ''}); add --temperature T > 0")
    gen = rt.generate(ids, a.max_new_tokens, speculative=not a.no_spec, stop=a.stop, on_text=stream,
                      draft_len=a.draft_len, sampling=sampling)
    stats = gen.stats.to_dict()
    schedule = rt.auto_schedule.to_dict() if a.draft_len == "auto" and not a.no_spec else None
    if a.json:
        out = {"ids": gen.ids, "stop_reason": gen.stop_reason, "backend": rt.backend_name,
               "graph_files": rt.graph_files,  # the flavour each graph runs from (target.q4.onnx: Q4MatMul)
               "speculative": not a.no_spec, "weights": label(rt.manifest), "draft_len": a.draft_len,
               "sampling": sampling.describe(),
               "schedule": schedule, "start_s": round(start_s, 3), **stats,
               "kv": rt.session.kv_report()}  # the bytes a windowed target's buffer bounds (docs/families)
        if (a.folder / "tokenizer.json").is_file():
            out["text"] = rt.text.decode(gen.ids)
        print(json.dumps(out))
        return 0
    if stream is None:
        print(gen.ids)
    print("\n" + stats_table(stats, rt.backend_label, schedule))
    print(describe(rt.manifest))
    return 0


def _check_rows(rt) -> int:
    """--check-rows: one JSON line; exit 0 invariant, 1 not (the failure on stderr), 2 not checkable."""
    from dflash2.runtime.invariance import validation

    v = validation(rt.session, timed=False)
    if v.skipped:
        raise Dflash2Error(f"--check-rows: not checked: {v.skipped}")
    print(json.dumps({"folder": str(rt.folder), "backend": rt.backend_name, "row_invariant": v.ok, **v.steps}))
    for f in v.failures:
        print(f"dflash2-run: {f}", file=sys.stderr)
    return 0 if v.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
