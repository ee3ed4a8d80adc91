"""Draft vocabulary: the token ids the drafter may propose (FR-Spec / EAGLE-3's reduced draft head).

The drafter's LM head is the target's: on SmolLM2 (V = 49,152) its [S, V] GEMM is ~3 of the
~7.5 ms a CPU draft costs. A drafter only earns acceptance on tokens the target actually emits,
so ranking ids by how often the target emits them and keeping the top N shrinks that GEMM to
[S, N] without losing drafts (measured in docs/smollm2.md). Verification is untouched: the target
still argmaxes the full vocabulary, so output stays lossless whatever the subset.

File: `draft_vocab.json` next to the drafter's config (JSON, not safetensors: the checkpoint
loader treats every *.safetensors there as a weight shard), strictly ascending ids, so the
lowest-index tie rule of top-K still means the lowest token id. No torch here: counting takes
plain int sequences.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable

from dflash2.errors import CheckpointError, Dflash2Error
from dflash2.folders import write_atomic

FILE = "draft_vocab.json"
FORMAT = "dflash2-draft-vocab"
VERSION = 1


def path_in(drafter_dir: str | Path) -> Path:
    return Path(drafter_dir) / FILE


def is_ours(path: Path) -> bool:
    """Whether `path` is a draft vocabulary dflash2 wrote (its format field), the only file --force replaces."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT


def min_size(c) -> int:
    """A DrafterConfig's top-K needs at least K ids (1 for DFlash v1's top-1)."""
    return c.selector_top_k if c.version == 2 else 1


def read(drafter_dir: str | Path, vocab_size: int, top_k: int) -> list[int] | None:
    """The ids of `drafter_dir/draft_vocab.json`, checked against the vocabulary; None without a file."""
    path = path_in(drafter_dir)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(path, "file", "a JSON draft vocabulary", "unreadable JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointError(path, "format", repr(FORMAT), repr(found))
    if doc.get("version") != VERSION:
        raise CheckpointError(path, "version", str(VERSION), repr(doc.get("version")))
    if doc.get("vocab_size") != vocab_size:
        raise CheckpointError(path, "vocab_size", f"{vocab_size} (the target's)", repr(doc.get("vocab_size")))
    ids = doc.get("ids")
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise CheckpointError(path, "ids", "a list of integer token ids", type(ids).__name__ if not
                              isinstance(ids, list) else "non-integer entries")
    check_ids(ids, vocab_size, top_k, str(path))
    return ids


def check_ids(ids: list[int], vocab_size: int, top_k: int, where: str) -> None:
    if len(ids) < max(top_k, 1):
        raise CheckpointError(where, "ids", f"at least top_k = {top_k} ids", f"{len(ids)}")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise CheckpointError(where, "ids", f"ids in [0, {vocab_size})", f"{len(bad)} outside, e.g. {bad[:3]}")
    disorder = [k for k in range(1, len(ids)) if ids[k] <= ids[k - 1]]
    if disorder:
        k = disorder[0]
        raise CheckpointError(where, "ids", "strictly ascending ids (sorted, no duplicates)",
                              f"{ids[k - 1]} then {ids[k]} at index {k}")


def from_sequences(sequences: Iterable[Iterable[int]], size: int, vocab_size: int,
                   always: Iterable[int] = ()) -> list[int]:
    """The `size` most frequent ids of `sequences` (ties: lower id first), plus `always` (e.g. EOS),
    returned sorted. Ids that never occur are left out, so the result may be shorter than `size`."""
    if size < 1:
        raise Dflash2Error(f"draft vocabulary size: expected >= 1, found {size}")
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    outside = [t for t in counts if not 0 <= t < vocab_size]
    if outside:
        raise Dflash2Error(f"draft vocabulary: token ids expected in [0, {vocab_size}), found {sorted(outside)[:3]}")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    return sorted(set(ranked) | {int(t) for t in always})


def read_with_size(drafter_dir: str | Path, vocab_size: int, top_k: int) -> tuple[list[int], int | None]:
    """The ids of an existing draft_vocab.json and the size it was asked for (None where it records none)."""
    ids = read(drafter_dir, vocab_size, top_k)
    if ids is None:
        raise CheckpointError(path_in(drafter_dir), "file", "a draft vocabulary", "nothing there")
    asked = json.loads(path_in(drafter_dir).read_text()).get("requested_size")
    return ids, asked if type(asked) is int else None


def coverage(sequences: Iterable[Iterable[int]], ids: list[int]) -> float:
    """Share of the tokens of `sequences` that are among `ids`."""
    keep, hit, total = set(ids), 0, 0
    for seq in sequences:
        for t in seq:
            hit, total = hit + (int(t) in keep), total + 1
    return hit / max(total, 1)


def document(ids: list[int], vocab_size: int, source: str, requested_size: int | None = None) -> str:
    """The file's text. `requested_size`: the N of "the N most frequent ids" (the file may hold fewer, plus EOS ids)."""
    check_ids(ids, vocab_size, 1, "draft vocabulary")
    doc = {"format": FORMAT, "version": VERSION, "vocab_size": vocab_size, "size": len(ids), "source": source,
           "ids": ids}
    if requested_size is not None:
        doc["requested_size"] = requested_size
    return json.dumps(doc, separators=(",", ":"))


def write(drafter_dir: str | Path, ids: list[int], vocab_size: int, source: str,
          requested_size: int | None = None) -> Path:
    path = path_in(drafter_dir)
    write_atomic(path, document(ids, vocab_size, source, requested_size))
    return path
