"""Output folders written atomically: checked first, filled in a temporary sibling, renamed into
place. Shared by export and engine builds; no torch (the engine stage must not need it)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash2.errors import OutputError  # noqa: F401 - callers import it from here (it lives in errors for dflash2.inputs)
from dflash2.inputs import check_input
from dflash2.interrupts import PLACED, Terminated, sigterm_raises


MANIFEST = "manifest.json"  # dflash2.manifest.NAME (that package imports this module)
OUR_FORMAT_PREFIX = "dflash2-"  # "dflash2-export", "dflash2-engines"


Inputs = dict[str, "str | Path | None"] | list[tuple[str, "str | Path | None"]]


def _resolved(path: str | Path, flag: str) -> Path:
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError):  # Python 3.11 raises RuntimeError on a link loop
        raise OutputError(f"{flag} {path}: expected a path, found a symbolic link loop; nothing was read or "
                          f"written") from None


def check_name(out: str | Path, flag: str = "--out") -> None:
    """Every component of an output path within the file system's name length (a 300-character --out name was
    an OSError traceback at the first `exists()`)."""
    for part in Path(out).parts:
        if len(os.fsencode(part)) > 255:
            raise OutputError(f"{flag} {out}: expected names of at most 255 bytes, found one of "
                              f"{len(os.fsencode(part))}; nothing was written")


def check_apart(out: str | Path, inputs: Inputs, out_flag: str = "--out") -> None:
    """Refuse an output that is, contains or lies inside an input (paths resolved, symlinks followed).

    Checked before anything is read or deleted: `--force` replaces the output folder, and writing
    into an input would change the checkpoint the output's checksums were taken from.
    inputs: flag -> path or (flag, path) pairs, None paths skipped: {"--model": drafter, "--target": target}."""
    o = _resolved(out, out_flag)
    for flag, path in inputs.items() if isinstance(inputs, dict) else inputs:
        if path is None:
            continue
        i = _resolved(path, flag)
        if o == i:
            how = "is"
        elif o in i.parents:
            how = "contains"
        elif i in o.parents:
            how = "lies inside"
        else:
            continue
        kind = "file" if i.is_file() else "folder"
        raise OutputError(f"{out_flag} {out} {how} the {flag} {kind} {path}: an output must be apart from every "
                          f"input (nothing was read or written); choose another {out_flag}")


def check_train_folders(target: str | Path, out: str | Path, corpora: list[str | Path]) -> None:
    """dflash2-train writes --out (the drafter) and the first --corpus (generated when empty): neither may
    be, hold or lie inside --target, nor overlap each other (a corpus shard inside a checkpoint, or a
    checkpoint inside a corpus, would be read back as the other)."""
    check_apart(out, [("--target", target)] + [("--corpus", c) for c in corpora])
    check_input(target, "--target")
    for c in corpora:
        check_apart(c, {"--target": target}, out_flag="--corpus")
        check_input(c, "--corpus")


def check_filled_in_place(folder: str | Path, flag: str, marker: str, what: str) -> None:
    """The one rule for a folder a command fills in place and reads back (a corpus it generates, resumes or
    reads): absent, empty (hidden files and a killed run's `.tmp-` files aside), or one it made, which holds
    `marker`. A folder holding other files is somebody's input (a corpus whose `corpus.json` was lost, a
    checkpoint): refused before anything is read or written, left as it is."""
    folder = Path(folder)
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise OutputError(f"{flag} {folder}: expected {what} folder, found a file (left as it is)")
    if not folder.is_dir() or (folder / marker).exists():
        return
    try:
        others = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and ".tmp-" not in p.name)
    except OSError as e:
        raise OutputError(f"{flag} {folder}: cannot list the folder: {_why(e)}") from None
    if others:
        raise OutputError(f"{flag} {folder}: expected {what} folder (with {marker}), a new or an empty one; found a "
                          f"folder holding other files (e.g. {others[0]}), left as it is; nothing was read or "
                          f"written: restore its {marker} or choose another folder")


def check_replaceable_file(path: str | Path, force: bool, ours, what: str) -> None:
    """A single output file written into a folder the user owns (draft_vocab.json): created when absent;
    replaced only with `--force` and only when `ours(path)` says dflash2 wrote it. Checked before any work."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink() or not path.is_file():
        raise OutputError(f"{path}: expected {what} to write, found a link or something else; left as it is")
    if not force:
        raise OutputError(f"{path}: exists; left as it is: pass --force to replace it")
    if not ours(path):
        raise OutputError(f"{path}: format: expected {what} (the only file --force replaces), found another file; "
                          f"left as it is")


