"""The files of a manifest: sha256 and size of every file (`file_table`), the check that each is still there and
unchanged (`file_problems`, `check_files`, hashing only what the record of hashed files cannot vouch for:
dflash2.manifest.hashcache), and the one writer that seals a folder's manifest.json (`write`, `reseal`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflash2.folders import write_atomic
from dflash2.manifest import hashcache
from dflash2.manifest.jsonio import content_sha256
from dflash2.manifest.records import FileEntry
from dflash2.manifest.schema import NAME, Manifest, ManifestError


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_problems(folder: Path, files: dict[str, FileEntry], rehash: bool = False) -> list[str]:
    """Every listed file exists with its recorded size and sha256. A file hashed before and unchanged
    since (size, mtime, inode: dflash2.manifest.hashcache) is not hashed again unless `rehash`."""
    problems = []
    record = hashcache.Record(folder)
    for name, meta in files.items():
        p = folder / name
        if not p.is_file():
            problems.append(f"files.{name}: expected a file of {meta.bytes} bytes, found none (missing)")
        elif p.stat().st_size != meta.bytes:
            problems.append(f"files.{name}: expected {meta.bytes} bytes, found {p.stat().st_size}")
        elif not rehash and record.trusted(name, meta.sha256):
            continue
        else:
            started = hashcache.now_ns()
            if sha256(p) != meta.sha256:
                problems.append(f"{name}: sha256 does not match the manifest (file changed after export)")
            else:
                record.add(name, meta.sha256, started)
    record.save()
    return problems


def remember_hashes(folder: Path, manifest: Manifest) -> None:
    """The hashes write() just took, recorded for `folder` (where the written folder now is: renamed, the files'
    inode and times unchanged), so the first start does not hash gigabytes again (dflash2.manifest.hashcache). A
    file written within RACY_NS of the hashing stays untrusted there and is hashed at its first check."""
    hashed = getattr(manifest, "hashed_ns", None)
    if hashed is None:
        return
    record = hashcache.Record(folder)
    for name, meta in manifest.files.items():
        record.add(name, meta.sha256, hashed)
    record.save()


def checked_file_problems(folder: Path, manifest: Manifest, rehash: bool = False) -> list[str]:
    """file_problems for a loaded manifest's files. A deleted tokenizer file is not a broken folder: only
    text in / out needs it (and says so)."""
    optional = set((manifest.tokenizer.files or []) if manifest.tokenizer is not None else [])
    return file_problems(Path(folder), {n: f for n, f in (manifest.files or {}).items()
                                        if n not in optional or (Path(folder) / n).exists()}, rehash)


def check_files(folder: str | Path, manifest: Manifest, rehash: bool = False) -> None:
    """Raise ManifestError naming every file that is missing, resized or changed since it was written."""
    problems = checked_file_problems(Path(folder), manifest, rehash)
    if problems:
        raise ManifestError(Path(folder) / NAME, problems)


def file_table(folder: Path, names: list[str]) -> dict[str, FileEntry]:
    return {n: FileEntry(sha256(folder / n), (folder / n).stat().st_size) for n in sorted(names)}


def reseal(folder: Path, manifest: Manifest) -> Manifest:
    """Rewrite manifest.json after a change to the manifest alone (a validation record added): the file table
    and its hashing time stay as `write` made them."""
    data = manifest.to_dict()
    manifest.manifest_sha256 = data["manifest_sha256"] = content_sha256(data)
    write_atomic(folder / NAME, json.dumps(data, indent=2))
    return manifest


def write(folder: Path, manifest: Manifest) -> Manifest:
    """Checksum every file of the folder into manifest.files, seal, then write manifest.json atomically.
    `manifest.hashed_ns` says when the hashing began (remember_hashes)."""
    names = [p.name for p in folder.iterdir() if p.is_file() and p.name != NAME and not p.name.startswith(".")]
    manifest.hashed_ns = hashcache.now_ns()
    manifest.files = file_table(folder, names)
    data = manifest.to_dict()
    manifest.manifest_sha256 = data["manifest_sha256"] = content_sha256(data)
    write_atomic(folder / NAME, json.dumps(data, indent=2))
    return manifest
