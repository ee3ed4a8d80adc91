"""Draft-length schedules compared without timing noise (`scripts/experiments/replay_schedules.py` is the command).

`record` runs each answer once with the drafter at EVERY position (verifying none of its drafts) and keeps per
position the drafter's confidences and how many of its drafts match the output; `replay` drives a schedule
through the rounds the runtime loop would run over those positions and prices each round from one measured cost
table (`cost_table`). Why it is exact: greedy speculative output is the target's own greedy output, and the
export's row-invariance check makes a verified row bitwise a decoded one, so the drafter's context (the committed
tokens' taps) is the same whatever the schedule did before: what it drafts at position i, and so how many of K
drafts the target accepts there (min(K, the matching prefix)), depends only on i. A wall-clock A/B on this shared
2-core machine moves one prompt by up to 30%; a replay of 32 answers takes a second and is the same every time.
What it leaves out: host time per round, and how a draft call disturbs the target's caches (wall-clock A/Bs:
`scripts/experiments/bench_schedules.py`).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from typing import Callable, Sequence

import numpy as np

from dflash2.speculative import DraftSchedule, Round, generate


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cost_table(s, repeats: int = 40, context: int = 100) -> dict:
    """ms: decode, verify[n] for n = 1..B (1 = decode), draft_base + draft_per_row * rows caught up."""
    B = s.block_size
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(context)]
    s.prefill(prompt)
    rows = (1, 16, 64)
    samples = {"decode": [], **{f"draft{r}": [] for r in rows}, **{f"verify{k}": [] for k in range(2, B + 1)}}
    for _ in range(repeats):
        s.pos = s.ctx_pos = context
        s.pending = 1
        samples["decode"].append(_timed(lambda: s.decode(prompt[-1])))
        for r in rows:
            s.pos, s.ctx_pos, s.pending = context, context - r, r
            samples[f"draft{r}"].append(_timed(lambda: s.draft(prompt[-1])))
        for k in range(2, B + 1):
            s.pos = context
            samples[f"verify{k}"].append(_timed(lambda: s.verify(prompt[-k:])))
    ms = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
    per_row = max((ms["draft64"] - ms["draft1"]) / 63, 0.0)
    return {"decode": ms["decode"], "verify": [0.0, ms["decode"], *(ms[f"verify{k}"] for k in range(2, B + 1))],
            "draft_base": ms["draft1"] - per_row, "draft_per_row": per_row, "measured_ms": ms}


class _EveryPosition:
    """Draft at every position, verify none of the drafts: the anchors walk the whole answer."""

    name = "record"

    def start(self) -> None: ...

    def wants_draft(self) -> bool:
        return True

    def wants_reuse(self) -> bool:
        return False

    def choose(self, confidence, available: int) -> int:
        return 0

    def observe(self, r: Round) -> None: ...


class Thresholds(_EveryPosition):
    """Draft every round; verify the leading drafts whose confidence exceeds t1 (the first) / t2 (the others):
    priced over a trace with thresholds chosen knowing its answers, the bound of rules that read confidences only
    (scripts/experiments/replay_schedules.py thresholds)."""

    name = "thresholds"

    def __init__(self, t1: float, t2: float):
        self.t = (t1, t2)

    def choose(self, confidence, available: int) -> int:
        k = 0
        while k < available and confidence is not None and confidence[k] > self.t[min(k, 1)]:
            k += 1
        return k


def record(rt, prompts: Sequence, max_new_tokens: int = 128, log: Callable[[str], None] | None = None) -> list[dict]:
    """Per prompt: the answer's length, and per anchor position p (ids[p] the last token out) the drafts' matching
    prefix, the drafter's confidences (None: a DFlash v1 drafter without them) and the target's top-1 probability
    of ids[p + 1]. Matches are counted against the target's own greedy continuation PAST the answer's end (EOS and
    the length limit cut what the loop emits, not what it counts as accepted), so a replay sees the loop's counts."""
    s = rt.session
    B = s.block_size
    drafted, target_p = [], []  # per call, copied: the session's output buffers are reused
    real_draft, real_verify = s.draft, s.verify

    def draft(*args, **kw):
        d = real_draft(*args, **kw)
        drafted.append(([int(x) for x in d.ids], None if d.confidence is None else [float(c) for c in d.confidence]))
        return d

    def verify(tokens):
        v = real_verify(tokens)
        z = v.logits()[-1].astype(np.float64)
        target_p.append(round(float(1.0 / np.exp(z - z.max()).sum()), 4))
        return v

    s.draft, s.verify = draft, verify
    answers = []
    try:
        for i, prompt in enumerate(prompts):
            ids = rt.prompt_ids(text=prompt, chat=True) if isinstance(prompt, str) else list(prompt)
            answer = generate(s, ids, max_new_tokens, rt.eos_ids, speculative=False).ids
            n = len(answer)
            truth = generate(s, ids, n + B, (), speculative=False).ids  # no EOS stop: the target's continuation
            drafted.clear()
            target_p.clear()
            g = generate(s, ids, n, (), schedule=_EveryPosition())  # the drafter at anchors 0 .. n - 2
            if truth[:n] != answer or g.ids != answer:
                raise RuntimeError(f"prompt {i}: the drafting run's output differs from the autoregressive one")
            positions = []
            for p, (d_ids, conf) in enumerate(drafted):  # anchor answer[p]; its drafts propose truth[p + 1 ...]
                after, m = truth[p + 1:], 0
                while m < len(d_ids) and m < len(after) and d_ids[m] == after[m]:
                    m += 1
                positions.append({"match": m, "confidence": conf, "target_p": target_p[p]})
            answers.append({"prompt": i, "prompt_tokens": len(ids), "tokens": n, "positions": positions})
            if log is not None:
                log(f"[{i + 1}/{len(prompts)}] {n} tokens, mean match {statistics.mean(x['match'] for x in positions):.2f}")
    finally:
        del s.draft, s.verify  # the instance attributes go: the class's methods are back
    return answers


