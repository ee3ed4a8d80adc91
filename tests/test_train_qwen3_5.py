"""dflash2-train with a Qwen3.5 hybrid target (Gated DeltaNet + gated full attention): the corpus is transformers'
own greedy answers and hidden states whatever the batching (left padding, finished rows leaving the batch with
their conv / recurrent states), the Teacher's soft labels are the target's own logits, and a short training run
gives a drafter that exports with the target and is accepted more often than a random one."""

from __future__ import annotations

import pytest
import torch

from dflash2 import tiny
from dflash2.train.data import generate_corpus, load_corpus
from dflash2.train.generate import chat_ids, generate_batch, load_hf_target

TAPS = (1, 2)
# prompts of 2..120 words: in one batch the shortest is left-padded by ~120 tokens, across a GDN chunk (64 rows)
PROMPTS = [" ".join(["the model drafts a block of tokens and the target verifies it"] * k)[: 9 * k + 6]
           for k in (1, 3, 8, 20, 45, 70)] + ["answer the question", "a small fast draft model for a large target"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the transformers GDN fallbacks are small ops that slow down a lot on a shared machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny.make_target(tmp_path_factory.mktemp("qwen3_5-train") / "target", family="qwen3_5")


@pytest.fixture(scope="module")
def hf(target):
    return load_hf_target(target)


def _hf_greedy(model, prompt: list[int], n: int, eos) -> list[int]:
    """transformers' own greedy generate for the prompt alone (no batch, no padding)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0].tolist()


def _hf_taps(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' hidden states after the tapped layers of a teacher-forced pass over ids[:-1] (fp32)."""
    with torch.no_grad():
        out = model(ids[None, :-1].long(), output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[k + 1][0] for k in TAPS], -1)


