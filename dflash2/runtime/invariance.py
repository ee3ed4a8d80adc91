"""Row invariance: does a k-row verify give, bit for bit, the logits that k 1-row decode steps give?

Greedy speculative decoding is lossless only if it does: the loop accepts a draft where the verify's argmax
equals it and takes the verify's argmax as the bonus token, so every verify row stands in for the decode step
target-only generation would have run at that position. Exact arithmetic guarantees it; a kernel that computes
a 1-row call and a k-row call differently (another summation order, another activation quantization path)
does not, and then a near tie can go either way. Measured on ONNX Runtime 1.32's CPU provider (AVX-512 VNNI,
SmolLM2-135M): fp32 (plain and fused-op graphs), int4 block 32 and int8 give bitwise-equal logits; int4
blocks 64 and 128 differ on every row (up to 1.6 / 3.0 in the logits) and their speculative output differed
from their own autoregressive output (docs/quantization.md).

The check runs the session exactly as generation does (the same binding, buffers, threads and in-place KV):
a greedy 1-row continuation of a fixed prompt, then the same tokens again as k-row verifies committed in full
for every k in 2..B, comparing every row's logits (bitwise) and argmax id with the 1-row pass. Before each
k-row pass the KV rows past the prompt are filled with NaN, so a verify that reads a row no earlier call of
that pass wrote shows up. Kernels are chosen per CPU (MLAS dispatches on the instruction set), so the export
checks the machine it runs on; `dflash2-run --check-rows` checks the machine that deploys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dflash2 import manifest as mf
from dflash2.runtime.binding import GqaSharedKv

# 48 + 40: the verifies straddle 64 keys, where MLAS's SGEMM changes path for a 256-long dot product (an attention
# over head_dim 256, Qwen3.5's: a k-row verify and a 1-row decode then differ once one is past 64 keys and the other
# not; measured on this CPU, docs/families/qwen3_5.md)
PROMPT_TOKENS, CONTINUATION = 48, 40
KEY = mf.ROW_CHECK  # the export manifest's validation record of this check
FIELD = f'validation["{KEY}"]'
COSTS = "costs_ms"  # its steps' entry with the calls' timings


@dataclass
class RowCheck:
    rows: int = 0  # verify rows compared
    differing: int = 0  # of them, logits not bitwise equal to the 1-row decode's, or another argmax id
    argmax_flips: int = 0  # of them, another argmax id (a speculative output that would differ)
    max_abs: float = 0.0  # over the finite entries
    per_k: dict[int, dict] = field(default_factory=dict)
    compactions: int = 0  # a windowed target's: the fewest window-buffer compactions one pass crossed
    seconds: dict[int, float] = field(default_factory=dict)  # rows -> the fastest call of that many rows (1: decode)

    @property
    def ok(self) -> bool:
        return self.rows > 0 and self.differing == 0

    def failures(self, what: str, hint: str = "") -> list[str]:
        if self.rows == 0 or self.ok:
            return []
        bad = ", ".join(f"k={k}: {v['differing']}/{v['rows']}" for k, v in self.per_k.items() if v["differing"])
        return [f"{what}: expected a k-row verify bitwise equal to k 1-row decode steps, found {self.differing} of "
                f"{self.rows} rows differing ({bad}; max |logit difference| {self.max_abs:.3g}; {self.argmax_flips} "
                f"rows take another argmax): this graph's kernels on this CPU are not row-count invariant, so "
                f"speculative output would not always equal target-only output (not lossless)"
                + (f". {hint}" if hint else "")]


def _prompt(vocab: int, n: int) -> list[int]:
    # fixed ids in [1, min(vocab, 32000)) (no tokenizer needed); the continuation is the target's own argmax
    m = min(vocab, 32_000)
    return [(7919 * i + 104_729) % max(m - 1, 1) + 1 for i in range(n)]


def continuation_for(window_capacity: int | None) -> int:
    """Tokens the check generates after its prompt: CONTINUATION, or for a windowed target (runtime.window) enough
    to pass its window buffer's capacity twice, so every k pass crosses compactions (at other commit points than
    the 1-row decode's: what ALIGN there is for)."""
    return CONTINUATION if window_capacity is None else max(CONTINUATION, 2 * window_capacity)


