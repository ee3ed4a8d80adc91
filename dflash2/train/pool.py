"""What a training step draws: sequences with anchor positions inside their answers.

Two kinds of source behind one interface (`vocab`, `draw`, `state` / `restore`, `timing`): `RecordPool`, a
taps corpus drawn at random (in memory or memory-mapped), and `IdStream` (train/live.py), an id corpus read
in a fixed order whose taps are computed when drawn. Every rank draws the same batch (same generator, same
calls) and takes its share of it.
"""

from __future__ import annotations

import random

import torch


def anchor_range(rec: dict) -> tuple[int, int]:
    """The first and last anchor a record's answer allows (inclusive; hi < lo: none): as at inference, the
    anchor slot holds a target-generated token, and at least one generated label follows it."""
    return rec["prompt_len"], len(rec["ids"]) - 2


def sample_anchors(rec: dict, n: int, rng: random.Random) -> list[int]:
    """`n` distinct anchors drawn from anchor_range; the block sees context rows < a and its labels are the
    following generated tokens."""
    lo, hi = anchor_range(rec)
    if hi < lo:
        return []
    return sorted(rng.sample(range(lo, hi + 1), min(n, hi - lo + 1)))


def _draw(records, c, rng: random.Random) -> list[tuple[dict, list[int]]]:
    """The global batch: the same sequences and anchors on every rank (same generator, same calls)."""
    return with_anchors(rng.sample(records, min(c.seqs_per_step, len(records))), c, rng)


def with_anchors(recs, c, rng: random.Random) -> list[tuple[dict, list[int]]]:
    out = []
    for rec in recs:
        anchors = sample_anchors(rec, c.anchors_per_seq, rng)
        if anchors:
            out.append((rec, anchors))
    return out


class RecordPool:
    """Records drawn at random every step (a taps corpus, in memory or memory-mapped): the trainer's batches.
    `IdStream` (train/live.py) is the other kind: an id corpus read in order, its taps computed when drawn."""

    def __init__(self, records):
        self.records = records

    def vocab(self) -> torch.Tensor:  # every token the target produced
        return torch.unique(torch.cat([r["ids"] for r in self.records]))

    def draw(self, c, rng: random.Random):
        return _draw(self.records, c, rng)

    def state(self) -> dict | None:
        return None

    def restore(self, saved: dict | None, where: str) -> None:
        pass

    def timing(self) -> str:
        return ""