def _close_to_fp16(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp16-stored taps against fp32 ones: within two half-ulps of fp16 (2^-11 relative) plus a little."""
    return bool(((got.float() - want).abs() <= 1e-3 * want.abs() + 1e-3).all())


def test_corpus_records_are_transformers_greedy_answers_and_hidden_states(target, hf, tmp_path):
    """Each corpus record (prompts batched by length, left-padded) holds exactly transformers' generate(do_sample=
    False) for its prompt alone and the hidden states of a teacher-forced pass; with an EOS that ends rows at
    different steps, finished rows leave the batch (KV rows and GDN conv / recurrent states) without changing the
    others. Left padding is exact for the GDN layers: transformers zeroes the padded rows' inputs, so their conv
    history and recurrent state stay zero, as for an unpadded prompt."""
    model, tok, tc = hf
    generate_corpus(target, PROMPTS, tmp_path / "c", list(TAPS), max_new_tokens=16, batch_size=4, shard_size=8,
                    log=lambda m: None)
    records = load_corpus(tmp_path / "c")
    assert len(records) == len(PROMPTS)
    lengths = sorted(r["prompt_len"] for r in records)
    assert lengths[3] - lengths[0] > 64 or lengths[-1] - lengths[4] > 64  # a batch pads across a GDN chunk
    for r in records:
        p = r["prompt_len"]
        assert r["ids"].tolist() == _hf_greedy(model, r["ids"][:p].tolist(), 16, list(tc.eos_token_ids))
        assert r["taps"].shape == (len(r["ids"]) - 1, 2 * tc.hidden_size)
        assert _close_to_fp16(r["taps"], _hf_taps(model, r["ids"]))

    batch = chat_ids(tok, PROMPTS[:6])  # unsorted: the longest and shortest share the batch
    full = generate_batch(model, batch, list(TAPS), 20, [], 0)
    stop = full[0]["ids"][full[0]["prompt_len"] + 2].item()  # row 0's third token: an EOS for this check
    got = generate_batch(model, batch, list(TAPS), 20, [stop], 0)
    answers = [len(r["ids"]) - r["prompt_len"] for r in got]
    assert min(answers) < 20 and max(answers) == 20  # rows finished at different steps: the batch was compacted
    for x, r in zip(batch, got):
        assert r["ids"].tolist() == _hf_greedy(model, x, 20, stop)
        assert _close_to_fp16(r["taps"], _hf_taps(model, r["ids"]))


def test_teacher_soft_labels_are_the_hybrid_targets_logits(target):
    """KD on a hybrid target: the layers after the last tap (GDN from a zero state, gated attention under the text
    M-RoPE angles) run over the last tap's rows give Qwen35Target's own logits, whichever tap order is stored."""
    from dflash2.reference.load import load_target
    from dflash2.reference.qwen3_5 import Qwen35Target
    from dflash2.train.objective import Teacher

    t = load_target(target, TAPS)
    assert isinstance(t, Qwen35Target)
    ids = torch.randint(4, 300, (90,), generator=torch.Generator().manual_seed(0))  # > 64 rows: two GDN chunks
    with torch.no_grad():
        full, taps, _ = t(ids, t.empty_state())
    H = t.config.hidden_size
    rows = torch.arange(len(ids) - 1)[None, :]
    for order in (TAPS, TAPS[::-1], TAPS[:1]):
        stored = torch.cat([taps[:, TAPS.index(k) * H:(TAPS.index(k) + 1) * H] for k in order], 1)[:-1]
        rec = {"ids": ids, "taps": stored, "prompt_len": 5}
        soft = Teacher(t, order).logits(rec, rows, None)[0]  # [89, V]
        assert (soft - full[:-1]).abs().max() < 1e-3 * full.abs().max(), order  # fp32 taps: the same logits
        vocab = torch.tensor([0, 5, 9, 40])
        assert torch.allclose(Teacher(t, order).logits(rec, rows, vocab)[0], soft[:, vocab], atol=1e-5)
        half = Teacher(t, order).logits(rec | {"taps": stored.half()}, rows, None)[0]  # the corpus's fp16 taps
        assert torch.equal(half.argmax(-1), full[:-1].argmax(-1))


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """A corpus of 8 short answers, and a drafter trained on them for 100 steps (it learns them by heart)."""
    from dflash2.train.trainer import TrainConfig, train

    root = tmp_path_factory.mktemp("qwen3_5-trained")
    generate_corpus(target, PROMPTS, root / "corpus", list(TAPS), max_new_tokens=40, batch_size=8, shard_size=8,
                    log=lambda m: None)
    records = load_corpus(root / "corpus")
    c = TrainConfig(layers=1, block_size=8, top_k=4, rank=8, steps=100, lr=1e-2, seqs_per_step=4,
                    anchors_per_seq=16, tap_ids=TAPS, mask_token_id=3, eval_every=50, save_every=100)
    logs = []
    train(target, root / "d", records, c, eval_records=records[:4], log_fn=logs.append)
    return root, records, logs


def _acceptance(export_dir, records) -> tuple[float, int]:
    """Tokens per round of the exported pair (draft_len 7) over the records' prompts; each answer checked against
    the corpus (the loop is lossless: the target's greedy answer whatever the drafter)."""
    from dflash2.runtime.api import Runtime

    rt, accepted = Runtime(export_dir), []
    for r in records:
        p = r["prompt_len"]
        g = rt.generate(r["ids"][:p].tolist(), 40, draft_len=7)
        assert g.ids == r["ids"][p:].tolist()
        accepted += g.stats.accepted
    return 1 + sum(accepted) / len(accepted), len(accepted)


def test_a_trained_drafter_exports_and_beats_a_random_one(target, trained):
    """A drafter trained for 100 steps on a qwen3_5 target's answers exports with the target (the hybrid graphs)
    and, on the same prompts, is accepted far more often than a random drafter of the same shape."""
    from dflash2.config import load_drafter_config
    from dflash2.export.api import export

    root, records, logs = trained
    ces = [float(line.split("draft CE ")[1].split()[0]) for line in logs if "draft CE" in line]
    assert ces[-1] < ces[0] / 4
    dc = load_drafter_config(root / "d")
    assert dc.version == 2 and dc.target_layer_ids == TAPS and dc.block_size == 8
    tiny.make_drafter(root / "random", target, block_size=8, tap_ids=TAPS, top_k=4, rank=8)
    tau = {}
    for name in ("d", "random"):
        export(root / name, target, root / f"export-{name}", max_seq_len=512, quiet=True)
        tau[name] = _acceptance(root / f"export-{name}", records)
    assert tau["random"][0] < 1.2 and tau["d"][0] > 3.0, tau  # measured: random 1.00 (312 rounds), trained 5.89 (54)


def test_training_with_soft_labels_and_bf16_runs_on_the_hybrid_target(target, trained, tmp_path):
    """--kd-weight on a qwen3_5 target: the Teacher's KL term enters the loss (one step from the same weights and
    draw: a larger draft loss), under bf16 autocast too (the Teacher's GDN runs in fp32)."""
    from dflash2.train.trainer import TrainConfig, train

    _, records, _ = trained
    ce = {}
    for kd, dtype in ((0.0, "fp32"), (0.5, "fp32"), (0.5, "bf16")):
        c = TrainConfig(layers=1, block_size=6, top_k=4, rank=8, steps=1, seqs_per_step=2, anchors_per_seq=4,
                        tap_ids=TAPS, mask_token_id=3, eval_every=100, save_every=100, kd_weight=kd)
        logs = []
        train(target, tmp_path / f"{kd}-{dtype}", records, c, log_fn=logs.append, dtype=dtype)
        ce[kd, dtype] = float(next(x for x in logs if "draft CE" in x).split("draft CE ")[1].split()[0])
    assert ce[0.5, "fp32"] > ce[0.0, "fp32"] + 1e-3, ce  # + 0.5 KL(target || drafter) > 0
    assert abs(ce[0.5, "bf16"] - ce[0.5, "fp32"]) < 0.05 * ce[0.5, "fp32"], ce


def test_the_conditional_generation_wrapper_answers_as_itself(target, tmp_path):
    """What users download, Qwen3_5ForConditionalGeneration (text under text_config, `model.language_model.*`
    names, a vision tower, an MTP head): the corpus generator (Qwen3_5ForCausalLM over its text weights) answers as
    the wrapper's own generate, and the generator's and the live trainer's taps are the reference target's."""
    from dflash2.reference.load import load_target
    from dflash2.train.live import TapsModel
    from tests.qwen3_5_wrapper import make_wrapper

    wrapper, folder = make_wrapper(target, tmp_path / "wrapper")
    model, tok, _ = load_hf_target(folder)
    batch = chat_ids(tok, PROMPTS[:3])
    ref = load_target(folder, TAPS)
    for x, r in zip(batch, generate_batch(model, batch, list(TAPS), 12, [], 0)):
        assert r["ids"].tolist() == _hf_greedy(wrapper, x, 12, None)
        with torch.no_grad():
            _, want, _ = ref(r["ids"].long(), ref.empty_state())
        assert _close_to_fp16(r["taps"], want[:-1])
        assert _close_to_fp16(TapsModel(folder, list(TAPS), "fp32").taps(r["ids"]), want[:-1])
