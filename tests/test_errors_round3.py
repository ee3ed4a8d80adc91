"""Issue 49, round three of "no data lost, no tracebacks": one test per class that failed before (exit status, one
line naming the file / field, inputs byte-identical, nothing left behind)."""

from __future__ import annotations

import json

import pytest

from dflash2 import tiny
from tests.errorcheck import one_line_error, snapshot


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny.make_pair(tmp_path_factory.mktemp("round3"), family="llama", version=2)


# (1) inputs overwritten: one rule, "a folder filled in place holds its marker or nothing"; "an output is no input"

def test_train_refuses_a_tap_corpus_that_lost_its_corpus_json(pair, tmp_path, capsys):
    from dflash2.cli import train as train_cli

    drafter, target = pair
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "shard-00000.safetensors").write_bytes(b"the user's shard, not to be replaced")
    before = snapshot(tmp_path, target)
    assert train_cli.main(["--target", str(target), "--out", str(tmp_path / "d"), "--corpus", str(corpus),
                           "--prompts", "templated:4", "--threads", "1"]) == 2
    msg = one_line_error(capsys.readouterr().err, "dflash2-train")
    assert str(corpus) in msg and "corpus.json" in msg and "shard-00000.safetensors" in msg
    assert snapshot(tmp_path, target) == before


def _bench_json(path, **kw):
    path.write_text(json.dumps({"whatever": 1, **kw}))
    return path


def test_bench_combine_refuses_json_over_its_own_input(tmp_path, capsys):
    from dflash2.cli import bench as bench_cli

    a = _bench_json(tmp_path / "A.json")
    b = _bench_json(tmp_path / "B.json")
    before = snapshot(tmp_path)
    assert bench_cli.main(["--combine", str(a), str(b), "--json", str(a)]) == 2
    msg = one_line_error(capsys.readouterr().err, "dflash2-bench")
    assert "--json" in msg and "--combine" in msg and str(a) in msg
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("content", ['{"not": "a draft vocabulary"}',
                                     '{"format": "dflash2-draft-vocab", "version": 1, "ids": [1]}'])
def test_draft_vocab_never_replaces_an_existing_file_without_force(pair, tmp_path, capsys, content, monkeypatch):
    from dflash2.cli import draft_vocab as cli
    from dflash2.train import data

    drafter, target = pair
    d = tmp_path / "drafter"
    import shutil

    shutil.copytree(drafter, d)
    (d / "draft_vocab.json").write_text(content)
    monkeypatch.setattr(data, "corpus_answers", lambda c: [list(range(5, 80))])
    before = snapshot(tmp_path, target)
    assert cli.main(["--drafter", str(d), "--target", str(target), "--corpus", str(tmp_path / "c"),
                     "--size", "64"]) == 2
    msg = one_line_error(capsys.readouterr().err, "dflash2-draft-vocab")
    assert str(d / "draft_vocab.json") in msg and "--force" in msg
    assert snapshot(tmp_path, target) == before
    ours = "dflash2-draft-vocab" in content
    code = cli.main(["--drafter", str(d), "--target", str(target), "--corpus", str(tmp_path / "c"), "--size", "64",
                     "--force"])
    err = capsys.readouterr().err
    if ours:
        assert code == 0, err
        assert json.loads((d / "draft_vocab.json").read_text())["size"] >= 64
    else:
        assert code == 2
        assert "format: expected a draft vocabulary" in one_line_error(err, "dflash2-draft-vocab")
        assert snapshot(tmp_path, target) == before
