"""dflash2-train on a tiny target: corpus, checkpoint format, loss goes down, resume, export."""

import json

import pytest
import torch

from dflash2 import draft_vocab, tiny
from dflash2.config import load_drafter_config, load_target_config
from dflash2.errors import Dflash2Error
from dflash2.reference.backend import TorchBackend
from dflash2.reference.load import load_pair
from dflash2.speculative import generate
from dflash2.train.data import generate_corpus, load_corpus, make_prompts
from dflash2.train import state
from dflash2.train.objective import Teacher, accepted_lengths, loop_accepted, offline_acceptance
from dflash2.train.trainer import STATE, TrainConfig, train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = tiny.make_target(root / "target", family="qwen3")
    generate_corpus(target, make_prompts(24), root / "corpus", [1, 2], max_new_tokens=32, batch_size=8,
                    shard_size=8, log=lambda m: None)
    return target, load_corpus(root / "corpus")


def test_corpus_is_the_targets_greedy_answer_with_its_taps(corpus):
    from dflash2.reference.load import load_target

    target_dir, records = corpus
    assert len(records) == 24
    t = load_target(target_dir, (1, 2))
    r = records[3]
    with torch.no_grad():
        logits, taps, _ = t(r["ids"], torch.zeros(0, *t.kv_row_shape()))
    p = r["prompt_len"]
    assert torch.equal(logits.argmax(-1)[p - 1:-1], r["ids"][p:])  # the answer IS the target's greedy output
    assert r["taps"].shape[0] == len(r["ids"]) - 1
    assert (taps[:-1] - r["taps"].float()).abs().max() < 1e-2  # fp16 storage


def test_teacher_soft_labels_are_the_targets_logits(corpus):
    """The layers after the last tap, run on the stored last-tap rows, give the target's own logits."""
    from dflash2.reference.load import load_target

    target_dir, records = corpus
    t = load_target(target_dir, ())
    r = records[5]
    with torch.no_grad():
        full, _, _ = t(r["ids"], torch.zeros(0, *t.kv_row_shape()))  # [n, V]
    teacher = Teacher(t, (2, 1))  # tap order as listed: the last tap (2) is the first slice here
    r = {**r, "taps": torch.cat([r["taps"][:, 64:], r["taps"][:, :64]], 1)}  # stored as (1, 2): reorder
    rows = torch.arange(r["taps"].shape[0])[None, :]
    soft = teacher.logits(r, rows, None)[0]  # [T, V]
    assert (soft - full[: soft.shape[0]]).abs().max() < 2e-2  # fp16 taps
    assert torch.equal(soft.argmax(-1)[r["prompt_len"] - 1:], r["ids"][r["prompt_len"]:].long())
    vocab = torch.tensor([0, 5, 9, 40])
    assert torch.allclose(teacher.logits(r, rows, vocab)[0], soft[:, vocab], atol=1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    target_dir, records = corpus
    out = tmp_path_factory.mktemp("trained") / "d"
    c = TrainConfig(layers=1, block_size=6, top_k=4, rank=8, steps=40, lr=3e-3, seqs_per_step=4, anchors_per_seq=6,
                    tap_ids=(1, 2), mask_token_id=3, eval_every=20, save_every=20)
    logs = []
    r = train(target_dir, out, records[:20], c, eval_records=records[20:], log_fn=logs.append)
    return out, r, logs


def test_corpus_resume_refuses_other_taps_and_partial_corpora(tmp_path, corpus):
    """Shards resume by index, so a folder started with other taps or prompts must not be extended."""
    target_dir, _ = corpus
    out = tmp_path / "c"
    generate_corpus(target_dir, make_prompts(4), out, [1, 2], max_new_tokens=4, batch_size=4, shard_size=2,
                    log=lambda m: None)
    with pytest.raises(Dflash2Error, match=r"corpus.json: this corpus was generated with other tap_ids"):
        generate_corpus(target_dir, make_prompts(4), out, [0, 2], max_new_tokens=4, log=lambda m: None)
    with pytest.raises(Dflash2Error, match=r"corpus.json: tap_ids expected \[0, 2\] \(--taps\), found \[1, 2\]"):
        load_corpus(out, [0, 2])
    meta = json.loads((out / "corpus.json").read_text())
    (out / "corpus.json").write_text(json.dumps(meta | {"complete": False}))  # as if interrupted
    with pytest.raises(Dflash2Error, match="expected a complete corpus, found a partial one"):
        load_corpus(out)


def test_train_writes_a_dflash2_checkpoint_and_learns(trained, corpus):
    target_dir, records = corpus
    out, r, logs = trained
    ces = [float(line.split("draft CE ")[1].split()[0]) for line in logs if "draft CE" in line]
    assert ces[-1] < ces[0]  # the draft cross-entropy goes down
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "progress.json", STATE,
                                                     "training.json"]  # progress.json: the compact state
    cfg = load_drafter_config(out)
    assert cfg.version == 2 and cfg.block_size == 6 and cfg.selector_top_k == 4 and cfg.target_layer_ids == (1, 2)
    target, d = load_pair(out, target_dir)  # the exact DFlash2 format: loads and validates
    acc = offline_acceptance(d, records[20:])
    assert acc["oracle"] >= acc["top1"] >= 1.0 and acc["oracle"] >= acc["selector"]
    assert r["history"][-1]["step"] == 40


