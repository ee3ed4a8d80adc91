"""Schedules replayed over recorded drafts (dflash2/bench/replay.py): its accounting on a hand-built trace, and
the auto schedule on the traces recorded from the shipped pair (no timing: the same numbers on every machine).
The replay against the runtime loop on the real pair: tests/test_default_model.py."""

import gzip
import json
from pathlib import Path

import pytest

from dflash2.bench.replay import bound, replay
from dflash2.runtime.schedule import AutoSchedule
from dflash2.speculative import FixedSchedule

TRACES = Path(__file__).resolve().parents[1] / "docs" / "results" / "schedule_traces"


class ReusingFixed(FixedSchedule):
    def wants_reuse(self) -> bool:
        return True


def _trace(n, S=7):
    """Every draft right: at anchor p, min(S, the n - 1 - p tokens left) of them match."""
    positions = [{"match": min(S, n - 1 - p), "confidence": [0.9] * S} for p in range(n - 1)]
    return {"block_size": S + 1, "answers": [{"tokens": n, "positions": positions}],
            "costs_ms": {"decode": 10.0, "verify": [0.0] + [10.0 + 2 * (k - 1) for k in range(1, S + 2)],
                         "draft_base": 2.0, "draft_per_row": 0.0}}


def test_replay_prices_a_hand_built_trace():
    t = _trace(10)  # K = 2 takes 3 tokens a round
    r = replay(FixedSchedule(2), t)
    assert (r["rounds"], r["drafted"], r["accepted"]) == (3, 3, 6)
    assert r["speed"] == pytest.approx(9 * 10.0 / (3 * (2.0 + 14.0)))
    # reusing: draft at 0 (2 verified, the bonus matches draft 3), the tail's drafts 4-5, then 7 (the last one
    # left), then a fresh draft of which one matches the last token
    r = replay(ReusingFixed(2), t)
    assert (r["rounds"], r["drafted"], r["reused"], r["accepted"]) == (4, 2, 2, 6)
    assert r["speed"] == pytest.approx(90.0 / ((2 + 14) + 14 + 12 + (2 + 14)))
    oracle = replay(None, t)  # the oracle: the least time knowing every match
    assert (oracle["rounds"], oracle["accepted"]) == (2, 7)  # 7 drafts and the bonus, then the last token alone
    assert oracle["speed"] == pytest.approx(90.0 / ((2 + 24) + 10))
    # perfect confidence: drafts every round (the last token's draft too), then verifies what pays of its matches
    known = bound(t, skip=False)
    assert (known["rounds"], known["drafted"], known["accepted"]) == (2, 2, 7)
    assert known["speed"] == pytest.approx(90.0 / ((2 + 24) + (2 + 10)))


def test_bounds_are_exact_on_a_trace_where_greedy_is_not():
    """replay.bound is a dynamic programme over the anchors, not the greedy 'draft wherever the matching drafts pay'.
    Hand-built: at anchor 0 one draft matches, at anchor 1 all seven. Greedy takes the one at 0 (2 tokens in 2 + 12 ms
    against 20 ms of decoding) and lands on anchor 2, where nothing matches: 14 + 8 x 10 = 94 ms for 10 tokens; the
    best decodes anchor 0 and takes all seven at anchor 1: 10 + (2 + 24) + 10 = 46 ms."""
    S = 7
    match = [1, 7, 0, 0, 0, 0, 0, 0, 0, 0]
    t = {"block_size": S + 1, "answers": [{"tokens": 11, "positions": [{"match": m, "confidence": [0.5] * S}
                                                                       for m in match]}],
         "costs_ms": {"decode": 10.0, "verify": [0.0] + [10.0 + 2 * (k - 1) for k in range(1, S + 2)],
                      "draft_base": 2.0, "draft_per_row": 0.0}}
    best = bound(t)
    assert best["speed"] == pytest.approx(100.0 / (10 + (2 + 24) + 10)) and best["accepted"] == 7
    assert best["rounds"] == 3 and best["drafted"] == 1
    every = bound(t, skip=False)  # drafting every round: the same path, each decode paying a draft
    assert every["speed"] == pytest.approx(100.0 / (12 + (2 + 24) + 12)) and every["drafted"] == 3
    # a long answer where nothing matches and a draft's price grows with the rows it catches up: the oracle decodes
    # all of it (a chain of 600 skipped states: deeper than recursion would go, solved without it)
    t["answers"] = [{"tokens": 601, "positions": [{"match": 0, "confidence": [0.5] * S}] * 600}]
    t["costs_ms"]["draft_per_row"] = 0.01
    assert bound(t) == {"speed": pytest.approx(1.0), "rounds": 600, "drafted": 0, "reused": 0, "accepted": 0,
                        "tokens": 600}


