"""The greedy speculative loop: accounting on a scripted backend, losslessness on real models."""

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen3ForCausalLM

from dflash2.reference.backend import TorchBackend
from dflash2.reference.load import load_pair
from dflash2.speculative import Drafted, Round, Verified, generate


class PlannedSchedule:
    """Scripted decisions per round: "skip" (no draft, K = 0) or a K to verify."""

    name = "planned"

    def __init__(self, plan, reuse=False):
        self.plan, self.i, self.rounds, self.reuse = plan, 0, [], reuse

    def start(self):
        pass

    def wants_draft(self):
        return self.plan[self.i % len(self.plan)] != "skip"

    def choose(self, confidence, available):
        k = self.plan[self.i % len(self.plan)]
        self.i += 1
        return 0 if k == "skip" else min(k, available)

    def wants_reuse(self):
        return self.reuse

    def observe(self, r: Round):
        self.rounds.append(r)


class Scripted:
    """A 'target' whose greedy sequence is `truth`; drafts follow `plan[r]` correct tokens then junk."""

    block_size = 5  # S = 4

    def __init__(self, truth, plan):
        self.truth, self.plan, self.pos, self.round, self.commits = truth, plan, 0, 0, []

    def prefill(self, ids):
        self.pos = 0
        return Verified([self.truth[0]])

    def draft(self, anchor):
        good = self.plan[self.round]
        self.round += 1
        nxt = self.truth[self.pos + 1: self.pos + 1 + 4] + [0] * 4
        return Drafted([nxt[k] if k < good else 999 for k in range(4)])

    def verify(self, tokens):
        assert tokens[0] == self.truth[self.pos]  # the anchor is the last committed token
        return Verified((self.truth[self.pos + 1: self.pos + 6] + [0] * 5)[:len(tokens)])

    def commit(self, n):
        self.commits.append(n)
        self.pos += n

    def decode(self, token):
        self.pos += 1
        return Verified([self.truth[self.pos]])


TRUTH = list(range(100, 160))


def test_zero_partial_full_acceptance():
    b = Scripted(TRUTH, [0, 2, 4, 4, 1] + [0] * 40)
    g = generate(b, [1, 2], max_new_tokens=16)
    assert g.ids == TRUTH[:16]
    assert g.stats.accepted[:5] == [0, 2, 4, 4, 1]
    assert b.commits[:5] == [1, 3, 5, 5, 2]  # anchor + accepted drafts stay in the KV
    assert g.stats.emitted[:4] == [1, 3, 5, 5]
    assert g.stop_reason == "length"


def test_length_limit_inside_a_block():
    b = Scripted(TRUTH, [4] * 10)
    g = generate(b, [1], max_new_tokens=8)  # 1 + 5 + 5 would overshoot: cut at 8
    assert g.ids == TRUTH[:8] and g.stats.emitted == [5, 2] and g.stop_reason == "length"


def test_eos_inside_accepted_run():
    b = Scripted(TRUTH, [4] * 10)
    g = generate(b, [1], max_new_tokens=50, eos_ids=[TRUTH[3]])
    assert g.ids == TRUTH[:4] and g.stop_reason == "eos"  # EOS kept, nothing after it
    assert g.stats.accepted == [4] and g.stats.emitted == [3]


def test_eos_as_first_token_and_autoregressive():
    assert generate(Scripted(TRUTH, []), [1], 10, eos_ids=[TRUTH[0]]).ids == [TRUTH[0]]
    g = generate(Scripted(TRUTH, []), [1], 10, speculative=False)
    assert g.ids == TRUTH[:10] and g.stats.rounds == 0


def test_stats():
    b = Scripted(TRUTH, [0, 2, 4, 1])
    s = generate(b, [1], max_new_tokens=11).stats
    assert s.accepted == [0, 2, 4, 1]
    assert s.acceptance_length == pytest.approx((1 + 3 + 5 + 2) / 4)
    assert s.position_acceptance() == [0.75, 0.5, 0.25, 0.25]
    d = s.to_dict()
    assert d["new_tokens"] == 11 and set(d["seconds"]) >= {"draft", "verify", "host", "total"}