def test_training_evaluator_matches_the_speculative_loop(trained, corpus):
    """At the anchors the loop visits, the trainer's block evaluation accepts exactly what the loop
    accepted, round by round: training sees the same context, anchor and labels as inference."""
    target_dir, records = corpus
    t, d = load_pair(trained[0], target_dir)
    online = []
    for rec in records[20:]:
        p, ids = rec["prompt_len"], rec["ids"].tolist()
        g = generate(TorchBackend(t, d, 256), ids[:p], len(ids) - p)
        assert g.ids == ids[p:]
        anchors = (p + torch.tensor([0, *g.stats.accepted]).add(1).cumsum(0)[:-1] - 1).tolist()
        anchors = [a for a in anchors if a <= len(ids) - 2]  # a block needs one label after its anchor
        assert accepted_lengths(d, rec, anchors)["selector"] == g.stats.accepted[: len(anchors)]
        chain = loop_accepted(d, rec, chunk=5)  # the loop's anchors found offline, in chunks of 5 blocks
        assert chain["selector"] == g.stats.accepted[: len(anchors)]  # the same rounds, the same acceptance
        online += g.stats.accepted
    assert sum(online) > 0  # some drafts are accepted, so the comparison is not all zeros


def test_resume_continues_from_the_saved_step(tmp_path, corpus):
    target_dir, records = corpus
    c = TrainConfig(layers=1, block_size=6, top_k=4, rank=8, steps=10, seqs_per_step=2, anchors_per_seq=4,
                    tap_ids=(1, 2), mask_token_id=3, eval_every=100, save_every=5)
    train(target_dir, tmp_path / "d", records, c, log_fn=lambda m: None)
    assert state.step_of(tmp_path / "d") == 10
    logs = []
    c.steps = 15
    train(target_dir, tmp_path / "d", records, c, log_fn=logs.append)
    assert logs[0] == "resumed at step 10" and state.step_of(tmp_path / "d") == 15


