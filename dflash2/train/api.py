"""dflash2-train as a Python call: `run_training(TrainOptions(target=..., out=...))` checks the options, finds or
makes the corpus (generated, an id corpus's taps rebuilt into the cache, or read live), holds out the evaluation
records, fixes the draft vocabulary and trains (dflash2.train.trainer.train), as the CLI does; the CLI parses
flags into TrainOptions and calls this. Progress lines go to stdout / stderr as the CLI prints them; a refusal is
a Dflash2Error naming the flag (field) and what was expected and found.

    from dflash2.train.api import TrainOptions, run_training
    result = run_training(TrainOptions(target=Path("target"), out=Path("drafter"), steps=200))
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

from dflash2.errors import Dflash2Error
from dflash2.train.options import (GENERATION_FLAGS, TrainOptions, check_options, generation_flags_match,
                                   generation_flags_unused)

__all__ = ["GENERATION_FLAGS", "TrainOptions", "check_options", "run_training"]


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_training(a: TrainOptions) -> dict | None:
    """Train as dflash2-train does (`_run_training`), holding the lock on --out: a second dflash2-train on the same
    OUT is refused instead of both writing it (torchrun's ranks share one lock: rank 0 holds it)."""
    check_options(a)
    from contextlib import nullcontext

    from dflash2.folders import check_train_folders, output_lock

    check_train_folders(a.target, a.out, a.corpus or [a.out.parent / "corpus"])  # refusals before the lock file

    from dflash2.disk import DiskFullError

    with output_lock(a.out) if _rank() == 0 else nullcontext():
        try:
            return _run_training(a)
        except DiskFullError as e:  # the writers that know what is left said so; otherwise nothing half-written
            e.after = e.after or "free some space and rerun the same command"
            raise


def _run_training(a: TrainOptions) -> dict | None:
    """Train as dflash2-train does. Returns what `train` returns (`history`: the held-out evaluations, ...) on
    the process that reports (rank 0 under torchrun), None where nothing was trained here (corpus_only, other
    ranks). Every check of `check_options` runs first, before torch is imported."""
    check_options(a)
    import torch

    from dflash2 import draft_vocab, families
    from dflash2.config import distinct_target_layer_ids, load_target_config, read_config
    from dflash2.errors import CheckpointError
    from dflash2.folders import check_filled_in_place, check_train_folders
    from dflash2.train.data import corpus_complete, corpus_prompts, generate_corpus, load_corpus
    from dflash2.train.trainer import TrainConfig, train

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise Dflash2Error(f"--device {a.device}: expected a CUDA device, found none (torch "
                           f"{torch.__version__}{', a CPU build' if torch.version.cuda is None else ''})")
    check_train_folders(a.target, a.out, a.corpus or [a.out.parent / "corpus"])  # before anything is read
    for c in a.corpus or [a.out.parent / "corpus"]:  # a folder of shards without its corpus.json is an input
        check_filled_in_place(c, "--corpus", "corpus.json", "a corpus")
    path, raw = read_config(a.target)
    archs = raw.get("architectures")
    fam = families.by_arch(archs[0]) if isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) \
        else None
    if fam is not None and not (fam.exportable and fam.trainable):  # a known family that does not train (yet)
        trainable = sorted(x for f in families.FAMILIES if f.exportable and f.trainable for x in f.archs)
        raise CheckpointError(path, "architectures", f"one of {trainable}", repr(archs[0]),
                              fam.not_exportable if not fam.exportable else fam.not_trainable)
    tc = load_target_config(a.target)  # every other refusal (an unknown architecture, a bad field) as the export's
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
        generation_flags_unused(a, "--partial-corpus trains on the shards written so far and generates none")
    if any(is_id_corpus(c) for c in corpora):  # ids from the repository: their taps from the local cache
        generation_flags_unused(a, "an id corpus's answers are made by dflash2-corpus grow")
        from dflash2.train.idcorpus import IdCorpus
        from dflash2.train.taps import taps_ready

        if _world() > 1:  # every rank would build the same cache at once
            for c in corpora:
                if is_id_corpus(c) and not taps_ready(IdCorpus(c), list(taps), cache_root=a.taps_cache):
                    raise Dflash2Error(f"{c}: its taps are not in the cache yet; under torchrun build them first "
                                       f"in one process: dflash2-corpus taps {c} --target {a.target} --taps "
                                       f"{','.join(map(str, taps))}")

        corpora = [build_taps(IdCorpus(c), a.target, list(taps), a.taps_cache, threads=a.threads)
                   if is_id_corpus(c) else c for c in corpora]
    if a.repair_corpus:
        _repair(a, [c for c, given in zip(corpora, a.corpus or corpora) if not is_id_corpus(given)])
    if not corpus_complete(corpora[0]) and not a.partial_corpus and _world() > 1:
        raise Dflash2Error(f"{corpora[0]}: expected a complete corpus under torchrun; generate it first in one "
                           "process (the same command with --corpus-only, without torchrun)")
    if corpus_complete(corpora[0]):
        generation_flags_match(a, corpora[0])
    if not corpus_complete(corpora[0]) and not a.partial_corpus:
        from dflash2.train.data import vocab_words

        words = vocab_words(a.target / "tokenizer.json", a.vocab_words) if a.vocab_words else None
        generate_corpus(a.target, corpus_prompts(a.prompts, a.seed, words), corpora[0], list(taps),
                        a.max_new_tokens,
                        batch_size=a.gen_batch, shard_size=a.shard_size, dtype=a.gen_dtype,
                        max_prompt_tokens=a.max_prompt_tokens, device=a.device)
    if a.corpus_only:
        print(f"wrote {corpora[0]}")
        return None
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
    if _rank() != 0:
        return None  # under torchrun rank 0 alone writes and reports
    if a.draft_vocab and fixed is None:
        _write_draft_vocab(a, draft_vocab.from_sequences(answers(), a.draft_vocab, tc.vocab_size, tc.eos_token_ids),
                           tc, source, r["step"])
    return r


