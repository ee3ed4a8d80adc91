"""A full disk (ENOSPC) or a spent quota (EDQUOT) while a file is written: one named error, not a traceback.

The libraries dflash2 writes with each report it their own way: Python an OSError (errno 28, often with no file
name: the write failed, not the open), safetensors a SafetensorError and tokenizers a plain Exception whose text
alone carries the code ('... (os error 28)'; older safetensors: 'Os { code: 28, ... }'). `writing(path, what,
needed)` turns each, raised while that one file is written, into a DiskFullError naming the file, what it is, the
bytes it needed and the bytes the disk had left once the half-written temporary file was gone.

A DiskFullError is a CliError of status 1 (what the machine refused): dflash2-train and dflash2-make-tiny print it
as their one line. The code that knows what the failure left behind (the last whole save, nothing at all) sets
`after`, which ends the line. Used by dflash2-make-tiny (dflash2.tiny) and dflash2-train (dflash2.train).
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash2.errors import CliError
from dflash2.folders import write_atomic

FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded"}
_CODE = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")


def full_code(e: BaseException) -> int | None:
    """ENOSPC / EDQUOT when `e` is a full disk or quota (an OSError, or a library's error that names the OS code
    only in its text), else None."""
    if isinstance(e, OSError):
        code = e.errno
    else:
        m = _CODE.search(str(e))
        code = int(m[1] or m[2]) if m else None
    return code if code in FULL else None


def size(n: int) -> str:
    """1536 -> '1.5 KiB', 1234604 -> '1.18 MiB' (three significant digits)."""
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 999.5 or unit == "TiB":
            return f"{n:.3g} {unit}"
    raise AssertionError("unreachable")


def free_bytes(path: str | Path) -> int | None:
    """The bytes an unprivileged writer may still use on the file system of `path` (its nearest existing
    folder), None when that cannot be read."""
    p = Path(path)
    while not p.is_dir() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def safetensors_bytes(tensors: dict, metadata: dict | None = None) -> int:
    """The size of the safetensors file these tensors make: their bytes + the JSON header (to a few bytes)."""
    data, header, at = 0, {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size() if hasattr(t, "element_size") else int(t.nbytes)
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [at, at + n]}
        at, data = at + n, data + n
    if metadata:
        header["__metadata__"] = metadata
    h = len(json.dumps(header, separators=(",", ":")).encode())
    return 8 + h + (-h % 8) + data


class DiskFullError(CliError):
    """A file could not be written: the disk is full or the quota spent. Status 1. `after` (what was left behind,
    what to do) and `path` may be set by the callers that know more, before the error reaches the CLI."""

    def __init__(self, path: str | Path, what: str, code: int, needed: int | None = None,
                 free: int | None = None, after: str = ""):
        self.path, self.what, self.code, self.after = Path(path), what, code, after
        self.needed, self.free = needed, free
        super().__init__(str(self), status=1)

    def __str__(self) -> str:
        show = size
        if self.needed is not None and self.free is not None and size(self.needed) == size(self.free):
            show = "{:,} bytes".format  # close enough to round alike: exact
        sizes = [f"{show(self.needed)} needed"] if self.needed is not None else []
        if self.code == errno.ENOSPC and self.free is not None:  # a quota's limit is not the disk's free space
            sizes.append(f"{show(self.free)} free")
        return (f"{self.path}: {FULL[self.code]} while writing {self.what}"
                + (f" ({', '.join(sizes)})" if sizes else "") + (f"; {self.after}" if self.after else ""))


@contextmanager
def writing(path: str | Path, what: str, needed: int | None = None, after: str = "") -> Iterator[None]:
    """A full disk or quota met inside the block (which writes `path`, `needed` bytes if known, and removes its own
    temporary file on the way out) -> DiskFullError (`after`: what is left, when the writer knows). Anything else
    passes unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        code = full_code(e)
        if code is None:
            raise
        raise DiskFullError(path, what, code, needed, free_bytes(Path(path).parent), after) from e


def write_text(path: Path, text: str, what: str) -> None:
    """folders.write_atomic (a temporary sibling, renamed): a full disk leaves the previous file whole, or none
    when it is new, and is a DiskFullError naming this one."""
    data = text.encode()
    with writing(path, what, len(data)):
        write_atomic(path, data)