def test_cli_generates_corpus_trains_and_reports(tmp_path, corpus, capsys):
    from dflash2.cli import train as train_cli

    target_dir, _ = corpus
    code = train_cli.main(["--target", str(target_dir), "--out", str(tmp_path / "d"), "--corpus", str(tmp_path / "c"),
                           "--prompts", "templated:12", "--max-new-tokens", "16", "--taps", "1,2", "--steps", "4",
                           "--block-size", "5", "--top-k", "4", "--rank", "8", "--seqs-per-step", "2",
                           "--anchors", "3", "--mask-token-id", "3", "--threads", "1", "--draft-vocab", "20",
                           "--kd-weight", "0.5", "--train-records", "5"])
    assert code == 0
    assert "training on 5 records, 1 held out" in capsys.readouterr().out
    assert len(load_corpus(tmp_path / "c")) == 12
    assert load_drafter_config(tmp_path / "d").block_size == 5
    ids = draft_vocab.read(tmp_path / "d", load_target_config(target_dir).vocab_size, 4)
    assert 4 <= len(ids) <= 20 + len(load_target_config(target_dir).eos_token_ids)
    code = train_cli.main(["--target", str(target_dir), "--out", str(tmp_path / "v"), "--corpus", str(tmp_path / "c"),
                           "--taps", "1,2", "--steps", "2", "--block-size", "5", "--top-k", "4", "--rank", "8",
                           "--seqs-per-step", "2", "--anchors", "3", "--mask-token-id", "3", "--threads", "1",
                           "--draft-vocab", "20", "--loss-vocab", "draft"])  # the loss over the draft vocabulary
    assert code == 0 and "once the run's checks pass" in capsys.readouterr().out  # the draft vocabulary's file
    assert json.loads((tmp_path / "v" / "draft_vocab.json").read_text())["requested_size"] == 20
    assert json.loads((tmp_path / "v" / "training.json").read_text())["config"]["loss_vocab"] == "draft"
    # a corpus tapped at other layers is refused, naming both
    code = train_cli.main(["--target", str(target_dir), "--out", str(tmp_path / "d2"), "--corpus",
                           str(tmp_path / "c"), "--taps", "0,2", "--steps", "1"])
    assert code == 2


def test_draft_vocab_cli_counts_the_corpus_answers(tmp_path, corpus, capsys):
    from dflash2.cli import draft_vocab as dv_cli

    target_dir, records = corpus
    drafter = tiny.make_drafter(tmp_path / "d", target_dir, top_k=4)
    folder = target_dir.parent / "corpus"  # the fixture's corpus folder
    args = ["--drafter", str(drafter), "--target", str(target_dir), "--corpus", str(folder)]
    assert dv_cli.main(args + ["--size", "16"]) == 0
    assert "covering" in capsys.readouterr().out
    tc = load_target_config(target_dir)
    ids = draft_vocab.read(drafter, tc.vocab_size, 4)
    counts = torch.bincount(torch.cat([r["ids"][r["prompt_len"]:] for r in records]), minlength=tc.vocab_size)
    top = set(torch.argsort(-counts, stable=True)[:16].tolist())  # ties: lower id first, as the CLI
    assert set(ids) == (top & set(torch.nonzero(counts).flatten().tolist())) | set(tc.eos_token_ids)
    assert dv_cli.main(args[:-2] + ["--corpus", str(tmp_path / "missing"), "--size", "16"]) == 2
    assert "expected a complete corpus" in capsys.readouterr().err
    assert dv_cli.main(args + ["--size", "2"]) == 2  # fewer ids than the selector's top-K
    assert "at least top_k = 4 ids" in capsys.readouterr().err


def test_finished_rows_leave_the_batch_without_changing_the_others(corpus):
    """With an EOS the tiny target emits early in some rows, those rows leave the batch (and their KV
    rows the cache) while the others go on: every row's answer and taps are what they are when no row
    ever stops, cut after its first EOS."""
    from dflash2.train.generate import chat_ids, generate_batch, load_hf_target

    target_dir, _ = corpus
    model, tok, _ = load_hf_target(target_dir)
    batch = sorted(chat_ids(tok, make_prompts(8)), key=len)
    full = generate_batch(model, batch, [1, 2], 20, [], 0)  # no EOS: every row runs 20 tokens
    answers = [r["ids"][r["prompt_len"]:].tolist() for r in full]
    stop = answers[0][2]  # row 0's third token: an EOS for this test
    cut = [a[: a.index(stop) + 1] if stop in a else a for a in answers]
    assert min(map(len, cut)) < 20 and max(map(len, cut)) == 20  # rows stop at different steps
    got = generate_batch(model, batch, [1, 2], 20, [stop], 0)
    for r, f, want in zip(got, full, cut):
        assert r["ids"][r["prompt_len"]:].tolist() == want
        n = len(r["ids"]) - 1  # taps of every position fed to the target: prompt + answer minus its last token
        assert r["taps"].shape[0] == n and torch.allclose(r["taps"].float(), f["taps"][:n].float(), atol=2e-3)


