"""The on-disk training corpus: the target's answers (ids) and its taps, in memory-mapped shards.

A corpus can be far larger than RAM (ShareGPT at scale is tens of GB of taps), so nothing loads it
whole: each shard is one safetensors file of flat tensors

    ids [N] int32, taps [M, n_taps * H] fp16, ids_offsets [R + 1], taps_offsets [R + 1], prompt_len [R]

and a record's taps are read by `safe_open(...).get_slice` (an mmap) only when the trainer touches
them. `corpus.json` is written first (taps, prompts, settings) and marked complete last, so a
generation killed at any point resumes at the first missing shard and a partial corpus is refused. A full disk
is a DiskFullError naming the shard (dflash2.disk): the shards before it stay, the same command resumes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dflash2.errors import Dflash2Error
from dflash2.disk import safetensors_bytes, writing

META = "corpus.json"
FORMAT = 2  # 1: one key per record (loaded whole); 2: flat memory-mapped shards
SHARD_GLOB = "shard-*.safetensors"
AFTER_FULL = "the corpus's files written so far are whole: free some space and rerun the same command to continue"


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.safetensors"


def save_shard(path: Path, records: list[dict]) -> None:
    """Atomic: a shard exists whole or not at all (written to a temp name, then renamed)."""
    ids = [torch.as_tensor(r["ids"], dtype=torch.int32) for r in records]
    taps = [r["taps"].to(torch.float16) for r in records]
    tensors = {
        "ids": torch.cat(ids), "taps": torch.cat(taps).contiguous(),
        "ids_offsets": torch.tensor([0] + [len(x) for x in ids]).cumsum(0).to(torch.int64),
        "taps_offsets": torch.tensor([0] + [len(t) for t in taps]).cumsum(0).to(torch.int64),
        "prompt_len": torch.tensor([r["prompt_len"] for r in records], dtype=torch.int32),
    }
    tmp, metadata = path.with_name(path.name + f".tmp-{os.getpid()}"), {"format": str(FORMAT)}
    with writing(path, "a corpus shard", safetensors_bytes(tensors, metadata), AFTER_FULL):
        try:
            save_file(tensors, str(tmp), metadata=metadata)
            os.replace(tmp, path)
        finally:  # a full disk or a kill mid-write: no half shard beside the whole ones
            tmp.unlink(missing_ok=True)


class Record(Mapping):
    """One sequence: 'ids' [T+1] (long), 'prompt_len', and 'taps' [T, n*H] (fp16), read on access."""

    def __init__(self, shard: "_Shard", j: int):
        self._shard, self._j = shard, j
        a, b = shard.ids_offsets[j], shard.ids_offsets[j + 1]
        self._ids = shard.ids[a:b].long()
        self._prompt_len = int(shard.prompt_len[j])

    def __getitem__(self, key: str):
        if key == "ids":
            return self._ids
        if key == "prompt_len":
            return self._prompt_len
        if key == "taps":
            return self._shard.taps(self._j)
        raise KeyError(key)

    def __iter__(self):
        return iter(("ids", "taps", "prompt_len"))

    def __len__(self) -> int:
        return 3


class _Shard:
    def __init__(self, path: Path):
        self.path = path
        try:
            self._f = safe_open(str(path), framework="pt")
            keys = set(self._f.keys())
            need = {"ids", "taps", "ids_offsets", "taps_offsets", "prompt_len"}
            if not need <= keys:
                raise Dflash2Error(f"{path}: expected corpus tensors {sorted(need)}, found {sorted(keys)} "
                                   "(a corpus from an older dflash2? regenerate it)")
            self.ids = self._f.get_tensor("ids")
            self.ids_offsets = self._f.get_tensor("ids_offsets").tolist()
            self.taps_offsets = self._f.get_tensor("taps_offsets").tolist()
            self.prompt_len = self._f.get_tensor("prompt_len")
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:  # how safetensors reports a bad file
            raise Dflash2Error(f"{path}: not a readable corpus shard ({e})") from None
        self._taps = self._f.get_slice("taps")

    def __len__(self) -> int:
        return len(self.prompt_len)

    def taps(self, j: int) -> torch.Tensor:
        return self._taps[self.taps_offsets[j]: self.taps_offsets[j + 1]]


class Corpus(Sequence):
    """All records of a complete corpus folder, lazily: ids are in memory, taps are mmapped."""

    def __init__(self, folder: str | Path, partial: bool = False):
        """partial: also accept a corpus whose generation has not finished (its shards so far, which are
        whole: each is written atomically); never by default, so a half-made corpus is not trained on by accident."""
        self.folder = Path(folder)
        self.meta = read_meta(self.folder, need_complete=not partial)
        if self.meta is None:
            raise Dflash2Error(f"{self.folder / META}: expected a corpus, found none")
        self.complete = bool(self.meta.get("complete"))
        if self.complete:  # a corpus is an input: a damaged one is refused, never regenerated behind the user's back
            bad = damage(self.folder, self.meta)
            if bad:
                fix = ("--repair-corpus regenerates only those shards (the intact ones are kept)"
                       if generated(self.meta) and all("records in its shards" not in b for b in bad) else
                       "regenerate it into a new folder" if generated(self.meta) else
                       "delete this taps cache folder: it is rebuilt from its id corpus")
                raise Dflash2Error(f"{self.folder}: a damaged corpus: {'; '.join(bad)}. Nothing was changed; {fix}")
        self._shards = [_Shard(p) for p in sorted(self.folder.glob(SHARD_GLOB))]
        self._index = [(s, j) for s in self._shards for j in range(len(s))]

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        s, j = self._index[i]
        return Record(s, j)

    def answer_tokens(self) -> int:
        return sum(len(r["ids"]) - r["prompt_len"] for r in self)


def _index(p: Path) -> int:
    return int(p.name.split("-")[1].split(".")[0])


def shard_size(folder: Path, meta: dict) -> int | None:
    """Prompts per shard: recorded in the metadata (since it is), else the rows of the first readable shard that
    is not the last one (every shard but the last is full); None when neither can be read."""
    size = meta.get("shard_size")
    if isinstance(size, int) and size >= 1:
        return size
    paths = sorted(folder.glob(SHARD_GLOB))
    for p in paths[:-1] or paths:
        try:
            return len(_Shard(p))
        except Dflash2Error:
            continue
    return None


def expected_shards(folder: Path, meta: dict) -> int | None:
    """How many shards a complete corpus has (None: unknown, see shard_size)."""
    size = shard_size(folder, meta)
    return None if size is None else -(-len(meta.get("prompts", [])) // size)


def generated(meta: dict) -> bool:
    """A corpus generated from its prompts (what --repair-corpus can redo), not a taps cache of an id corpus
    (dflash2.train.taps: no prompts, `sources`; rebuilt by its own command when missing)."""
    return bool(meta.get("prompts")) and not meta.get("sources")


def damage(folder: Path, meta: dict) -> list[str]:
    """What is wrong with a complete corpus's shards: unreadable ones; for a generated corpus also missing indices
    and rows that do not add up to its prompts. [] when intact."""
    problems, rows = [], 0
    paths = sorted(folder.glob(SHARD_GLOB))
    for p in paths:
        try:
            rows += len(_Shard(p))
        except Dflash2Error as e:
            problems.append(str(e).replace(str(p), p.name))
    if not generated(meta):
        return problems
    n = expected_shards(folder, meta)
    have = {_index(p) for p in paths}
    missing = sorted(set(range(n)) - have) if n is not None else []
    if missing:
        problems.append(f"shard(s) {', '.join(shard_path(folder, i).name for i in missing)} missing")
    if not problems and rows != len(meta.get("prompts", [])):
        problems.append(f"{rows} records in its shards, expected {len(meta.get('prompts', []))} (one per prompt)")
    return problems


def repair(folder: Path) -> tuple[dict, list[int]]:
    """--repair-corpus: remove the unreadable shards of a damaged corpus and mark it unfinished, so its
    generation resumes at exactly the missing shards. Returns (its metadata, the shard indices to regenerate)."""
    meta = read_meta(folder)
    if meta is None:
        raise Dflash2Error(f"{folder / META}: expected a corpus to repair, found none")
    if not generated(meta):
        raise Dflash2Error(f"{folder}: --repair-corpus: a taps cache of an id corpus is not repaired; delete it and "
                           "it is rebuilt from its id corpus")
    size = shard_size(folder, meta)
    if size is None:
        raise Dflash2Error(f"{folder}: cannot repair: its shard size is not recorded and no full shard is "
                           "readable; regenerate the corpus into a new folder")
    n = -(-len(meta.get("prompts", [])) // size)
    redo = []
    for p in sorted(folder.glob(SHARD_GLOB)):
        try:
            with open(p, "rb"):  # unreadable for another reason (permissions, I/O): stop, delete nothing
                pass
        except OSError as e:
            raise Dflash2Error(f"{p}: cannot be read ({e.strerror}); nothing was repaired") from None
        try:
            _Shard(p)
        except Dflash2Error:  # opened but not a valid shard: the damage itself
            redo.append(_index(p))
    P = len(meta["prompts"])
    wrong = [p.name for p in folder.glob(SHARD_GLOB) if _index(p) not in redo and
             (_index(p) >= n or len(_Shard(p)) != min(size, P - _index(p) * size))]
    if wrong:  # intact shards of another layout: regenerating the missing ones would not make it whole
        raise Dflash2Error(f"{folder}: shard(s) {', '.join(sorted(wrong))} do not hold the rows its {P} prompts in "
                           f"shards of {size} give; nothing was repaired: regenerate it into a new folder")
    for i in redo:
        shard_path(folder, i).unlink()
    have = {_index(p) for p in folder.glob(SHARD_GLOB)}
    redo = sorted(set(redo) | (set(range(n)) - have))
    write_meta(folder, meta | {"complete": False, "shard_size": size})
    return read_meta(folder), redo


def read_meta(folder: Path, need_complete: bool = False) -> dict | None:
    path = folder / META
    if not path.is_file():
        if need_complete:
            raise Dflash2Error(f"{path}: expected a complete corpus, found none")
        return None
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Dflash2Error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise Dflash2Error(f"{path}: expected a JSON object, found {type(meta).__name__}")
    if meta.get("format", 1) != FORMAT:
        raise Dflash2Error(f"{path}: corpus format expected {FORMAT}, found {meta.get('format', 1)} "
                           "(made by another dflash2 version; regenerate it into a new folder)")
    if need_complete and not meta.get("complete"):
        raise Dflash2Error(f"{path}: expected a complete corpus, found a partial one "
                           "(rerun its generation to finish it)")
    return meta


def write_meta(folder: Path, meta: dict) -> None:
    tmp, data = folder / (META + f".tmp-{os.getpid()}"), json.dumps(meta | {"format": FORMAT}, indent=1).encode()
    with writing(folder / META, f"the corpus's {META}", len(data), AFTER_FULL):
        try:
            tmp.write_bytes(data)
            os.replace(tmp, folder / META)
        finally:
            tmp.unlink(missing_ok=True)


def start_or_resume(folder: Path, meta: dict,
                    keys=("tap_ids", "prompts", "max_new_tokens", "dtype", "generation")) -> set[int]:
    """Write the metadata of a new corpus, or check a started one was made the same way; returns
    the indices of the shards already written (resumed by index: only valid for the same settings).
    generation: how answers were computed (a corpus from before bf16 meant cast weights, when it meant
    autocast, has none and is not resumed into a mix)."""
    folder.mkdir(parents=True, exist_ok=True)
    old = read_meta(folder)
    if old is None:
        write_meta(folder, meta | {"complete": False})
        return set()
    diff = [k for k in keys if old.get(k) != meta.get(k)]
    if diff:
        raise Dflash2Error(f"{folder / META}: this corpus was generated with other {', '.join(diff)} "
                           f"(tap_ids {old.get('tap_ids')} vs {meta['tap_ids']}, {len(old.get('prompts', []))} vs "
                           f"{len(meta['prompts'])} prompts); use another folder or delete it")
    return {_index(p) for p in folder.glob(SHARD_GLOB)}


def corpus_complete(folder: str | Path) -> bool:
    try:
        meta = read_meta(Path(folder))
    except Dflash2Error:
        return False
    return bool(meta and meta.get("complete"))


def load_corpus(folder: str | Path, tap_ids: list[int] | None = None, partial: bool = False,
                taps_from: str = "--taps") -> Corpus:
    """A complete corpus (lazy; `partial`: the shards written so far); with `tap_ids`, checks they are
    the taps it was made with. taps_from: where those taps came from, for the message."""
    c = Corpus(folder, partial)
    if tap_ids is not None and list(c.meta["tap_ids"]) != list(tap_ids):
        raise Dflash2Error(f"{Path(folder) / META}: tap_ids expected {list(tap_ids)} ({taps_from}), "
                           f"found {c.meta['tap_ids']} (a corpus made with other taps, or of another target)")
    return c


def corpus_answers(folder: str | Path) -> list[list[int]]:
    """The answers (target-generated ids after each prompt) of a complete corpus, without its taps: a tap corpus
    (dflash2-train) or an id corpus (dflash2-corpus, dflash2.train.idcorpus: each shard checked against its hash)."""
    from dflash2.train import idcorpus

    if idcorpus.is_id_corpus(folder):
        c = idcorpus.IdCorpus(folder)
        shards = (c.shard(i) for i in range(len(c.shards)))
        return [s.row(j)[1].tolist() for s in shards for j in range(len(s))]
    return [r["ids"][r["prompt_len"]:].tolist() for r in Corpus(folder)]
