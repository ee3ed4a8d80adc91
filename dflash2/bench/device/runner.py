"""The device check's runner: rows, each piece under its own time budget, the table, the JSON, the verdict,
and what a device call would carry (--travel). Kept apart from the pieces so that it needs no GPU, no torch
and no kernel library: the tests drive it on fakes (tests/test_device_check.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the checkout: dflash2/bench/device/runner.py -> ../../..
TOTAL_BUDGET_S = 470  # the 8 minutes, less what Python's start and the wheel install take
# (name, budget in seconds); the trainer's budget is its training minutes plus BUDGETS["trainer"]
BUDGETS = {"environment": 20, "build": 100, "kernel-twin": 60, "kernel-time": 60, "cuda-graph": 40,
           "torch-ref": 60, "trainer": 75, "tensorrt": 10}
PIECES = tuple(BUDGETS)
PASS, FAIL, ERROR, TIMEOUT, SKIP = "pass", "FAIL", "ERROR", "TIMEOUT", "skipped"


# ---------------------------------------------------------------- rows, runner, table, JSON

@dataclass
class Row:
    piece: str
    result: str = PASS
    cases: int = 0
    seconds: float = 0.0
    detail: str = ""
    data: dict = field(default_factory=dict)


class PieceTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise PieceTimeout()


def run_piece(name: str, fn, ctx: dict, budget_s: float) -> Row:
    """Run fn(ctx) -> Row (or dict of Row fields) under a wall-clock budget (SIGALRM; a call blocked in C
    is cut when it returns). Any exception becomes an ERROR row, running out of time a TIMEOUT row."""
    t0 = time.monotonic()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, max(budget_s, 0.001))
    try:
        got = fn(ctx)
        row = got if isinstance(got, Row) else Row(name, **(got or {}))
        row.piece = name
    except PieceTimeout:
        row = Row(name, TIMEOUT, detail=f"ran past its budget of {budget_s:.0f} s")
    except Exception as e:  # noqa: BLE001 - every failure becomes a row, never a traceback that stops the check
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        row = Row(name, ERROR, detail=msg[:400])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    row.seconds = round(time.monotonic() - t0, 2)
    return row


def format_table(rows: list[Row]) -> str:
    w = max([len(r.piece) for r in rows] + [5])
    lines = [f"{'piece':<{w}}  {'cases':>6}  {'result':<8}  {'seconds':>8}  detail"]
    for r in rows:
        lines.append(f"{r.piece:<{w}}  {r.cases:>6}  {r.result:<8}  {r.seconds:>8.1f}  {r.detail}")
    return "\n".join(lines)


def verdict(rows: list[Row]) -> tuple[int, str]:
    bad = [r.piece for r in rows if r.result not in (PASS, SKIP)]
    skipped = [r.piece for r in rows if r.result == SKIP]
    ran = len(rows) - len(skipped)
    if bad:
        return 1, f"device_check: FAILED: {', '.join(bad)} ({ran - len(bad)}/{ran} pieces passed; skipped: " \
                  f"{', '.join(skipped) or 'none'})"
    return 0, f"device_check: {ran}/{ran} pieces passed; skipped: {', '.join(skipped) or 'none'}"


def write_report(out: Path, rows: list[Row], meta: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rc, line = verdict(rows)
    doc = {"format": "dflash2-device-check", "version": 1, "exit_code": rc, "verdict": line, **meta,
           "rows": [asdict(r) for r in rows]}
    path = out / "device_check.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    (out / "device_check.txt").write_text(format_table(rows) + "\n" + line + "\n")
    return path


DEVICE_TREE_LIMIT = 64 * 1024 * 1024  # what one device call carries: the tree that travels + carried paths


def travel_bytes(root: Path = ROOT, carry: tuple[str, ...] = ()) -> dict:
    """What a device call would send from `root`: tracked files present on disk (a sparse checkout's
    absent ones are not), untracked files git does not ignore, and the `carry` paths; with the largest."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    files = {root / f for f in out.decode(errors="replace").split("\0") if f}
    for c in carry:
        p = root / c
        files |= set(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else ({p} if p.is_file() else set())
    sizes = sorted(((f.stat().st_size, str(f.relative_to(root))) for f in files if f.is_file() and not f.is_symlink()),
                   reverse=True)
    total = sum(b for b, _ in sizes)
    return {"bytes": total, "files": len(sizes), "limit": DEVICE_TREE_LIMIT, "fits": total < DEVICE_TREE_LIMIT,
            "largest": sizes[:5]}


def run_all(ctx: dict, pieces=PIECES, funcs=None, total_s: float = TOTAL_BUDGET_S, echo=print,
            on_row=None) -> list[Row]:
    """Each piece in order under min(its budget, what the whole check has left); a piece left no time is a
    TIMEOUT row. The trainer's budget is its minutes plus its setup allowance."""
    if not funcs:  # the pieces import this module, so their table is looked up here, not at import time
        from dflash2.bench.device.main import FUNCS
        funcs = FUNCS
    end = time.monotonic() + total_s
    rows = []
    for name in pieces:
        own = BUDGETS.get(name, 60) + (60 * ctx.get("train_minutes", 0) if name == "trainer" else 0)
        left = end - time.monotonic()
        budget = min(own, left)
        if budget < 1:
            row = Row(name, TIMEOUT, detail=f"not started: the check's {total_s:.0f} s were spent")
        else:
            ctx["budget"] = budget
            row = run_piece(name, funcs[name], ctx, budget)
        rows.append(row)
        if on_row:
            on_row(rows)
        if echo:
            echo(f"[device_check] {row.piece}: {row.result} ({row.seconds:.1f} s) {row.detail}", flush=True)
    return rows

