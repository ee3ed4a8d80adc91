"""Helpers for the bad-input tests: snapshots that prove no input changed and nothing was left behind."""

from __future__ import annotations

import hashlib
from pathlib import Path


def snapshot(*roots: Path) -> dict[str, str]:
    """Every entry under the roots -> sha256 (files), 'dir' or 'link -> target': any change shows."""
    out = {}
    for root in roots:
        for p in sorted([root, *root.rglob("*")]):
            if p.is_symlink():
                out[str(p)] = f"link -> {p.readlink()}"
            elif p.is_dir():
                out[str(p)] = "dir"
            elif not p.is_file():  # a FIFO, a socket, a device: never read (a FIFO would block)
                out[str(p)] = f"special {p.lstat().st_mode:o}"
            else:
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line_error(err: str, prog: str) -> str:
    """The CLI's stderr must be exactly one line `PROG: error: ...` (no traceback)."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def one_error(err: str, prog: str) -> str:
    """One error, no traceback: `PROG: error: ...` and, for an error listing several problems, its
    indented problem lines. Returns the whole message as one string."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines and lines[0].startswith(f"{prog}: error: ") and "Traceback" not in err, err
    assert all(ln.startswith("  ") for ln in lines[1:]), err
    return " ".join(ln.strip() for ln in lines)
