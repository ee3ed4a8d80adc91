"""What a training run is asked to do (`TrainOptions`, one field per dflash2-train flag, the flag's defaults) and
every range check on it, before anything is read or written (`check_options`). No torch here: a refused run
costs no import. Messages name the dflash2-train flag of a field (`--steps` for `steps`): the CLI's words, and
what docs/training.md documents."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from dflash2.errors import Dflash2Error

# flags that only shape a corpus being generated: given where none is, they would be ignored in silence
GENERATION_FLAGS = ("--prompts", "--vocab-words", "--max-new-tokens", "--max-prompt-tokens", "--gen-batch",
                    "--shard-size", "--gen-dtype")


@dataclass
class TrainOptions:
    """One dflash2-train run (`dflash2-train --help` says what each flag does; field = flag without `--`)."""

    target: Path  # the target checkpoint folder (Llama / Qwen3, safetensors)
    out: Path  # the drafter folder written (resumed when it holds train_state/)
    # corpus: id corpora (dflash2-corpus) and / or corpora with taps (the first generated when empty);
    # None: OUT/../corpus
    corpus: list[Path] | None = None
    # generating a corpus (GENERATION_FLAGS)
    prompts: str = "sharegpt"
    vocab_words: int = 0
    max_new_tokens: int = 128
    max_prompt_tokens: int = 512
    gen_batch: int = 32
    gen_dtype: str = "fp32"
    shard_size: int = 128
    given: frozenset[str] = frozenset()  # the GENERATION_FLAGS the caller set (checked against the corpus)
    # which corpus, and how it is read
    corpus_only: bool = False
    repair_corpus: bool = False
    partial_corpus: bool = False
    taps_cache: Path | None = None
    live_taps: str | None = None  # "bf16" | "fp32": taps computed in the loop from one id corpus
    minutes: float | None = None
    # the drafter and its training
    taps: tuple[int, ...] | None = None  # None: 3 evenly spaced target layers
    layers: int = 1
    block_size: int = 8
    top_k: int = 8
    rank: int = 64
    steps: int = 1000
    lr: float = 5e-4
    seqs_per_step: int = 6
    anchors: int = 16
    mask_token_id: int = 0
    init_from: str | None = None  # "first" | "last" (None: TrainConfig's)
    fixed_multiplier: bool = False
    kd_weight: float = 0.0
    loss_decay: float = 4.0
    train_records: int | None = None
    holdout: float = 0.1
    draft_vocab: int | None = None
    loss_vocab: str = "shortlist"  # | "draft"
    anchors_at: str = "uniform"  # | "after-miss"
    device: str = "cpu"
    dtype: str = "fp32"  # | "bf16"
    grad_accum: int = 1
    init_weights: Path | None = None
    max_shard_mb: float | None = None
    eval_every: int = 100
    save_every: int = 100
    threads: int | None = None
    seed: int = 0

    def __post_init__(self):  # paths given as strings (a Python caller) work as the CLI's Path objects do
        for name in ("target", "out", "taps_cache", "init_weights"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, Path(getattr(self, name)))
        if self.corpus is not None:
            self.corpus = [Path(c) for c in self.corpus]
        self.given = frozenset(self.given)


def check_options(a: TrainOptions) -> None:
    """Every range, before anything is read or written (a refused run leaves no config.json behind)."""
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
    from dflash2.errors import check_threads

    check_threads(a.threads)
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
        generation_flags_unused(a, "--live-taps trains on an id corpus as it stands (dflash2-corpus grow makes "
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
    check_torchrun_env(os.environ)


def check_torchrun_env(env) -> None:
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


def generation_flags_unused(a: TrainOptions, why: str) -> None:
    if a.given:
        raise Dflash2Error(f"{', '.join(sorted(a.given))}: expected only when a corpus is generated; {why}, "
                           "so they would have no effect (drop them)")


def generation_flags_match(a: TrainOptions, corpus: Path) -> None:
    """Over a complete corpus the same command may be rerun (it resumes training): generation flags are
    accepted where they equal what the corpus records, refused where they ask for something else. Not compared:
    --gen-batch (it only sets how fast missing shards are made) and --prompts / --vocab-words /
    --max-prompt-tokens (the corpus records its prompts, not the spec that chose them)."""
    from dflash2.train.corpus import read_meta

    meta = read_meta(corpus) or {}
    asked = {"--max-new-tokens": ("max_new_tokens", a.max_new_tokens), "--shard-size": ("shard_size", a.shard_size),
             "--gen-dtype": ("dtype", a.gen_dtype)}
    wrong = [f"{flag} {v} (it was made with {meta[key]})" for flag, (key, v) in asked.items()
             if flag in a.given and key in meta and meta[key] != v]
    if wrong:
        raise Dflash2Error(f"{corpus}: a complete corpus, so {'; '.join(wrong)} would have no effect (drop the "
                           "flag, or generate into another --corpus folder)")
