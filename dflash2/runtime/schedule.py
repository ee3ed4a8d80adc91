"""How many drafts to verify each round (`--draft-len auto`): a measured cost model + calibrated acceptance.

Per runtime session (one opened export or engine folder):
- `CostModel`: seconds of a target call on n = 1..B rows right after a draft (`verify[n]`), of a
  plain decode step (`decode`: one row, no draft before it) and of one drafter call (`draft`).
  `calibrate` measures them when the session opens (an untimed warm-up first: the first run of each
  shape allocates); every round of the loop then refines them with its own timings (EMA).
- `AcceptanceModel`: P(draft k accepted | drafts 1..k-1 accepted) as a function of the drafter's
  confidence (the selector's walked-candidate probability, DFlash v1's top-1 probability), learned
  from the session's own accept / reject history; prior: the confidence squared (drafters are over-confident).
- `AutoSchedule`: the object the loop asks. After a draft, with p_k the calibrated probabilities,
      K* = argmax_K  sum_{k<=K} prod_{j<=k} p_j  -  rate * verify[K+1]       K in 0..S
  (each extra draft must earn its verify time at the rate the session already gets; K = 0 is a plain
  decode step). Before drafting: if recent drafted rounds were expected to yield fewer tokens than
  plain decoding yields in the same time (draft + verify), skip the drafter; probe again after a
  back-off that doubles while probes keep failing.
No torch, no numpy in the hot path: S <= 16 floats per round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from dflash2.speculative import Round

EMA = 0.15  # weight of a new timing: ~7 rounds of memory, fast enough for a shared, drifting CPU
DRIFT = 0.05  # weight of a round's observed/predicted ratio on the entries it did not measure


@dataclass
class CostModel:
    """Seconds per call. verify[n] for n = 1..B (index 0 unused)."""

    verify: list[float]
    decode: float
    draft: float
    calibration_seconds: float = 0.0  # wall time of `calibrate`, warm-up included
    measured_seconds: float = 0.0  # of which the timed calls (the warm-up is what any first run pays)

    @property
    def block_size(self) -> int:
        return len(self.verify) - 1

    def observe(self, r: Round) -> None:
        """One round's timings. The observed entry follows them (EMA); every entry follows the ratio
        observed / predicted a little (DRIFT), so rows the loop rarely uses track a machine whose speed
        drifts (a shared CPU) instead of keeping stale calibration values."""
        n = r.verified + 1
        predicted = self.verify[n] if r.drafted else self.decode
        seen = min(max(r.verify_seconds, 0.5 * predicted), 2.0 * predicted)  # a stall moves it 2x at most
        g = 1.0 + DRIFT * (seen / predicted - 1.0) if predicted > 0 else 1.0
        self.verify = [v * g for v in self.verify]
        self.decode *= g
        if r.drafted:
            self.draft += EMA * (min(r.draft_seconds, 2.0 * self.draft) - self.draft)
            self.verify[n] += EMA * (seen - self.verify[n])
        else:
            self.draft *= g
            self.decode += EMA * (seen - self.decode)

    def to_dict(self) -> dict:
        return {"verify_ms": [round(1e3 * v, 3) for v in self.verify[1:]], "decode_ms": round(1e3 * self.decode, 3),
                "draft_ms": round(1e3 * self.draft, 3), "calibration_seconds": round(self.calibration_seconds, 4),
                "measured_seconds": round(self.measured_seconds, 4)}


def calibrate(session, token: int = 0, repeats: int = 1) -> CostModel:
    """Time the session's own graphs: decode (1 row), draft, verify of B rows. The rows between 1 and
    B are interpolated linearly (a CPU's verify cost is close to linear in n; a GPU's is flat) until
    the loop measures them. Leaves the session reset (its buffers' contents are scratch)."""
    B = session.block_size
    t0 = time.perf_counter()
    block = [token] * B
    session.prefill(block)  # warm-up, untimed: every shape's first run allocates
    session.draft(token)
    session.verify(block)
    session.commit(1)
    decode, draft, full = [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        session.verify([token])
        decode.append(time.perf_counter() - t)
        session.commit(1)
        t = time.perf_counter()
        session.draft(token)
        draft.append(time.perf_counter() - t)
        t = time.perf_counter()
        session.verify(block)
        full.append(time.perf_counter() - t)
        session.commit(1)
    session.reset()
    d1, dB = min(decode), min(full)  # min: the least disturbed sample on a shared machine
    verify = [0.0] + [d1 + (dB - d1) * (n - 1) / max(B - 1, 1) for n in range(1, B + 1)]
    return CostModel(verify, d1, min(draft), time.perf_counter() - t0, sum(decode) + sum(draft) + sum(full))


@dataclass
class AcceptanceModel:
    """Beta posteriors of acceptance per confidence bin, decaying toward the prior so an unlucky bin
    is tried again; without confidences (an old export), one bin per draft position."""

    bins: int = 10
    prior_strength: float = 4.0  # pseudo-observations behind the prior
    decay: float = 0.998  # per observed round: evidence half-life ~350 rounds
    hits: dict[int, float] = field(default_factory=dict)
    trials: dict[int, float] = field(default_factory=dict)

    def _key(self, conf: float | None, position: int) -> int:
        if conf is None:
            return self.bins + position
        return min(int(conf * self.bins), self.bins - 1) if conf > 0 else 0

    def _prior(self, key: int) -> float:
        if key >= self.bins:  # no confidence: a deliberately modest prior, halving with depth
            return 0.5 ** (key - self.bins + 1)
        # confidence squared: drafters are over-confident. The shipped SmolLM2 drafter's learned rates
        # per bin (0.95 -> 0.78, 0.65 -> 0.47, 0.45 -> 0.25, 0.35 -> 0.07) sit near c^2, not near c.
        return ((key + 0.5) / self.bins) ** 2

    def _posterior(self, key: int) -> float:
        n0 = self.prior_strength
        return (self.hits.get(key, 0.0) + n0 * self._prior(key)) / (self.trials.get(key, 0.0) + n0)

    def probability(self, conf: float | None, position: int) -> float:
        return self._posterior(self._key(conf, position))

    def observe(self, confidence: Sequence[float] | None, verified: int, accepted: int) -> None:
        """Drafts 1..accepted were accepted, draft accepted+1 (if verified) was rejected; later ones unseen."""
        if not verified:
            return
        for key in self.trials:
            self.trials[key] *= self.decay
            self.hits[key] *= self.decay
        for k in range(min(accepted + 1, verified)):
            key = self._key(None if confidence is None else float(confidence[k]), k)
            self.trials[key] = self.trials.get(key, 0.0) + 1.0
            self.hits[key] = self.hits.get(key, 0.0) + (1.0 if k < accepted else 0.0)

    def to_dict(self) -> dict:
        """Per bin (confidence bins 0..bins-1, then draft positions when there are no confidences)."""
        keys = sorted(self.trials)
        return {"bins": self.bins, "prior_strength": self.prior_strength,
                "probability": {str(k): round(self._posterior(k), 4) for k in keys},
                "trials": {str(k): round(self.trials[k], 2) for k in keys}}


class AutoSchedule:
    """The per-session draft-length policy (implements `dflash2.speculative.DraftSchedule`)."""

    name = "auto"
    MAX_BACKOFF = 64  # rounds skipped between probes at most: a failed probe costs ~one draft call

    def __init__(self, costs: CostModel, acceptance: AcceptanceModel | None = None):
        self.costs, self.acceptance = costs, acceptance or AcceptanceModel()
        self.surplus = 0.5  # EMA of expected tokens over plain decoding per drafted round; > 0: draft first
        self.skip_left, self.backoff, self.probing = 0, 1, False
        self.expected = 0.0  # surplus the last choose() predicted
        self.confidence: Sequence[float] | None = None
        self.tokens = self.seconds = 0.0  # EMAs of one round's tokens and seconds: the achieved rate

    @property
    def rate(self) -> float:
        """Tokens per second an extra verified draft must beat: the better of plain decoding and the
        rate the session achieves."""
        ar = 1.0 / self.costs.decode if self.costs.decode > 0 else 0.0
        return max(ar, self.tokens / self.seconds if self.seconds > 0 else 0.0)

    def wants_draft(self) -> bool:
        if self.skip_left > 0:
            self.skip_left -= 1
            return False
        return True

    def choose(self, confidence: Sequence[float] | None, available: int) -> int:
        self.confidence = confidence
        if available == 0:
            return 0
        c, rate, acc = self.costs, self.rate, self.acceptance
        best_k, best_v, best_t = 0, 1.0 - rate * c.verify[1], 1.0
        expected, reach = 1.0, 1.0  # expected tokens of K drafts; P(drafts 1..k all accepted)
        for k in range(1, min(available, c.block_size - 1) + 1):
            reach *= acc.probability(None if confidence is None else float(confidence[k - 1]), k - 1)
            expected += reach
            value = expected - rate * c.verify[k + 1]
            if value > best_v:
                best_k, best_v, best_t = k, value, expected
        # tokens over what plain decoding makes in this round's time (the draft already spent)
        self.expected = best_t - (c.draft + c.verify[best_k + 1]) / c.decode
        return best_k

    def observe(self, r: Round) -> None:
        self.costs.observe(r)
        spent = r.verify_seconds + (r.draft_seconds if r.drafted else 0.0)
        self.tokens += EMA * (r.accepted + 1 - self.tokens)
        self.seconds += EMA * (spent - self.seconds)
        if not r.drafted:
            return
        self.acceptance.observe(self.confidence, r.verified, r.accepted)
        if self.probing:
            if self.expected > 0:  # the probe says drafting pays again
                self.surplus, self.backoff, self.probing = self.expected, 1, False
            else:
                self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
                self.skip_left = self.backoff
            return
        self.surplus += 0.3 * (self.expected - self.surplus)
        if self.surplus < 0:
            self.probing, self.skip_left = True, self.backoff

    def to_dict(self) -> dict:
        return {"costs": self.costs.to_dict(), "acceptance": self.acceptance.to_dict(),
                "backoff": self.backoff, "surplus": round(self.surplus, 4)}
