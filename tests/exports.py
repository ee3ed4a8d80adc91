"""Session-wide tiny exports shared by the export and runtime tests (each takes ~10 s)."""

from __future__ import annotations

from pathlib import Path

from dflash2.export.api import export

T = 64  # export capacity of the shared tiny engines-test export
PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 300, 8]


def export_pair(root: Path, pairs: dict, family: str, version: int, **kw) -> Path:
    out = root / f"export-{family}-v{version}" / "out"
    if not (out / "manifest.json").is_file():
        drafter, target = pairs[(family, version)]
        export(drafter, target, out, quiet=True, **kw)
    return out
