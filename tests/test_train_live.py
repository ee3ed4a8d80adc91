"""dflash2-train --live-taps: taps computed in the loop from an id corpus (against the reference target), the
corpus read in a fixed, resumable order with whole conversations held out, and a run continued on a fresh
clone from only the files a repository keeps (progress.json + the fp16 drafter)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash2 import tiny
from dflash2.cli import train as train_cli
from dflash2.errors import Dflash2Error
from dflash2.train import state
from dflash2.train.grow import grow
from dflash2.train.idcorpus import IdCorpus
from dflash2.train.live import IdStream, TapsModel
from tests.test_idcorpus import CONVS

TAPS = [1, 2]
COMMITTED = ("config.json", "model.safetensors", "progress.json", "training.json", "draft_vocab.json")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A tiny qwen3 target and an id corpus of 3 shards over 60 conversations (its answers: the target's)."""
    root = tmp_path_factory.mktemp("live")
    target = tiny.make_target(root / "target", family="qwen3")
    sharegpt = root / "sharegpt.json"
    convs = [{"conversations": [t | {"value": f"{t['value']} (variant {i})"} for t in c["conversations"]]}
             for c in CONVS for i in range(15)]  # every row distinct; conversation 49 (held out) answerable
    sharegpt.write_text(json.dumps(convs))
    folder = root / "corpus"
    grow(target, folder, minutes=10, shard_items=20, batch_size=10, max_new_tokens=16, context_tokens=400,
         dtype="fp32", conversations=(0, 60), max_shards=3, log=lambda m: None, sharegpt_file=sharegpt)
    return target, folder


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_taps_match_the_reference_target(targets, family):
    from dflash2.reference.load import load_target

    ids = torch.randint(0, 200, (23,))
    ref = load_target(targets[family], tuple(TAPS))
    with torch.no_grad():
        _, want, _ = ref(ids, torch.zeros(0, *ref.kv_row_shape()))  # [24 - 1 + 1, 2H]: every position
    got = TapsModel(targets[family], TAPS, "fp32").taps(ids)  # [22, 2H]: the last id is a label only
    assert got.dtype == torch.float16 and got.shape == (22, want.shape[1])
    assert (got.float() - want[:-1]).abs().max() < 1e-2  # fp16 storage of fp32 taps
    bf = TapsModel(targets[family], TAPS, "bf16").taps(ids).float()
    assert ((bf - want[:-1]).norm() / want[:-1].norm()) < 0.02  # bf16 weights and activations
    with pytest.raises(Dflash2Error, match="expected layer ids below the target's"):
        TapsModel(targets[family], [1, 99], "fp32")


def _stream(live, **kw):
    target, folder = live
    return IdStream(IdCorpus(folder), TapsModel(target, TAPS, "fp32"), log=lambda m: None, **kw)


def _key(rec) -> tuple:
    return tuple(rec["ids"].tolist())


def test_whole_conversations_are_held_out(live):
    _, folder = live
    c = IdCorpus(folder)
    by_conv = {}
    for i in range(len(c.shards)):
        sh = c.shard(i)
        for j in range(len(sh)):
            p, a = sh.row(j)
            by_conv.setdefault(int(sh.source[j, 0]), set()).add(tuple(p.tolist() + a.tolist()))
    s = _stream(live, holdout_mod=4)
    held = {tuple(ids.tolist()) for ids, _ in s.eval_rows}
    trained = {_key(r) for r in s.take(s.rows_per_epoch)}
    assert held and trained and not held & trained
    assert held == set().union(*(rows for conv, rows in by_conv.items() if conv % 4 == 3))
    assert trained == set().union(*(rows for conv, rows in by_conv.items() if conv % 4 != 3))
    assert s.rows_per_epoch + len(s.eval_rows) == c.totals()["rows"]
    ev = s.held_out(2)
    assert ev[0]["taps"] is ev[0]["taps"]  # computed once, kept: held-out records are evaluated every eval


