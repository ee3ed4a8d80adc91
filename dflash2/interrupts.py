"""SIGTERM as an exception: `finally` blocks (temp-folder cleanup) run on `kill PID` as they do on Ctrl-C.

Python turns SIGINT into KeyboardInterrupt by default, but SIGTERM's default action ends the
process at once, so a half-written temp folder stayed behind. `Terminated` subclasses
KeyboardInterrupt: code that catches `Exception` never swallows it, and the CLIs answer both
with one line and the shell's exit status (130 for SIGINT, 143 for SIGTERM).

Imports nothing of dflash2: dflash2.folders imports this module (its temp folders raise Terminated) and reports
the outputs it puts in place into PLACED here, which the interruption line reads.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


# Outputs this process put in place (dflash2.folders.replace_folder appends each): an interruption after that is
# reported as "OUT: complete and in place", not "nothing was written". Cleared when a CLI's main starts.
PLACED: list[Path] = []


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM (or SIGHUP: the terminal closed) while `sigterm_raises()` is active."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


# signals whose default action ends the process at once (no `finally`): turned into Terminated
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active, SIGTERM and SIGHUP raise Terminated. A handler someone else installed is left alone,
    and outside the main thread (where Python cannot install handlers) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mine = [s for s in ENDING_SIGNALS if signal.getsignal(s) in (signal.SIG_DFL, _raise_terminated)]
    previous = {s: signal.signal(s, _raise_terminated) for s in mine}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_status(e: KeyboardInterrupt) -> int:
    """128 + the signal number, as a shell reports a process ended by that signal."""
    return 128 + (e.signum if isinstance(e, Terminated) else signal.SIGINT)


def interrupt_in(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C / SIGTERM inside an exception that a library wrapped it in (torch.export turns a
    KeyboardInterrupt during tracing into a TorchExportError), else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


Main = Callable[[list[str] | None], int]

# what the machine refused, not what the user typed: the disk is full, read-only, or not ours
ENVIRONMENT_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                      errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                      errno.EPERM: "operation not permitted (an immutable file or folder?)",
                      errno.EFBIG: "file too large for the file system", errno.EIO: "input/output error",
                      # a cache or output path through a file (HOME, DFLASH2_VERIFIED_DIR, --cache being a file)
                      errno.ENOTDIR: "a file stands where a folder is needed",
                      errno.EEXIST: "a file stands where a folder is needed",
                      errno.ELOOP: "a symbolic link loop", errno.ENAMETOOLONG: "a name too long for the file system"}


def environment_error(e: BaseException) -> str | None:
    """'PATH: no space left on the device' for an OSError of the machine (or safetensors' wrapper of one,
    which names the OS code only in its text); None for anything else (a bug: its traceback is kept)."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None and type(e).__name__ == "SafetensorError":  # older: "Os { code: 28", 0.8: "(os error 28)"
        m = re.search(r"Os \{ code: (\d+)|\(os error (\d+)\)", str(e))
        code = int(m[1] or m[2]) if m else None
    if code not in ENVIRONMENT_ERRNOS:
        return None
    path = getattr(e, "filename", None)
    return f"{path + ': ' if path else ''}{ENVIRONMENT_ERRNOS[code]}"


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of the closed pipe raises nothing more."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _interrupted(prog: str, e: KeyboardInterrupt, after: str) -> int:
    word = {signal.SIGHUP: "hung up (SIGHUP)"}.get(getattr(e, "signum", None), "terminated") \
        if isinstance(e, Terminated) else "interrupted"
    if PLACED:  # the output was complete and in place when the signal came: say so, not "nothing"
        after = f"{', '.join(map(str, PLACED))}: complete and in place (the signal came after it was written)"
    print(f"\n{prog}: {word}; {after}", file=sys.stderr)
    return exit_status(e)


def _while_exiting(prog: str, code: int) -> None:
    """After main() returned, a signal during the interpreter's teardown (freeing sessions, joining threads)
    would end the process silently (-15) or with 'Exception ignored' noise: one line saying the run had
    finished, and the signal's status. Only for the process entry point (argv None, as the console scripts call
    it; never a test's main([...]), a REPL or a notebook); a signal the parent ignores (nohup) stays ignored."""
    done = f"{', '.join(map(str, PLACED))}: complete and in place" if PLACED else "nothing more to do"

    def late(signum, frame):
        word = {signal.SIGHUP: "hung up (SIGHUP)", signal.SIGINT: "interrupted"}.get(signum, "terminated")
        try:
            os.write(2, f"\n{prog}: {word} while exiting; it had finished with status {code} ({done})\n".encode())
        finally:
            os._exit(128 + signum)

    interactive = hasattr(sys, "ps1") or sys.flags.interactive or "ipykernel" in sys.modules
    if threading.current_thread() is threading.main_thread() and not interactive:  # never a REPL's Ctrl-C
        for s in (*ENDING_SIGNALS, signal.SIGINT):
            if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler, _raise_terminated):
                signal.signal(s, late)


def _closed_streams() -> None:
    """A stream closed at the start (`>&-`, `2>&-`) leaves sys.stdout / sys.stderr None, and every print and the
    final flush failed with AttributeError: its output is discarded instead, as a shell's `>/dev/null` would (the
    command still runs and writes its files). A closed stdin stays None: `--prompt -` names it."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            try:
                setattr(sys, name, open(os.devnull, "w"))
            except OSError:
                pass


def interruptible(prog: str, after: str = "nothing was written") -> Callable[[Main], Main]:
    """For a CLI's main(): Ctrl-C (SIGINT) or `kill` (SIGTERM) -> one line `PROG: interrupted; AFTER`
    on stderr and the shell's status, 130 / 143, instead of a KeyboardInterrupt traceback. No cleanup
    here: the `finally` blocks of the code that was running (temp folders) have run when we print.
    after: what the user finds afterwards (for the atomic writers: nothing)."""
    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            PLACED.clear()  # this run's outputs only (tests call several mains in one process)
            _closed_streams()
            try:
                with sigterm_raises():
                    code = main(argv)
                    sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at the exit's flush
                if argv is None:  # the process's own entry point: the exit itself can take a while
                    _while_exiting(prog, code)
                return code
            except KeyboardInterrupt as e:
                return _interrupted(prog, e, after)
            except BrokenPipeError:  # stdout closed early (`... | head -c 5`): one line, the shell's SIGPIPE status
                _silence_stdout()
                print(f"{prog}: stopped: standard output was closed (broken pipe); {after}", file=sys.stderr)
                return 128 + signal.SIGPIPE
            except Exception as e:  # a full / read-only disk, a permission: one line (the temp folders are gone)
                if interrupt_in(e) is not None:  # Ctrl-C inside a library that wrapped it
                    return _interrupted(prog, interrupt_in(e), after)
                what = environment_error(e)
                if what is None:
                    raise
                print(f"{prog}: error: {what}; {after}", file=sys.stderr)
                return 1
        return run
    return wrap
