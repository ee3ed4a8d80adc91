"""Draft vocabulary: file rules, the restricted head == masking the full head, export + lossless on ORT."""

import json
import shutil

import pytest
import torch

from dflash2 import draft_vocab as dv
from dflash2 import tiny
from dflash2.config import load_target_config
from dflash2.errors import CheckpointError, Dflash2Error
from dflash2.export.api import export
from dflash2.reference.load import load_pair
from dflash2.reference.selector import select_candidates
from dflash2.runtime.api import Runtime
from dflash2.speculative import generate


def test_from_sequences_ranks_by_count_then_lower_id():
    seqs = [[5, 5, 5, 2, 2, 9], [9, 9, 7, 1], [2]]  # counts: 5:3, 2:3, 9:3, 7:1, 1:1
    assert dv.from_sequences(seqs, 3, 10) == [2, 5, 9]
    assert dv.from_sequences(seqs, 4, 10) == [1, 2, 5, 9]  # 1 beats 7 on the tie
    assert dv.from_sequences(seqs, 2, 10, always=[0]) == [0, 2, 5]  # EOS kept whatever its count
    assert dv.from_sequences(seqs, 100, 10) == [1, 2, 5, 7, 9]  # never-seen ids are left out
    with pytest.raises(Dflash2Error, match=r"expected in \[0, 8\), found \[9\]"):
        dv.from_sequences(seqs, 3, 8)


def _write(folder, **doc):
    base = {"format": dv.FORMAT, "version": dv.VERSION, "vocab_size": 50, "ids": [1, 2, 3, 4]}
    (folder / dv.FILE).write_text(json.dumps(base | doc))


@pytest.mark.parametrize("doc,field,expected", [
    ({"format": "other"}, "format", "'dflash2-draft-vocab'"),
    ({"version": 9}, "version", "1"),
    ({"vocab_size": 51}, "vocab_size", "50 (the target's)"),
    ({"ids": "1,2"}, "ids", "a list of integer token ids"),
    ({"ids": [1, 2.5, 3]}, "ids", "a list of integer token ids"),
    ({"ids": [1, 3, 2, 4]}, "ids", "strictly ascending"),
    ({"ids": [1, 2, 2, 4]}, "ids", "strictly ascending"),
    ({"ids": [1, 2, 3, 50]}, "ids", r"ids in [0, 50)"),
    ({"ids": [1, 2]}, "ids", "at least top_k = 3 ids"),
])
def test_read_names_file_field_expected_and_found(tmp_path, doc, field, expected):
    _write(tmp_path, **doc)
    with pytest.raises(CheckpointError) as e:
        dv.read(tmp_path, 50, 3)
    assert e.value.field == field and expected in e.value.expected and dv.FILE in e.value.file