@pytest.mark.parametrize("name", ["int4dyn_shipped", "int4dyn_sg24", "fp32_shipped"])
def test_bounds_bound_every_schedule_on_recorded_drafts(name):
    """The oracle is at least auto (which skips drafts and verifies reused tails: the traces' verify curves are
    subadditive, so a tail never beats verifying it with its draft) and at least perfect confidence; perfect
    confidence is at least every fixed K and the best confidence-threshold rule (schedules that draft every round)."""
    from dflash2.bench.replay import Thresholds

    t = _recorded(name)
    oracle, perfect = bound(t)["speed"], bound(t, skip=False)["speed"]
    assert oracle >= perfect >= max(replay(FixedSchedule(k), t)["speed"] for k in range(1, 8))
    assert oracle >= replay(AutoSchedule(8), t)["speed"]
    best = json.loads((TRACES.parent / "drafter_quant" / "thresholds_int4dyn.json").read_text())
    row = next((r for n, r in best.items() if Path(n).name.startswith(name + ".")), None)
    if row is not None:
        assert perfect >= replay(Thresholds(row["t1"], row["t2"]), t)["speed"]


def test_scaled_costs_price_a_cheaper_draft_and_a_flatter_verify(tmp_path, capsys):
    """replay.scaled_costs and `scripts/experiments/replay_schedules.py bounds`: the draft times f, a verify's excess over a decode
    step times g. Free drafts and a flat verify (a verify of 8 rows costing one decode step): every bound is the
    same 90 ms of plain decoding over two 10 ms rounds."""
    from dflash2.bench.replay import scaled_costs

    t = _trace(10)
    c = scaled_costs(t["costs_ms"], draft=0.5, verify=0.5)
    assert c["draft_base"] == 1.0 and c["verify"] == [0.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0]
    assert t["costs_ms"]["draft_base"] == 2.0  # the trace's own table is left as it was
    path, out = tmp_path / "t.json", tmp_path / "b.json"
    path.write_text(json.dumps(t))
    assert _script().main(["bounds", str(path), "--draft", "1,0", "--verify", "0", "--json", str(out)]) == 0
    free = json.loads(out.read_text())[str(path)][1]
    assert (free["draft"], free["verify"]) == (0.0, 0.0)
    assert free["perfect_confidence"] == pytest.approx(4.5) and free["oracle"] == pytest.approx(4.5)
    assert "| 0 | 0 |" in capsys.readouterr().out