def test_stop_callback():
    seen = []
    g = generate(Scripted(TRUTH, [4] * 10), [1], 50, on_tokens=lambda new: seen.append(new) or len(seen) == 2)
    assert g.stop_reason == "stop" and seen == [[TRUTH[0]], TRUTH[1:6]]


def test_draft_len_verifies_only_the_first_k_drafts():
    b = Scripted(TRUTH, [4] * 20)
    sent = []
    verify = b.verify
    b.verify = lambda tokens: sent.append(len(tokens)) or verify(tokens)
    g = generate(b, [1], max_new_tokens=13, draft_len=2)
    assert g.ids == TRUTH[:13]
    assert set(sent) == {3} and g.stats.accepted == [2] * 4 and b.commits == [3] * 4  # anchor + 2 drafts
    for bad in (0, 5):
        with pytest.raises(ValueError, match=r"draft length expected 1\.\.4 .* found " + str(bad)):
            generate(Scripted(TRUTH, [4] * 20), [1], 8, draft_len=bad)


def test_schedule_skips_drafts_and_switches_k():
    b = Scripted(TRUTH, [4] * 40)
    drafts_called = []
    draft = b.draft
    b.draft = lambda anchor: drafts_called.append(1) or draft(anchor)
    sched = PlannedSchedule(["skip", 4, 0, "skip", "skip", 2, 4])
    g = generate(b, [1], max_new_tokens=30, schedule=sched)
    assert g.ids == TRUTH[:30]
    assert g.stats.verified[:7] == [0, 4, 0, 0, 0, 2, 4] and g.stats.skipped[:7] == [True, False, False, True,
                                                                                       True, False, False]
    assert b.commits[:7] == [1, 5, 1, 1, 1, 3, 5]  # K = 0 commits the anchor only: a plain decode step
    assert len(drafts_called) == sum(not s for s in g.stats.skipped)
    h = g.stats.k_histogram()
    assert h["skip"] == sum(g.stats.skipped) and h["4"] >= 2 and h["0"] >= 1
    assert [r.drafted for r in sched.rounds[:3]] == [False, True, True] and sched.rounds[1].accepted == 4


HF = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}


@pytest.mark.parametrize("family,version", [("llama", 1), ("llama", 2), ("qwen3", 1), ("qwen3", 2)])
def test_lossless_against_transformers_generate(pairs, family, version):
    drafter_dir, target_dir = pairs[(family, version)]
    target, drafter = load_pair(drafter_dir, target_dir)
    prompt = [3, 14, 15, 92, 65, 35]
    spec = generate(TorchBackend(target, drafter, 256), prompt, max_new_tokens=64)
    hf = HF[family].from_pretrained(target_dir, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                      pad_token_id=0, min_new_tokens=64)[0, len(prompt):].tolist()
    assert spec.ids == ref and len(ref) == 64


def test_backend_reused_for_a_second_prompt(pairs):
    """prefill starts both caches over: a reused backend gives what a fresh one gives."""
    target, drafter = load_pair(*pairs[("llama", 2)])
    first, second = [202, 220, 25, 137, 266, 253], [212, 160, 249, 188, 303, 116]
    b = TorchBackend(target, drafter, 256)
    generate(b, first, 24)
    assert generate(b, second, 24).ids == generate(TorchBackend(target, drafter, 256), second, 24).ids


class OracleDrafts(TorchBackend):
    """Real target and drafter, but drafts replaced by the known greedy continuation with planned
    mistakes: exercises partial / full acceptance and KV rollback through the real target."""

    def __init__(self, target, drafter, truth, prompt_len, plan):
        super().__init__(target, drafter, 256)
        self.truth, self.prompt_len, self.plan, self.r = truth, prompt_len, plan, 0

    def draft(self, anchor):
        d = super().draft(anchor)  # keeps the drafter's context cache advancing for real
        S, start = self.block_size - 1, self.pos - self.prompt_len + 1
        good = self.plan[self.r % len(self.plan)]
        self.r += 1
        nxt = (self.truth[start: start + S] + [0] * S)[:S]
        return Drafted([t if k < good else (t + 1) % self.target.config.vocab_size for k, t in enumerate(nxt)],
                       d.confidence)


