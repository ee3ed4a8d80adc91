"""What is an input: the one rule for every path a command reads (checkpoints, exports, corpora, vocabularies,
plugins), checked before anything is read or written. A FIFO blocks a reader forever, a folder or a link loop
named `model.safetensors` ends in a traceback, a JSON file a library reads ends in that library's traceback:
each is refused here in one line naming the file. dflash2.folders holds the output side."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from dflash2.errors import CheckpointError, OutputError

MANIFEST = "manifest.json"  # dflash2.manifest.NAME (that package imports this module through dflash2.folders)


# entries an input folder holds that a command opens as files: they must be regular files (links followed)
READ_SUFFIXES = (".json", ".safetensors", ".jinja", ".gguf", ".onnx", ".data", ".txt", ".engine", ".so")


# JSON files whose dflash2 readers name every problem themselves (field by field)
OWN_READERS = {"config.json", "model.safetensors.index.json", MANIFEST, "corpus.json", "draft_vocab.json",
               "progress.json"}


def not_a_file(p: Path) -> str | None:
    """What `p` is when it cannot be read as a file or listed as a folder without blocking or failing: a FIFO,
    a socket, a device, a symbolic link loop, a name too long; None for a regular file, a folder, or nothing."""
    try:
        st = os.stat(p)  # links followed
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if e.errno == errno.ENAMETOOLONG:
            return "a name longer than the file system allows"
        if e.errno == errno.ENOENT and os.path.islink(p):
            return f"a dangling symbolic link (to {os.readlink(p)})"
        return None  # missing, permission: named by whoever reads it
    except ValueError:  # an embedded NUL
        return "a name with a NUL byte"
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return None
    return "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) \
        else "a device"


def check_regular_file(path: str | Path, field: str = "file") -> Path:
    """The one check before a file is opened for reading: a regular file (links followed), never a FIFO that
    blocks forever, a folder, a device or a link loop. CheckpointError `PATH: FIELD: expected a regular file,
    found ...` otherwise."""
    path = Path(path)
    kind = not_a_file(path)
    if kind is None and path.is_dir():
        kind = "a folder"
    if kind is not None:
        raise CheckpointError(path, field, "a regular file", kind)
    return path


def check_input(path: str | Path | None, flag: str) -> None:
    """The one rule for an input path (a checkpoint, an export, a corpus, a plugin): itself a regular file or a
    folder, and every entry of a folder that a command opens as a file (by its suffix) a regular file: a FIFO
    blocked forever, a folder or a link loop named `model.safetensors` was a traceback. Checked before
    anything is read or written."""
    if path is None:
        return
    path = Path(path)
    kind = not_a_file(path)
    if kind is not None:
        raise OutputError(f"{flag} {path}: expected a file or a folder, found {kind}; nothing was read or written")
    if not path.is_dir():
        return
    try:
        entries = sorted(path.iterdir())
    except OSError:
        return  # named by the reader (permission)
    for p in entries:
        if p.suffix in READ_SUFFIXES:
            check_regular_file(p)
        if p.suffix == ".json" and p.name not in OWN_READERS:  # read by libraries that end in their own traceback
            _check_json(p)                                      # (transformers, tokenizers)


def parse_json(path: Path, data: bytes, field: str = "file"):
    """`data` (the bytes of `path`) as JSON; undecodable, malformed or too deeply nested text named (file, field,
    expected, found). The one parse of the JSON files a command checks (config.py's readers too)."""
    try:
        return json.loads(data)
    except UnicodeDecodeError:
        raise CheckpointError(path, field, "UTF-8 JSON text", "undecodable bytes") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(path, field, "valid JSON", f"a parse error at line {e.lineno}: {e.msg}") from None
    except RecursionError:
        raise CheckpointError(path, field, "JSON nested less than 1,000 deep", "deeper nesting") from None


def _check_json(p: Path) -> None:
    try:
        data = p.read_bytes()
    except OSError:
        return  # named by the reader (permission)
    parse_json(p, data)