def test_the_order_is_fixed_resumable_and_extended_by_growth(live):
    a, b = _stream(live, seed=0), _stream(live, seed=0)
    first = [_key(r) for r in a.take(a.rows_per_epoch)]
    assert len(set(first)) == a.rows_per_epoch  # an epoch is every training row once
    assert [_key(r) for r in b.take(5)] + [_key(r) for r in b.take(a.rows_per_epoch - 5)] == first
    assert [_key(r) for r in _stream(live, seed=1).take(a.rows_per_epoch)] != first
    assert set(_key(r) for r in a.take(a.rows_per_epoch)) == set(first)  # epoch 2: another shuffle, same rows
    # a corpus that gained shards since keeps the order of what it had
    small = _stream(live, seed=0, max_shards=2)
    assert small.rows_per_epoch < a.rows_per_epoch
    assert [_key(r) for r in small.take(small.rows_per_epoch)] == first[: small.rows_per_epoch]
    # restore: continues after the saved cursor; another seed, hold-out rule or fewer shards are refused
    c = _stream(live, seed=0)
    c.restore(small.state() | {"cursor": 7}, "P")
    assert [_key(r) for r in c.take(3)] == first[7:10]
    with pytest.raises(Dflash2Error, match=r"P: stream.seed expected 0 \(this run\), found 1"):
        c.restore(_stream(live, seed=1).state(), "P")
    with pytest.raises(Dflash2Error, match=r"P: stream.holdout_mod expected 50 \(this run\), found 4"):
        c.restore(_stream(live, holdout_mod=4).state(), "P")
    with pytest.raises(Dflash2Error, match=r"P: stream.shards expected at most 2 \(the corpus now\), found 3"):
        small.restore(c.state(), "P")


def _train(live, out, *extra):
    target, folder = live
    return train_cli.main(["--target", str(target), "--out", str(out), "--corpus", str(folder), "--live-taps",
                           "fp32", "--taps", "1,2", "--layers", "1", "--block-size", "4", "--top-k", "4",
                           "--rank", "8", "--seqs-per-step", "2", "--anchors", "3", "--mask-token-id", "3",
                           "--threads", "1", "--draft-vocab", "30", "--eval-every", "3", "--save-every", "3",
                           *extra])