def replay(schedule: DraftSchedule | None, trace: dict) -> dict:
    """One session: every answer of the trace in turn through one schedule instance. Priced in ms.
    schedule None: the oracle bound (`bound`). A schedule whose `wants_reuse()` says so verifies the unverified
    tail of the last draft instead of drafting again, when every verified draft and the target's own next token
    matched it (greedy: the tail then proposes exactly the positions that follow)."""
    if schedule is None:
        return bound(trace)
    c = trace["costs_ms"]
    S = trace["block_size"] - 1
    ms = ar_ms = 0.0
    tokens = drafted = rounds = reused = accepted = 0
    for ans in trace["answers"]:
        pos, n, pending = ans["positions"], ans["tokens"], ans.get("prompt_tokens", 1)  # the first draft takes the prompt
        schedule.start()
        p, tail = 0, None  # p: index of the anchor (ids[p] is the last token out); tail: (q, o) = drafts[q][o:]
        while p < n - 1:
            from_tail = tail is not None and bool(schedule.wants_reuse())
            if from_tail:
                q, o = tail
                conf, match, d = pos[q]["confidence"], max(pos[q]["match"] - o, 0), False
                conf = None if conf is None else conf[o:]  # (a drafter without confidences: None)
                k = schedule.choose(conf, S - o)
            else:
                q, o, match = p, 0, pos[p]["match"]
                d = schedule.wants_draft()
                k = schedule.choose(pos[p]["confidence"], S) if d else 0
            draft_ms = c["draft_base"] + c["draft_per_row"] * pending if d else 0.0
            acc = min(k, match)  # as the loop counts it: the answer's end truncates what is emitted, not this
            verify_ms = c["verify"][k + 1]
            schedule.observe(Round(d, k, acc, draft_ms / 1e3, verify_ms / 1e3))
            pending = acc + 1 + (0 if d else pending)
            ms += draft_ms + verify_ms
            reused += from_tail
            # the tail stays valid when all k drafts and the bonus (the target's next token) matched it
            tail = (q, o + k + 1) if (d or from_tail) and acc == k and match >= k + 1 \
                and o + k + 1 < S else None
            p, rounds, drafted, accepted = p + acc + 1, rounds + 1, drafted + d, accepted + acc
        tokens += n - 1
        ar_ms += (n - 1) * c["decode"]
    return {"speed": ar_ms / ms, "rounds": rounds, "drafted": drafted, "reused": reused, "accepted": accepted,
            "tokens": tokens}


