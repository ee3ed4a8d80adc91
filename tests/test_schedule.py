"""The draft-length schedule on scripted cost models and scripted accept / reject histories (no timing)."""

import pytest

from dflash2.runtime.schedule import AcceptanceModel, AutoSchedule, CostModel
from dflash2.speculative import Round

B = 8  # S = 7


def costs(verify_ms, decode_ms=10.0, draft_ms=2.0) -> CostModel:
    return CostModel([0.0] + [v / 1e3 for v in verify_ms], decode_ms / 1e3, draft_ms / 1e3)


FLAT = [10.0] * B  # a GPU: 8 rows cost what 1 costs
CPU = [10.0 + 1.5 * (n - 1) for n in range(1, B + 1)]  # ~2x for 8 rows, like SmolLM2 on 2 cores
STEEP = [10.0 * n for n in range(1, B + 1)]  # every row costs a full decode step


def test_flat_verify_cost_verifies_every_draft_when_confident():
    s = AutoSchedule(B, costs(FLAT))
    assert s.choose([0.95] * 7, 7) == 7
    assert s.choose([0.3] * 7, 7) == 7  # extra rows are free: any chance of acceptance pays


def test_steep_verify_cost_verifies_nothing():
    s = AutoSchedule(B, costs(STEEP))
    assert s.choose([0.95] * 7, 7) == 0  # each draft costs a decode step and yields < 1 token
    assert s.choose([0.95] * 7, 7) == 0


def test_cpu_like_cost_follows_confidence():
    s = AutoSchedule(B, costs(CPU))
    assert s.choose([0.95] * 7, 7) == 7
    assert s.choose([0.05] * 7, 7) == 0
    k = s.choose([0.95, 0.9, 0.6, 0.1, 0.9, 0.9, 0.9], 7)  # confidence collapses at draft 4
    assert 2 <= k <= 3
    assert s.choose([0.95] * 7, 2) == 2  # never more than available


def test_acceptance_is_learned_from_history():
    a = AcceptanceModel()
    assert a.probability(0.92, 0) == pytest.approx(0.95 ** 2)  # prior: the bin's confidence squared
    for _ in range(200):  # a drafter that is over-confident: its 0.9s are always rejected
        a.observe([0.92] * 7, verified=7, accepted=0)
    assert a.probability(0.92, 0) < 0.05
    assert a.probability(0.55, 0) == pytest.approx(0.55 ** 2)  # other bins keep their prior
    for _ in range(200):  # drafts 1-2 accepted, 3 rejected, 4.. unseen
        a.observe([0.35] * 7, verified=7, accepted=2)
    assert a.probability(0.35, 0) == pytest.approx(2 / 3, abs=0.03)


def test_acceptance_without_confidence_is_per_position():
    a = AcceptanceModel()
    for _ in range(100):
        a.observe(None, verified=3, accepted=1)
    assert a.probability(None, 0) > 0.95 and a.probability(None, 1) < 0.05
    assert a.probability(None, 2) == pytest.approx(0.125)  # never verified past a rejection: prior


def test_an_over_confident_drafter_turns_drafting_off_then_probes_with_backoff():
    s = AutoSchedule(B, costs(CPU))
    drafted = []
    for _ in range(400):
        d = s.wants_draft()
        drafted.append(d)
        k = s.choose([0.9] * 7, 7) if d else 0
        s.observe(Round(d, k, 0, 0.002 if d else 0.0, CPU[k] / 1e3))  # every draft is rejected
    assert sum(drafted[:20]) < 20 and sum(drafted[-200:]) <= 200 / 32  # rare probes at the end
    assert s.backoff == AutoSchedule.MAX_BACKOFF


def test_drafting_resumes_when_drafts_are_accepted_again():
    s = AutoSchedule(B, costs(CPU))
    s.probing, s.skip_left, s.backoff = True, 3, 4
    assert [s.wants_draft() for _ in range(4)] == [False, False, False, True]
    k = s.choose([0.95] * 7, 7)
    s.observe(Round(True, k, k, 0.002, CPU[k] / 1e3))
    assert not s.probing and s.backoff == 1 and s.wants_draft()


def test_cost_model_refines_from_the_loop():
    c = costs(CPU)
    for _ in range(100):
        c.observe(Round(True, 3, 1, 0.004, 0.030))  # verify of 4 rows measured at 30 ms, draft at 4 ms
        c.observe(Round(False, 0, 0, 0.0, 0.012))  # a plain decode step at 12 ms
    assert c.verify[4] == pytest.approx(0.030, rel=0.02) and c.draft == pytest.approx(0.004, rel=0.02)
    assert c.decode == pytest.approx(0.012, rel=0.02)
    # rows never measured keep the calibrated shape but follow the machine, which got slower
    assert c.verify[2] > CPU[1] / 1e3 and c.verify[3] / c.verify[2] == pytest.approx(CPU[2] / CPU[1])
    assert set(c.to_dict()) == {"verify_ms", "decode_ms", "draft_ms"}


