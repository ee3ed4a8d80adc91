"""dflash2-train: train a DFlash2 drafter + selector for a target on the CPU (small scale).

Data: the target's own greedy answers to a prompt set (generated once into --corpus, resumable),
with the taps of every position. The output folder is a DFlash2 checkpoint for dflash2-export.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from dflash2.cli import cli_main
from dflash2.errors import require_extra
from dflash2.train.options import GENERATION_FLAGS, TrainOptions


def _taps_arg(v: str) -> tuple[int, ...]:
    try:
        taps = tuple(int(x) for x in v.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: expected layer ids separated by commas (e.g. 1,14,27)") from None
    if any(t < 0 for t in taps):
        raise argparse.ArgumentTypeError(f"{v!r}: expected layer ids >= 0")
    return taps


def _given(p: argparse.ArgumentParser, argv: list[str] | None, flags) -> set[str]:
    """Which of `flags` the command line gave (abbreviated, `--flag=v` or not): a second parse of the same
    words with every default suppressed holds exactly those."""
    for action in p._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    seen = vars(p.parse_args(argv))
    return {f for f in flags for action in p._actions if f in action.option_strings and action.dest in seen}


def parser() -> argparse.ArgumentParser:
    """dflash2-train's flags: one per TrainOptions field (dest = field name), its default the field's."""
    p = argparse.ArgumentParser(prog="dflash2-train", description=__doc__)
    p.add_argument("--target", required=True, type=Path, help="target folder (Llama / Qwen3, safetensors)")
    p.add_argument("--out", required=True, type=Path, help="drafter folder to write (resumes if it has train_state/)")
    p.add_argument("--corpus", type=Path, nargs="+",
                   help="corpus folder(s): an id corpus (dflash2-corpus; its taps are rebuilt into --taps-cache) or a "
                        "corpus with taps (the first is generated when empty; default OUT/../corpus)")
    p.add_argument("--prompts",
                   help="prompts to generate the corpus from: 'sharegpt[:N]' (first human turns of ShareGPT "
                        "conversations 0..14,999; 15,000+ are held out), 'templated[:N]' (dflash2.train.data), "
                        "or a file (JSON list / one per line)")
    p.add_argument("--vocab-words", type=int, metavar="N",
                   help="templated prompts also get one for each of N words of the target's vocabulary (the shipped "
                        "recipe: templated:10000 --vocab-words 5000 --seed 1)")
    p.add_argument("--max-new-tokens", type=int, help="answer length when generating the corpus")
    p.add_argument("--max-prompt-tokens", type=int, help="skip longer prompts (chat template included)")
    p.add_argument("--gen-batch", type=int, help="prompts per generation batch")
    p.add_argument("--gen-dtype", choices=("fp32", "bf16"),
                   help="corpus generation precision (bf16: the target cast once, ~1.7x fp32 on AVX-512 BF16 CPUs, native on GPUs; "
                        "answers may differ from fp32 greedy after a few tokens)")
    p.add_argument("--shard-size", type=int, help="prompts per corpus shard (the resume unit)")
    p.add_argument("--corpus-only", action="store_true", help="generate the corpus, then stop")
    p.add_argument("--repair-corpus", action="store_true",
                   help="regenerate the unreadable or missing shards of a damaged --corpus (with the settings it "
                        "records; the intact shards are kept); without it a damaged corpus is refused")
    p.add_argument("--partial-corpus", action="store_true",
                   help="train on the shards a still-unfinished corpus has so far (its generation is not resumed)")
    p.add_argument("--taps-cache", type=Path, metavar="DIR",
                   help="where the taps of an id corpus (dflash2-corpus) are rebuilt (default ~/.cache/dflash2/taps)")
    p.add_argument("--live-taps", choices=("bf16", "fp32"), metavar="DTYPE",
                   help="with an id corpus: compute the taps of the sequences drawn in the training loop (the target's "
                        "layers up to the last tap, bf16 or fp32) instead of caching the whole corpus's first; the "
                        "corpus is read in order and the position is saved, so a resumed run sees new data; held out: "
                        "every conversation = 49 mod 50")
    p.add_argument("--minutes", type=float, metavar="M",
                   help="stop after the step that passes M minutes of training, saved: the same command continues")
    p.add_argument("--taps", type=_taps_arg,
                   help="target layer ids to tap (default: 3 evenly spaced, z-lab's rule)")
    p.add_argument("--layers", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--rank", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seqs-per-step", type=int)
    p.add_argument("--anchors", type=int, help="random anchors (blocks) per sequence")
    p.add_argument("--mask-token-id", type=int)
    p.add_argument("--init-from", choices=["first", "last"],
                   help="target layers copied into the drafter at initialisation (default last; first measured worse)")
    p.add_argument("--fixed-multiplier", action="store_true",
                   help="keep output_multiplier at 1 instead of learning it from the selector loss")
    p.add_argument("--kd-weight", type=float,
                   help="add this weight x KL(target || drafter) on draft rows: soft labels from the target's "
                        "layers after the last tap (default 0: hard labels only)")
    p.add_argument("--loss-decay", type=float, metavar="GAMMA",
                   help="draft position k's cross-entropy weighs exp(-(k-1)/GAMMA) (default %(default)s: ~4 for block "
                        "8, ~7 for 16; smaller puts the first drafts first, which is all a CPU target verifies)")
    p.add_argument("--train-records", type=int, metavar="N",
                   help="train on only the first N (shuffled) training records: data-scaling studies")
    p.add_argument("--holdout", type=float, help="share of the (last) corpus kept for evaluation")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="also write draft_vocab.json: the N token ids the target emits most in the training "
                        "answers (the exported drafter's LM head then covers only those)")
    p.add_argument("--loss-vocab", choices=("shortlist", "draft"),
                   help="the draft loss's softmax: shortlist = every token of the corpus + 2,048 random negatives "
                        "(default); draft = the --draft-vocab ids the exported head will cover, fixed when the run "
                        "starts (a step ~0.82x as long at the same acceptance, docs/training.md; labels outside it are "
                        "dropped, as the exported drafter cannot draft them)")
    p.add_argument("--anchors-at", choices=("uniform", "after-miss"),
                   help="where a sequence's --anchors training blocks sit: uniform over its answer (default), or "
                        "after-miss: one step of the speculative loop from uniform anchors with the current drafter "
                        "(the token after its first wrong draft), where the loop drafts from (docs/training.md)")
    p.add_argument("--device", help="cpu | cuda (under torchrun: each rank takes its LOCAL_RANK GPU)")
    p.add_argument("--dtype", choices=("fp32", "bf16"),
                   help="training compute: bf16 autocast (fp32 master weights, fp32 selector math) or fp32")
    p.add_argument("--grad-accum", type=int,
                   help="micro-batches per step; the global batch stays --seqs-per-step sequences")
    p.add_argument("--init-weights", type=Path, metavar="DRAFTER",
                   help="start from this drafter's weights (same shapes, or fewer layers: the new ones start as the "
                        "identity, copies of its last layer with zeroed output projections; or a lower --rank: the new "
                        "successor columns start at 0), e.g. to continue on new data")
    p.add_argument("--max-shard-mb", type=float, help="write the drafter as safetensors shards of at most this size")
    p.add_argument("--eval-every", type=int, help="steps between held-out evaluations")
    p.add_argument("--save-every", type=int, help="steps between resumable saves (train_state/)")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainOptions) if f.default is not dataclasses.MISSING}
    for action in p._actions:  # on the actions, not p.set_defaults: _given's second parse must see none
        if action.dest in defaults and action.dest != "given":
            action.default = defaults[action.dest]
    return p


def options(argv: list[str] | None) -> TrainOptions:
    """The command line as TrainOptions (argparse's own errors: usage line, status 2)."""
    p = parser()
    a = p.parse_args(argv)
    given = _given(p, argv, GENERATION_FLAGS)
    return TrainOptions(**{f.name: getattr(a, f.name) for f in dataclasses.fields(TrainOptions) if f.name != "given"},
                        given=frozenset(given))


@cli_main("dflash2-train", "rerun the same command to resume from the last saved step")
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-train", "train", 'torch', 'transformers')
    from dflash2.train.api import run_training

    o = options(argv)
    r = run_training(o)
    if r is not None:  # the process that reports trained (not --corpus-only, not another torchrun rank)
        last = r["history"][-1] if r["history"] else {}
        print(f"wrote {o.out}; held-out tau: " + ", ".join(f"{k} {last[k]:.2f}" for k in ("selector", "top1", "oracle")
                                                           if k in last))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
