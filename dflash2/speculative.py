"""The speculative loop, written once for every backend (PyTorch reference, ONNX Runtime,
TensorRT). No torch: it moves token ids; the backend owns tensors, caches and write pointers.

    t = prefill(prompt).ids[-1]                      # first token + context rows of the prompt
    loop: d = draft(anchor=t) if schedule.wants_draft() else None   # Drafted: ids [S], confidence [S], q
          (or, greedy, d = the last draft's unverified tail when it still follows the output: `wants_reuse`)
          K = schedule.choose(d.confidence, len(d.ids))  # drafts to verify, 0..S (0: a plain decode step)
          p = verify([t, *d.ids[:K]]).ids            # [K+1] target argmax at start..start+K
          acc = leading matches d[k] == p[k]
          commit(acc + 1)                            # KV keeps anchor + accepted; rest: pointer rollback
          emit d[:acc] + [p[acc]]; t = p[acc]        # the bonus becomes the next anchor
Whatever the schedule chooses, the output is the target's greedy continuation (lossless).
At T > 0 (dflash2.sampling) the drafter samples with seeded uniforms and acc / the bonus come from
rejection sampling on the verified rows' logits: the output has the target-only sampling distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from dflash2.sampling import DRAFT, TOKEN, Sampling, sample, uniform, uniforms, verify_round


@dataclass(frozen=True)
class Drafted:
    """What one draft returns: everything the loop reads of it."""

    ids: Sequence[int]  # [S] the drafts
    confidence: Sequence[float] | None = None  # [S] the drafter's per-position confidence (the schedule reads it)
    q: tuple[Any, Any] | None = None  # (candidate ids [S, K], q [S, K]) of a sampled DFlash2 draft; None: one-hot


def _no_logits():
    raise ValueError("this target call has no logits (the backend was not asked to keep them)")


@dataclass(frozen=True)
class Verified:
    """What one target call (prefill / verify / decode) returns: the argmax ids of its rows, and a lazy handle
    on the fp32 logits of its last min(n, B) rows (pulled only when sampling reads them)."""

    ids: Sequence[int]  # [n]
    logits: Callable[[], Any] = _no_logits  # () -> [min(n, B), V] fp32


class SpecBackend(Protocol):
    """Exactly what the loop uses. verify + commit without a draft in between keep the context rows pending
    for the next draft; a verify is always followed by a commit of at least one row (a 1-row verify's state may be
    written in place). A Verified's logits stay valid until the backend's next call."""

    block_size: int  # B; S = B - 1 drafts per round

    def prefill(self, ids: Sequence[int]) -> Verified: ...

    def draft(self, anchor: int, uniforms: Sequence[float] | None = None, temperature: float = 0.0) -> Drafted:
        ...

    def verify(self, tokens: Sequence[int]) -> Verified: ...

    def commit(self, n: int) -> None: ...

    def decode(self, token: int) -> Verified: ...


@dataclass(frozen=True)
class Round:
    """What a schedule learns from one round."""

    drafted: bool  # the drafter ran
    verified: int  # K drafts sent to the target
    accepted: int
    draft_seconds: float
    verify_seconds: float


class DraftSchedule(Protocol):
    name: str

    def start(self) -> None: ...  # a new generation begins

    def wants_draft(self) -> bool: ...

    def choose(self, confidence: Sequence[float] | None, available: int) -> int: ...

    def wants_reuse(self) -> bool: ...  # verify the last draft's still-valid tail instead of drafting again

    def observe(self, r: Round) -> None: ...


class FixedSchedule:
    """K drafts every round (`--draft-len K`)."""

    def __init__(self, k: int):
        self.k, self.name = k, str(k)

    def start(self) -> None:
        pass

    def wants_draft(self) -> bool:
        return True

    def choose(self, confidence: Sequence[float] | None, available: int) -> int:
        return min(self.k, available)

    def wants_reuse(self) -> bool:
        return False  # the drafter runs every round: what --draft-len K measures

    def observe(self, r: Round) -> None:
        pass


@dataclass
class Stats:
    block_size: int
    prompt_tokens: int = 0
    accepted: list[int] = field(default_factory=list)  # drafts matched per round (before truncation)
    verified: list[int] = field(default_factory=list)  # K: drafts verified per round
    skipped: list[bool] = field(default_factory=list)  # the drafter did not run this round and nothing was reused
    reused: list[bool] = field(default_factory=list)  # the drafts verified were the last draft's tail
    emitted: list[int] = field(default_factory=list)  # tokens appended per round (after EOS / limit)
    times: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0,
                                                              "decode": 0.0, "total": 0.0})
    new_tokens: int = 0

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def acceptance_length(self) -> float:
        """tau = accepted drafts + 1 per target verify, averaged over rounds (0 when none)."""
        return sum(a + 1 for a in self.accepted) / self.rounds if self.rounds else 0.0

    def position_acceptance(self) -> list[float]:
        """rate[k] = share of the rounds that verified draft k+1 in which it was accepted (0 when none did).
        Stats built from accepted counts alone (offline acceptance) count every round as verifying all S."""
        S, out = self.block_size - 1, []
        verified = self.verified if len(self.verified) == len(self.accepted) else [S] * self.rounds
        for k in range(S):
            n = sum(v > k for v in verified)
            out.append(sum(a > k for a in self.accepted) / n if n else 0.0)
        return out

    def k_histogram(self) -> dict[str, int]:
        """Rounds per K verified; "skip": rounds whose drafter did not run (K = 0, drafter skipped); "reused":
        rounds that verified the last draft's tail (also counted by their K)."""
        h = {"skip": sum(self.skipped), "reused": sum(self.reused)}
        for k, s in zip(self.verified, self.skipped):
            if not s:
                h[str(k)] = h.get(str(k), 0) + 1
        return h

    @property
    def decode_seconds(self) -> float:
        return self.times["total"] - self.times["prefill"]

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens after the first, over the time after prefill (time-to-first-token excluded)."""
        return (self.new_tokens - 1) / self.decode_seconds if self.new_tokens > 1 and self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        t = dict(self.times)
        t["host"] = max(0.0, t["total"] - sum(v for k, v in t.items() if k != "total"))
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "rounds": self.rounds,
                "acceptance_length": self.acceptance_length, "position_acceptance": self.position_acceptance(),
                "accepted_per_round": list(self.accepted), "emitted_per_round": list(self.emitted),
                "k_histogram": self.k_histogram(),
                "tokens_per_second": self.tokens_per_second, "seconds": t}


@dataclass
class Generation:
    ids: list[int]
    stats: Stats
    stop_reason: str  # "eos" | "length" | "stop"


def gap_closed(selector: float, top1: float, oracle: float) -> float | None:
    """Share of the top-1 -> oracle acceptance gap a selector closes (None when there is no gap)."""
    gap = oracle - top1
    return (selector - top1) / gap if gap > 0 else None


def check_draft_len(draft_len: int | None, block_size: int) -> int:
    S = block_size - 1
    if draft_len is None:
        return S
    if not 1 <= draft_len <= S:
        raise ValueError(f"draft length expected 1..{S} (the drafter's block size - 1), found {draft_len}")
    return draft_len


def parse_draft_len(value, block_size: int | None = None) -> int | str:
    """The one draft-length rule of the CLIs, the API and the benches: 'auto' (or None) -> "auto"; an int or
    its digits -> K, checked against 1..block_size-1 when the block size is known (a CLI parses before it
    knows it: the range is checked, and named, once the drafter is loaded)."""
    if value is None or value == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"draft length: expected 'auto' or an integer, found {value!r}")
    return value if block_size is None else check_draft_len(value, block_size)


def parse_draft_lens(text: str, block_size: int | None = None) -> tuple[int, ...]:
    """A comma-separated list of fixed draft lengths (--sweep-draft-len 1,2,7)."""
    out = [parse_draft_len(x.strip(), block_size) for x in text.split(",") if x.strip()]
    if not out or "auto" in out:
        raise ValueError(f"draft lengths: expected integers like 1,2,7, found {text!r}")
    return tuple(out)


def accepted_prefix(drafts: Sequence[int], preds: Sequence[int]) -> int:
    acc = 0
    while acc < len(drafts) and drafts[acc] == preds[acc]:
        acc += 1
    return acc


def _take(new: list[int], out: list[int], max_new: int, eos: frozenset[int]) -> tuple[list[int], str | None]:
    """Cut a run of new tokens at the first EOS (kept) or the length limit."""
    room = max_new - len(out)
    for i, t in enumerate(new[:room]):
        if t in eos:
            return new[: i + 1], "eos"
    return new[:room], ("length" if len(new) >= room else None)


def generate(backend: SpecBackend, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
             speculative: bool = True, on_tokens: Callable[[list[int]], bool] | None = None,
             draft_len: int | None = None, schedule: DraftSchedule | None = None,
             sampling: Sampling | None = None) -> Generation:
    """Speculative generation; `on_tokens(new)` streams each accepted run and may return True to stop.
    schedule: decides per round whether to draft and how many drafts to verify (the runtime's
    `AutoSchedule`); without one, draft_len drafts every round (default all S = block_size - 1).
    sampling at T > 0: drafts are accepted by rejection sampling against the target's processed
    distribution (dflash2.sampling), so the output has the target-only sampling distribution."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens expected >= 1, found {max_new_tokens}")
    schedule = schedule or FixedSchedule(check_draft_len(draft_len, backend.block_size))
    sampler = None if sampling is None or sampling.greedy else sampling
    stats, eos, clock = Stats(backend.block_size, len(prompt)), frozenset(eos_ids), time.perf_counter
    out: list[int] = []
    tail: tuple[list[int], list[float] | None] | None = None  # unverified drafts that still follow the output
    if speculative:
        schedule.start()
    t0 = clock()
    v = backend.prefill(prompt)
    t = _sample_next(v, sampler, len(prompt)) if sampler else int(v.ids[-1])
    stats.times["prefill"] = clock() - t0
    new, reason = _take([t], out, max_new_tokens, eos)
    while True:
        out += new
        if on_tokens is not None and on_tokens(new):
            reason = reason or "stop"
        if reason:
            break
        at = len(prompt) + len(out) - 1  # absolute position of the anchor t
        if speculative:
            t1 = clock()
            reuse = tail is not None and schedule.wants_reuse()
            d = None if reuse else _draft(backend, t, at, sampler) if schedule.wants_draft() else None
            drafts, conf = tail if reuse else ([int(x) for x in d.ids], d.confidence) if d else ([], None)  # [<=S]
            k = schedule.choose(conf, len(drafts))
            t2 = clock()
            v = backend.verify([t, *drafts[:k]])
            preds = [int(p) for p in v.ids]  # [k+1] target argmax
            t3 = clock()
            if sampler:  # rejection sampling on the verified rows' logits; q one-hot at a draft without one
                acc, bonus = verify_round(v.logits()[-(k + 1):], drafts[:k], *(d.q if d and d.q else (None, None)),
                                          at, sampler)
            else:
                acc = accepted_prefix(drafts[:k], preds)
                bonus = preds[acc]
            backend.commit(acc + 1)
            schedule.observe(Round(d is not None, k, acc, t2 - t1, t3 - t2))
            # greedy: when the k drafts verified and the target's own next token all matched the drafts, the rest
            # of them proposes exactly the positions that follow: free drafts for the next round (a block drafter
            # drafts S at once; most rounds verify fewer)
            tail = (drafts[k + 1:], None if conf is None else [float(c) for c in conf[k + 1:]]) \
                if sampler is None and acc == k and len(drafts) > k + 1 and bonus == drafts[k] else None
            new, reason = _take([*drafts[:acc], bonus], out, max_new_tokens, eos)
            stats.times["draft"] += t2 - t1
            stats.times["verify"] += t3 - t2
            stats.accepted.append(acc)
            stats.verified.append(k)
            stats.skipped.append(d is None and not reuse)
            stats.reused.append(reuse)
            stats.emitted.append(len(new))
            t = bonus
        else:
            t1 = clock()
            v = backend.decode(t)
            t = _sample_next(v, sampler, at + 1) if sampler else int(v.ids[0])
            stats.times["decode"] += clock() - t1
            new, reason = _take([t], out, max_new_tokens, eos)
    stats.times["total"] = clock() - t0
    stats.new_tokens = len(out)
    return Generation(out, stats, reason)


def _sample_next(v: Verified, s: Sampling, position: int) -> int:
    """Target-only sampling of the token at `position` from a target call's last logits row."""
    return sample(v.logits()[-1], s, uniform(s.seed, position, TOKEN))


def _draft(backend: SpecBackend, anchor: int, at: int, s: Sampling | None) -> Drafted:
    if s is None:
        return backend.draft(anchor)
    S = backend.block_size - 1  # row j drafts position at + 1 + j
    return backend.draft(anchor, uniforms(s.seed, at + 1, S, DRAFT), s.temperature)