def test_lifted_turns_drafts_right_without_touching_the_trace():
    """`bounds --lift q`: each draft after the matching prefix turned right in turn with probability min(1, 2 q c);
    q = 0 changes nothing, q = 1 at confidence 0.9 turns every draft right; the trace read stays as it was."""
    script = _script()
    t = _trace(10)
    for p in t["answers"][0]["positions"]:
        p["match"] = 0
    assert script.lifted(t, 0.0) == t
    assert {p["match"] for p in script.lifted(t, 1.0)["answers"][0]["positions"]} == {7}
    assert {p["match"] for p in t["answers"][0]["positions"]} == {0}
    half = [p["match"] for p in script.lifted(t, 0.3, seed=1)["answers"][0]["positions"]]
    assert half == [p["match"] for p in script.lifted(t, 0.3, seed=1)["answers"][0]["positions"]]  # seeded
    assert 0 < sum(half) < 7 * len(half)


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("replay_schedules", TRACES.parents[2] / "scripts" / "experiments" / "replay_schedules.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _recorded(name: str) -> dict:
    return json.loads(gzip.decompress((TRACES / f"{name}.json.gz").read_bytes()))


@pytest.mark.parametrize("name, floor", [("int4_shipped", 0.98), ("int4_sg24", 1.0), ("fp32_shipped", 1.19),
                                         ("fp32_sg24", 1.26), ("int4dyn_shipped", 0.99), ("int4dyn_sg24", 1.02)])
def test_auto_on_the_shipped_pairs_recorded_drafts(name, floor):
    """The shipped drafter's drafts at every position of 8 shipped and 24 held-out ShareGPT answers, on the int4
    default and the fp32 export, priced at costs measured on the 2-core machine (`scripts/experiments/replay_schedules.py`).
    int4: no fixed K pays there (a draft 0.35 of a decode step, 2 rows 1.14x), and the schedule before this one
    drafted in 29% of the shipped prompts' rounds and ran 0.963x plain decoding; fp32, where drafting pays,
    1.202x / 1.275x. Floors: never below plain decoding by more than 2%, fp32 within 0.02 of before. int4dyn: the
    default now, its drafter's weights int8-dynamic (a draft 0.28-0.30 of a decode step): 0.995x / 1.026x when recorded."""
    r = replay(AutoSchedule(8), _recorded(name))
    assert r["speed"] >= floor, r


def test_threshold_rule_verifies_the_leading_confident_drafts():
    """replay.Thresholds (scripts/experiments/replay_schedules.py thresholds): t1 for the first draft, t2 for the rest, stopping at
    the first draft below; priced over the committed trace at the thresholds the docs report, the speed they report."""
    from dflash2.bench.replay import Thresholds

    t = Thresholds(0.5, 0.8)
    assert t.wants_draft() and not t.wants_reuse()
    assert t.choose([0.9, 0.85, 0.7, 0.99], 4) == 2 and t.choose([0.4, 0.99], 2) == 0 and t.choose([0.9, 0.9], 1) == 1
    best = json.loads((TRACES.parent / "drafter_quant" / "thresholds_int4dyn.json").read_text())
    for name, row in best.items():
        r = replay(Thresholds(row["t1"], row["t2"]), _recorded(Path(name).name[:-len(".json.gz")]))
        assert r["speed"] == pytest.approx(row["speed"], abs=1e-9) and r["drafted"] == row["rounds"]


def test_exact_costs_swaps_in_the_traces_table_after_calibration(tmp_path, capsys):
    """`replay --exact-costs`: the same schedule, its cost model replaced by the trace's own table once its calibration
    rounds are done (what a perfect cost model reaches). On the hand-built trace the calibrated line and the table
    differ (verify[2] priced by a line through 1 and 5 rows), and the exact variant holds the table itself."""
    script = _script()
    t = _trace(40)
    t["costs_ms"]["verify"][2] = 10.5  # a 2-row verify cheaper than the line through 1 and 5 rows says
    exact = script._exact_costs(AutoSchedule, t["costs_ms"])(8)
    plain = AutoSchedule(8)
    replay(exact, t), replay(plain, t)
    assert exact.costs.verify == pytest.approx([v / 1e3 for v in t["costs_ms"]["verify"]])
    assert exact.costs.decode == pytest.approx(0.010) and exact.costs.draft == pytest.approx(0.002)
    assert plain.costs.verify[2] != pytest.approx(0.0105)  # calibration alone does not know the 2-row cost
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t))
    out = tmp_path / "r.json"
    assert script.main(["replay", str(path), "--schedule", f"now={Path(__file__).resolve().parents[1]}/dflash2/runtime/"
                        "schedule.py", "--exact-costs", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())[str(path)]) == ["now", "now/exact", "oracle"]
    assert "now/exact" in capsys.readouterr().out


