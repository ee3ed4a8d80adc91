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


def listed(p: Path) -> bool:
    """A folder entry the file table must list: what `write` lists (every entry but manifest.json and hidden ones)."""
    return p.name != NAME and not p.name.startswith(".")


def coverage_problems(folder: Path, names: set[str]) -> list[str]:
    """The file table covers the folder and stays inside it: every name a plain file name of the folder (no
    `..`, no `/`, no absolute path, no link out of the folder), and every file of the folder listed, so a file
    whose entry was dropped from a resealed manifest (edited weights, another tokenizer) is never read unchecked."""
    problems = []
    try:
        home = folder.resolve()
    except (OSError, RuntimeError):
        return [f"{folder}: expected a folder that resolves, found a link loop"]
    for name in sorted(names):
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name or Path(name).is_absolute():
            problems.append(f"files.{name}: expected a file name inside the folder, found a path outside it")
            continue
        try:
            inside = (folder / name).resolve().parent == home
        except (OSError, RuntimeError):  # a link loop
            inside = False
        if not inside:
            problems.append(f"files.{name}: expected a file inside the folder, found a link out of it (or a loop)")
    try:
        present = sorted(p.name for p in folder.iterdir() if listed(p))
    except OSError as e:
        return problems + [f"{folder}: expected a folder that can be listed, found {e.strerror}"]
    problems += [f"files.{n}: expected every file of the folder listed with its sha256, found {n} not listed "
                 f"(an edited manifest? re-export / rebuild the folder)" for n in present if n not in names]
    return problems


def file_problems(folder: Path, files: dict[str, FileEntry], rehash: bool = False,
                  listed_too: set[str] | None = None) -> list[str]:
    """Every listed file exists with its recorded size and sha256, the table lists every file of the folder
    (`coverage_problems`; `listed_too`: names listed but left out of `files`, e.g. a deleted tokenizer file).
    A file hashed before and unchanged since (size, mtime, inode: dflash2.manifest.hashcache) is not hashed
    again unless `rehash`."""
    problems = coverage_problems(folder, set(files) | (listed_too or set()))
    if problems:
        return problems
    record = hashcache.Record(folder)
    for name, meta in files.items():
        p = folder / name
        if p.is_symlink() or not p.is_file():  # a FIFO, a folder, a link: never opened
            if p.exists() or p.is_symlink():
                problems.append(f"files.{name}: expected a regular file of {meta.bytes} bytes, found "
                                f"{'a link' if p.is_symlink() else 'a folder' if p.is_dir() else 'a FIFO or device'}")
                continue
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
    files = manifest.files or {}
    unlisted = [f"files: expected {n} listed (the manifest's {where} reads it), found no entry"
                for n, where in read_files(manifest) if n not in files]
    if unlisted:
        return unlisted
    return file_problems(Path(folder), {n: f for n, f in files.items()
                                        if n not in optional or (Path(folder) / n).exists()}, rehash,
                         listed_too=set(files))


def read_files(manifest: Manifest) -> list[tuple[str, str]]:
    """(file, what reads it) for every file the manifest's graphs, engines and tokenizer name."""
    out = []
    for g, graph in (getattr(manifest, "graphs", None) or {}).items():
        if graph is None:
            continue
        out += [(f, f"graphs.{g}") for f in (graph.flavours.portable, graph.flavours.tensorrt, graph.flavours.cpu_q4) if f]
        out += [(f.strip(), f"graphs.{g}.data") for f in (graph.data or "").split(",") if f.strip()]
    for g, e in (getattr(manifest, "engines", None) or {}).items():
        if e is not None and e.file:
            out.append((e.file, f"engines.{g}"))
    return out


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