def test_a_fresh_clone_continues_from_the_committed_files(live, tmp_path, capsys):
    a = tmp_path / "a"
    assert _train(live, a, "--steps", "6") == 0
    assert "id corpus" in capsys.readouterr().out
    p = json.loads((a / "progress.json").read_text())
    assert p["step"] == 6 and p["extra"]["stream"]["cursor"] == 12 and p["extra"]["seen"]["records"] == 12
    hist = json.loads((a / "training.json").read_text())["history"]
    assert [h["step"] for h in hist] == [0, 3, 6]  # the curve starts at the initial drafter
    assert hist[0]["seen"]["answer_tokens"] == 0 < hist[1]["seen"]["answer_tokens"] < hist[2]["seen"]["answer_tokens"]
    # what a repository keeps: no train_state (AdamW's moments), a fresh folder on another machine
    b = tmp_path / "b"
    b.mkdir()
    for name in COMMITTED:
        shutil.copy(a / name, b / name)
    assert _train(live, b, "--steps", "10") == 0
    out = capsys.readouterr().out
    assert "resumed at step 6 from the compact state" in out
    q = json.loads((b / "progress.json").read_text())
    assert q["step"] == 10 and q["extra"]["stream"]["cursor"] == 20 and q["extra"]["seen"]["records"] == 20
    assert [h["step"] for h in json.loads((b / "training.json").read_text())["history"]] == [0, 3, 6, 9, 10]
    # the same run continued from its full state (moments and all) reaches the same step and cursor
    assert _train(live, a, "--steps", "10") == 0
    assert "resumed at step 6" in capsys.readouterr().out
    assert json.loads((a / "progress.json").read_text())["extra"]["stream"]["cursor"] == 20
    assert state.progress_step(b) == 10
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "scripts" / "train_curve.py"
    curve = subprocess.run([sys.executable, str(script), str(b / "training.json")], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert [json.loads(curve[0])[i]["step"] for i in range(5)] == [0, 3, 6, 9, 10]
    assert sum(line.startswith("| ") and line.split("|")[1].strip().isdigit() for line in curve) == 5


def test_tampered_or_mismatched_compact_state_is_refused_by_name(live, tmp_path, capsys):
    a = tmp_path / "a"
    assert _train(live, a, "--steps", "3") == 0
    b = tmp_path / "b"
    b.mkdir()
    for name in COMMITTED:
        shutil.copy(a / name, b / name)
    weights = (b / "model.safetensors").read_bytes()
    (b / "model.safetensors").write_bytes(weights[:-2] + bytes([weights[-2] ^ 1, weights[-1]]))
    config = (b / "config.json").read_bytes()  # with the learned unary scale the saved weights go with
    capsys.readouterr()
    assert _train(live, b, "--steps", "6") == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "sha256" in err and "Traceback" not in err
    (b / "model.safetensors").write_bytes(weights)
    assert _train(live, b, "--steps", "6", "--rank", "16") == 2  # another selector rank than the saved drafter
    err = capsys.readouterr().err
    assert "progress.json" in err and "rank" in err
    assert _train(live, b, "--steps", "6", "--seed", "1") == 2  # another corpus order
    assert "stream.seed expected 1 (this run), found 0" in capsys.readouterr().err
    assert json.loads((b / "progress.json").read_text())["step"] == 3  # refused runs wrote nothing
    assert (b / "config.json").read_bytes() == config  # not even the config of the run they would have been


def test_a_time_budget_stops_saved_and_the_same_command_continues(live, tmp_path, capsys):
    a = tmp_path / "a"
    assert _train(live, a, "--steps", "50", "--minutes", "0.0001") == 0
    out = capsys.readouterr().out
    assert "stopped at step 1/50: the 0.0001-minute budget is spent" in out
    assert state.progress_step(a) == 1 and (a / "draft_vocab.json").is_file()
    assert json.loads((a / "training.json").read_text())["history"][-1]["step"] == 1
    assert _train(live, a, "--steps", "50", "--minutes", "0.0001", "--loss-decay", "1.5") == 0
    assert "stopped at step 2/50" in capsys.readouterr().out
    assert json.loads((a / "training.json").read_text())["config"]["gamma"] == 1.5  # the flag reaches the loss
    assert _train(live, a, "--steps", "50", "--minutes", "0.0001", "--anchors-at", "after-miss") == 0
    assert "stopped at step 3/50" in capsys.readouterr().out
    assert json.loads((a / "training.json").read_text())["config"]["anchors_at"] == "after-miss"


@pytest.mark.parametrize("extra, message", [
    (["--taps-cache", "x"], "--live-taps: expected without --taps-cache"),
    (["--train-records", "4"], "--live-taps: expected without --train-records"),
    (["--minutes", "0"], "--minutes: expected a finite number of minutes > 0, found 0.0"),
    (["--minutes", "inf"], "--minutes: expected a finite number of minutes > 0, found inf"),
    (["--loss-vocab", "draft", "--draft-vocab", "0"], "--draft-vocab: expected >= 1, found 0"),
])
def test_live_flags_are_checked_before_anything_is_written(live, tmp_path, capsys, extra, message):
    assert _train(live, tmp_path / "d", "--steps", "2", *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_live_taps_need_one_id_corpus(live, tmp_path, capsys):
    target, folder = live
    assert train_cli.main(["--target", str(target), "--out", str(tmp_path / "d"), "--corpus", str(folder),
                           str(folder), "--live-taps", "fp32", "--steps", "2"]) == 2
    assert "--live-taps: expected one --corpus (an id corpus), found 2" in capsys.readouterr().err
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "corpus.json").write_text(json.dumps({"tap_ids": [1, 2], "complete": True}))
    assert train_cli.main(["--target", str(target), "--out", str(tmp_path / "d"), "--corpus", str(tmp_path / "old"),
                           "--live-taps", "fp32", "--steps", "2"]) == 2
    assert "expected an id corpus" in capsys.readouterr().err
    other = tiny.make_target(tmp_path / "other", family="qwen3", seed=5)
    assert train_cli.main(["--target", str(other), "--out", str(tmp_path / "d"), "--corpus", str(folder),
                           "--live-taps", "fp32", "--steps", "2", "--taps", "1,2"]) == 2
    assert "sha256" in capsys.readouterr().err


def test_a_full_disk_mid_training_keeps_the_last_save_whole(live, tmp_path, capsys, monkeypatch):
    """ENOSPC while step 6's state is written: one line, status 1, the step-3 files whole and consistent (the same
    command then resumes from them), no temporary file left beside them."""
    import errno

    from dflash2.train import trainer

    out = tmp_path / "d"
    assert _train(live, out, "--steps", "3") == 0
    capsys.readouterr()
    before = {n: (out / n).read_bytes() for n in COMMITTED}
    real = trainer.save_file

    def full_disk(tensors, filename, metadata=None):  # the drafter's weights: half a file, then the disk is full
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(trainer, "save_file", full_disk)
    assert _train(live, out, "--steps", "6") == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "Loading weights" not in ln]
    assert len(err) == 1 and err[0].startswith("dflash2-train: error: ") and "no space left on the device" in err[0] \
        and "Traceback" not in err[0], err
    assert {n: (out / n).read_bytes() for n in COMMITTED} == before  # progress.json still names these weights
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    monkeypatch.setattr(trainer, "save_file", real)
    assert _train(live, out, "--steps", "6") == 0  # from the full state of step 6 (written whole before the failure)
    assert "resumed at step 6" in capsys.readouterr().out
    assert state.progress_step(out) == 6