def sizes(max_seq_len: int, block_size: int, want: int = CONTINUATION) -> tuple[int, int]:
    """(prompt tokens, continuation) that fit the session: PROMPT_TOKENS + `want` (CONTINUATION) where they do, else a
    shorter prompt first (a continuation of at least B tokens checks every k), then a shorter continuation.
    The last call writes row prompt + continuation - 1 and the gqa kernel one spare row after it."""
    room = max_seq_len - 1
    prompt = max(1, min(PROMPT_TOKENS, room - block_size))
    return prompt, max(0, min(want, room - prompt))


def _poison(kv, start: int) -> None:
    """NaN into every KV row from `start` on, where the buffer is host memory (ONNX Runtime's CPU provider)."""
    host = getattr(kv.buffer, "host", None)
    if not isinstance(host, np.ndarray) or not np.issubdtype(host.dtype, np.floating):
        return
    axis = 2 if isinstance(kv, GqaSharedKv) else 0  # [2L, kv, T, hd] or [T, *row]
    index = [slice(None)] * host.ndim
    index[axis] = slice(start, None)
    host[tuple(index)] = np.nan


def _release_stale(session) -> None:
    """A hybrid target's recurrent-state rows that no later step reads, handed back to the OS before a step
    (RowStates.release_stale): this check's verifies of every k up to B touch both state buffers whole, 0.6 GiB
    at Qwen3.5-0.8B's shape where 17 rows (0.3 GiB) are live at most. What the steps compute is unchanged: a step
    reads only the current row and writes every row it outputs."""
    states = getattr(session, "states", None)
    if states is not None:
        states.release_stale()


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_rows(session, continuation: int | None = None) -> RowCheck:
    """Compare every k-row verify (k = 2..B) row with the 1-row decode at the same position. continuation: tokens
    after the prompt (None: continuation() for the session's target), as many as max_seq_len leaves room for."""
    window = getattr(session, "window", None)
    if continuation is None:
        continuation = continuation_for(window.capacity if window is not None else None)
    n_prompt, fits = sizes(session.max_seq_len, session.block_size, continuation)
    continuation = min(continuation, fits)
    prompt = _prompt(session.vocab_size, n_prompt)
    first = session.prefill(prompt)
    tokens, want, out = [int(first.ids[-1])], [], RowCheck()
    for _ in range(continuation):  # the reference: one row per call, as target-only generation runs
        t0 = time.perf_counter()
        v = session.decode(tokens[-1])
        _fastest(out.seconds, 1, time.perf_counter() - t0)
        want.append(np.array(v.logits()[0], copy=True))
        tokens.append(int(v.ids[0]))
    for k in range(2, min(session.block_size, continuation) + 1):
        session.reset()  # what prefill starts with; here first, so that no state row is live for the release
        _release_stale(session)
        session.prefill(prompt)
        _poison(session.target_kv, n_prompt)
        window = getattr(session, "window", None)
        if window is not None:  # the window buffer's rows past the prompt's (its row r holds position base + r)
            _poison(window, n_prompt - window.base)
        n = d = flips = 0
        for p in range(0, continuation - k + 1, k):  # rows p..p+k-1 predict tokens p+1..p+k, as in a verify
            _release_stale(session)
            t0 = time.perf_counter()
            v = session.verify(tokens[p:p + k])
            _fastest(out.seconds, k, time.perf_counter() - t0)
            logits, ids = v.logits()[:k], [int(x) for x in v.ids[:k]]
            for r in range(k):
                flip = ids[r] != tokens[p + r + 1]
                bad = flip or not _same_bits(logits[r], want[p + r])
                n, d, flips = n + 1, d + bad, flips + flip
                with np.errstate(invalid="ignore"):  # inf - inf: not a finite difference, left out of max_abs
                    diff = np.abs(logits[r].astype(np.float64) - want[p + r])
                finite = diff[np.isfinite(diff)]
                out.max_abs = max(out.max_abs, float(finite.max()) if finite.size else 0.0)
            session.commit(k)
        out.per_k[k] = {"rows": n, "differing": d}
        if window is not None:
            out.compactions = window.compactions if k == 2 else min(out.compactions, window.compactions)
        out.rows, out.differing, out.argmax_flips = out.rows + n, out.differing + d, out.argmax_flips + flips
    session.reset()
    return out