def bound(trace: dict, skip: bool = True) -> dict:
    """The least time any schedule could spend on the trace's answers knowing every position's match (exact, by
    dynamic programming over the anchors): the oracle (`skip`: each round drafts or decodes, and verifies any k of
    the drafts that will match), or perfect confidence (skip False: every round drafts, as a schedule that learns
    what it drafted only by drafting, then verifies any k of the matching drafts; fixed K and confidence thresholds
    are such schedules). Draft tails (a verify without a drafter call) cannot beat the oracle where a verify of
    r1 + r2 rows costs at most r1 rows' and r2 rows' apart (every measured table): one round verifying both parts
    is cheaper. Priced with the draft's per-row term at the rows then pending, as `replay` does."""
    c = trace["costs_ms"]
    S = trace["block_size"] - 1
    ms = ar_ms = 0.0
    tokens = drafted = rounds = accepted = 0
    for ans in trace["answers"]:
        pos, n = ans["positions"], ans["tokens"]
        best: dict[tuple[int, int], tuple[float, tuple]] = {}  # (anchor, rows pending) -> (ms to the end, first step)

        def key(p: int, pending: int) -> tuple[int, int]:
            return p, pending if c["draft_per_row"] else 0  # the rows pending only price a draft

        def value(p: int, pending: int) -> float:
            return 0.0 if p >= n - 1 else best[key(p, pending)][0]

        def solve(p0: int, pending0: int) -> float:
            """Every state (p, pending) reachable from p0 solved, deepest first (an explicit stack: a run of skipped
            drafts chains as many states as the answer has tokens)."""
            stack = [(p0, pending0)]
            while stack:
                p, pending = stack[-1]
                if p >= n - 1 or key(p, pending) in best:
                    stack.pop()
                    continue
                m = min(pos[p]["match"], S, n - 2 - p)  # drafts that count: the answer's end truncates the rest
                steps = [((True, k), p + k + 1, k + 1) for k in range(m + 1)]
                if skip:
                    steps.append(((False, 0), p + 1, pending + 1))
                todo = [(q, r) for _, q, r in steps if q < n - 1 and key(q, r) not in best]
                if todo:
                    stack.extend(todo)
                    continue
                draft = c["draft_base"] + c["draft_per_row"] * pending
                best[key(p, pending)] = min(((draft if d else 0.0) + c["verify"][k + 1] + value(q, r), (d, k))
                                            for (d, k), q, r in steps)
                stack.pop()
            return value(p0, pending0)

        p, pending = 0, ans.get("prompt_tokens", 1)
        ms += solve(p, pending)
        while p < n - 1:  # the path, for the counts
            d, k = best[key(p, pending)][1]
            p, pending = p + k + 1, k + 1 + (0 if d else pending)
            rounds, drafted, accepted = rounds + 1, drafted + d, accepted + k
        tokens += n - 1
        ar_ms += (n - 1) * c["decode"]
    return {"speed": ar_ms / ms, "rounds": rounds, "drafted": drafted, "reused": 0, "accepted": accepted,
            "tokens": tokens}


