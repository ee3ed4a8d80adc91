"""The one reader: `load()` checks a folder's manifest.json and returns it typed, or raises ManifestError listing
every problem at once (the checks: dflash2/manifest/__init__.py)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash2.manifest.jsonio import _convert, _found, content_sha256
from dflash2.manifest.schema import (FORMAT_VERSION, KINDS, MIN_CONTRACT_VERSION, NAME, EngineManifest,
                                     ExportManifest, Manifest, ManifestError)
from dflash2.manifest.sealing import checked_file_problems
from dflash2.ops import contract as C


def _newer(data: dict, key: str, ours: int) -> str | None:
    found = data.get(key)
    if isinstance(found, int) and not isinstance(found, bool) and found > ours:
        return (f"{key}: made by a newer dflash2 (version {found} > {ours}); upgrade dflash2 to read this "
                f"folder, or re-export with this one")
    return None


def load(folder: str | Path, kinds: type | tuple[type, ...] = (ExportManifest, EngineManifest),
         check_files: bool = True, rehash: bool = False) -> Manifest:
    """The typed manifest of an export or engine folder; ManifestError lists every problem at once.
    rehash: hash every file even where the record of hashed files (dflash2.manifest.hashcache) says it is
    unchanged since its last check."""
    folder = Path(folder)
    path = folder / NAME
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    formats = [k.__dataclass_fields__["format"].default for k in kinds]
    if not folder.is_dir():
        found = ("a file (give the folder that holds manifest.json)" if folder.is_file() else
                 "something that is not a folder" if folder.exists() else "no such directory")
        raise ManifestError(folder, [f"expected an export or engine folder, found {found}"])
    if not path.is_file():
        raise ManifestError(folder, [f"expected {NAME} (a folder written by dflash2-export or dflash2-build), "
                                     f"found none"])
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ManifestError(path, [f"expected valid JSON, found a parse error{where}"]) from None
    if not isinstance(data, dict):
        raise ManifestError(path, [f"expected a JSON object, found {_found(data)}"])
    if data.get("format") not in formats:
        raise ManifestError(path, [f"format: expected one of {formats}, found {data.get('format')!r}"])
    newer = [p for p in (_newer(data, "format_version", FORMAT_VERSION),
                         _newer(data, "contract_version", C.CONTRACT_VERSION)) if p]
    if newer:
        raise ManifestError(path, newer)
    old = data.get("contract_version")
    if isinstance(old, int) and not isinstance(old, bool) and old < MIN_CONTRACT_VERSION:
        raise ManifestError(path, [f"contract_version: expected >= {MIN_CONTRACT_VERSION}, found {old} (made by an "
                                   "older dflash2, before confidence and sampling: re-export with dflash2-export)"])
    if data.get("format_version") != FORMAT_VERSION:
        raise ManifestError(path, [f"format_version: expected {FORMAT_VERSION}, found {data.get('format_version')!r} "
                                   f"(made by an older dflash2: re-export / rebuild this folder)"])
    problems = []
    stored, actual = data.get("manifest_sha256"), content_sha256(data)
    if stored != actual:
        problems.append(f"manifest_sha256: expected {actual} (the sha256 of the manifest's content), found "
                        f"{stored!r}: {NAME} was edited after it was written; re-export / rebuild the folder")
    manifest = _convert(KINDS[data["format"]], data, "", problems)
    problems += manifest.check()
    if check_files:
        problems += checked_file_problems(folder, manifest, rehash)
    if problems:
        raise ManifestError(path, problems)
    return manifest

