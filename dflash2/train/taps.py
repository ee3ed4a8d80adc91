"""Taps on demand: one teacher-forced pass of the target over an id corpus, into a local cache.

The repository keeps ids only (`idcorpus`); the trainer needs the target's hidden states at every
position. A forward pass over prompt + answer gives them all at once (no generation), so the cache is a
plain `train/corpus.py` corpus (memory-mapped fp16 shards) the trainer already reads. Each cached shard
records the sha256 of the id shard it came from: a cache shard whose source changed, or that is missing,
is rebuilt; the others are reused across runs.
"""

from __future__ import annotations

import time
from pathlib import Path

from dflash2.errors import Dflash2Error
from dflash2.train.corpus import SHARD_GLOB, read_meta, save_shard, shard_path, write_meta
from dflash2.train.idcorpus import IdCorpus

DEFAULT_CACHE = Path("~/.cache/dflash2/taps")
TOKENS_PER_BATCH = 8192  # bounds the hidden states kept per forward (all layers, fp32): ~0.6 GB at H = 576


def cache_folder(corpus: IdCorpus, tap_ids: list[int], dtype: str, root: Path | None) -> Path:
    root = (root or DEFAULT_CACHE).expanduser()
    w = corpus.meta["target"]["weights_sha256"][:12]
    return root / f"{corpus.folder.resolve().name}-{w}-taps{'_'.join(map(str, tap_ids))}-{dtype}"


def teacher_forced_taps(model, seqs: list[list[int]], tap_ids: list[int], pad: int) -> list:
    """Taps [len(s) - 1, n*H] fp16 of each sequence: the hidden states after the tapped layers at every
    position whose token goes through the target (all but the last), right-padded in one batch."""
    import torch

    B, L = len(seqs), max(len(s) for s in seqs) - 1
    ids = torch.full((B, L), pad, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s) - 1] = torch.tensor(s[:-1])
        mask[i, : len(s) - 1] = 1
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    taps = torch.cat([out.hidden_states[k + 1] for k in tap_ids], -1).half()  # [B, L, n*H]
    return [taps[i, : len(s) - 1].clone() for i, s in enumerate(seqs)]


def taps_ready(corpus: IdCorpus, tap_ids: list[int], dtype: str = "fp32", cache_root: Path | None = None) -> bool:
    """Whether the cache already holds every shard's taps, from the shard's current bytes (nothing to build)."""
    out = cache_folder(corpus, tap_ids, dtype, cache_root)
    try:
        meta = read_meta(out) or {}
    except Dflash2Error:
        return False
    sources = meta.get("sources") or {}
    return bool(meta.get("complete")) and all(
        sources.get(shard_path(out, i).name) == e["sha256"] and shard_path(out, i).is_file()
        for i, e in enumerate(corpus.shards))


def check_answering_target(corpus: IdCorpus, target_dir: Path) -> None:
    """Taps must come from the target whose answers the corpus holds (its weights' sha256 is recorded)."""
    from dflash2.train.grow import target_identity

    want = corpus.meta["target"]["weights_sha256"]
    found = target_identity(Path(target_dir))["weights_sha256"]
    if found != want:
        raise Dflash2Error(f"{target_dir}: weights sha256 expected {want} (the target that answered "
                           f"{corpus.folder}), found {found}: taps must come from the target that made the answers")


def build_taps(corpus: IdCorpus, target_dir: Path, tap_ids: list[int], cache_root: Path | None = None,
               max_shards: int | None = None, dtype: str = "fp32", threads: int | None = None, log=print) -> Path:
    """The cache folder holding the taps of the corpus's first `max_shards` shards (all by default)."""
    import torch

    from dflash2.train.generate import as_generation_dtype, load_hf_target

    if threads:
        torch.set_num_threads(threads)
    check_answering_target(corpus, target_dir)
    from dflash2.config import load_target_config

    layers = load_target_config(target_dir).num_layers
    if not tap_ids or any(not 0 <= t < layers for t in tap_ids):  # before the cache folder exists
        raise Dflash2Error(f"--taps {','.join(map(str, tap_ids))}: expected layer ids in 0..{layers - 1} (the "
                           f"target's {layers} layers, {Path(target_dir) / 'config.json'})")
    out = cache_folder(corpus, tap_ids, dtype, cache_root)
    out.mkdir(parents=True, exist_ok=True)
    meta = read_meta(out) or {}
    sources = dict(meta.get("sources", {}))
    entries = corpus.shards[: max_shards or len(corpus.shards)]
    todo = [i for i, e in enumerate(entries) if sources.get(shard_path(out, i).name) != e["sha256"]
            or not shard_path(out, i).is_file()]
    base = {"target": str(target_dir), "tap_ids": list(tap_ids), "prompts": [], "max_new_tokens": None,
            "dtype": dtype, "generation": f"teacher-forced taps of {corpus.folder}", "sources": sources}
    for p in out.glob(SHARD_GLOB):  # a shard beyond the requested ones, or of a changed source, is not used
        if p.name not in {shard_path(out, i).name for i in range(len(entries))}:
            p.unlink()
    if not todo:
        write_meta(out, base | {"complete": True})
        return out
    log(f"taps: {len(todo)} of {len(entries)} shards to build into {out} (layers {list(tap_ids)}, {dtype})")
    model, tok, tc = load_hf_target(Path(target_dir))
    model = as_generation_dtype(model, dtype)
    t0, tokens = time.perf_counter(), 0
    for n, i in enumerate(todo):
        shard = corpus.shard(i)
        seqs = []
        for j in range(len(shard)):
            p, a = shard.row(j)
            seqs.append((p.tolist() + a.tolist(), len(p)))
        order = sorted(range(len(seqs)), key=lambda j: len(seqs[j][0]))
        taps = [None] * len(seqs)
        k = 0
        while k < len(order):  # batches of similar length, bounded in tokens
            L = len(seqs[order[k]][0])
            m = k + 1
            while m < len(order) and (m - k + 1) * len(seqs[order[m]][0]) <= max(TOKENS_PER_BATCH, L):
                m += 1
            part = order[k:m]
            # pad 0: right padding under the mask never reaches a real position of a causal model
            for j, t in zip(part, teacher_forced_taps(model, [seqs[j][0] for j in part], tap_ids, 0)):
                taps[j] = t
            k = m
        records = [{"ids": s, "taps": t, "prompt_len": pl} for (s, pl), t in zip(seqs, taps)]
        save_shard(shard_path(out, i), records)
        sources[shard_path(out, i).name] = entries[i]["sha256"]
        write_meta(out, base | {"complete": False, "sources": sources})
        tokens += sum(len(s) for s, _ in seqs)
        rate = tokens / (time.perf_counter() - t0)
        log(f"taps: shard {n + 1}/{len(todo)} ({shard.name}) {rate:.0f} tok/s, "
            f"ETA {(len(todo) - n - 1) * (time.perf_counter() - t0) / (n + 1) / 60:.1f} min")
    write_meta(out, base | {"complete": True, "sources": sources})
    return out