def _fastest(seconds: dict[int, float], rows: int, t: float) -> None:
    seconds[rows] = min(t, seconds.get(rows, t))  # the least disturbed call: the first of a shape allocates


def draft_seconds(session, calls: int = 3) -> float:
    """The fastest of `calls` drafts of one new context row after a 2-token prefill (what a round's draft catches up
    at one accepted token). Opens the drafter's session where the runtime defers it (the row check's): after the
    check, the state rows it wrote handed back and only two written again (a 48-token prefill here took the
    Qwen3.5-0.8B export's peak from 1.94 to 2.14 GiB)."""
    prompt = _prompt(session.vocab_size, 2)
    session.reset()
    _release_stale(session)
    session.prefill(prompt)
    session.draft(prompt[-1])  # the prompt's rows: the first call of the drafter (it allocates)
    best = float("inf")
    for _ in range(calls):
        session.ctx_pos, session.pending = session.ctx_pos - 1, 1  # the last context row again, written in place
        t0 = time.perf_counter()
        session.draft(prompt[-1])
        best = min(best, time.perf_counter() - t0)
    session.reset()
    return best


def costs_ms(r: RowCheck, draft_s: float, block_size: int, threads: int | None) -> dict | None:
    """The row check's timings as the schedule's prior (`AutoSchedule.from_prior`): verify[n] for n = 1..B (the check
    times every row count 1..k_max; past k_max, where max_seq_len left no room, the slope of the last two), decode,
    draft, ms."""
    if 1 not in r.seconds or not 0 < draft_s < float("inf"):
        return None
    t, top = r.seconds, max(r.seconds)
    slope = (t[top] - t[top - 1]) if top > 1 else 0.0
    verify = [0.0] + [round(1e3 * (t[n] if n <= top else t[top] + slope * (n - top)), 4)
                      for n in range(1, block_size + 1)]
    return {"decode": verify[1], "verify": verify, "draft": round(1e3 * draft_s, 4), "threads": threads,
            "why": "the fastest call of each row count in this check, on the machine that exported: the prior of "
                   "--draft-len auto's cost model (dflash2.runtime.schedule.AutoSchedule.from_prior)"}


def validation(session, what: str = "target", hint: str = "", timed: bool = True) -> mf.Validation:
    """The check as an export validation record (manifest.validation["target.rows"]); timed: with the calls'
    timings and a draft's as steps[COSTS] (the schedule's prior) where the check passed."""
    r = check_rows(session)
    if r.rows == 0:
        return mf.Validation(ok=False, failures=[], skipped=f"max_seq_len {session.max_seq_len} leaves no room for "
                                                            f"a 2-row verify after a prompt")
    steps = {"rows": r.rows, "differing": r.differing, "argmax_flips": r.argmax_flips, "max_abs": r.max_abs,
             "per_k": {str(k): v for k, v in r.per_k.items()}, "rule": "bitwise equal logits and equal argmax ids",
             "k_max": max(r.per_k)}
    if getattr(session, "window", None) is not None:  # the window buffer's compactions a pass crossed (fewest)
        steps["window_compactions"] = r.compactions
    if r.ok and timed:
        try:
            d = draft_seconds(session)
        except Exception:  # noqa: BLE001 - a prior only saves a cold session time; the check's verdict stands
            d = float("inf")
        c = costs_ms(r, d, session.block_size, getattr(session.backend, "threads", None))
        if c is not None:
            steps[COSTS] = c
    return mf.Validation(ok=r.ok, failures=r.failures(what, hint), steps=steps)