def _grown(out, trained, corpus, log_fn, **shape):
    """One step at lr 0 from the `trained` drafter into a run of another `shape` (weights as warm-started):
    -> (the trained drafter, the grown one), both loaded as references."""
    target_dir, records = corpus
    c = TrainConfig(block_size=6, top_k=4, steps=1, lr=0.0, seqs_per_step=1, anchors_per_seq=2, tap_ids=(1, 2),
                    mask_token_id=3, eval_every=100, save_every=1, **shape)
    train(target_dir, out, records[:20], c, eval_records=records[20:22], init_weights=trained[0], log_fn=log_fn)
    return load_pair(trained[0], target_dir)[1], load_pair(out, target_dir)[1]


def test_init_weights_grows_a_smaller_drafter_without_changing_what_it_drafts(tmp_path, trained, corpus):
    """--layers 2 --init-weights <a 1-layer drafter>: the new layer copies the last one with its residual
    branches' output projections zeroed, so before any update the grown drafter drafts exactly what the
    smaller one did (lr 0 keeps the weights as initialised)."""
    from dflash2.checkpoint import load_tensors
    from dflash2.train.objective import block_forward

    target_dir, records = corpus
    logs = []
    small, grown = _grown(tmp_path / "grown", trained, corpus, logs.append, layers=2, rank=8)
    assert f"initialised from {trained[0]}" in logs
    w = load_tensors(tmp_path / "grown")
    assert not w["layers.1.self_attn.o_proj.weight"].any() and not w["layers.1.mlp.down_proj.weight"].any()
    assert torch.equal(w["layers.1.self_attn.q_proj.weight"], w["layers.0.self_attn.q_proj.weight"])
    assert grown.config.num_layers == 2 and small.config.num_layers == 1
    for rec in records[20:]:
        anchors = list(range(rec["prompt_len"] - 1, len(rec["ids"]) - 2, 3))
        with torch.no_grad():
            h_small, labels, aid = block_forward(small, rec, anchors)
            h_grown, _, _ = block_forward(grown, rec, anchors)
            torch.testing.assert_close(h_grown, h_small, rtol=0, atol=1e-5)
            assert torch.equal(small.propose_batch(h_small, aid)["draft_ids"], grown.propose_batch(h_grown, aid)["draft_ids"])


def test_init_weights_grows_the_selector_rank_without_changing_what_it_drafts(tmp_path, trained, corpus):
    """--rank 12 --init-weights <a rank-8 drafter>: new gate rows and predecessor columns random, new successor
    columns 0, so every pair score, and with it every walk, is the smaller selector's (lr 0: as initialised)."""
    from dflash2.checkpoint import load_tensors
    from dflash2.train.objective import block_forward

    target_dir, records = corpus
    small, wide = _grown(tmp_path / "wide", trained, corpus, lambda m: None, layers=1, rank=12)
    w, w0 = load_tensors(tmp_path / "wide"), load_tensors(trained[0])
    sel = "candidate_selector."
    assert w[sel + "successor_codebook"].shape == (w0[sel + "successor_codebook"].shape[0], 12)
    assert not w[sel + "successor_codebook"][:, 8:].any() and w[sel + "predecessor_codebook"][:, 8:].abs().sum() > 0
    assert torch.equal(w[sel + "predecessor_codebook"][:, :8], w0[sel + "predecessor_codebook"])
    assert wide.config.selector_rank == 12 and small.config.selector_rank == 8
    for rec in records[20:]:
        anchors = list(range(rec["prompt_len"] - 1, len(rec["ids"]) - 2, 3))
        with torch.no_grad():
            h, _, aid = block_forward(small, rec, anchors)
            a, b = small.propose_batch(h, aid), wide.propose_batch(h, aid)
        assert torch.equal(a["draft_ids"], b["draft_ids"])
        torch.testing.assert_close(b["path_scores"], a["path_scores"], rtol=0, atol=1e-6)


