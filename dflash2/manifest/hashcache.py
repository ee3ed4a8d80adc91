"""A record of files whose sha256 was checked, so a start does not re-hash gigabytes every time (formerly
dflash2.verified; not `speculative.Verified`, the target's verify result).

`dflash2-run` checks every file of a folder against the sha256 its manifest records. Hashing is ~1 s
per GB here (4.5 s for a 3.8 GB Qwen3-0.6B-shaped export at every start), so a check that passed is
recorded in the cache (`$DFLASH2_VERIFIED_DIR`, default `$DFLASH2_CACHE/verified/`, ~/.cache/dflash2) with the file's size,
mtime, ctime, inode and the sha256 it matched; the next start trusts a file whose size, mtime, ctime and
inode are unchanged and rehashes the others. `dflash2-run --verify-files` (or `load(..., rehash=True)`) hashes
everything regardless.

Racy timestamps, as git handles them: a file written moments before it was hashed could be written
again within the filesystem's timestamp granularity (a few ms) without its mtime changing, so an
entry is trusted only when the file's mtime is at least RACY_NS older than the moment it was hashed.
A record that cannot be read or written is ignored: it only ever saves time, never decides an outcome
it did not check.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from dflash2.folders import cache_root

RACY_NS = 2_000_000_000


class Record:
    """The checked files of one folder (keyed by its absolute path)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder).absolute()
        key = hashlib.sha256(str(self.folder).encode()).hexdigest()[:24]
        self.path = Path(os.environ.get("DFLASH2_VERIFIED_DIR") or cache_root() / "verified") / f"{key}.json"
        self.entries: dict[str, dict] = {}
        self.changed = False
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("folder") == str(self.folder) and isinstance(doc.get("files"), dict):
                self.entries = doc["files"]
        except (OSError, ValueError, AttributeError):
            pass

    @staticmethod
    def _stat(path: Path) -> dict:
        st = path.stat()
        # ctime: a file replaced and given its old mtime back (cp -p, utime) still gets a new ctime
        return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}

    def trusted(self, name: str, sha256: str) -> bool:
        """The file was hashed to `sha256` and has not changed since (module docstring)."""
        e = self.entries.get(name)
        if not isinstance(e, dict) or e.get("sha256") != sha256:
            return False
        try:
            now = self._stat(self.folder / name)
        except OSError:
            return False
        same = all(e.get(k) == v for k, v in now.items())
        return same and isinstance(e.get("hashed_ns"), int) and now["mtime_ns"] < e["hashed_ns"] - RACY_NS

    def add(self, name: str, sha256: str, hashed_ns: int) -> None:
        try:
            self.entries[name] = {**self._stat(self.folder / name), "sha256": sha256, "hashed_ns": hashed_ns}
            self.changed = True
        except OSError:
            pass

    def save(self) -> None:
        if not self.changed:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"folder": str(self.folder), "files": self.entries}))
            os.replace(tmp, self.path)
        except OSError:  # a cache folder that is a file (HOME, DFLASH2_VERIFIED_DIR): only time is lost
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


def now_ns() -> int:
    return time.time_ns()
