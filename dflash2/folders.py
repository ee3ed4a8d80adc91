"""Output folders written atomically: checked first, filled in a temporary sibling, renamed into
place. Shared by export and engine builds; no torch (the engine stage must not need it)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dflash2.errors import Dflash2Error


class OutputError(Dflash2Error):
    pass


def check_output(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: expected a folder, found a file")
    if out.exists() and not force:
        raise OutputError(f"{out}: output folder exists; pass --force to replace it")
    probe = out.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"{out}: cannot create the output folder: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK):
        raise OutputError(f"{out}: cannot write into {probe} (permission denied)")


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a temp sibling, then rename: readers never see a half-written file."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def copy_present(src: Path, names: list[str], dst: Path) -> list[str]:
    """Copy those of `names` that exist in `src` into `dst`; returns the copied names."""
    copied = [n for n in names if (src / n).is_file()]
    for n in copied:
        shutil.copy2(src / n, dst / n)
    return copied


def temp_folder(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def replace_folder(tmp: Path, out: Path) -> None:
    """Rename into place; an existing folder (only with --force) is moved aside first, then removed."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
