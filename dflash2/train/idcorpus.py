"""The id corpus: the target's own greedy answers as token ids, small enough to live in the repository.

Taps are 1,000x larger than ids (a 576-wide target tapped 3 times: 3.4 KB per token in fp16, 2 bytes as
a uint16 id), so what is kept across machines is only the ids; `dflash2.train.taps` rebuilds the taps of
any shard with one teacher-forced pass of the target into a local cache.

A folder holds

    corpus.json          what it is: the target (name, config and weight hashes), the prompt source, the
                         generation settings, every shard (file, sha256, items, tokens) and every session
    shard-00000.safetensors   prompt_ids [P] u16|u32, answer_ids [A] u16|u32,
                              prompt_offsets [R+1] i64, answer_offsets [R+1] i64, source [R, 2] i32

Items are (conversation, turn) pairs in a fixed order (`sharegpt_items`), and shard s answers items
[s * shard_items, (s + 1) * shard_items): generation resumes at the first shard the manifest lacks, on
any machine, and reproduces nothing twice. Every shard is checked against its sha256 when read.
torch-free: numpy and safetensors.numpy only.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from dflash2.errors import Dflash2Error

META = "corpus.json"
KIND = "dflash2-id-corpus"
VERSION = 1
TENSORS = ("prompt_ids", "answer_ids", "prompt_offsets", "answer_offsets", "source")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant"}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass(frozen=True)
class Item:
    conversation: int  # index in the ShareGPT file
    turn: int  # index of the human turn answered, in the conversation's turn list
    messages: tuple[tuple[str, str], ...]  # (role, text): the earlier turns, then the human turn


def sharegpt_items(conversations: tuple[int, int] = (0, 15_000), path=None) -> list[Item]:
    """Every human turn (that passes the prompt filters) of conversations [a, b), with the earlier turns as
    context, in file order. Conversations >= 15,000 are held out: asking for them is refused."""
    from dflash2.prompts import EVAL_START, _keep, iter_sharegpt

    a, b = conversations
    if not 0 <= a < b <= EVAL_START:
        raise Dflash2Error(f"ShareGPT training conversations: expected a range inside [0, {EVAL_START}), found "
                           f"[{a}, {b}) (conversations {EVAL_START}+ are held out for evaluation)")
    out = []
    for idx, turns in iter_sharegpt(path):
        if idx < 0 or idx >= b:
            break
        if idx < a:
            continue
        msgs = []
        for t, turn in enumerate(turns):
            if not isinstance(turn, dict) or ROLES.get(turn.get("from")) is None:
                break  # an unknown speaker: the context after it is not a chat we can template
            role, text = ROLES[turn["from"]], str(turn.get("value", "")).strip()
            msgs.append((role, text))
            if role == "user" and _keep(text):
                out.append(Item(idx, t, tuple(msgs)))
    return out


def chat_prompt(tok, item: Item, budget: int) -> list[int] | None:
    """The chat-templated prompt of an item, its earliest turns dropped until it fits `budget` tokens;
    None when the human turn alone does not fit."""
    msgs = list(item.messages)
    while msgs:
        x = tok.apply_chat_template([{"role": r, "content": c} for r, c in msgs], add_generation_prompt=True)
        ids = list(x["input_ids"]) if hasattr(x, "keys") else list(x)
        if len(ids) <= budget:
            return ids
        msgs = msgs[2:] if len(msgs) > 2 else []  # drop the oldest (user, assistant) pair
        while msgs and msgs[0][0] != "user":
            msgs = msgs[1:]
    return None


def id_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def write_shard(path: Path, rows: list[tuple[list[int], list[int], int, int]], vocab_size: int) -> dict:
    """rows: (prompt ids, answer ids, conversation, turn). Atomic (temp name, then rename); returns its
    manifest entry."""
    dt = id_dtype(vocab_size)
    p_off = np.cumsum([0] + [len(r[0]) for r in rows]).astype(np.int64)
    a_off = np.cumsum([0] + [len(r[1]) for r in rows]).astype(np.int64)
    tensors = {
        "prompt_ids": np.asarray([t for r in rows for t in r[0]], dtype=dt),
        "answer_ids": np.asarray([t for r in rows for t in r[1]], dtype=dt),
        "prompt_offsets": p_off, "answer_offsets": a_off,
        "source": np.asarray([[r[2], r[3]] for r in rows], dtype=np.int32).reshape(-1, 2),
    }
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"kind": KIND, "version": str(VERSION)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    convs = [r[2] for r in rows]
    return {"file": path.name, "sha256": sha256_file(path), "rows": len(rows),
            "prompt_tokens": int(p_off[-1]), "answer_tokens": int(a_off[-1]),
            "conversations": [min(convs), max(convs)] if convs else None}


@dataclass
class Shard:
    """One verified shard: the ids of each row, as numpy views."""
    name: str
    prompt_ids: np.ndarray
    answer_ids: np.ndarray
    prompt_offsets: np.ndarray
    answer_offsets: np.ndarray
    source: np.ndarray

    def __len__(self) -> int:
        return len(self.source)

    def row(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt ids, answer ids) of row j."""
        p, a = self.prompt_offsets, self.answer_offsets
        return self.prompt_ids[p[j]: p[j + 1]], self.answer_ids[a[j]: a[j + 1]]