def test_init_weights_with_other_widths_or_more_layers_is_refused(tmp_path, trained, corpus):
    target_dir, records = corpus
    c = TrainConfig(layers=1, block_size=6, top_k=4, rank=8, steps=1, seqs_per_step=1, anchors_per_seq=2,
                    tap_ids=(1,), mask_token_id=3, eval_every=100, save_every=1)
    with pytest.raises(Dflash2Error, match=r"differing tensors \['fc.weight"):
        train(target_dir, tmp_path / "d", records[:20], c, init_weights=trained[0], log_fn=lambda m: None)
    c.tap_ids, c.rank = (1, 2), 4
    with pytest.raises(Dflash2Error, match="selector rank of at most this run's 4, found 8"):
        train(target_dir, tmp_path / "d", records[:20], c, init_weights=trained[0], log_fn=lambda m: None)
    v1 = tiny.make_drafter(tmp_path / "v1", target_dir, version=1, block_size=6, tap_ids=(1, 2))
    with pytest.raises(Dflash2Error, match="expected a DFlash2 drafter like this run's, found a DFlash1 one"):
        train(target_dir, tmp_path / "d", records[:20], c, init_weights=v1, log_fn=lambda m: None)
    assert not (tmp_path / "d").exists()  # refused before the run's folder (config.json) was written
    c.rank, c.layers = 8, 2
    train(target_dir, tmp_path / "two", records[:20], c, init_weights=trained[0], log_fn=lambda m: None)
    c.layers = 1
    with pytest.raises(Dflash2Error, match="expected a drafter with at most this run's 1 layers, found 2"):
        train(target_dir, tmp_path / "one", records[:20], c, init_weights=tmp_path / "two", log_fn=lambda m: None)


def test_loss_decay_weighs_draft_positions(trained, corpus):
    """--loss-decay GAMMA: position k's cross-entropy weighs exp(-(k-1)/GAMMA); a tiny GAMMA leaves the first
    draft's cross-entropy alone, a huge one the plain mean over positions (hand-computed here)."""
    import torch.nn.functional as F
    from dflash2.train.objective import block_forward, losses

    target_dir, records = corpus
    _, d = load_pair(trained[0], target_dir)
    rec = records[20]
    with torch.no_grad():
        hidden, labels, aid = block_forward(d, rec, list(range(rec["prompt_len"] - 1, len(rec["ids"]) - 8, 2)))
        ce = F.cross_entropy(d.logits(hidden).flatten(0, 1), labels.flatten(), ignore_index=-100,
                             reduction="none").view_as(labels)  # [nb, S]
        valid = labels >= 0
        first, _ = losses(d, hidden, labels, aid, 1e-3, d.config.selector_top_k)
        flat, _ = losses(d, hidden, labels, aid, 1e9, d.config.selector_top_k)
    torch.testing.assert_close(first, ce[:, 0][valid[:, 0]].mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat, ce[valid].mean(), rtol=1e-5, atol=1e-6)