def test_read_without_file_and_unreadable_json(tmp_path):
    assert dv.read(tmp_path, 50, 3) is None
    (tmp_path / dv.FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable JSON"):
        dv.read(tmp_path, 50, 3)


def _hidden(drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, drafter.config.num_drafts, drafter.config.hidden_size, generator=g)


@pytest.mark.parametrize("version", [1, 2])
def test_whole_vocabulary_as_draft_vocab_changes_nothing(pairs, version):
    target, drafter = load_pair(*pairs[("llama", version)])
    hidden, anchor = _hidden(drafter), torch.tensor([3, 4, 5, 6])
    before = [drafter.propose(h, a) for h, a in zip(hidden, anchor)]
    drafter.set_draft_vocab(list(range(target.config.vocab_size)))
    after = [drafter.propose(h, a) for h, a in zip(hidden, anchor)]
    for b, a in zip(before, after):
        assert all(torch.equal(b[k], a[k]) for k in b)


@pytest.mark.parametrize("version", [1, 2])
def test_restricted_head_equals_the_full_head_masked_outside(pairs, version):
    target, drafter = load_pair(*pairs[("llama", version)])
    V, c = target.config.vocab_size, drafter.config
    ids = sorted(torch.randperm(V, generator=torch.Generator().manual_seed(3))[: V // 3].tolist())
    hidden, anchor = _hidden(drafter, 1), torch.tensor([3, 4, 5, 6])
    free = [drafter.propose(h, a)["draft_ids"] for h, a in zip(hidden, anchor)]
    drafter.set_draft_vocab(ids)
    got = [drafter.propose(h, a) for h, a in zip(hidden, anchor)]
    # independent reference: full-vocabulary logits with every id outside the subset at -inf
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    masked = drafter.logits(hidden).float().masked_fill(outside, float("-inf"))  # [4, S, V]
    if version == 1:
        want = [{"draft_ids": m.argmax(-1).int(), "confidence": torch.softmax(m, -1).amax(-1)}
                for m in masked]  # multiplier 1, no softcap in the tiny drafter; -inf ids have probability 0
    else:
        sel = drafter.candidate_selector
        out = select_candidates(masked, hidden, anchor, sel.hidden_projection.weight, sel.predecessor_codebook,
                                sel.successor_codebook, c.selector_top_k, c.output_multiplier, c.logit_softcap)
        want = [{k: v[i] for k, v in out.items()} for i in range(4)]
    for g, w in zip(got, want):  # ids exactly; scores up to GEMM blocking (a [N, H] head vs a [V, H] one)
        assert all(torch.equal(g[k], w[k]) if not g[k].is_floating_point() else torch.allclose(g[k], w[k], atol=1e-5)
                   for k in g)
        assert set(g["draft_ids"].tolist()) <= set(ids)
        if "cand_ids" in g:
            assert set(g["cand_ids"].flatten().tolist()) <= set(ids)
    assert any(not torch.equal(f, g["draft_ids"]) for f, g in zip(free, got))  # the subset did bind


@pytest.mark.parametrize("version", [1, 2])
def test_export_with_draft_vocab_is_lossless_on_ort_and_full_vocab_ignores_it(tmp_path, pairs, version):
    src, target_dir = pairs[("llama", version)]
    drafter_dir = tmp_path / "drafter"
    shutil.copytree(src, drafter_dir)
    V = load_target_config(target_dir).vocab_size
    prompt = [7, 1, 8, 2, 8, 1, 8]
    ar = generate(_torch_backend(src, target_dir), prompt, 48, speculative=False)  # target-only greedy
    ids = dv.from_sequences([ar.ids, prompt, range(0, V, 3)], V // 2, V)
    dv.write(drafter_dir, ids, V, "test")
    m = export(drafter_dir, target_dir, tmp_path / "out", quiet=True)
    assert m.draft_vocab.size == len(ids) and len(m.draft_vocab.sha256) == 64 and all(v.ok for v in m.validation.values())
    rt = Runtime(tmp_path / "out")
    spec = generate(rt.session, prompt, 48)
    assert spec.ids == ar.ids  # lossless: the target still verifies over the whole vocabulary
    ref = generate(_torch_backend(drafter_dir, target_dir), prompt, 48)
    assert spec.ids == ref.ids and spec.stats.accepted == ref.stats.accepted
    if version == 2:
        m = export(drafter_dir, target_dir, tmp_path / "full", quiet=True, full_vocab=True)
        assert m.draft_vocab is None


def _torch_backend(drafter_dir, target_dir):
    from dflash2.reference.backend import TorchBackend

    return TorchBackend(*load_pair(drafter_dir, target_dir), 512)


def test_cli_refuses_a_target_of_another_vocabulary(tmp_path, capsys):
    from dflash2.cli import draft_vocab as cli
    from tests.errorcheck import one_line_error, snapshot

    target = tiny.make_target(tmp_path / "target")
    drafter = tiny.make_drafter(tmp_path / "drafter", target)  # 384 ids
    other = tiny.make_target(tmp_path / "other", vocab_size=512)
    before = snapshot(tmp_path)
    assert cli.main(["--drafter", str(drafter), "--target", str(other), "--corpus", str(tmp_path / "c"),
                     "--size", "64"]) == 2
    msg = one_line_error(capsys.readouterr().err, "dflash2-draft-vocab")
    assert "expected the drafter's target (config.json vocab_size 384" in msg and "found vocab_size 512" in msg
    assert snapshot(tmp_path) == before


def test_cli_read_only_drafter_is_one_line_and_nothing_changed(tmp_path, capsys, monkeypatch):
    import errno

    from dflash2.cli import draft_vocab as cli
    from dflash2.train import data
    from tests.errorcheck import one_line_error, snapshot

    target = tiny.make_target(tmp_path / "target")
    drafter = tiny.make_drafter(tmp_path / "drafter", target)
    monkeypatch.setattr(data, "corpus_answers", lambda c: [list(range(5, 80))])

    def read_only(path, data):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(dv, "write_atomic", read_only)
    before = snapshot(tmp_path)
    assert cli.main(["--drafter", str(drafter), "--target", str(target), "--corpus", str(tmp_path / "c"),
                     "--size", "64"]) == 1
    msg = one_line_error(capsys.readouterr().err, "dflash2-draft-vocab")
    assert "could not write draft_vocab.json (Read-only file system); nothing was changed" in msg
    assert snapshot(tmp_path) == before
