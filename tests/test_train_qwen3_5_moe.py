"""dflash2-train with a Qwen3.5-MoE target (the Qwen3.5 hybrid whose every MLP is the experts' block with a shared
expert): the corpus holds transformers' own greedy answers and hidden states at the taps (batched, left-padded
prompts), the Teacher's soft labels are the MoE reference's own logits, a fresh drafter's MLP is the target's shared
expert (the config has no dense intermediate_size), and a short training run gives a drafter that exports with the
target, decodes losslessly and is accepted more often than a random one."""

from __future__ import annotations

import pytest
import torch

from dflash2 import tiny
from dflash2.train.data import generate_corpus, load_corpus
from dflash2.train.generate import load_hf_target
from tests.test_train_qwen3_5 import PROMPTS, TAPS, _acceptance, _close_to_fp16, _hf_greedy, _hf_taps


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny.make_target(tmp_path_factory.mktemp("qwen3_5_moe-train") / "target", family="qwen3_5_moe")


def test_corpus_records_are_transformers_greedy_answers_and_hidden_states(target, tmp_path):
    model, _, tc = load_hf_target(target)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    generate_corpus(target, PROMPTS, tmp_path / "c", list(TAPS), max_new_tokens=16, batch_size=4, shard_size=8,
                    log=lambda m: None)
    records = load_corpus(tmp_path / "c")
    assert len(records) == len(PROMPTS)
    for r in records:
        p = r["prompt_len"]
        assert r["ids"].tolist() == _hf_greedy(model, r["ids"][:p].tolist(), 16, list(tc.eos_token_ids))
        assert r["taps"].shape == (len(r["ids"]) - 1, 2 * tc.hidden_size)
        assert _close_to_fp16(r["taps"], _hf_taps(model, r["ids"]))


def test_teacher_soft_labels_are_the_moe_targets_logits(target):
    from dflash2.reference.load import load_target
    from dflash2.reference.moe import SparseMoE
    from dflash2.train.objective import Teacher

    t = load_target(target, TAPS)
    teacher = Teacher(t, TAPS)
    assert all(isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert is not None for layer in teacher.layers)
    ids = torch.randint(4, 300, (90,), generator=torch.Generator().manual_seed(0))  # > 64 rows: two GDN chunks
    with torch.no_grad():
        full, taps, _ = t(ids, t.empty_state())
    rec = {"ids": ids, "taps": taps[:-1], "prompt_len": 5}
    soft = teacher.logits(rec, torch.arange(len(ids) - 1)[None, :], None)[0]
    assert (soft - full[:-1]).abs().max() < 1e-3 * full.abs().max()


def test_a_fresh_drafters_mlp_is_the_nearest_shared_expert(target):
    """The config has intermediate_size 0 (no dense MLP): the drafter's MLP takes the shared expert's width and
    starts as a copy of the shared expert of its source layer (init_from last: the target's last layer)."""
    from dflash2.reference.load import load_target
    from dflash2.train.init import drafter_config_dict, init_drafter
    from dflash2.train.trainer import TrainConfig

    t = load_target(target, TAPS)
    c = TrainConfig(layers=1, block_size=8, top_k=4, rank=8, tap_ids=TAPS, mask_token_id=3)
    cfg = drafter_config_dict(target, c)
    assert cfg["intermediate_size"] == t.config.shared_expert_intermediate_size == 64
    d = init_drafter(t, cfg)
    shared = t.layers[-1].mlp.shared_expert
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(d.layers[0].mlp, name).weight, getattr(shared, name).weight), name


def test_a_trained_drafter_exports_and_beats_a_random_one(target, tmp_path):
    from dflash2.export.api import export
    from dflash2.train.trainer import TrainConfig, train

    generate_corpus(target, PROMPTS, tmp_path / "corpus", list(TAPS), max_new_tokens=40, batch_size=8, shard_size=8,
                    log=lambda m: None)
    records = load_corpus(tmp_path / "corpus")
    c = TrainConfig(layers=1, block_size=8, top_k=4, rank=8, steps=100, lr=1e-2, seqs_per_step=4,
                    anchors_per_seq=16, tap_ids=TAPS, mask_token_id=3, eval_every=50, save_every=100, kd_weight=0.5)
    train(target, tmp_path / "d", records, c, eval_records=records[:4], log_fn=lambda m: None)
    tiny.make_drafter(tmp_path / "random", target, block_size=8, tap_ids=TAPS, top_k=4, rank=8)
    tau = {}
    for name in ("d", "random"):  # _acceptance checks each answer against the corpus: lossless
        export(tmp_path / name, target, tmp_path / f"export-{name}", max_seq_len=512, quiet=True)
        tau[name] = _acceptance(tmp_path / f"export-{name}", records)
    assert tau["random"][0] < 1.2 and tau["d"][0] > 3.0, tau
