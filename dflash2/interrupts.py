"""SIGTERM as an exception: `finally` blocks (temp-folder cleanup) run on `kill PID` as they do on Ctrl-C.

Python turns SIGINT into KeyboardInterrupt by default, but SIGTERM's default action ends the
process at once, so a half-written temp folder stayed behind. `Terminated` subclasses
KeyboardInterrupt: code that catches `Exception` never swallows it, and the CLIs answer both
with one line and the shell's exit status (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM while `sigterm_raises()` is active."""


def _raise_terminated(signum, frame):
    raise Terminated(f"signal {signum}")


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active, SIGTERM raises Terminated. A handler someone else installed is left alone, and
    outside the main thread (where Python cannot install handlers) this does nothing."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, _raise_terminated):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_status(e: KeyboardInterrupt) -> int:
    """128 + the signal number, as a shell reports a process ended by that signal."""
    return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)


Main = Callable[[list[str] | None], int]


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of the closed pipe raises nothing more."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def interruptible(prog: str, after: str = "nothing was written") -> Callable[[Main], Main]:
    """For a CLI's main(): Ctrl-C (SIGINT) or `kill` (SIGTERM) -> one line `PROG: interrupted; AFTER`
    on stderr and the shell's status, 130 / 143, instead of a KeyboardInterrupt traceback. No cleanup
    here: the `finally` blocks of the code that was running (temp folders) have run when we print.
    after: what the user finds afterwards (for the atomic writers: nothing)."""
    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                with sigterm_raises():
                    code = main(argv)
                    sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at the exit's flush
                    return code
            except KeyboardInterrupt as e:
                word = "terminated" if isinstance(e, Terminated) else "interrupted"
                print(f"\n{prog}: {word}; {after}", file=sys.stderr)
                return exit_status(e)
            except BrokenPipeError:  # stdout closed early (`... | head -c 5`): one line, the shell's SIGPIPE status
                _silence_stdout()
                print(f"{prog}: stopped: standard output was closed (broken pipe); {after}", file=sys.stderr)
                return 128 + signal.SIGPIPE
        return run
    return wrap