@contextmanager
def output_lock(out: str | Path, flag: str = "--out") -> Iterator[None]:
    """One writer per output folder that is filled in place over a long run (dflash2-train --out): an flock on a
    hidden `.OUT.lock` sibling, released by the kernel if the process dies (no stale lock), removed on leaving.
    A second run on the same OUT is refused at once, naming the process that holds it."""
    import fcntl

    out = Path(out)
    if not out.parent.is_dir():  # a new parent: made by the run itself, nobody else can be writing there yet
        yield
        return
    lock = out.parent / f".{out.name}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only parent: the run itself names that
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            raise OutputError(f"{flag} {out}: expected a folder no other run is writing, found it locked by process "
                              f"{holder} ({lock}); wait for it to end or choose another {flag}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            try:
                lock.unlink()
            except OSError:
                pass
    finally:
        os.close(fd)


def written_by_dflash2(folder: Path) -> bool:
    """A folder --force may replace: it holds a manifest.json whose format is one of ours."""
    try:
        m = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(m, dict) and isinstance(m.get("format"), str) and m["format"].startswith(OUR_FORMAT_PREFIX)


def check_output(out: Path, force: bool, inputs: Inputs | None = None) -> None:
    """Every output-folder rule, before anything is read: apart from the inputs, creatable, and an
    existing folder replaced only with --force and only when empty or written by dflash2."""
    check_name(out)
    for flag, path in (inputs or {}).items() if isinstance(inputs, dict) else inputs or []:
        check_input(path, flag)
    check_apart(out, inputs or {})
    if out.is_symlink():
        raise OutputError(f"{out}: output is a symbolic link; pass the folder itself (or another --out)")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: expected a folder, found a file")
    if out.exists() and not force:
        raise OutputError(f"{out}: output folder exists; pass --force to replace it")
    if out.exists() and _has_entries(out) and not written_by_dflash2(out):
        raise OutputError(f"{out}: --force replaces only a folder written by dflash2 (one with its {MANIFEST}); "
                          f"this one has none, so it was left as it is; remove it yourself or choose another --out")
    probe = out.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"{out}: cannot create the output folder: {probe} is a file, not a folder")
    check_writable(out, probe)


def _why(e: OSError) -> str:
    if e.errno == errno.EROFS:
        return "it is on a read-only filesystem"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return f"the filesystem refuses new folders there ({e.strerror})"  # e.g. /proc, /sys


def check_writable(out: Path, probe: Path) -> None:
    """Create and remove the temp folder's name in `probe` (the nearest existing ancestor of `out`):
    the only test that tells a read-only filesystem, /proc or missing permissions apart before any
    weight is loaded (os.access answers True for root on all of them)."""
    trial = probe / f".{out.name}.tmp-{os.getpid()}"
    try:
        trial.mkdir()
    except FileExistsError:
        return
    except OSError as e:
        raise OutputError(f"{out}: cannot create the output folder in {probe}: {_why(e)}") from None
    trial.rmdir()