def scaled_costs(table: dict, draft: float = 1.0, verify: float = 1.0) -> dict:
    """A cost table with the draft's cost times `draft` and what each verify costs beyond a decode step times
    `verify` (0: a verify of any rows costs one decode step, as on a GPU): what a cheaper drafter or a flatter
    verify would be worth, priced over the same recorded drafts (`scripts/experiments/replay_schedules.py bounds`)."""
    d = table["decode"]
    return {**table, "draft_base": table["draft_base"] * draft, "draft_per_row": table["draft_per_row"] * draft,
            "verify": [0.0, *(d + (v - d) * verify for v in table["verify"][1:])]}


def load_schedules(items: Sequence[str]) -> dict:
    """NAME=FILE -> the `AutoSchedule` class of FILE (another version of dflash2/runtime/schedule.py, e.g. `git show
    REV:...`), to compare schedules in one process. A version from before draft tails (no `wants_reuse`) is refused
    here, in one line, rather than deep in the loop: the DraftSchedule protocol is what the loop calls."""
    out = {}
    for item in items:
        name, _, path = item.partition("=")
        spec = importlib.util.spec_from_file_location(f"_schedule_{name}", path) if path else None
        if spec is None or spec.loader is None:
            raise ValueError(f"--schedule {item}: expected NAME=FILE, FILE a Python file")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
        spec.loader.exec_module(mod)
        if not hasattr(mod, "AutoSchedule"):
            raise ValueError(f"--schedule {item}: expected a class AutoSchedule in it, found none")
        if not callable(getattr(mod.AutoSchedule, "wants_reuse", None)):
            raise ValueError(f"--schedule {item}: its AutoSchedule predates draft tails (no wants_reuse); add "
                             f"`def wants_reuse(self): return False` to replay it")
        out[name] = mod.AutoSchedule
    return out


def geometric_rate(tau: float, S: int) -> float:
    """The per-draft acceptance a (each draft accepted with probability a once every draft before it was) at which a
    round of all S drafts yields tau tokens on average: 1 + sum_{j=1..S} a^j = tau (bisection; tau in [1, S + 1])."""
    if not 1.0 <= tau <= S + 1:
        raise ValueError(f"tau: expected 1 .. {S + 1} (a round of {S} drafts), found {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if 1 + sum(a ** j for j in range(1, S + 1)) < tau else (lo, a)
    return (lo + hi) / 2


def synthetic_trace(tau: float, block_size: int, costs_ms: dict, answers: int = 32, tokens: int = 128,
                    prompt_tokens: int = 40, seed: int = 0) -> dict:
    """A trace as `record` writes one, for a drafter that is not here: at every anchor the drafts' matching prefix is
    drawn (seeded) so that a round of all block_size - 1 drafts yields `tau` tokens on average (tau as model cards
    publish it: accepted drafts + 1 per round at the full block). Draft j is accepted with probability a once drafts
    1..j-1 were (a = geometric_rate(tau, S)), independently at each anchor: no confidences (a DFlash v1 drafter's
    form; the schedule then learns one acceptance rate per draft position) and no runs of easy text: a schedule that
    reads either may do better on a real trace of the same tau. Priced by `costs_ms` (`cost_table`); every answer's
    first draft catches up `prompt_tokens` rows, as `record`'s traces say."""
    rng, S = np.random.default_rng(seed), block_size - 1
    a = geometric_rate(tau, S)
    out = []
    for i in range(answers):
        draws = rng.random((tokens - 1, S)) < a  # anchors 0 .. tokens - 2; draws[p, j]: draft j + 1 right, given the rest
        match = np.where(draws.all(axis=1), S, np.argmin(draws, axis=1))  # the leading run of True
        out.append({"prompt": i, "prompt_tokens": prompt_tokens, "tokens": tokens,
                    "positions": [{"match": int(m), "confidence": None, "target_p": None} for m in match]})
    return {"export": None, "synthetic": {"tau": tau, "rate": a, "seed": seed}, "block_size": block_size,
            "costs_ms": costs_ms, "answers": out}