def test_synthetic_trace_draws_the_asked_acceptance_and_replays_without_confidences():
    """replay.synthetic_trace (a drafter known only by its published acceptance): a round of all S drafts yields tau
    on average, seeded (the same trace every time), no confidences; a schedule that reuses draft tails replays it."""
    from dflash2.bench.replay import geometric_rate, synthetic_trace

    S = 15
    for tau in (1.0, 3.26, 16.0):
        a = geometric_rate(tau, S)
        assert 1 + sum(a ** j for j in range(1, S + 1)) == pytest.approx(tau, abs=1e-9)
    with pytest.raises(ValueError):
        geometric_rate(17.0, S)
    costs = {"decode": 10.0, "verify": [0.0] + [10.0 + 2 * (k - 1) for k in range(1, S + 2)], "draft_base": 2.0,
             "draft_per_row": 0.0}
    t = synthetic_trace(3.26, S + 1, costs, answers=8, tokens=64, seed=1)
    assert t == synthetic_trace(3.26, S + 1, costs, answers=8, tokens=64, seed=1)
    m = [p["match"] for ans in t["answers"] for p in ans["positions"]]
    assert len(m) == 8 * 63 and all(0 <= x <= S for x in m)
    assert 1 + sum(m) / len(m) == pytest.approx(3.26, rel=0.1)
    assert all(p["confidence"] is None for ans in t["answers"] for p in ans["positions"])
    r = replay(FixedSchedule(S), t)  # every round verifies all S: accepted = the matches at the anchors it visits
    assert r["tokens"] == 8 * 63 and r["drafted"] == r["rounds"]
    assert replay(ReusingFixed(2), t)["reused"] > 0
    assert replay(AutoSchedule(S + 1), t)["tokens"] == 8 * 63


@pytest.mark.parametrize("tokens", [32, 128])
def test_auto_never_below_097_where_a_draft_costs_two_decode_steps(tokens):
    """The reduced Qwen3.5-MoE's measured cost table (a draft of its 248,320-word head: 2.2 decode steps) with
    synthetic drafts at published acceptances (tau 1-10): `--draft-len auto` started from the export's prior stays
    at >= 0.97x of plain decoding in one session over 32 answers and in a fresh session per answer; without the
    probe budget one session of 32-token answers was 0.91x (a probe per answer)."""
    from dflash2.bench.replay import synthetic_trace
    from dflash2.runtime.schedule import CostModel

    table = json.loads((TRACES.parent / "qwen3_5_moe" / "cost_table_reduced_int4_2threads_loaded.json").read_text())
    c, B = table["costs_ms"], table["block_size"]
    prior = CostModel([v / 1e3 for v in c["verify"]], c["decode"] / 1e3, (c["draft_base"] + c["draft_per_row"]) / 1e3)
    assert prior.draft / prior.decode > 2
    for tau in (1, 2.5, 3.26, 10):
        t = synthetic_trace(tau, B, c, 32, tokens, seed=0)
        one = replay(AutoSchedule.from_prior(B, prior), t)
        fresh = [replay(AutoSchedule.from_prior(B, prior), {**t, "answers": [a]}) for a in t["answers"]]
        fresh_speed = sum(r["tokens"] for r in fresh) / sum(r["tokens"] / r["speed"] for r in fresh)
        assert one["speed"] >= 0.97 and fresh_speed >= 0.97, (tau, one["speed"], fresh_speed)
        if tokens == 32:
            assert replay(AutoSchedule(B), t)["speed"] >= 0.96  # no prior, the budget alone: one session