def test_a_loss_over_the_draft_vocabulary_fixes_it_when_the_run_starts(live, tmp_path, capsys):
    """--loss-vocab draft: draft_vocab.json is written before the first step (with the size asked for) and a resumed
    run trains over that file, not over a recount; another --draft-vocab on resume is refused, and the flag needs
    --draft-vocab at all."""
    out = tmp_path / "d"
    assert _train(live, out, "--steps", "2", "--loss-vocab", "draft") == 0
    said = capsys.readouterr().out
    assert "loss over the draft vocabulary: " in said and "of the training answers' tokens" in said
    doc = json.loads((out / "draft_vocab.json").read_text())
    assert doc["requested_size"] == 30 and doc["size"] == len(doc["ids"]) <= 30 + 1  # + EOS
    hist = json.loads((out / "training.json").read_text())
    assert hist["config"]["loss_vocab"] == "draft" and hist["history"][-1]["step"] == 2
    (out / "draft_vocab.json").write_text(json.dumps(doc | {"ids": doc["ids"][:-1], "size": doc["size"] - 1}))
    assert _train(live, out, "--steps", "4", "--loss-vocab", "draft") == 0  # resumes over the file as it stands
    assert f"fixed when this run started: {doc['size'] - 1} ids" in capsys.readouterr().out
    assert json.loads((out / "draft_vocab.json").read_text())["ids"] == doc["ids"][:-1]
    assert _train(live, out, "--steps", "6", "--loss-vocab", "draft", "--draft-vocab", "31") == 2
    assert "draft_vocab.json: requested_size expected 31 (--draft-vocab of this run), found 30" in capsys.readouterr().err
    assert _train(live, tmp_path / "e", "--steps", "2", "--loss-vocab", "draft", "--draft-vocab", "2") == 2
    assert "--draft-vocab 2 over dflash2-train id corpus" in capsys.readouterr().err  # fewer ids than --top-k 4
    assert not (tmp_path / "e" / "draft_vocab.json").exists()
    target, folder = live
    assert train_cli.main(["--target", str(target), "--out", str(tmp_path / "f"), "--corpus", str(folder),
                           "--live-taps", "fp32", "--steps", "2", "--loss-vocab", "draft"]) == 2
    assert "--loss-vocab draft: expected --draft-vocab N" in capsys.readouterr().err
    assert not (tmp_path / "f").exists()
    # a warm start refused after the vocabulary was counted: the run's folder is never made, so a corrected
    # rerun (with another --draft-vocab, say) does not meet a draft_vocab.json or config.json of a run that never ran
    v1 = tiny.make_drafter(tmp_path / "v1", target, version=1, block_size=4, tap_ids=(1, 2))
    assert _train(live, tmp_path / "g", "--steps", "2", "--loss-vocab", "draft", "--init-weights", str(v1)) == 2
    assert "expected a DFlash2 drafter like this run's, found a DFlash1 one" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()


def test_soft_labels_from_live_taps_are_the_targets_logits(live, tmp_path, capsys):
    """--kd-weight with --live-taps: the Teacher runs the layers after the last tap over the taps computed in the
    loop, which gives the target's own logits (its greedy answer is their argmax); the run records the weight."""
    from dflash2.reference.load import load_target
    from dflash2.train.objective import Teacher

    target, _ = live
    rec = _stream(live).held_out(1)[0]
    t = load_target(target, ())
    with torch.no_grad():
        full, _, _ = t(rec["ids"], torch.zeros(0, *t.kv_row_shape()))  # [n, V]
    rows = torch.arange(rec["taps"].shape[0])[None, :]
    soft = Teacher(load_target(target, tuple(TAPS)), tuple(TAPS)).logits(rec, rows, None)[0]  # [n - 1, V]
    assert (soft - full[:soft.shape[0]]).abs().max() < 2e-2  # fp16 taps
    assert torch.equal(soft.argmax(-1)[rec["prompt_len"] - 1:], rec["ids"][rec["prompt_len"]:].long())
    import re

    capsys.readouterr()
    ce = {}
    for kd in ("0", "0.5"):  # one step from the same weights on the same draw: its loss is printed before the update
        assert _train(live, tmp_path / kd, "--steps", "1", "--kd-weight", kd, "--loss-vocab", "draft") == 0
        ce[kd] = float(re.search(r"step 1/1 .*draft CE ([0-9.]+)", capsys.readouterr().out).group(1))
    assert ce["0.5"] > ce["0"] + 1e-3, ce  # + 0.5 KL(target || drafter), > 0 for a drafter that is not the target
    hist = json.loads((tmp_path / "0.5" / "training.json").read_text())
    assert hist["config"]["kd_weight"] == 0.5 and hist["history"][-1]["step"] == 1