def _has_entries(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError as e:
        raise OutputError(f"{folder}: cannot list the existing output folder: {_why(e)}") from None


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a temp sibling, then rename: readers never see a half-written file."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:  # interrupted or failed (disk full): no half-written sibling stays behind
        tmp.unlink(missing_ok=True)


def copy_present(src: Path, names: list[str], dst: Path) -> list[str]:
    """Copy those of `names` that exist in `src` into `dst`; returns the copied names."""
    copied = [n for n in names if (src / n).is_file()]
    for n in copied:
        shutil.copy2(src / n, dst / n)
    return copied


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale(out: Path) -> list[Path]:
    """Remove the `.NAME.tmp-PID` / `.NAME.old-PID` siblings of `out` whose process is gone (killed by
    SIGKILL or a power cut, so its own cleanup never ran). A stale `.old-` folder is a previous output
    moved aside for --force; if `out` itself is missing it is put back instead of deleted."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)-(\d+)$")
    removed = []
    if not out.parent.is_dir():
        return removed
    for p in sorted(out.parent.iterdir()):
        m = pattern.match(p.name)
        if not m or int(m[2]) == os.getpid() or pid_alive(int(m[2])):
            continue
        if m[1] == "old" and not out.exists() and p.is_dir():
            p.rename(out)
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


@contextmanager
def temp_folder(out: Path) -> Iterator[Path]:
    """A fresh `.NAME.tmp-PID` sibling of `out`, removed on leaving the block however it is left:
    error, Ctrl-C, or SIGTERM (turned into an exception while the folder exists). Stale siblings of
    dead processes are removed first, so interrupted runs do not pile up."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    with sigterm_raises():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def replace_folder(tmp: Path, out: Path, force: bool = False, replaceable=None, what: str = "the output") -> None:
    """Rename into place; an existing folder (only with --force) is moved aside first, then removed.

    The output rule is checked again here, at the last moment: a folder or file that appeared at `out` while the
    tool ran (a user's, or a second run's) is refused and left as it is, never deleted; with `force`, only a
    folder that is empty or `replaceable` (default: written by dflash2) is replaced. Refused: OutputError, and
    the caller's temp folder goes (`temp_folder`): nothing was written."""
    replaceable = replaceable or written_by_dflash2
    if out.exists() or out.is_symlink():
        kept = f"it was left as it is and {what} was not written"
        if not force:
            raise OutputError(f"{out}: appeared while this ran (it did not exist at the start); {kept}: choose "
                              f"another output or run again with --force")
        if out.is_symlink() or not out.is_dir() or (_has_entries(out) and not replaceable(out)):
            raise OutputError(f"{out}: changed while this ran into something --force does not replace (a file, "
                              f"a link, or a folder dflash2 did not write); {kept}")
    with signals_held():  # the swap and the old folder's removal run to the end; a Ctrl-C counts right after
        _swap(tmp, out, what)
        PLACED.append(out)  # an interruption from now on says OUT is complete (dflash2.interrupts words it)


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT / SIGTERM / SIGHUP held back in the main thread and answered when the block ends: an interrupted
    removal of the replaced folder kept 7 of an old export's 24 files beside the new one. Python-level handlers
    that only record (a thread mask would not do: ONNX Runtime's and torch's threads take the signal too)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if got:  # answered now, as the signal's own handler would have: Ctrl-C -> KeyboardInterrupt
        sig = got[0]
        handler = previous.get(sig)
        if sig == signal.SIGINT and handler is signal.default_int_handler:
            raise KeyboardInterrupt
        if callable(handler):
            handler(sig, None)
        elif handler == signal.SIG_DFL:
            raise KeyboardInterrupt if sig == signal.SIGINT else Terminated(sig)


def _swap(tmp: Path, out: Path, what: str) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    done = False
    try:
        tmp.rename(out)
        done = True
    except OSError as e:  # something took the name between the check and the rename
        raise OutputError(f"{out}: could not be put in place ({e.strerror}); what is there was left as it is and "
                          f"{what} was not written" + (f"; the previous folder was not removed (back at {out}, or in {old} "
                                                        f"when the name is taken)" if old else "")) from None
    finally:  # the previous folder goes only once the new one is in place; interrupted: it goes back
        if old is not None and done:
            shutil.rmtree(old, ignore_errors=True)
        elif old is not None and not out.exists() and not out.is_symlink():
            old.rename(out)


def cache_root() -> Path:
    """dflash2's cache (checkpoints prepared, taps, the record of verified files): $DFLASH2_CACHE or
    ~/.cache/dflash2."""
    return Path(os.environ.get("DFLASH2_CACHE", Path.home() / ".cache" / "dflash2"))


FAILED_MARK = "VALIDATION_FAILED.txt"


def keep_failed(tmp: Path, out: Path, failures: list[str] = ()) -> str:
    """A failed export's temp folder (the graphs, their Polygraphy replay files) renamed to `OUT.failed`
    for inspection instead of deleted. An earlier `OUT.failed` of ours is replaced; a folder of that name
    that dflash2 did not write is left alone and `OUT.failed-2`, ... is used; `failures` (each failing output
    with its difference) are written into its FAILED mark. Returns the line that says where."""
    dest = out.parent / f"{out.name}.failed"
    n = 1
    while dest.exists() and not (dest / FAILED_MARK).is_file():
        n += 1
        dest = out.parent / f"{out.name}.failed-{n}"
    try:
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
        (dest / FAILED_MARK).write_text(
            f"dflash2-export of {out} failed validation; nothing was written to {out}.\n"
            "Replay a graph's check: polygraphy run NAME.onnx --onnxrt --load-inputs NAME.inputs.json "
            "--load-outputs NAME.reference.json (tolerances: docs/export.md). Delete this folder when done.\n"
            + "".join(f"failed: {f}\n" for f in failures))
    except OSError as e:
        return f"the failing graphs could not be kept ({e.strerror}); nothing was written to {out}"
    return (f"kept for inspection in {dest}: the graphs written so far and their Polygraphy replay files "
            f"(NAME.inputs.json, NAME.reference.json); nothing was written to {out}")
