"""The one wrapper of every dflash2 CLI's `main(argv) -> int`: how a run that did not succeed ends, in one place.

    from dflash2.cli import CliError, cli_main

    @cli_main("dflash2-x", after="nothing was written")
    def main(argv: list[str] | None = None) -> int:
        a = parser.parse_args(argv)
        ...
        raise Dflash2Error("--flag: expected X, found Y")       # -> "dflash2-x: error: --flag: ...", status 2
        ...
        except OSError as e:                                     # a message of the CLI's own, another status
            raise CliError(f"{a.out}: could not write ... ({e.strerror}); nothing was written", status=1) from None
        return 0

What it answers, each with one line on stderr and no traceback:
  - a Dflash2Error (or one of `errors`) raised anywhere in main: `PROG: error: MESSAGE`, status 2, or the
    CliError's `status`;
  - Ctrl-C / SIGTERM / SIGHUP, a closed stdout, an OSError of the machine (disk full, read-only, permission):
    dflash2.interrupts.interruptible (`PROG: interrupted; AFTER`, 130 / 143 / 129 / 141 / 1; `after` says what
    the user finds afterwards).
A bug (any other exception) keeps its traceback. Replacing a CLI's own `except Dflash2Error as e: print(f"PROG:
error: {e}", file=sys.stderr); return 2` with this wrapper keeps its messages and statuses byte for byte; only an
error raised after such a try block, which used to end in a traceback, now gets its one line too.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from dflash2.errors import CliError, Dflash2Error  # noqa: F401 (CliError: re-exported, dflash2.cli)
from dflash2.interrupts import Main, interruptible


def cli_main(prog: str, after: str = "nothing was written",
             errors: tuple[type[Exception], ...] = (Dflash2Error,)) -> Callable[[Main], Main]:
    """Wrap a CLI's main (module docstring). prog: the command's name, the prefix of every line; after: what an
    interrupted run leaves (dflash2.interrupts.interruptible); errors: the exceptions answered as refused input
    (dflash2-run adds ValueError)."""
    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def answered(argv: list[str] | None = None) -> int:
            try:
                return main(argv)
            except errors as e:  # a path of undecodable argv bytes is shown escaped, never an encoding error
                print(f"{prog}: error: {e}".encode("utf-8", "backslashreplace").decode("utf-8"), file=sys.stderr)
                return e.status if isinstance(e, CliError) else 2
        return interruptible(prog, after)(answered)
    return wrap