def test_cost_model_ignores_a_single_hiccup():
    c = costs(CPU)
    c.observe(Round(True, 1, 0, 0.002, 5.0))  # one 5 s stall (another process): bounded influence
    assert c.verify[2] < 2 * CPU[1] / 1e3 and c.verify[8] < 1.1 * CPU[7] / 1e3


def test_calibration_is_the_first_rounds_on_a_fixed_plan():
    """No separate engine calls: the session's first four rounds draft-and-verify-half, decode, again;
    the smaller of each pair of timings makes the cost model (the first run of a shape allocates)."""
    s = AutoSchedule(B)
    timings = [(0.050, 0.300), (0.0, 0.040), (0.004, 0.024), (0.0, 0.012)]  # first runs slow, then clean
    for (draft_s, verify_s), drafts in zip(timings, [True, False, True, False]):
        assert s.wants_draft() is drafts
        k = s.choose([0.01] * 7 if drafts else None, 7 if drafts else 0)  # even a hopeless draft: 4 of 7
        assert k == (4 if drafts else 0)
        s.observe(Round(drafts, k, 0, draft_s, verify_s))  # every draft rejected
    c = s.costs
    assert (c.decode, c.draft, c.verify[5]) == (0.012, 0.004, 0.024)
    assert c.verify[1] == 0.012 and c.verify[3] == pytest.approx(0.018)  # the line through 1 and 5 rows
    assert c.verify[8] == pytest.approx(0.012 + 0.003 * 7)  # and beyond
    cal = s.to_dict()["costs"]
    assert cal["calibrated"] and cal["calibration_rounds"] == 4 and cal["measured_seconds"] == pytest.approx(0.43)
    # added: the rounds' 0.43 s beyond their 4 tokens at the session's rate (at least plain decoding's)
    assert 0 < cal["calibration_seconds"] <= 0.43 - 4 * 0.012 + 1e-9
    assert s.choose([0.01] * 7, 7) == 0  # calibrated: the policy decides again


def test_a_given_cost_model_skips_calibration():
    s = AutoSchedule(B, costs(FLAT))
    assert s.to_dict()["costs"]["calibration_rounds"] == 0 and s.to_dict()["costs"]["calibrated"]
    assert s.choose([0.3] * 7, 7) == 7


def test_every_entry_follows_the_machine_not_only_the_one_observed():
    """Calibrated during a slow spell, then the machine gets 1.5x faster and the loop verifies 6 rows
    every round: the unobserved decode step must get faster too, or K = 5 would soon look cheaper
    than a decode step (a real failure: verify of 6 rows at 37 ms beside a stale 56 ms decode)."""
    c = costs([1.5 * v for v in CPU], decode_ms=15.0, draft_ms=3.0)
    for _ in range(300):
        c.observe(Round(True, 5, 2, 0.002, CPU[5] / 1e3))  # the true, faster cost of 6 rows
    assert c.verify[6] == pytest.approx(CPU[5] / 1e3, rel=0.02)
    assert c.decode == pytest.approx(0.010, rel=0.1) and c.verify[6] > c.decode
    assert c.verify[8] / c.verify[1] == pytest.approx(CPU[7] / CPU[0], rel=0.1)  # the calibrated shape holds


def test_calibration_repeats_its_plan_until_it_timed_a_full_verify():
    """A drafter that returned fewer drafts than the planned rounds verify timed no verify: the plan
    goes on (at most four times) instead of leaving a zero cost in the model."""
    s = AutoSchedule(B)
    for i in range(4):
        d = s.wants_draft()
        s.observe(Round(d, 3 if d else 0, 0, 0.003, 0.015 if d else 0.010))  # 3 of 7 drafts only
    assert s.to_dict()["costs"]["calibrated"] is False and s.wants_draft()
    assert s.choose([0.5] * 7, 7) == 4
    s.observe(Round(True, 4, 0, 0.003, 0.020))
    assert s.to_dict()["costs"]["calibrated"] and s.costs.verify[5] == 0.020 and s.costs.decode == 0.010


def test_a_new_answer_ends_a_carried_back_off():
    """A back-off built on one prompt's rejections does not keep the next prompt from drafting: its
    first round probes."""
    s = AutoSchedule(B, costs(CPU))
    s.probing, s.skip_left, s.backoff = True, 40, 64
    s.start()
    assert s.wants_draft() and s.backoff == 1 and s.probing  # the probe still decides by its expected surplus
    k = s.choose([0.95] * 7, 7)
    s.observe(Round(True, k, k, 0.002, CPU[k] / 1e3))
    assert not s.probing and s.wants_draft()
    d = AutoSchedule(B, costs(CPU))  # drafting normally: a new answer changes nothing
    d.start()
    assert d.wants_draft() and not d.probing and d.backoff == 1