def _write_draft_vocab(a: TrainOptions, ids: list[int], tc, source: str, step: int) -> None:
    """draft_vocab.json beside the trained drafter (written atomically); a full disk says the drafter is saved."""
    from dflash2 import draft_vocab
    from dflash2.disk import writing

    with writing(draft_vocab.path_in(a.out), "the draft vocabulary", after=f"the drafter of step {step} is saved "
                 f"whole ({a.out}): free some space and rerun the same command to write it"):
        print(f"wrote {draft_vocab.write(a.out, ids, tc.vocab_size, source, a.draft_vocab)} ({len(ids)} ids)")


def _fingerprint(folder: Path) -> str:
    """The model a folder holds, whatever its path: config.json's bytes and each safetensors file's name and
    sha256 (hashed in full: a repair is rare, and a regeneration with other weights would mix two models)."""
    import hashlib

    from dflash2.inputs import check_regular_file
    from dflash2.manifest.sealing import sha256

    h = hashlib.sha256(check_regular_file(folder / "config.json").read_bytes())
    for w in sorted(folder.glob("*.safetensors")):
        h.update(f"{w.name}:{sha256(check_regular_file(w))}\n".encode())
    return h.hexdigest()


def same_target(recorded: str, given: str | Path) -> bool:
    """Whether the corpus's recorded target and --target are one model: the same path (links followed), the same
    folder (another mount, a hard link), or a folder with the same config and weights (a copy): the same target
    named by another path was refused as 'another model'."""
    import os

    r, g = Path(recorded), Path(given)
    try:
        if r.resolve() == g.resolve() or (r.is_dir() and os.path.samefile(r, g)):
            return True
        return r.is_dir() and g.is_dir() and _fingerprint(r) == _fingerprint(g)
    except (OSError, RuntimeError, Dflash2Error):
        return False


def _repair(a: TrainOptions, corpora: list[Path]) -> None:
    """--repair-corpus: regenerate the damaged shards of each generated corpus given, with the settings it records
    and the model it records (refused: another --target, torchrun, an id corpus, nothing damaged)."""
    from dflash2.train.corpus import damage, read_meta, repair
    from dflash2.train.data import generate_corpus

    if _world() > 1:
        raise Dflash2Error("--repair-corpus: run it in one process (without torchrun): every rank would regenerate "
                           "the same shards at once")
    if not corpora:
        raise Dflash2Error("--repair-corpus: no generated corpus among --corpus (an id corpus's taps cache is rebuilt "
                           "by deleting it)")
    for c in corpora:
        meta = read_meta(c)
        if meta is None or not meta.get("complete") or not damage(c, meta):
            continue  # nothing to repair here (an unfinished corpus resumes by itself)
        if not same_target(str(meta.get("target")), a.target):
            raise Dflash2Error(f"--repair-corpus: {c} holds the answers of {meta.get('target')}, --target is {a.target}: "
                               "regenerating its shards with another model would mix two models' answers")
        meta, redo = repair(c)
        print(f"repairing {c}: regenerating shard(s) {redo} with its recorded settings", file=sys.stderr)
        generate_corpus(a.target, meta["prompts"], c, meta["tap_ids"], meta["max_new_tokens"], batch_size=a.gen_batch,
                        shard_size=meta["shard_size"], dtype=meta["dtype"], max_prompt_tokens=10**9,
                        device=a.device)  # its prompts were kept once already


def _fixed_draft_vocab(a: TrainOptions, tc, answers, source: str) -> tuple[list[int] | None, dict[str, str]]:
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
    if _rank() != 0:  # rank 0 writes the file; the others count the same ids
        return draft_vocab.from_sequences(answers(), a.draft_vocab, tc.vocab_size, tc.eos_token_ids), {}
    seqs = answers()
    ids = draft_vocab.from_sequences(seqs, a.draft_vocab, tc.vocab_size, tc.eos_token_ids)
    draft_vocab.check_ids(ids, tc.vocab_size, a.top_k, f"--draft-vocab {a.draft_vocab} over {source}")
    print(f"loss over the draft vocabulary: {len(ids)} ids ({draft_vocab.coverage(seqs, ids):.2%} of the training "
          f"answers' tokens; the others are not trained on), into {draft_vocab.path_in(a.out)} once the run's checks "
          "pass", flush=True)
    return ids, {draft_vocab.path_in(a.out).name: draft_vocab.document(ids, tc.vocab_size, source, a.draft_vocab)}


def _train_live(a: TrainOptions, corpus: Path, cfg, tc, taps) -> dict | None:
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
    if _rank() != 0:
        return None
    if a.draft_vocab and fixed is None:
        _write_draft_vocab(a, draft_vocab.from_sequences(stream.answers(), a.draft_vocab, tc.vocab_size,
                                                         tc.eos_token_ids), tc, source, r["step"])
    return r
