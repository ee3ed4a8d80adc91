"""dflash2-train: train a DFlash2 drafter + selector for a target on the CPU (small scale).

Data: the target's own greedy answers to a prompt set (generated once into --corpus, resumable),
with the taps of every position. The output folder is a DFlash2 checkpoint for dflash2-export.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

from dflash2.errors import Dflash2Error, require_extra
from dflash2.interrupts import interruptible


def _repair(a, corpora: list[Path]) -> None:
    """--repair-corpus: regenerate the damaged shards of each generated corpus given, with the settings it records
    and the model it records (refused: another --target, torchrun, an id corpus, nothing damaged)."""
    from dflash2.train.corpus import damage, read_meta, repair
    from dflash2.train.data import generate_corpus

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise Dflash2Error("--repair-corpus: run it in one process (without torchrun): every rank would regenerate "
                           "the same shards at once")
    if not corpora:
        raise Dflash2Error("--repair-corpus: no generated corpus among --corpus (an id corpus's taps cache is rebuilt "
                           "by deleting it)")
    for c in corpora:
        meta = read_meta(c)
        if meta is None or not meta.get("complete") or not damage(c, meta):
            continue  # nothing to repair here (an unfinished corpus resumes by itself)
        if Path(str(meta.get("target"))).resolve() != Path(a.target).resolve():
            raise Dflash2Error(f"--repair-corpus: {c} holds the answers of {meta.get('target')}, --target is {a.target}: "
                               "regenerating its shards with another model would mix two models' answers")
        meta, redo = repair(c)
        print(f"repairing {c}: regenerating shard(s) {redo} with its recorded settings", file=sys.stderr)
        generate_corpus(a.target, meta["prompts"], c, meta["tap_ids"], meta["max_new_tokens"], batch_size=a.gen_batch,
                        shard_size=meta["shard_size"], dtype=meta["dtype"], max_prompt_tokens=10**9,
                        device=a.device)  # its prompts were kept once already


def _taps_arg(v: str) -> tuple[int, ...]:
    try:
        taps = tuple(int(x) for x in v.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: expected layer ids separated by commas (e.g. 1,14,27)") from None
    if any(t < 0 for t in taps):
        raise argparse.ArgumentTypeError(f"{v!r}: expected layer ids >= 0")
    return taps


# flags that only shape a corpus being generated: given where none is, they would be ignored in silence
GENERATION_FLAGS = ("--prompts", "--vocab-words", "--max-new-tokens", "--max-prompt-tokens", "--gen-batch",
                    "--shard-size", "--gen-dtype")


def _given(p: argparse.ArgumentParser, argv: list[str] | None, flags) -> set[str]:
    """Which of `flags` the command line gave (abbreviated, `--flag=v` or not): a second parse of the same
    words with every default suppressed holds exactly those."""
    for action in p._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    seen = vars(p.parse_args(argv))
    return {f for f in flags for action in p._actions if f in action.option_strings and action.dest in seen}


def _generation_flags_unused(a: argparse.Namespace, why: str) -> None:
    if getattr(a, "given", None):
        raise Dflash2Error(f"{', '.join(sorted(a.given))}: expected only when a corpus is generated; {why}, "
                           "so they would have no effect (drop them)")


def _generation_flags_match(a: argparse.Namespace, corpus: Path) -> None:
    """Over a complete corpus the same command may be rerun (it resumes training): generation flags are
    accepted where they equal what the corpus records, refused where they ask for something else. Not compared:
    --gen-batch (it only sets how fast missing shards are made) and --prompts / --vocab-words /
    --max-prompt-tokens (the corpus records its prompts, not the spec that chose them)."""
    from dflash2.train.corpus import read_meta

    meta = read_meta(corpus) or {}
    asked = {"--max-new-tokens": ("max_new_tokens", a.max_new_tokens), "--shard-size": ("shard_size", a.shard_size),
             "--gen-dtype": ("dtype", a.gen_dtype)}
    wrong = [f"{flag} {v} (it was made with {meta[key]})" for flag, (key, v) in asked.items()
             if flag in getattr(a, "given", ()) and key in meta and meta[key] != v]
    if wrong:
        raise Dflash2Error(f"{corpus}: a complete corpus, so {'; '.join(wrong)} would have no effect (drop the "
                           "flag, or generate into another --corpus folder)")


def check_args(a: argparse.Namespace) -> None:
    """Every range, before anything is read or written (a refused run leaves no config.json behind)."""
    import math

    at_least = {"--steps": (a.steps, 1), "--seqs-per-step": (a.seqs_per_step, 1), "--anchors": (a.anchors, 1),
                "--grad-accum": (a.grad_accum, 1), "--layers": (a.layers, 1), "--block-size": (a.block_size, 2),
                "--top-k": (a.top_k, 1), "--rank": (a.rank, 1), "--max-new-tokens": (a.max_new_tokens, 1),
                "--max-prompt-tokens": (a.max_prompt_tokens, 1), "--gen-batch": (a.gen_batch, 1),
                "--shard-size": (a.shard_size, 1), "--eval-every": (a.eval_every, 1), "--save-every": (a.save_every, 1),
                "--vocab-words": (a.vocab_words, 0), "--mask-token-id": (a.mask_token_id, 0),
                "--threads": (a.threads, 1), "--draft-vocab": (a.draft_vocab, 1),
                "--train-records": (a.train_records, 1)}
    for flag, (v, low) in at_least.items():
        if v is not None and v < low:
            raise Dflash2Error(f"{flag}: expected >= {low}, found {v}")
    if not (math.isfinite(a.lr) and a.lr > 0):
        raise Dflash2Error(f"--lr: expected a finite number > 0, found {a.lr}")
    if not (math.isfinite(a.kd_weight) and a.kd_weight >= 0):
        raise Dflash2Error(f"--kd-weight: expected a finite number >= 0, found {a.kd_weight}")
    if not (math.isfinite(a.loss_decay) and a.loss_decay > 0):
        raise Dflash2Error(f"--loss-decay: expected a finite number > 0, found {a.loss_decay}")
    if not 0 < a.holdout < 1:
        raise Dflash2Error(f"--holdout: expected a share in (0, 1), found {a.holdout}")
    if a.minutes is not None and not (math.isfinite(a.minutes) and a.minutes > 0):
        raise Dflash2Error(f"--minutes: expected a finite number of minutes > 0, found {a.minutes}")
    if a.live_taps:
        clash = [f for f, on in (("--train-records", a.train_records), ("--partial-corpus", a.partial_corpus),
                                 ("--repair-corpus", a.repair_corpus), ("--corpus-only", a.corpus_only),
                                 ("--taps-cache", a.taps_cache)) if on]
        if clash:
            raise Dflash2Error(f"--live-taps: expected without {', '.join(clash)} (it trains on an id corpus as it "
                               "stands, its taps made in the loop), found them")
        if not a.corpus or len(a.corpus) != 1:
            raise Dflash2Error(f"--live-taps: expected one --corpus (an id corpus), found "
                               f"{len(a.corpus or [])}")
        _generation_flags_unused(a, "--live-taps trains on an id corpus as it stands (dflash2-corpus grow makes "
                                    "its answers)")
    if a.loss_vocab == "draft" and not a.draft_vocab:
        raise Dflash2Error("--loss-vocab draft: expected --draft-vocab N (the vocabulary it trains over), found none")
    if a.max_shard_mb is not None and not (math.isfinite(a.max_shard_mb) and a.max_shard_mb > 0):
        raise Dflash2Error(f"--max-shard-mb: expected a size in MB > 0, found {a.max_shard_mb}")
    if a.device != "cpu" and not (a.device == "cuda" or a.device.startswith("cuda:") and a.device[5:].isdigit()):
        raise Dflash2Error(f"--device: expected cpu, cuda or cuda:N, found {a.device!r}")
    if a.init_weights is not None and not (a.init_weights / "config.json").is_file():
        raise Dflash2Error(f"--init-weights {a.init_weights}: expected a drafter folder with config.json, found "
                           f"{'a folder without one' if a.init_weights.is_dir() else 'nothing there'}")
    _check_torchrun_env(os.environ)


def _check_torchrun_env(env) -> None:
    """WORLD_SIZE / RANK as torchrun sets them: integers, RANK < WORLD_SIZE, and the rendezvous address given (a
    missing one would make torch wait for the other ranks without a word)."""
    vals = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        if name in env:
            try:
                vals[name] = int(env[name])
            except ValueError:
                raise Dflash2Error(f"environment {name}: expected an integer, found {env[name]!r}") from None
    world = vals.get("WORLD_SIZE", 1)
    if world < 1:
        raise Dflash2Error(f"environment WORLD_SIZE: expected >= 1, found {world}")
    if not 0 <= vals.get("RANK", 0) < world:
        raise Dflash2Error(f"environment RANK: expected 0..{world - 1} (WORLD_SIZE {world}), found {vals['RANK']}")
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if world > 1 and not env.get(n)]
    if missing:
        raise Dflash2Error(f"environment {', '.join(missing)}: expected with WORLD_SIZE {world} (start the ranks with "
                           "torchrun --nproc-per-node N -m dflash2.cli.train ...), found none")
    port = env.get("MASTER_PORT")
    if world > 1 and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise Dflash2Error(f"environment MASTER_PORT: expected a port 1..65535, found {port!r}")
    if world > 1:
        from dflash2.train.distributed import rendezvous_timeout

        rendezvous_timeout()  # a bad DFLASH2_RENDEZVOUS_TIMEOUT named before anything runs


@interruptible("dflash2-train", "rerun the same command to resume from the last saved step")
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-train", "train", 'torch', 'transformers')
    p = argparse.ArgumentParser(prog="dflash2-train", description=__doc__)
    p.add_argument("--target", required=True, type=Path, help="target folder (Llama / Qwen3, safetensors)")
    p.add_argument("--out", required=True, type=Path, help="drafter folder to write (resumes if it has train_state/)")
    p.add_argument("--corpus", type=Path, nargs="+",
                   help="corpus folder(s): an id corpus (dflash2-corpus; its taps are rebuilt into --taps-cache) or a "
                        "corpus with taps (the first is generated when empty; default OUT/../corpus)")
    p.add_argument("--prompts", default="sharegpt",
                   help="prompts to generate the corpus from: 'sharegpt[:N]' (first human turns of ShareGPT "
                        "conversations 0..14,999; 15,000+ are held out), 'templated[:N]' (dflash2.train.data), "
                        "or a file (JSON list / one per line)")
    p.add_argument("--vocab-words", type=int, default=0, metavar="N",
                   help="templated prompts also get one for each of N words of the target's vocabulary (the shipped "
                        "recipe: templated:10000 --vocab-words 5000 --seed 1)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length when generating the corpus")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (chat template included)")
    p.add_argument("--gen-batch", type=int, default=32, help="prompts per generation batch")
    p.add_argument("--gen-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="corpus generation precision (bf16: the target cast once, ~1.7x fp32 on AVX-512 BF16 CPUs, native on GPUs; "
                        "answers may differ from fp32 greedy after a few tokens)")
    p.add_argument("--shard-size", type=int, default=128, help="prompts per corpus shard (the resume unit)")
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
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seqs-per-step", type=int, default=6)
    p.add_argument("--anchors", type=int, default=16, help="random anchors (blocks) per sequence")
    p.add_argument("--mask-token-id", type=int, default=0)
    p.add_argument("--init-from", choices=["first", "last"],
                   help="target layers copied into the drafter at initialisation (default last; first measured worse)")
    p.add_argument("--fixed-multiplier", action="store_true",
                   help="keep output_multiplier at 1 instead of learning it from the selector loss")
    p.add_argument("--kd-weight", type=float, default=0.0,
                   help="add this weight x KL(target || drafter) on draft rows: soft labels from the target's "
                        "layers after the last tap (default 0: hard labels only)")
    p.add_argument("--loss-decay", type=float, default=4.0, metavar="GAMMA",
                   help="draft position k's cross-entropy weighs exp(-(k-1)/GAMMA) (default %(default)s: ~4 for block "
                        "8, ~7 for 16; smaller puts the first drafts first, which is all a CPU target verifies)")
    p.add_argument("--train-records", type=int, metavar="N",
                   help="train on only the first N (shuffled) training records: data-scaling studies")
    p.add_argument("--holdout", type=float, default=0.1, help="share of the (last) corpus kept for evaluation")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="also write draft_vocab.json: the N token ids the target emits most in the training "
                        "answers (the exported drafter's LM head then covers only those)")
    p.add_argument("--loss-vocab", choices=("shortlist", "draft"), default="shortlist",
                   help="the draft loss's softmax: shortlist = every token of the corpus + 2,048 random negatives "
                        "(default); draft = the --draft-vocab ids the exported head will cover, fixed when the run "
                        "starts (a step ~0.82x as long at the same acceptance, docs/training.md; labels outside it are "
                        "dropped, as the exported drafter cannot draft them)")
    p.add_argument("--anchors-at", choices=("uniform", "after-miss"), default="uniform",
                   help="where a sequence's --anchors training blocks sit: uniform over its answer (default), or "
                        "after-miss: one step of the speculative loop from uniform anchors with the current drafter "
                        "(the token after its first wrong draft), where the loop drafts from (docs/training.md)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (under torchrun: each rank takes its LOCAL_RANK GPU)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="training compute: bf16 autocast (fp32 master weights, fp32 selector math) or fp32")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per step; the global batch stays --seqs-per-step sequences")
    p.add_argument("--init-weights", type=Path, metavar="DRAFTER",
                   help="start from this drafter's weights (same shapes, or fewer layers: the new ones start as the "
                        "identity, copies of its last layer with zeroed output projections; or a lower --rank: the new "
                        "successor columns start at 0), e.g. to continue on new data")
    p.add_argument("--max-shard-mb", type=float, help="write the drafter as safetensors shards of at most this size")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    p.add_argument("--save-every", type=int, default=100, help="steps between resumable saves (train_state/)")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.given = _given(p, argv, GENERATION_FLAGS)
    try:
        check_args(a)
    except Dflash2Error as e:
        print(f"dflash2-train: error: {e}", file=sys.stderr)
        return 2
    import torch

    from dflash2 import draft_vocab
    from dflash2.config import distinct_target_layer_ids, load_target_config
    from dflash2.folders import check_train_folders
    from dflash2.train.data import corpus_complete, corpus_prompts, generate_corpus, load_corpus
    from dflash2.train.trainer import TrainConfig, train

    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            raise Dflash2Error(f"--device {a.device}: expected a CUDA device, found none (torch "
                               f"{torch.__version__}{', a CPU build' if torch.version.cuda is None else ''})")
        check_train_folders(a.target, a.out, a.corpus or [a.out.parent / "corpus"])  # before anything is read
        tc = load_target_config(a.target)
        for flag, v in (("--mask-token-id", a.mask_token_id), ("--draft-vocab", a.draft_vocab)):
            if v is not None and v >= tc.vocab_size + (flag == "--draft-vocab"):
                raise Dflash2Error(f"{flag}: expected {'<' if flag == '--mask-token-id' else '<='} the target's "
                                   f"vocab_size {tc.vocab_size} ({a.target / 'config.json'}), found {v}")
        if a.taps and max(a.taps) >= tc.num_layers:
            raise Dflash2Error(f"--taps: expected layer ids < the target's {tc.num_layers} layers, found {max(a.taps)}")
        taps = a.taps or distinct_target_layer_ids(tc.num_layers, 3)
        corpora = a.corpus or [a.out.parent / "corpus"]
        from dflash2.train.idcorpus import is_id_corpus
        from dflash2.train.taps import build_taps

        cfg = TrainConfig(layers=a.layers, block_size=a.block_size, top_k=a.top_k, rank=a.rank, steps=a.steps,
                          lr=a.lr, seqs_per_step=a.seqs_per_step, anchors_per_seq=a.anchors,
                          mask_token_id=a.mask_token_id, tap_ids=tuple(taps), seed=a.seed,
                          init_from=a.init_from or TrainConfig.init_from,
                          learn_multiplier=not a.fixed_multiplier, kd_weight=a.kd_weight, gamma=a.loss_decay,
                          eval_every=a.eval_every, save_every=a.save_every, loss_vocab=a.loss_vocab,
                          anchors_at=a.anchors_at)
        if a.live_taps:
            return _train_live(a, corpora[0], cfg, tc, taps)

        if a.partial_corpus:
            _generation_flags_unused(a, "--partial-corpus trains on the shards written so far and generates none")
        if any(is_id_corpus(c) for c in corpora):  # ids from the repository: their taps from the local cache
            _generation_flags_unused(a, "an id corpus's answers are made by dflash2-corpus grow")
            from dflash2.train.idcorpus import IdCorpus
            from dflash2.train.taps import taps_ready

            if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank would build the same cache at once
                for c in corpora:
                    if is_id_corpus(c) and not taps_ready(IdCorpus(c), list(taps), cache_root=a.taps_cache):
                        raise Dflash2Error(f"{c}: its taps are not in the cache yet; under torchrun build them first "
                                           f"in one process: dflash2-corpus taps {c} --target {a.target} --taps "
                                           f"{','.join(map(str, taps))}")

            corpora = [build_taps(IdCorpus(c), a.target, list(taps), a.taps_cache, threads=a.threads)
                       if is_id_corpus(c) else c for c in corpora]
        if a.repair_corpus:
            _repair(a, [c for c, given in zip(corpora, a.corpus or corpora) if not is_id_corpus(given)])
        if not corpus_complete(corpora[0]) and not a.partial_corpus and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise Dflash2Error(f"{corpora[0]}: expected a complete corpus under torchrun; generate it first in one "
                               "process (the same command with --corpus-only, without torchrun)")
        if corpus_complete(corpora[0]):
            _generation_flags_match(a, corpora[0])
        if not corpus_complete(corpora[0]) and not a.partial_corpus:
            from dflash2.train.data import vocab_words

            words = vocab_words(a.target / "tokenizer.json", a.vocab_words) if a.vocab_words else None
            generate_corpus(a.target, corpus_prompts(a.prompts, a.seed, words), corpora[0], list(taps),
                            a.max_new_tokens,
                            batch_size=a.gen_batch, shard_size=a.shard_size, dtype=a.gen_dtype,
                            max_prompt_tokens=a.max_prompt_tokens, device=a.device)
        if a.corpus_only:
            print(f"wrote {corpora[0]}")
            return 0
        # shards are ordered by prompt length: shuffle; hold out from the LAST corpus only, so a run
        # warm-started on earlier corpora is evaluated on records it never saw
        taps_from = "--taps" if a.taps else f"the default taps of the target's {tc.num_layers} layers; --taps chooses"
        loaded = [list(load_corpus(corpus, list(taps), partial=a.partial_corpus, taps_from=taps_from))
                  for corpus in corpora]
        if a.partial_corpus:
            print(f"partial corpus: {[len(x) for x in loaded]} records so far in {[str(c) for c in corpora]}")
        for recs in loaded:
            random.Random(a.seed).shuffle(recs)
        n_eval = max(1, int(len(loaded[-1]) * a.holdout))
        records = [r for recs in loaded for r in recs]  # the held-out records are the last n_eval
        train_records = records[:-n_eval]
        if a.train_records:  # one shuffle across corpora, then a prefix: smaller subsets nest in larger ones
            random.Random(a.seed).shuffle(train_records)
            train_records = train_records[: a.train_records]
        if not train_records:  # before train() writes anything into OUT
            raise Dflash2Error(f"{corpora[-1]}: {len(records)} record(s), all held out for evaluation (--holdout "
                               f"{a.holdout}); expected at least 2 (generate a larger corpus into another --corpus folder)")
        print(f"training on {len(train_records)} records, {n_eval} held out", flush=True)
        answers = lambda: [rec["ids"][rec["prompt_len"]:].tolist() for rec in train_records]  # noqa: E731
        source = f"dflash2-train corpus {[str(c) for c in corpora]}"
        fixed, files = _fixed_draft_vocab(a, tc, answers, source)
        r = train(a.target, a.out, train_records, cfg, eval_records=records[-n_eval:], device=a.device,
                  dtype=a.dtype, grad_accum=a.grad_accum, init_weights=a.init_weights, max_shard_mb=a.max_shard_mb,
                  minutes=a.minutes, draft_ids=fixed, out_files=files)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0  # under torchrun rank 0 alone writes and reports
        if a.draft_vocab and fixed is None:
            ids = draft_vocab.from_sequences(answers(), a.draft_vocab, tc.vocab_size, tc.eos_token_ids)
            print(f"wrote {draft_vocab.write(a.out, ids, tc.vocab_size, source, a.draft_vocab)} ({len(ids)} ids)")
    except Dflash2Error as e:
        print(f"dflash2-train: error: {e}", file=sys.stderr)
        return 2
    _summary(a, r)
    return 0


def _fixed_draft_vocab(a, tc, answers, source: str) -> tuple[list[int] | None, dict[str, str]]:
    """--loss-vocab draft: the draft vocabulary the loss runs over, fixed when the run starts (written into OUT
    before the first step, read back when a run resumes: a corpus that grew since would otherwise move it under
    the weights trained on it), and the file to write when it is new (`train` writes it once its checks passed).
    None for the shortlist loss (draft_vocab.json is then written at the end)."""
    from dflash2 import draft_vocab
    from dflash2.train import state

    if a.loss_vocab != "draft":
        return None, {}
    resuming = (a.out / state.PROGRESS).is_file() or state.path(a.out).is_file()
    if resuming and draft_vocab.path_in(a.out).is_file():
        ids, asked = draft_vocab.read_with_size(a.out, tc.vocab_size, a.top_k)
        if asked != a.draft_vocab:
            raise Dflash2Error(f"{draft_vocab.path_in(a.out)}: requested_size expected {a.draft_vocab} (--draft-vocab "
                               f"of this run), found {asked}: the run being resumed trained over that vocabulary")
        print(f"loss over the draft vocabulary fixed when this run started: {len(ids)} ids "
              f"({draft_vocab.path_in(a.out)})", flush=True)
        return ids, {}
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 writes the file; the others count the same ids
        return draft_vocab.from_sequences(answers(), a.draft_vocab, tc.vocab_size, tc.eos_token_ids), {}
    seqs = answers()
    ids = draft_vocab.from_sequences(seqs, a.draft_vocab, tc.vocab_size, tc.eos_token_ids)
    draft_vocab.check_ids(ids, tc.vocab_size, a.top_k, f"--draft-vocab {a.draft_vocab} over {source}")
    print(f"loss over the draft vocabulary: {len(ids)} ids ({draft_vocab.coverage(seqs, ids):.2%} of the training "
          f"answers' tokens; the others are not trained on), into {draft_vocab.path_in(a.out)} once the run's checks "
          "pass", flush=True)
    return ids, {draft_vocab.path_in(a.out).name: draft_vocab.document(ids, tc.vocab_size, source, a.draft_vocab)}


def _summary(a, r: dict) -> None:
    last = r["history"][-1] if r["history"] else {}
    print(f"wrote {a.out}; held-out tau: " + ", ".join(f"{k} {last[k]:.2f}" for k in ("selector", "top1", "oracle")
                                                       if k in last))


def _train_live(a, corpus: Path, cfg, tc, taps) -> int:
    """--live-taps: the id corpus as a stream, its taps computed by the target in the loop."""
    from dflash2 import draft_vocab
    from dflash2.train.idcorpus import IdCorpus, is_id_corpus
    from dflash2.train.live import IdStream, TapsModel
    from dflash2.train.taps import check_answering_target
    from dflash2.train.trainer import train

    if not is_id_corpus(corpus):
        raise Dflash2Error(f"--live-taps: --corpus {corpus}: expected an id corpus (dflash2-corpus grow; corpus.json "
                           "kind dflash2-id-corpus), found none there")
    ic = IdCorpus(corpus)
    check_answering_target(ic, a.target)
    stream = IdStream(ic, TapsModel(a.target, list(taps), a.live_taps), seed=a.seed)
    if not stream.eval_rows:
        print(f"note: {corpus} holds no held-out conversation yet (index = {stream.holdout_mod - 1} mod "
              f"{stream.holdout_mod}): training.json gets no held-out curve", file=sys.stderr)
    source = f"dflash2-train id corpus {corpus}"
    fixed, files = _fixed_draft_vocab(a, tc, stream.answers, source)
    r = train(a.target, a.out, stream, cfg, device=a.device, dtype=a.dtype, grad_accum=a.grad_accum,
              init_weights=a.init_weights, max_shard_mb=a.max_shard_mb, minutes=a.minutes, draft_ids=fixed,
              out_files=files)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if a.draft_vocab and fixed is None:
        ids = draft_vocab.from_sequences(stream.answers(), a.draft_vocab, tc.vocab_size, tc.eos_token_ids)
        print(f"wrote {draft_vocab.write(a.out, ids, tc.vocab_size, source, a.draft_vocab)} ({len(ids)} ids)")
    _summary(a, r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
