"""Typed errors. Each names the file, the field or tensor, what was expected and what was found."""

from __future__ import annotations


class Dflash2Error(Exception):
    """Base class: every error this package raises on bad input."""


class OutputError(Dflash2Error):
    """An output (or input) path refused before anything is written (dflash2.folders, dflash2.inputs)."""


class CheckpointError(Dflash2Error):
    def __init__(self, file: str, field: str, expected: str, found: str, hint: str = ""):
        self.file, self.field, self.expected, self.found = str(file), field, expected, found
        msg = f"{file}: {field}: expected {expected}, found {found}"
        super().__init__(msg + (f" ({hint})" if hint else ""))


class TensorSetError(Dflash2Error):
    """All tensor problems of one checkpoint at once: missing, unexpected, mis-shaped."""

    def __init__(self, folder: str, missing: list[str], unexpected: list[str],
                 misshaped: list[tuple[str, tuple, tuple]]):
        self.missing, self.unexpected, self.misshaped = missing, unexpected, misshaped
        lines = [f"{folder}: checkpoint tensors do not match the config"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        for name, want, got in misshaped:
            lines.append(f"  mis-shaped: {name}: expected {list(want)}, found {list(got)}")
        super().__init__("\n".join(lines))


class ValidationError(Dflash2Error):
    """ONNX Runtime vs reference mismatches after export: every failing output listed."""

    def __init__(self, failures: list[str], kept: str | None = None):
        self.failures, self.kept = failures, kept
        super().__init__("validation failed for {} output(s):\n  ".format(len(failures)) + "\n  ".join(failures)
                         + (f"\n{kept}" if kept else ""))


def require_extra(prog: str, extra: str, *modules: str) -> None:
    """A CLI whose install extra is missing says which one, instead of an ImportError traceback: the base
    install is the torch-free runtime (`pip install dflash2[runtime]`)."""
    import importlib.util
    import sys

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"{prog}: error: needs {', '.join(missing)}, which this install lacks: pip install 'dflash2[{extra}]'",
              file=sys.stderr)
        raise SystemExit(2)


def cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_threads(value: int | None, flag: str = "--threads") -> None:
    """A thread count is 1..the cores this process may use: `--threads 10000` started 10,000 threads on 2 cores."""
    if value is None:
        return
    if value < 1:
        raise Dflash2Error(f"{flag}: expected >= 1, found {value}")
    if value > cores():
        raise Dflash2Error(f"{flag}: expected at most {cores()} (the CPU cores this process may use), found {value}")


class CliError(Dflash2Error):
    """A refusal worded by the CLI itself, with its own exit status (1: what the machine refused, e.g. a write).
    Here, not in cli/, so that a shared module (dflash2.disk) may raise one; dflash2.cli re-exports it."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status
