"""A corpus is an input: one with a shard missing or unreadable is refused with the shard named and nothing
changed; --repair-corpus regenerates exactly those shards (byte-identical here: greedy fp32, same batches)."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from dflash2 import tiny
from dflash2.cli import train as train_cli
from dflash2.train.corpus import META, load_corpus
from dflash2.train.data import make_prompts
from dflash2.train.generate import generate_corpus
from tests.errorcheck import one_line_error, snapshot


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("damage")
    target = tiny.make_target(root / "target")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the repair runs (--threads 1): torch's CPU kernels round differently per thread count
    try:
        generate_corpus(target, make_prompts(12), root / "corpus", [1, 2], max_new_tokens=8, batch_size=4,
                        shard_size=4, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    return target, root / "corpus"


def _sums(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("shard-*"))}


def _train(target, corpus, out, *extra):
    return train_cli.main(["--target", str(target), "--corpus", str(corpus), "--out", str(out), "--steps", "1",
                           "--layers", "1", "--threads", "1", "--taps", "1,2", *extra])


def _one_prompt_more(corpus):
    """corpus.json edited to claim a 13th prompt: the shards hold 12 records."""
    meta = json.loads((corpus / META).read_text())
    (corpus / META).write_text(json.dumps(meta | {"prompts": meta["prompts"] + ["x"], "shard_size": 13}))


DAMAGE = {
    "missing": (lambda c: (c / "shard-00001.safetensors").unlink(), "shard(s) shard-00001.safetensors missing"),
    "truncated": (lambda c: (c / "shard-00002.safetensors").write_bytes((c / "shard-00002.safetensors").read_bytes()[:-64]),
                  "shard-00002.safetensors: not a readable corpus shard"),
    "rows_short": (lambda c: _one_prompt_more(c), "12 records in its shards, expected 13"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_corpus_is_refused_untouched(tmp_path, made, capsys, case):
    target, original = made
    corpus = tmp_path / "corpus"
    shutil.copytree(original, corpus)
    damage, words = DAMAGE[case]
    damage(corpus)
    before = snapshot(tmp_path)
    assert _train(target, corpus, tmp_path / "drafter") == 2
    msg = one_line_error(capsys.readouterr().err, "dflash2-train")
    # the way out it names: a repair where regenerating shards can make it whole, else a new corpus
    assert words in msg and ("regenerate it into a new folder" if case == "rows_short" else "--repair-corpus") in msg
    assert snapshot(tmp_path) == before  # nothing changed, nothing written (no drafter folder either)


def test_repair_regenerates_only_the_damaged_shards(tmp_path, made, capsys):
    target, original = made
    corpus = tmp_path / "corpus"
    shutil.copytree(original, corpus)
    want = _sums(original)
    DAMAGE["missing"][0](corpus)
    DAMAGE["truncated"][0](corpus)
    kept = (corpus / "shard-00000.safetensors").stat().st_mtime_ns
    assert _train(target, corpus, tmp_path / "drafter", "--repair-corpus") == 0
    assert "regenerating shard(s) [1, 2]" in capsys.readouterr().err
    assert _sums(corpus) == want  # the same bytes as before the damage
    assert (corpus / "shard-00000.safetensors").stat().st_mtime_ns == kept  # the intact shard untouched
    assert len(load_corpus(corpus)) == 12 and (tmp_path / "drafter" / "config.json").is_file()


def test_repair_refuses_another_target_and_torchrun(tmp_path, made, capsys, monkeypatch):
    """Regenerating shards with another model would mix two models' answers; under torchrun every rank would
    regenerate the same shards: both refused, nothing changed."""
    target, original = made
    corpus = tmp_path / "corpus"
    shutil.copytree(original, corpus)
    DAMAGE["missing"][0](corpus)
    other = tiny.make_target(tmp_path / "other", seed=1)  # other weights (a copy of the same model is the same target)
    before = snapshot(corpus)
    assert _train(other, corpus, tmp_path / "drafter", "--repair-corpus") == 2
    assert "would mix two models' answers" in one_line_error(capsys.readouterr().err, "dflash2-train")
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)  # as torchrun sets them for rank 0
    assert _train(target, corpus, tmp_path / "drafter", "--repair-corpus") == 2
    assert "without torchrun" in one_line_error(capsys.readouterr().err, "dflash2-train")
    assert snapshot(corpus) == before


def test_taps_mismatch_blames_the_default_not_a_flag_never_given(tmp_path, made, capsys):
    target, corpus = made
    other = tmp_path / "corpus"
    shutil.copytree(corpus, other)
    meta = json.loads((other / META).read_text())
    (other / META).write_text(json.dumps(meta | {"tap_ids": [0, 3]}))  # as if made with other taps
    before = snapshot(tmp_path)
    code = train_cli.main(["--target", str(target), "--corpus", str(other), "--out", str(tmp_path / "d"),
                           "--steps", "1", "--layers", "1", "--threads", "1"])
    msg = one_line_error(capsys.readouterr().err, "dflash2-train")
    assert code == 2 and "tap_ids expected [1, 2] (the default taps of the target's 4 layers; --taps chooses), " \
                         "found [0, 3]" in msg, msg
    assert snapshot(tmp_path) == before


def test_generation_flags_over_a_complete_corpus(tmp_path, made, capsys):
    """Rerunning the command that made a corpus resumes training (its generation flags equal the corpus's);
    asking for another answer length or shard size over a complete corpus would be ignored: refused, by name."""
    target, corpus = made
    before = snapshot(corpus)
    assert _train(target, corpus, tmp_path / "d", "--max-new-tokens", "16", "--shard-size", "4") == 2
    assert "a complete corpus, so --max-new-tokens 16 (it was made with 8) would have no effect" in one_line_error(
        capsys.readouterr().err, "dflash2-train")
    assert not (tmp_path / "d").exists()
    assert _train(target, corpus, tmp_path / "d", "--max-new-tokens", "8", "--shard-size", "4",
                  "--gen-batch", "2") == 0  # the command that made it: training runs
    assert snapshot(corpus) == before


def test_generation_flags_with_live_taps_are_refused(tmp_path, made, capsys):
    target, corpus = made
    code = train_cli.main(["--target", str(target), "--corpus", str(corpus), "--out", str(tmp_path / "d"),
                           "--live-taps", "fp32", "--gen-batch", "8", "--max-new-tokens=4"])
    assert code == 2
    assert "--gen-batch, --max-new-tokens: expected only when a corpus is generated; --live-taps trains on an id " \
        "corpus as it stands" in one_line_error(capsys.readouterr().err, "dflash2-train")
    assert not (tmp_path / "d").exists()


def test_generation_flags_abbreviated_or_with_a_partial_corpus_are_refused(tmp_path, made, capsys):
    target, corpus = made
    assert _train(target, corpus, tmp_path / "d", "--partial-corpus", "--gen-b", "2") == 2
    assert "--gen-batch: expected only when a corpus is generated; --partial-corpus trains on the shards written " \
        "so far" in one_line_error(capsys.readouterr().err, "dflash2-train")
    assert not (tmp_path / "d").exists()