@pytest.mark.parametrize("version", [1, 2])
def test_skipped_drafts_keep_the_context_pending(pairs, version):
    """Rounds without a draft leave their context rows pending: the drafter's cache matches a run that
    drafted every round, and the ids stay the target's greedy ones."""
    target, drafter = load_pair(*pairs[("llama", version)])
    prompt = [5, 6, 7, 8]
    truth = generate(TorchBackend(target, drafter, 256), prompt, 60, speculative=False).ids
    b = TorchBackend(target, drafter, 256)
    drafts, draft = [], b.draft
    b.draft = lambda *a, **kw: drafts.append(draft(*a, **kw)) or drafts[-1]
    g = generate(b, prompt, 60, schedule=PlannedSchedule(["skip", "skip", 7, 0, "skip", 3, 7]))
    assert g.ids == truth
    assert b.ctx_pos + (0 if b.pending is None else b.pending.shape[0]) == b.pos  # every row drafted or pending
    assert drafts and all(len(d.confidence) == 7 and all(0 < c <= 1 for c in d.confidence) for d in drafts)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rollback_with_real_models(pairs, family):
    target, drafter = load_pair(*pairs[(family, 2)])
    prompt = [5, 6, 7, 8]
    truth = generate(TorchBackend(target, drafter, 256), prompt, 80, speculative=False).ids
    b = OracleDrafts(target, drafter, truth, len(prompt), plan=[0, 3, 7, 1, 5, 7, 2])
    g = generate(b, prompt, 80)
    assert g.ids == truth
    assert {0, 3, 7} <= set(g.stats.accepted)  # zero, partial and full acceptance all happened


def _count_drafts(b):
    called = []
    draft = b.draft
    b.draft = lambda anchor: called.append(1) or draft(anchor)
    return called


def test_a_draft_tail_that_still_follows_the_output_is_verified_without_drafting():
    """Round 1 drafts 4 (all right) and verifies 1: the target's next token equals draft 2, so drafts 3-4
    propose exactly what follows; round 2 verifies one of them without calling the drafter, and its bonus
    equals draft 4, which is the last: round 3 drafts again."""
    b = Scripted(TRUTH, [4] * 40)
    called = _count_drafts(b)
    sched = PlannedSchedule([1], reuse=True)
    g = generate(b, [1], max_new_tokens=25, schedule=sched)
    assert g.ids == TRUTH[:25]
    assert g.stats.reused[:6] == [False, True] * 3 and g.stats.accepted[:6] == [1] * 6
    assert len(called) == g.stats.rounds - sum(g.stats.reused) and not any(g.stats.skipped)
    assert [r.drafted for r in sched.rounds[:4]] == [True, False, True, False]  # the schedule sees no draft call
    assert g.stats.k_histogram()["reused"] == sum(g.stats.reused)
    again = generate(Scripted(TRUTH, [4] * 40), [1], max_new_tokens=25, schedule=PlannedSchedule([1]))
    assert again.ids == g.ids and not any(again.stats.reused)  # a schedule that declines drafts every round


def test_a_tail_after_a_mismatch_is_never_reused():
    """Draft 2 wrong (the bonus differs from it), or the verified draft rejected: the rest of the block was
    drafted after a token that is not the output's, so the next round drafts afresh."""
    for good in (1, 0):
        b = Scripted(TRUTH, [good] * 40)
        called = _count_drafts(b)
        g = generate(b, [1], max_new_tokens=20, schedule=PlannedSchedule([1], reuse=True))
        assert g.ids == TRUTH[:20] and not any(g.stats.reused) and len(called) == g.stats.rounds


def test_a_k0_round_whose_bonus_matches_draft_1_leaves_the_rest_as_the_tail():
    b = Scripted(TRUTH, [4] * 40)
    sched = PlannedSchedule([0, 2], reuse=True)  # K = 0: a decode step after a draft; then 2 of the tail
    g = generate(b, [1], max_new_tokens=12, schedule=sched)
    assert g.ids == TRUTH[:12] and g.stats.reused[:2] == [False, True] and g.stats.accepted[:2] == [0, 2]
