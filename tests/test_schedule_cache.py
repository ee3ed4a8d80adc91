"""The auto schedule's state kept between sessions (dflash2.runtime.schedule_cache): round trip, what is refused,
and a second runtime session on an export that starts calibrated, knowing, and still lossless."""

import json

import pytest

from dflash2.runtime import schedule_cache
from dflash2.runtime.schedule import AutoSchedule
from tests.exports import PROMPT
from tests.test_schedule import INT4, B, costs, simulate


def _learned() -> AutoSchedule:
    s = AutoSchedule(B, costs(**INT4))
    simulate(s, INT4, answers=6)  # drafting does not pay here: value < 0, a back-off built up
    return s


def test_state_round_trips():
    s = _learned()
    t = AutoSchedule.from_state(B, json.loads(json.dumps(s.state())))
    assert t is not None and not t.calibration.active and t.calibration.rounds == 0
    assert (t.costs.verify, t.costs.decode, t.costs.draft) == (s.costs.verify, s.costs.decode, s.costs.draft)
    assert all(t.acceptance.probability(c, 0) == s.acceptance.probability(c, 0) for c in (0.15, 0.55, 0.95))
    assert t.value == s.value < 0 and t.backoff == s.backoff
    assert (t.made, t.lost) == (s.made, s.lost) and s.made > 0  # the probe budget goes on
    assert t.probing  # it did not pay: the new session skips, its first round of an answer a probe if affordable
    t.start()
    assert t.wants_draft() == t.affordable() and t.probing


@pytest.mark.parametrize("edit", [
    lambda st: st.update(version=0), lambda st: st.update(block_size=4), lambda st: st.update(calibrated=False),
    lambda st: st["costs"].update(decode=0.0), lambda st: st["costs"].update(verify=[0.0, 1.0]),
    lambda st: st["acceptance"]["hits"].update({"9": 1e9}), lambda st: st.pop("costs"),
    lambda st: st["acceptance"].update(trials="x"), lambda st: st.update(value="much"),
    lambda st: st.update(value=float("nan")), lambda st: st["costs"].update(draft=float("inf")),
    lambda st: st.update(backoff=float("inf")), lambda st: st["acceptance"].update(bins=0)],
    ids=["version", "block-size", "uncalibrated", "zero-cost", "short-curve", "hits>trials", "missing", "garbage",
         "value", "nan-value", "inf-cost", "inf-backoff", "zero-bins"])
def test_a_state_this_version_did_not_write_is_not_used(edit):
    st = json.loads(json.dumps(_learned().state()))
    edit(st)
    assert AutoSchedule.from_state(B, st) is None  # a cache only ever saves time: the session calibrates


def test_a_second_session_starts_from_the_first(exports, tmp_path, monkeypatch):
    from dflash2.runtime.api import Runtime

    monkeypatch.setenv("DFLASH2_SCHEDULE_CACHE", "1")
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    folder = exports[("qwen3", 2)]
    first = Runtime(folder)
    ar = first.generate(PROMPT, 24, speculative=False).ids
    assert not list((tmp_path / "schedule").glob("*.json")) if (tmp_path / "schedule").exists() else True
    assert first.generate(PROMPT, 24).ids == ar and first.auto_schedule.calibration.rounds > 0
    saved = list((tmp_path / "schedule").glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["calibrated"]

    second = Runtime(folder)
    assert second.schedule_from_cache and not second.auto_schedule.calibration.active
    assert second.auto_schedule.costs.verify == first.auto_schedule.costs.verify
    assert second.generate(PROMPT, 24).ids == ar  # lossless whatever the schedule starts from
    assert second.auto_schedule.calibration.rounds == 0  # no calibration rounds in this session

    other = Runtime(folder, threads=1)  # another thread count is another cost model: its own entry
    assert not other.schedule_from_cache and other.auto_schedule.calibration.active
    own = Runtime(folder, drafter_threads=1)  # and so is the drafter's own
    assert not own.schedule_from_cache

    saved[0].write_text("{ not json")  # damaged: ignored, the session calibrates and writes it afresh
    third = Runtime(folder)
    assert not third.schedule_from_cache and third.generate(PROMPT, 24).ids == ar
    assert json.loads(saved[0].read_text())["calibrated"]

    cold = Runtime(folder, schedule_cache=False)  # dflash2-bench's sessions: cold, nothing read or written
    assert not cold.schedule_from_cache and cold.auto_schedule.calibration.active


def test_the_key_names_the_export_backend_threads_and_machine():
    k = schedule_cache.key("a" * 64, "onnxruntime", None, None)
    assert k == schedule_cache.key("a" * 64, "onnxruntime", None, None)
    assert len({k, schedule_cache.key("b" * 64, "onnxruntime", None, None),
                schedule_cache.key("a" * 64, "tensorrt", None, None),
                schedule_cache.key("a" * 64, "onnxruntime", None, 2),
                schedule_cache.key("a" * 64, "onnxruntime", None, None, 1)}) == 5


def test_the_drafter_gets_its_own_thread_count(exports, monkeypatch):
    """Runtime(drafter_threads=N) / DFLASH2_DRAFTER_THREADS: the drafter session's intra-op threads, the target's
    untouched (as ONNX Runtime's own session options report them); a bad value is named."""
    from dflash2.errors import Dflash2Error
    from dflash2.runtime.api import Runtime

    folder = exports[("qwen3", 2)]

    def threads(rt, graph):
        return rt.session.backend.session(graph).get_session_options().intra_op_num_threads

    rt = Runtime(folder, threads=2, drafter_threads=1)
    assert (threads(rt, "target"), threads(rt, "drafter")) == (2, 1)
    monkeypatch.setenv("DFLASH2_DRAFTER_THREADS", "1")
    assert threads(Runtime(folder, threads=2), "drafter") == 1
    monkeypatch.setenv("DFLASH2_DRAFTER_THREADS", "two")
    with pytest.raises(Dflash2Error, match="DFLASH2_DRAFTER_THREADS: expected a positive integer .*found 'two'"):
        Runtime(folder, threads=2)
    monkeypatch.delenv("DFLASH2_DRAFTER_THREADS")
    assert threads(Runtime(folder, threads=2), "drafter") == 2