def test_a_loss_over_a_vocabulary_drops_labels_outside_it_and_keeps_their_ids_as_predecessors(trained, corpus):
    """--loss-vocab draft: the softmax runs over the draft vocabulary only; a label outside it is not trained on
    (the exported head can never draft it), yet it stays the next row's predecessor in the selector's pair score.
    Both losses against plain loops over a vocabulary that leaves out labels right before rows the selector trains on."""
    import math

    import torch.nn.functional as F
    from dflash2.train.objective import block_forward, losses

    target_dir, records = corpus
    _, d = load_pair(trained[0], target_dir)
    rec, K, m = records[20], d.config.selector_top_k, 1.7
    sel = d.candidate_selector
    g = torch.Generator().manual_seed(0)  # pair scores as large as the unary ones: a wrong predecessor shows
    for cb in (sel.predecessor_codebook, sel.successor_codebook):
        cb.data = 3 * torch.randn(cb.shape, generator=g)
    with torch.no_grad():
        hidden, labels, aid = block_forward(d, rec, list(range(rec["prompt_len"] - 1, len(rec["ids"]) - 3)))
        every = torch.tensor(sorted(set(labels[labels >= 0].tolist())))
        top = torch.searchsorted(every, labels.clamp(min=0))[..., None] == (hidden @ d.head_weight[every].T).topk(
            K, dim=-1).indices  # [nb, S, K]: label among the top-K over every label
        hit = top.any(-1) & (labels >= 0)
        hits = set(labels[hit].tolist())  # dropped: labels right before a hit row, never a hit row's own
        common = {int(labels[n, s - 1]) for n, s in hit[:, 1:].nonzero().add(torch.tensor([0, 1])).tolist()} - hits
        ids = sorted((set(labels[labels >= 0].tolist()) - common) | {3, 7, 11, 60})
        vocab = torch.tensor(ids)
        dl, sl = losses(d, hidden, labels, aid, 2.0, K, vocab, m)
    head = d.head_weight[vocab]  # [U, H]
    num = den = sel_num = sel_den = after_dropped = 0.0
    for n in range(labels.shape[0]):
        for s in range(labels.shape[1]):
            y = int(labels[n, s])
            if y < 0 or y not in ids:
                continue
            logits = hidden[n, s] @ head.T  # [U]
            w = math.exp(-s / 2.0)
            num, den = num + w * float(F.cross_entropy(logits[None], torch.tensor([ids.index(y)]))), den + w
            top = torch.topk(logits, K).indices.tolist()  # columns of the vocabulary
            if ids.index(y) not in top:
                continue
            prev = int(aid[n]) if s == 0 else int(labels[n, s - 1])  # the true token, inside the vocabulary or not
            gate = hidden[n, s] @ sel.hidden_projection.weight.T  # [R]
            score = torch.stack([logits[c] * m + (sel.predecessor_codebook[prev] * gate
                                                  * sel.successor_codebook[ids[c]]).sum() for c in top])
            sel_num += float(F.cross_entropy(score.detach()[None], torch.tensor([top.index(ids.index(y))])))
            sel_den, after_dropped = sel_den + 1, after_dropped + (prev in common)
    assert den > 0 and after_dropped > 0  # some selector rows follow a dropped label
    assert float(dl) == pytest.approx(num / den, rel=1e-4)
    assert float(sl) == pytest.approx(sel_num / sel_den, rel=1e-4)


def test_after_miss_anchors_are_where_the_loop_drafts_next(trained, corpus):
    """--anchors-at after-miss: from each anchor, the token after the first wrong draft (a + accepted + 1), as
    the speculative loop's next round: every step of the loop's own chain maps onto the next one."""
    from dflash2.train.objective import after_misses

    target_dir, records = corpus
    _, d = load_pair(trained[0], target_dir)
    rec = records[21]
    p, hi = rec["prompt_len"], len(rec["ids"]) - 2
    chain, a = [], p
    acc = accepted_lengths(d, rec, list(range(p, hi + 1)))["selector"]
    while a <= hi:  # the loop's anchors, walked by hand from every position's acceptance
        chain.append(a)
        a += acc[a - p] + 1
    assert len(chain) > 2 and after_misses(d, rec, chain) == chain[1:]
    assert after_misses(d, rec, [hi]) == []  # past the answer's last anchor: dropped
    hand = sorted({x + acc[x - p] + 1 for x in range(p, hi + 1) if x + acc[x - p] + 1 <= hi})
    assert after_misses(d, rec, list(range(p, hi + 1))) == hand