def read_shard(folder: Path, entry: dict, vocab_size: int) -> Shard:
    """A shard checked whole: its sha256 against the manifest, its tensors, offsets and ids."""
    path = folder / str(entry.get("file"))
    if not path.is_file():
        raise Dflash2Error(f"{path}: corpus shard listed in {folder / META} is missing")
    found = sha256_file(path)
    if found != entry.get("sha256"):
        raise Dflash2Error(f"{path}: corpus shard is damaged: sha256 expected {entry.get('sha256')}, found {found} "
                           "(restore it from git, e.g. git checkout -- <file>)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            t = {k: f.get_tensor(k) for k in TENSORS}
    except Exception as e:  # a hash-matching file that safetensors cannot read is an entry forged by hand
        raise Dflash2Error(f"{path}: not a readable corpus shard ({e})") from None
    s = Shard(path.name, **t)
    n = len(s.source)
    for name, off, ids in (("prompt", s.prompt_offsets, s.prompt_ids), ("answer", s.answer_offsets, s.answer_ids)):
        if len(off) != n + 1 or off[0] != 0 or off[-1] != len(ids) or np.any(np.diff(off) < 0):
            raise Dflash2Error(f"{path}: {name}_offsets expected {n + 1} non-decreasing offsets from 0 to "
                               f"{len(ids)}, found {len(off)} ending at {off[-1] if len(off) else None}")
        if len(ids) and int(ids.max()) >= vocab_size:
            raise Dflash2Error(f"{path}: {name}_ids expected ids below vocab_size {vocab_size}, found {int(ids.max())}")
    if n != entry.get("rows"):
        raise Dflash2Error(f"{path}: rows expected {entry.get('rows')} (corpus.json), found {n}")
    return s


class IdCorpus:
    """A corpus folder: its manifest, read and checked; shards read (and verified) on demand."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.meta = read_meta(self.folder)
        if self.meta is None:
            raise Dflash2Error(f"{self.folder / META}: expected an id corpus (dflash2-corpus grow), found none")

    @property
    def shards(self) -> list[dict]:
        return self.meta["shards"]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["target"]["vocab_size"])

    def shard(self, i: int) -> Shard:
        return read_shard(self.folder, self.shards[i], self.vocab_size)

    def verify(self) -> None:
        """Every shard against its hash; a shard file on disk the manifest does not list is named too."""
        for i in range(len(self.shards)):
            self.shard(i)
        listed = {e["file"] for e in self.shards}
        extra = sorted(p.name for p in self.folder.glob("shard-*.safetensors") if p.name not in listed)
        if extra:
            raise Dflash2Error(f"{self.folder}: shard files not listed in {META}: {extra[:5]} (left by an "
                               "interrupted generation; the next `dflash2-corpus grow` replaces them)")

    def totals(self) -> dict:
        s = self.shards
        convs = [e["conversations"] for e in s if isinstance(e.get("conversations"), list)
                 and len(e["conversations"]) == 2]
        return {"shards": len(s), "rows": sum(e["rows"] for e in s),
                "prompt_tokens": sum(e["prompt_tokens"] for e in s),
                "answer_tokens": sum(e["answer_tokens"] for e in s),
                "conversations": [min(c[0] for c in convs), max(c[1] for c in convs)] if convs else None}


def is_id_corpus(folder: str | Path) -> bool:
    """Whether `folder` holds an id corpus (its corpus.json says so) rather than a tap corpus."""
    try:
        return json.loads((Path(folder) / META).read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def read_meta(folder: Path) -> dict | None:
    path = folder / META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Dflash2Error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        raise Dflash2Error(f"{path}: expected an id corpus (kind {KIND!r}), found "
                           f"{meta.get('kind') if isinstance(meta, dict) else type(meta).__name__!r}")
    if meta.get("version") != VERSION:
        raise Dflash2Error(f"{path}: id corpus version expected {VERSION}, found {meta.get('version')}")
    for key, typ in (("target", dict), ("generation", dict), ("source", dict), ("shards", list),
                     ("sessions", list), ("shard_items", int)):
        if not isinstance(meta.get(key), typ):
            raise Dflash2Error(f"{path}: field {key!r} expected {typ.__name__}, found {type(meta.get(key)).__name__}")
    for key, typ in (("name", str), ("family", str), ("vocab_size", int), ("weights_sha256", str)):
        if not isinstance(meta["target"].get(key), typ):
            raise Dflash2Error(f"{path}: field target.{key} expected {typ.__name__}, found "
                               f"{meta['target'].get(key)!r}")
    for i, e in enumerate(meta["shards"]):
        for key, typ in (("file", str), ("sha256", str), ("rows", int), ("prompt_tokens", int),
                         ("answer_tokens", int)):
            if not isinstance(e, dict) or not isinstance(e.get(key), typ):
                raise Dflash2Error(f"{path}: field shards.{i}.{key} expected {typ.__name__}, found "
                                   f"{e.get(key) if isinstance(e, dict) else e!r}")
    for i, e in enumerate(meta["sessions"]):
        if not isinstance(e, dict):
            raise Dflash2Error(f"{path}: field sessions.{i} expected an object, found {e!r}")
    return meta


def write_meta(folder: Path, meta: dict) -> None:
    """Atomic: a reader sees the old manifest or the new one, never half of one."""
    path = folder / META
    tmp = path.with_name(META + f".tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
