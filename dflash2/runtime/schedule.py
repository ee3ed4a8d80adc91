"""How many drafts to verify each round (`--draft-len auto`): a measured cost model + calibrated acceptance.

Per runtime session (one opened export or engine folder):
- `CostModel`: seconds of a target call on n = 1..B rows right after a draft (`verify[n]`), of a
  plain decode step (`decode`: one row, no draft before it) and of one drafter call (`draft`).
  `Calibration` measures them from the session's first four rounds (they generate tokens like any
  other round, on a fixed plan: no extra engine calls); every later round refines them: all entries
  follow the machine's speed, the observed one also the curve's shape.
- `AcceptanceModel`: P(draft k accepted | drafts 1..k-1 accepted) as a function of the drafter's
  confidence (the selector's walked-candidate probability, DFlash v1's top-1 probability), learned
  from the session's own accept / reject history; prior: the confidence squared (drafters are over-confident).
- `AutoSchedule`: the object the loop asks. After a draft, with p_k the calibrated probabilities,
      K* = argmax_K  sum_{k<=K} prod_{j<=k} p_j  -  rate * verify[K+1]       K in 0..S
  (each extra draft must earn its verify time at the rate the session already gets; K = 0 is a plain
  decode step). Before drafting: if recent drafted rounds were expected to yield fewer tokens than
  plain decoding yields in the same time (draft + verify), skip the drafter; probe again after a
  back-off that doubles while probes keep failing (how fast it ends: `AutoSchedule`), and only while what probes
  lost stays within 1.5% of the session's plain decoding time (`AutoSchedule.affordable`).
- A cold session on an export whose row check timed its calls starts from that cost model (`AutoSchedule.from_prior`).
No torch, no numpy in the hot path: S <= 16 floats per round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from dflash2.speculative import Round

EMA = 0.15  # weight of a new timing: ~7 rounds of memory, fast enough for a shared, drifting CPU
SPEED = 0.12  # weight (in log space) of a round's observed/predicted ratio on EVERY entry: the machine's speed
SHAPE = 0.03  # and on the observed entry alone: the cost curve's shape


@dataclass
class CostModel:
    """Seconds per call. verify[n] for n = 1..B (index 0 unused)."""

    verify: list[float]
    decode: float
    draft: float

    @property
    def block_size(self) -> int:
        return len(self.verify) - 1

    @classmethod
    def from_samples(cls, block_size: int, decode: float, draft: float, rows: int, seconds: float) -> "CostModel":
        """decode (1 row), draft and a verify of `rows` rows measured; the other row counts follow the
        line through (1, decode) and (rows, seconds) (a CPU's verify cost is close to linear in n, a
        GPU's flat) until the loop measures them."""
        slope = (seconds - decode) / max(rows - 1, 1)
        return cls([0.0] + [max(decode + slope * (n - 1), 0.5 * decode) for n in range(1, block_size + 1)],
                   decode, draft)

    def observe(self, r: Round) -> None:
        """One round's timings, as a ratio to what the model predicted. Every entry follows that ratio
        (SPEED: the machine got faster or slower, which on a shared CPU changes by 2x within a minute)
        and the observed entry a little more (SHAPE: the curve itself was off). A model whose observed
        entry alone followed the machine would, after a slow spell, think the one K it keeps using
        cheaper than a decode step (measured: verify of 6 rows at 37 ms beside a stale 56 ms decode)."""
        n = r.verified + 1
        plain = n == 1 and not r.drafted  # a decode step (a verify of reused drafts is a verify)
        predicted = self.decode if plain else self.verify[n]
        if predicted <= 0:
            return
        ratio = min(max(r.verify_seconds / predicted, 0.5), 2.0)  # a stall moves it 2x at most
        g, local = ratio ** SPEED, ratio ** SHAPE
        self.verify = [v * g for v in self.verify]
        self.decode *= g
        if plain:
            self.decode *= local
        else:
            self.verify[n] *= local
        if r.drafted:
            self.draft += EMA * (min(r.draft_seconds, 2.0 * self.draft) - self.draft)
        else:
            self.draft *= g

    def to_dict(self) -> dict:
        return {"verify_ms": [round(1e3 * v, 3) for v in self.verify[1:]], "decode_ms": round(1e3 * self.decode, 3),
                "draft_ms": round(1e3 * self.draft, 3)}


@dataclass
class Calibration:
    """The cost model's first measurements, taken from the session's first rounds instead of separate
    engine calls: those rounds generate tokens like any other (the verify decides them), they only
    follow a fixed plan. "full" drafts and verifies half the drafts (times the drafter and a verify of
    (S+1)/2 + 1 rows: enough for the line through the verify costs, at ~60% of the cost of verifying
    all S, which made calibration 1.1% of a 128-token generation in one run), "decode" verifies the
    anchor alone (a decode step). Each is taken twice and the smaller
    sample kept: the first run of a shape allocates, and on a shared machine the least disturbed
    sample is the truest. What it costs is what those rounds took beyond producing their tokens at the
    rate the session then achieves (`added_seconds`); on a GPU, where verifying all drafts is what the
    policy would choose anyway, that is about nothing."""

    plan: tuple[str, ...] = ("full", "decode", "full", "decode")
    samples: dict[str, list[float]] = field(default_factory=lambda: {"decode": [], "draft": [], "full": []})
    prior: CostModel | None = None  # costs measured by the export's row check (`AutoSchedule.from_prior`)
    rounds: int = 0
    seconds: float = 0.0  # wall time of the calibration rounds (draft + verify)
    tokens: int = 0  # tokens they produced

    @property
    def active(self) -> bool:
        """Until the plan is done and every quantity has a sample (a round that verified fewer drafts
        than planned times nothing: the plan repeats, four times at most)."""
        need = ("decode",) if self.prior is not None else tuple(self.samples)  # a prior: decode steps scale it
        missing = not all(self.samples[k] for k in need)
        return self.rounds < len(self.plan) or (missing and self.rounds < 4 * len(self.plan))

    @property
    def drafts_now(self) -> bool:
        return self.plan[self.rounds % len(self.plan)] == "full"

    @staticmethod
    def drafts_verified(num_drafts: int) -> int:
        return (num_drafts + 1) // 2

    def observe(self, r: Round, num_drafts: int) -> None:
        if r.drafted and r.verified == self.drafts_verified(num_drafts):
            self.samples["draft"].append(r.draft_seconds)
            self.samples["full"].append(r.verify_seconds)
        elif not r.drafted:
            self.samples["decode"].append(r.verify_seconds)
        self.rounds += 1
        self.seconds += r.verify_seconds + (r.draft_seconds if r.drafted else 0.0)
        self.tokens += r.accepted + 1

    def costs(self, block_size: int) -> CostModel:
        m = {k: min(v) if v else 0.0 for k, v in self.samples.items()}
        if self.prior is not None:  # the prior's shape at this machine's speed (the loop refines both)
            p, decode = self.prior, m["decode"] or self.prior.decode
            scale = decode / p.decode
            return CostModel([v * scale for v in p.verify], decode, p.draft * scale)
        decode = m["decode"] or m["full"] or 1e-3  # never a zero cost: the loop refines it multiplicatively
        rows = self.drafts_verified(block_size - 1) + 1
        return CostModel.from_samples(block_size, decode, m["draft"] or 0.2 * decode, rows, m["full"] or decode)

    def added_seconds(self, rate: float) -> float:
        return max(0.0, self.seconds - self.tokens / rate) if rate > 0 else 0.0

    def to_dict(self, rate: float) -> dict:
        return {"calibration_seconds": round(self.added_seconds(rate), 4), "measured_seconds": round(self.seconds, 4),
                "calibration_rounds": self.rounds, "calibrated": not self.active}


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
    """The per-session draft-length policy (implements `dflash2.speculative.DraftSchedule`).
    costs: a known cost model (tests, a scripted machine); without one the session's first rounds
    measure it (`Calibration`).

    Two time scales decide whether the drafter runs at all. `surplus` (fast: ~3 drafted rounds) follows
    the gain the acceptance model expects of each drafted round: text turns predictable and back within
    an answer. `value` (slow: ~25 drafted rounds, across answers) follows the gain drafted rounds REALLY
    made, (accepted + 1) - (draft + verify[K+1]) / decode: whether drafting pays in this session at all.
    Where it does (fp32 here: 1.16x), a skipped stretch ends at the first promising probe and every new
    answer starts drafting. Where it does not (the int4 target: a draft ~0.4 of a decode step, a 2-row
    verify 1.14x), one promising-looking probe was not evidence: every confident-but-wrong probe reset
    the back-off to one round and 131 probes over 8 answers cost 4.5% against plain decoding; there a
    probe must really win, a win halves the back-off instead of ending it, and a new answer gets one
    probe (`scripts/experiments/bench_schedules.py`, docs/draft_len.md)."""

    name = "auto"
    MAX_BACKOFF = 64  # rounds skipped between probes at most where a draft costs <= PROBE_DRAFT decode steps
    PROBE_DRAFT = 0.4  # the draft / decode ratio MAX_BACKOFF was tuned at (the int4 Qwen3 default: ~0.6% lost)
    BUDGET = 0.015  # probes lose at most this share of the plain decoding time the session's tokens are worth
    # (replayed, a draft of 2.2 decode steps: 0.980x of plain decoding at 0.02, 0.987x at 0.015, and the
    # wall clock ~1% under the replay; at 0.01 a paying fp32 trace of the shipped pair lost 10%)
    LONG = 0.04  # weight of a drafted round's real gain in `value`

    def __init__(self, block_size: int, costs: CostModel | None = None, acceptance: AcceptanceModel | None = None):
        self.block_size = block_size
        self.calibration = Calibration(plan=()) if costs is not None else Calibration()
        self.costs = costs or CostModel([0.0] * (block_size + 1), 0.0, 0.0)
        self.acceptance = acceptance or AcceptanceModel()
        self.surplus = 0.5  # EMA of expected tokens over plain decoding per drafted round; > 0: draft first
        self.value = 0.5  # slow EMA of the real tokens over plain decoding per drafted round; > 0: drafting pays
        self.skip_left, self.backoff, self.probing = 0, 1, False
        self.expected = 0.0  # surplus the last choose() predicted
        self.confidence: Sequence[float] | None = None
        self.tokens = self.seconds = 0.0  # EMAs of one round's tokens and seconds: the achieved rate
        self.made = 0  # tokens the session has produced (every round)
        self.lost = 0.0  # decode steps its probes took beyond the tokens they made

    @classmethod
    def from_prior(cls, block_size: int, prior: CostModel) -> "AutoSchedule":
        """A cold session (no saved state) that knows the export's cost model (`prior`: the row check's timings on
        the CPU that exported, `dflash2.runtime.invariance.costs_ms`). Where the prior expects a first draft to pay,
        it calibrates as a session without one. Where it does not (a draft of a 248,320-word head costs 2-3 decode
        steps), its calibration is two plain decode steps that scale the prior to this machine, and its first draft
        is a probe under the budget (`affordable`): no draft is spent on calibration, and a session of one short
        answer never pays for a drafter that cannot win there. Calibrating on drafted rounds there was 0.83-0.89x
        of plain decoding per one-answer session on a reduced Qwen3.5-MoE (docs/results/README.md, 2026-12-06)."""
        s = cls(block_size)
        if cls(block_size, prior)._expected_surplus() >= 0:  # a first draft is expected to pay: calibrate on drafted
            return s  # rounds, which also try deep drafts (replayed: starting from the prior there lost up to 3.6%)
        s.calibration = Calibration(plan=("decode", "decode"), prior=prior)
        return s

    def affordable(self) -> bool:
        """A probe's draft fits the exploration budget: where a draft costs more than PROBE_DRAFT decode steps, what
        probes lost so far plus this draft at most BUDGET of the plain decoding time of the tokens made (cheaper
        probes are bounded by the back-off cap, as tuned on the shipped pair). Probes exist to notice text turning
        predictable; where a draft costs several decode steps (a 248,320-word head) one probe per answer was 7% of a
        32-token answer (replayed: 0.91-0.93x of plain decoding over 32 such answers in one session)."""
        c = self.costs
        if c.decode <= 0 or c.draft <= self.PROBE_DRAFT * c.decode:  # the back-off cap bounds cheap probes (~0.6%)
            return True
        return self.lost + c.draft / c.decode <= self.BUDGET * self.made

    @property
    def rate(self) -> float:
        """Tokens per second an extra verified draft must beat: the better of plain decoding and the
        rate the session achieves."""
        ar = 1.0 / self.costs.decode if self.costs.decode > 0 else 0.0
        return max(ar, self.tokens / self.seconds if self.seconds > 0 else 0.0)

    def max_backoff(self) -> int:
        """MAX_BACKOFF rounds, or more where a draft costs more than PROBE_DRAFT decode steps, so that a failed probe
        costs the same share of plain decoding whatever the drafter's head costs. Replayed
        (`scripts/experiments/replay_published.py`, a reduced Qwen3.5-MoE whose 248,320-word head makes a draft 2.6
        decode steps): 0.962-0.967x of plain decoding at tau 1-3.26 with the fixed cap, 0.977-0.982x priced; every
        shipped-pair trace (draft <= 0.4) replays the same (docs/results/README.md, 2026-12-06)."""
        c = self.costs
        if self.calibration.active or c.decode <= 0:
            return self.MAX_BACKOFF
        return max(self.MAX_BACKOFF, int(self.MAX_BACKOFF * c.draft / (self.PROBE_DRAFT * c.decode)))

    def start(self) -> None:
        """A new answer: the drafter may do better on it than on the last one, so its first round probes
        (measured: three ShareGPT prompts where K = 2-3 paid 1.03-1.47x stayed skipped for all 125 rounds
        behind the previous prompt's 64-round back-off); where drafting pays in this session the back-off
        ends too, where it does not the back-off stays (one probe per answer, not a restart)."""
        if self.probing:
            self.skip_left = 0
            if self.value > 0:
                self.backoff = 1

    def wants_reuse(self) -> bool:
        """Verify the last draft's unverified tail instead of drafting (the loop offers it only when every
        verified draft and the target's next token matched that draft, greedy): free drafts, once calibrated."""
        return not self.calibration.active

    def wants_draft(self) -> bool:
        if self.calibration.active:
            return self.calibration.drafts_now
        if self.skip_left > 0:
            self.skip_left -= 1
            return False
        return not self.probing or self.affordable()  # an unaffordable probe waits for tokens, round by round

    def choose(self, confidence: Sequence[float] | None, available: int) -> int:
        self.confidence = confidence
        if available == 0:
            return 0
        if self.calibration.active:  # a "full" calibration round
            return min(available, Calibration.drafts_verified(self.block_size - 1))
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

    def _expected_surplus(self) -> float:
        """Tokens over plain decoding the best K is expected to make in a drafted round, draft included, at the
        acceptance model's probabilities without confidences (before any draft: its prior)."""
        c = self.costs
        best, expected, reach = 1.0 - (c.draft + c.verify[1]) / c.decode, 1.0, 1.0
        for k in range(1, c.block_size):
            reach *= self.acceptance.probability(None, k - 1)
            expected += reach
            best = max(best, expected - (c.draft + c.verify[k + 1]) / c.decode)
        return best

    def gain(self, r: Round) -> float:
        """Tokens a drafted round made beyond what plain decoding makes in its time, at the cost model's
        prices (not the round's own timings: one stall on a shared machine would swamp the signal)."""
        c = self.costs
        return r.accepted + 1 - (c.draft + c.verify[min(r.verified + 1, c.block_size)]) / c.decode

    def observe(self, r: Round) -> None:
        spent = r.verify_seconds + (r.draft_seconds if r.drafted else 0.0)
        self.made += r.accepted + 1
        self.tokens += EMA * (r.accepted + 1 - self.tokens)
        self.seconds += EMA * (spent - self.seconds)
        if r.verified:  # fresh or reused drafts: the confidences choose() saw
            self.acceptance.observe(self.confidence, r.verified, r.accepted)
        if self.calibration.active:
            self.calibration.observe(r, self.block_size - 1)
            if not self.calibration.active:
                self.costs = self.calibration.costs(self.block_size)
                if self.calibration.prior is not None:  # no draft yet, none expected to pay: the first is a probe
                    self.surplus, self.probing = min(self._expected_surplus(), 0.0), True
            return
        self.costs.observe(r)
        if not r.drafted:
            return
        gain = self.gain(r)
        if self.probing:  # at the round's own time (a draft after skipped rounds also reads their context rows:
            c = self.costs  # 74 ms against a 56 ms model on the reduced Qwen3.5-MoE), a stall counted 2x at most
            priced = c.draft + c.verify[min(r.verified + 1, c.block_size)]
            spent = min(r.draft_seconds + r.verify_seconds, 2.0 * priced) / c.decode
            self.lost += max(0.0, spent - (r.accepted + 1))
        self.value += self.LONG * (gain - self.value)
        pays = self.value > 0  # drafting pays in this session: a promising probe ends a skipped stretch
        if self.probing:
            if self.expected > 0 and (pays or gain > 0):
                self.surplus, self.probing = self.expected, False
                self.backoff = 1 if pays else max(1, self.backoff // 2)
            else:
                self.backoff = min(2 * self.backoff, self.max_backoff())
                self.skip_left = self.backoff
            return
        self.surplus += 0.3 * (self.expected - self.surplus)
        if self.surplus < 0:
            self.probing, self.skip_left = True, self.backoff

    STATE_VERSION = 1

    def state(self) -> dict:
        """What the next session on this machine may start from (`dflash2.runtime.schedule_cache`): the cost
        model, the acceptance history, whether drafting pays, the back-off and the probe budget (tokens made, decode
        steps probes lost: a new session is not a new budget); none of one answer's state."""
        a = self.acceptance
        return {"version": self.STATE_VERSION, "block_size": self.block_size, "calibrated": not self.calibration.active,
                "costs": {"verify": self.costs.verify, "decode": self.costs.decode, "draft": self.costs.draft},
                "acceptance": {"bins": a.bins, "hits": {str(k): v for k, v in a.hits.items()},
                               "trials": {str(k): v for k, v in a.trials.items()}},
                "value": self.value, "backoff": self.backoff, "made": self.made, "lost": self.lost}

    @classmethod
    def from_state(cls, block_size: int, state: dict) -> "AutoSchedule | None":
        """A schedule that starts where a saved session stopped: calibrated, its acceptance and `value` learned
        (a session where drafting did not pay starts skipping, with one probe). None when the state is not one
        this version wrote for this block size (a cache is never an error: it only saves time)."""
        try:
            if state["version"] != cls.STATE_VERSION or state["block_size"] != block_size or not state["calibrated"]:
                return None
            c, a = state["costs"], state["acceptance"]
            verify = [float(v) for v in c["verify"]]
            costs = CostModel(verify, float(c["decode"]), float(c["draft"]))
            if len(verify) != block_size + 1 or not all(0 < x < math.inf for x in (*verify[1:], costs.decode, costs.draft)):
                return None
            acc = AcceptanceModel(bins=int(a["bins"]))
            if acc.bins != AcceptanceModel.bins:  # the keys below are bins of this version's layout
                return None
            acc.hits = {int(k): float(v) for k, v in a["hits"].items()}
            acc.trials = {int(k): float(v) for k, v in a["trials"].items()}
            if set(acc.hits) != set(acc.trials) or not all(0 <= acc.hits[k] <= acc.trials[k] < math.inf for k in acc.hits):
                return None
            s = cls(block_size, costs, acc)
            s.value = float(state["value"])
            s.backoff = max(1, min(int(state["backoff"]), s.max_backoff()))
            s.made, s.lost = int(state.get("made", 0)), float(state.get("lost", 0.0))  # the probe budget goes on
            if not math.isfinite(s.value) or s.made < 0 or not 0 <= s.lost < math.inf:
                return None
            if s.value <= 0:  # drafting did not pay here: start skipping (start() makes the first round a probe)
                s.surplus, s.probing = s.value, True
            return s
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):  # e.g. "backoff": Infinity
            return None

    def to_dict(self) -> dict:
        """costs: the cost model and what its calibration took (rounds, their wall time, and the seconds
        they cost beyond the tokens they produced at the session's rate)."""
        return {"costs": {**self.costs.to_dict(), **self.calibration.to_dict(self.rate)},
                "acceptance": self.acceptance.to_dict(), "backoff": self.backoff, "surplus": round(self.surplus, 4),
                "value": round(self.value, 4)}
