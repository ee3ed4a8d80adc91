"""Training straight from an id corpus: the taps computed in the loop, the corpus read as a stream.

Why: the repository keeps the corpus as ids (`idcorpus`), and every session may land on a fresh machine. A
taps cache of the whole corpus costs one teacher-forced pass over every position before the first step
(~7.6 hours of one core for 3.7M answer tokens), and most of it would not be trained on in one session. So
the trainer computes the taps of just the sequences it draws, with the target's layers up to the last tap
(bf16 casts once: 1.5x fp32 on AVX-512 BF16, taps within ~0.7% of fp32's, under the int4 target's own
deviation), and reads the corpus in a fixed order whose position (`cursor`) is part of the training state:
a run resumed on another machine continues with the next unseen sequences, and shards the corpus gains
between sessions extend the order without reordering what came before.

Held out: every conversation whose index is `holdout_mod - 1` modulo `holdout_mod` (all of its turns), so
the held-out set is the same in every session however far the corpus has grown, and no held-out
conversation's earlier turns are trained on.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from dflash2.errors import Dflash2Error
from dflash2.train.idcorpus import IdCorpus
from dflash2.train.pool import with_anchors

HOLDOUT_MOD = 50  # 2% of the conversations


class TapsModel:
    """The target's layers 0..max(tap_ids) (transformers' own model: the independent reference), in fp32 or
    cast once to bf16; `taps(ids)` -> the tapped layers' outputs at every position but the last, fp16."""

    def __init__(self, target_dir: str | Path, tap_ids: list[int], dtype: str = "bf16"):
        from dflash2.train.generate import as_generation_dtype, load_hf_target

        model, _, tc = load_hf_target(Path(target_dir))
        if max(tap_ids) >= tc.num_layers:
            raise Dflash2Error(f"taps {tap_ids}: expected layer ids below the target's {tc.num_layers}")
        self.tap_ids, self.dtype = list(tap_ids), dtype
        base = model.model
        base.layers = base.layers[: max(tap_ids) + 1]  # the layers after the last tap and the head never run
        self.base = as_generation_dtype(base, dtype)
        self._out: dict[int, torch.Tensor] = {}
        self.seconds, self.tokens = 0.0, 0  # spent computing taps (the trainer's log prints the rate)
        for k in set(tap_ids):  # a hook keeps each tapped layer's raw output (HF's last hidden state is normed)
            self.base.layers[k].register_forward_hook(self._keeper(k))

    def _keeper(self, k: int):
        def hook(_module, _args, output):
            self._out[k] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.inference_mode()
    def taps(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T+1] -> taps [T, n*H] fp16 (the token at T is a label only, it never goes through the target)."""
        t0 = time.perf_counter()
        self._out.clear()
        self.base(ids[None, :-1].long(), use_cache=False)
        out = torch.cat([self._out[k][0] for k in self.tap_ids], -1).half()
        self.seconds, self.tokens = self.seconds + time.perf_counter() - t0, self.tokens + len(ids) - 1
        return out


class LiveRecord(Mapping):
    """A corpus record ('ids' [T+1] long, 'prompt_len', 'taps' [T, n*H] fp16) whose taps are computed when
    read; `keep` holds them once computed (held-out records are evaluated many times)."""

    def __init__(self, ids: np.ndarray, prompt_len: int, model: TapsModel, keep: bool = False):
        self._ids, self._prompt_len, self._model, self._keep = ids, prompt_len, model, keep
        self._taps: torch.Tensor | None = None

    def __getitem__(self, key: str):
        if key == "ids":
            return torch.from_numpy(self._ids.astype(np.int64))
        if key == "prompt_len":
            return self._prompt_len
        if key == "taps":
            if self._taps is not None:
                return self._taps
            t = self._model.taps(self["ids"])
            if self._keep:
                self._taps = t
            return t
        raise KeyError(key)

    def __iter__(self):
        return iter(("ids", "taps", "prompt_len"))

    def __len__(self) -> int:
        return 3

    @property
    def answer_tokens(self) -> int:
        return len(self._ids) - self._prompt_len


class IdStream:
    """The id corpus as the trainer's batches: training rows in a fixed order (shard by shard, each shard's
    rows shuffled by (seed, epoch, shard)), `seqs_per_step` consecutive ones per step; the held-out rows apart."""

    def __init__(self, corpus: IdCorpus, model: TapsModel, seed: int = 0, holdout_mod: int = HOLDOUT_MOD,
                 max_shards: int | None = None, log=print):
        self.corpus, self.model, self.seed, self.holdout_mod = corpus, model, seed, holdout_mod
        self.cursor = 0  # rows of the order consumed so far, over all epochs
        self._train: list[list[tuple[np.ndarray, int]]] = []  # per shard: (ids, prompt_len) of its training rows
        self.eval_rows: list[tuple[np.ndarray, int]] = []
        n = len(corpus.shards) if max_shards is None else min(max_shards, len(corpus.shards))
        if n == 0:
            raise Dflash2Error(f"{corpus.folder}: the id corpus has no shards yet (dflash2-corpus grow)")
        for i in range(n):
            sh = corpus.shard(i)  # verified against its sha256
            rows = []
            for j in range(len(sh)):
                p, a = sh.row(j)
                row = (np.concatenate([p, a]), len(p))
                (self.eval_rows if int(sh.source[j, 0]) % holdout_mod == holdout_mod - 1 else rows).append(row)
            self._train.append(rows)
        self.rows_per_epoch = sum(len(r) for r in self._train)
        if self.rows_per_epoch == 0:
            raise Dflash2Error(f"{corpus.folder}: no training rows in its first {n} shards")
        self.shards = n
        log(f"id corpus {corpus.folder}: {n} shards, {self.rows_per_epoch:,} training rows "
            f"({sum(len(r[0]) - r[1] for s in self._train for r in s):,} answer tokens), "
            f"{len(self.eval_rows):,} held out (conversations = {holdout_mod - 1} mod {holdout_mod})")

    def vocab(self) -> torch.Tensor:
        """Every token id in the training rows (the trainer's softmax shortlist holds them all)."""
        return torch.from_numpy(np.unique(np.concatenate([r[0] for s in self._train for r in s])).astype(np.int64))

    def _order(self, epoch: int) -> list[tuple[int, int]]:
        out = []
        for i, rows in enumerate(self._train):
            idx = list(range(len(rows)))
            random.Random(f"{self.seed}/{epoch}/{i}").shuffle(idx)
            out += [(i, j) for j in idx]
        return out

    def take(self, n: int) -> list[LiveRecord]:
        """The next n training records of the order (the next epoch's order after the last row)."""
        out, cache = [], {}
        for k in range(self.cursor, self.cursor + n):
            epoch, pos = divmod(k, self.rows_per_epoch)
            if epoch not in cache:
                cache[epoch] = self._order(epoch)
            i, j = cache[epoch][pos]
            ids, pl = self._train[i][j]
            out.append(LiveRecord(ids, pl, self.model))
        self.cursor += n
        return out

    def draw(self, c, rng: random.Random):
        """The trainer's global batch: the next `seqs_per_step` rows, anchors from the trainer's generator."""
        return with_anchors(self.take(c.seqs_per_step), c, rng)

    def timing(self) -> str:
        m = self.model
        return f"  taps {m.tokens / m.seconds:,.0f} tok/s ({m.dtype})" if m.seconds else ""

    def held_out(self, n: int) -> list[LiveRecord]:
        """The first n held-out records (in corpus order: the same ones every session), taps kept once made."""
        return [LiveRecord(ids, pl, self.model, keep=True) for ids, pl in self.eval_rows[:n]]

    def answers(self) -> list[list[int]]:
        """The training rows' answers (what a draft vocabulary is counted over)."""
        return [r[0][r[1]:].tolist() for s in self._train for r in s]

    def state(self) -> dict:
        return {"cursor": self.cursor, "rows_per_epoch": self.rows_per_epoch, "shards": self.shards,
                "seed": self.seed, "holdout_mod": self.holdout_mod, "corpus": self.corpus.folder.resolve().name,
                "weights_sha256": self.corpus.meta["target"]["weights_sha256"]}

    def restore(self, saved: dict, where: str) -> None:
        """Continue after what a saved state consumed. The order of the shards it saw is unchanged by the corpus
        growing since, but not by another seed, hold-out rule or corpus."""
        for key in ("seed", "holdout_mod", "weights_sha256"):
            if saved.get(key) != self.state()[key]:
                raise Dflash2Error(f"{where}: stream.{key} expected {self.state()[key]!r} (this run), found "
                                   f"{saved.get(key)!r}: it was trained on another corpus order; train into "
                                   "another --out")
        if int(saved.get("shards", 0)) > self.shards:
            raise Dflash2Error(f"{where}: stream.shards expected at most {self.shards} (the corpus now), found "
                               f"{saved.get('shards')}: the corpus lost shards since")
        self.cursor = int(saved["cursor"])


def held_out_with_taps(target: str | Path, corpus: str | Path, taps: list[int], rows: int,
                       log=print) -> list[LiveRecord]:
    """The first `rows` held-out records of an id corpus, their taps (bf16, as training makes them) computed now with
    progress logged and kept: what the offline comparisons of several drafters read
    (scripts/experiments/eval_drafters.py, scripts/experiments/confidence_signals.py)."""
    recs = IdStream(IdCorpus(corpus), TapsModel(target, list(taps), "bf16")).held_out(rows)
    t0 = time.perf_counter()
    for i, r in enumerate(recs):
        r["taps"]  # noqa: B018 (computed once, kept)
        if (i + 1) % 32 == 0 or i + 1 == len(recs):
            log(f"[taps {i + 1}/{len(recs)}] {time.perf_counter() - t0:.0f} s")
    return recs
