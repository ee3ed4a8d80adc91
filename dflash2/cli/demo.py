"""dflash2-demo: the main job end to end on the built-in default model.

1. prepare SmolLM2-135M-Instruct (offline wheel -> cached safetensors, once)
2. export it with the shipped DFlash2 drafter (ONNX + manifest, validated; reused while unchanged)
3. chat-generate with speculative decoding on ONNX Runtime: streamed text, then stats, and the
   same prompt target-only in the same process for the speedup and the lossless check
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

from dflash2.cli.args import add_sampling_args
from dflash2.cli.run import DRAFT_LEN_HELP, draft_len_arg
from dflash2.errors import Dflash2Error, require_extra
from dflash2.cli.entry import cli_main

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def default_drafter() -> Path:
    return Path(str(resources.files("dflash2.data").joinpath("drafters/smollm2-135m-dflash2")))


# the drafter's weights in a quantized demo export: ONNX Runtime's DynamicQuantizeMatMul (per-column int8), the
# fastest drafter measured at its 8 rows, same acceptance as int4 (docs/quantization.md, "The drafter's own
# quantization"); the target stays the row-invariant int4 that keeps the output lossless
DRAFTER_QUANT = "int8-dynamic"
# what the demo exported OUT from: hidden, because an export folder holds only the files its manifest lists
# (dflash2-run refuses any other entry: a dropped manifest entry must not let a file be read unchecked)
STAMP = ".demo.json"


def ensure_export(drafter: Path, target: Path, out: Path, quiet: bool, quantize: str = "none") -> None:
    """Export unless OUT already holds an export of exactly these checkpoints (and quantization)."""
    from dflash2 import manifest as mf
    from dflash2.ops import contract as C

    files = ("model.safetensors", "config.json", "draft_vocab.json")
    stamp = {"drafter": {f: mf.sha256(drafter / f) for f in files if (drafter / f).is_file()}, "target": str(target),
             "format_version": mf.FORMAT_VERSION, "contract_version": C.CONTRACT_VERSION}  # older: redone
    if quantize != "none":  # target and drafter, both fused-op graphs built from templates (auto: gqa)
        stamp["quantize"], stamp["layout"] = quantize, "gqa target + fused drafter"
        stamp["drafter_quantize"] = DRAFTER_QUANT
    if (out / STAMP).is_file() and json.loads((out / STAMP).read_text()) == stamp:
        return
    from dflash2.export.api import export
    from dflash2.export.quantize import OrtQuant

    from dflash2.folders import OutputError, written_by_dflash2

    # the demo re-exports over its own folder without asking; anything else at --out is the user's
    if out.is_symlink() or out.exists() and (not out.is_dir() or any(out.iterdir()) and not written_by_dflash2(out)):
        raise OutputError(f"{out}: dflash2-demo writes its export here and replaces only a folder dflash2 wrote (one "
                          f"with manifest.json); this is something else, so it was left as it is; choose another "
                          f"--out")
    print(f"exporting {drafter.name} + {target.name} -> {out}", file=sys.stderr)
    export(drafter, target, out, force=True, quiet=quiet,
           quantize=None if quantize == "none" else OrtQuant(quantize, drafter_method=DRAFTER_QUANT))
    (out / STAMP).write_text(json.dumps(stamp))


@cli_main("dflash2-demo", "nothing half-written was left (a finished export stays for the next run)",
          errors=(Dflash2Error, ValueError))
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-demo", "smollm2", 'torch', 'onnx', 'transformers', 'gguf')
    p = argparse.ArgumentParser(prog="dflash2-demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text prompt ('-': read it from stdin)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("out/smollm2-135m-dflash2"), help="export folder")
    p.add_argument("--drafter", type=Path, default=None, help="default: the drafter shipped in the package")
    p.add_argument("--draft-len", type=draft_len_arg, default="auto", metavar="auto|K", help=DRAFT_LEN_HELP)
    p.add_argument("--quantize", choices=["int4", "int8", "none"], default="int4",
                   help="weight-only target for ONNX Runtime, its fused-op graph, the drafter fp32 (default int4: "
                        "the fastest here, docs/quantization.md; 'none' exports fp32)")
    p.add_argument("--quiet", action="store_true")
    add_sampling_args(p)
    a = p.parse_args(argv)
    from dflash2.cli.args import read_prompt, sampling_of
    from dflash2.cli.run import stats_table
    from dflash2.models import smollm2
    from dflash2.runtime.api import Runtime

    prompt = read_prompt(a.prompt)  # before the model is prepared: a bad prompt costs nothing
    if a.max_new_tokens < 1:
        raise Dflash2Error(f"--max-new-tokens: expected >= 1, found {a.max_new_tokens}")
    target = smollm2.prepare()
    ensure_export(a.drafter or default_drafter(), target, a.out, a.quiet, a.quantize)
    rt = Runtime(a.out)
    ids = rt.prompt_ids(text=prompt, chat=True)
    sampling = sampling_of(rt, a)
    for spec_on in (True, False):  # warm-up: first runs of each graph shape allocate, keep them untimed
        rt.generate(ids, 8, speculative=spec_on, draft_len=a.draft_len, sampling=sampling)
    print(f"\n>>> {a.prompt}\n")
    spec = rt.generate(ids, a.max_new_tokens, on_text=lambda t: print(t, end="", flush=True),
                       draft_len=a.draft_len, sampling=sampling)
    # the speedup from spec, target-only, target-only, spec (ABBA): the machine's drift over the four runs and
    # whatever favours the first or second of a pair cancel (one run each, in one order, moved the quiet
    # int4 default's ratio by 3-9% with two drafted rounds in 108)
    base = rt.generate(ids, a.max_new_tokens, speculative=False, sampling=sampling)
    base2 = rt.generate(ids, a.max_new_tokens, speculative=False, sampling=sampling)
    spec2 = rt.generate(ids, a.max_new_tokens, draft_len=a.draft_len, sampling=sampling)
    s = spec.stats.to_dict()
    print("\n\n" + stats_table(s, rt.backend_label, rt.auto_schedule.to_dict() if a.draft_len == "auto" else None))
    print(speed_lines(spec, base, base2, spec2))
    if not sampling.greedy:  # same distribution, different draws: tests/test_sampling.py proves it
        print(f"{'sampling':<24}{sampling.describe():>12}\n{'lossless':<24}{'in distribution':>12}")
        return 0
    same = spec.ids == base.ids == base2.ids == spec2.ids
    print(f"{'identical to target-only':<24}{str(same):>12}")
    return 0 if same else 1


def speed_lines(spec, base, base2, spec2) -> str:
    """Target-only tokens/s, then the speedup with its spread: each ABBA pair (a speculative run and the target-only
    run beside it) is one sample, and a change the two pairs disagree about by more than it amounts to prints as
    `no measurable difference` (dflash2/bench/ratio.py: a busy machine showed 1.28x for two modes that did the same
    work)."""
    from dflash2.bench.ratio import describe_ratio

    spec_tps, base_tps = _pooled_tps(spec, spec2), _pooled_tps(base, base2)
    pairs = [_pooled_tps(sp) / _pooled_tps(b) if _pooled_tps(b) else 0.0 for sp, b in ((spec, base), (spec2, base2))]
    # tokens per target pass, over both speculative runs: no round costs less than one pass (bench/ratio.py)
    passes = sum(g.stats.rounds for g in (spec, spec2))
    ceiling = sum(g.stats.acceptance_length * g.stats.rounds for g in (spec, spec2)) / passes if passes else None
    ratio = describe_ratio(pairs, spec_tps / base_tps if base_tps else 0.0, over="ABBA pairs", ceiling=ceiling)
    return (f"{'target-only tokens/s':<24}{base_tps:>12.1f}\n"
            f"{'speedup':<24}{ratio}   ({spec_tps:.1f} / {base_tps:.1f} tokens/s)")


def _pooled_tps(*gens) -> float:
    """Tokens after the first over the time after prefill, summed over runs (Stats.tokens_per_second's rule)."""
    seconds = sum(g.stats.decode_seconds for g in gens)
    return sum(max(g.stats.new_tokens - 1, 0) for g in gens) / seconds if seconds > 0 else 0.0


if __name__ == "__main__":
    raise SystemExit(main())
