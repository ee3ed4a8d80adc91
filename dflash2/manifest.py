"""The export / engine folder manifest: written by export and engines, read by the runtime.

Plain JSON and hashlib: no torch, no onnx (the runtime imports this on edge boards).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflash2.errors import Dflash2Error
from dflash2.folders import write_atomic

EXPORT_FORMAT = "dflash2-export"
ENGINE_FORMAT = "dflash2-engines"
FORMAT_VERSION = 1
NAME = "manifest.json"


class ManifestError(Dflash2Error):
    pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_table(folder: Path, names: list[str]) -> dict[str, dict]:
    return {n: {"sha256": sha256(folder / n), "bytes": (folder / n).stat().st_size} for n in sorted(names)}


def write(folder: Path, manifest: dict) -> dict:
    """Checksum every file of the folder into manifest["files"], then write manifest.json atomically."""
    names = [p.name for p in folder.iterdir() if p.is_file() and p.name != NAME and not p.name.startswith(".")]
    manifest["files"] = file_table(folder, names)
    write_atomic(folder / NAME, json.dumps(manifest, indent=2))
    return manifest


def load(folder: str | Path, formats: tuple[str, ...] = (EXPORT_FORMAT, ENGINE_FORMAT)) -> dict:
    folder = Path(folder)
    path = folder / NAME
    if not folder.is_dir():
        raise ManifestError(f"{folder}: expected an export or engine folder, found no such directory")
    if not path.is_file():
        raise ManifestError(f"{folder}: expected {NAME} (a folder written by dflash2-export or dflash2-build), "
                            f"found none")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: expected valid JSON, found a parse error at line {e.lineno}") from None
    if m.get("format") not in formats:
        raise ManifestError(f"{path}: format: expected one of {list(formats)}, found {m.get('format')!r}")
    if m.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path}: format_version: expected {FORMAT_VERSION}, found {m.get('format_version')!r}")
    return m


def verify_files(folder: str | Path, manifest: dict) -> None:
    """Every file the manifest lists exists with its recorded size and sha256; all problems at once."""
    folder = Path(folder)
    problems = []
    for name, meta in manifest.get("files", {}).items():
        p = folder / name
        if not p.is_file():
            problems.append(f"{name}: missing")
        elif p.stat().st_size != meta["bytes"]:
            problems.append(f"{name}: expected {meta['bytes']} bytes, found {p.stat().st_size}")
        elif sha256(p) != meta["sha256"]:
            problems.append(f"{name}: sha256 does not match the manifest (file changed after export)")
    if problems:
        raise ManifestError(f"{folder / NAME}: files do not match the manifest:\n  " + "\n  ".join(problems))
