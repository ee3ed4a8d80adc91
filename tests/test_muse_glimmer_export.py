"""Muse-Glimmer's standard-op target graphs (dflash2.export.muse_glimmer: portable + TensorRT flavour) on ONNX
Runtime against the reference and transformers, on the tiny pair of test_muse_glimmer_reference (window 8, NoPE full
layers) with Meta's assistant's taps and block (test_meta_assistant): a prefill 5x the window holding image / video
ids (logits, next ids, new K/V, fused context), the fixed-buffer flavour with stale rows, greedy ids over 64 tokens
past the window equal to transformers' `generate`, and speculative verification through the graph with rollback
at every accepted count 0..S equal to greedy (lossless)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from dflash2.export import muse_glimmer as graph  # noqa: E402
from dflash2.export import signature as N  # noqa: E402
from dflash2.export.weights import ModuleWeights  # noqa: E402
from dflash2.reference.load import load_drafter  # noqa: E402
from dflash2.reference.muse_glimmer import load_target  # noqa: E402

from tests.test_meta_assistant import TAPS, assistant  # noqa: E402
from tests.test_muse_glimmer_reference import IMAGE, VIDEO, WINDOW, pair, prompt  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.set_num_threads(1)
    hf, _, target_dir = pair("untied", tmp_path_factory)
    _, drafter_dir = assistant(tmp_path_factory)
    ref = load_target(target_dir, tuple(TAPS))
    drafter = load_drafter(drafter_dir, ref)
    portable, fixed = graph.build(ref.config, drafter.config, ModuleWeights(ref), ModuleWeights(drafter),
                                  fuse_context=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    sessions = [ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
                for m in (portable, fixed)]
    return hf, ref, drafter, sessions


def step(sess, ids, past):
    """The portable graph on ids [n] after past [P, L, 2, kv, hd] -> (next_ids, context, new_kv, logits)."""
    out = sess.run(None, {N.INPUT_IDS: np.asarray(ids, np.int32), N.PAST_KV: past})
    return dict(zip([o.name for o in sess.get_outputs()], out))


def test_prefill_past_the_window_matches_the_reference(built):
    _, ref, drafter, (portable, _) = built
    ids = prompt(5 * WINDOW, seed=2)
    ids[4], ids[17] = IMAGE, VIDEO  # remapped to 0 in the graph too
    out = step(portable, ids.numpy(), np.zeros((0, *ref.kv_row_shape()), np.float32))
    with torch.no_grad():
        logits, taps, kv = ref(ids, torch.zeros(0, *ref.kv_row_shape()))
        context = drafter.context(taps)
    B = drafter.config.block_size
    assert np.abs(out[N.LOGITS] - logits[-B:].numpy()).max() < TOL
    assert (out[N.NEXT_IDS] == logits.argmax(-1).numpy()).all()
    assert np.abs(out[N.NEW_KV] - kv.numpy()).max() < TOL
    assert np.abs(out[N.CONTEXT] - context.numpy()).max() < TOL


def test_the_fixed_flavour_masks_stale_rows(built):
    """kv_cache [cap] with garbage past past_len: the same step as the portable graph on the valid prefix."""
    _, ref, _, (portable, fixed) = built
    ids = prompt(3 * WINDOW, seed=4)
    first = step(portable, ids[:20].numpy(), np.zeros((0, *ref.kv_row_shape()), np.float32))
    cache = np.random.default_rng(0).standard_normal((64, *ref.kv_row_shape())).astype(np.float32) * 50
    cache[:20] = first[N.NEW_KV]
    want = step(portable, ids[20:].numpy(), first[N.NEW_KV])
    got = fixed.run(None, {N.INPUT_IDS: ids[20:].numpy().astype(np.int32), N.KV_CACHE: cache,
                           N.PAST_LEN: np.array([20], np.int32)})
    got = dict(zip([o.name for o in fixed.get_outputs()], got))
    for name in (N.LOGITS, N.NEW_KV, N.CONTEXT):
        assert np.abs(got[name] - want[name]).max() < TOL, name
    assert (got[N.NEXT_IDS] == want[N.NEXT_IDS]).all()


def greedy(sess, ref, ids, count: int) -> list[int]:
    out = step(sess, ids.numpy(), np.zeros((0, *ref.kv_row_shape()), np.float32))
    past, got = out[N.NEW_KV], [int(out[N.NEXT_IDS][-1])]
    while len(got) < count:
        out = step(sess, [got[-1]], past)
        past = np.concatenate([past, out[N.NEW_KV]])
        got.append(int(out[N.NEXT_IDS][0]))
    return got


def test_greedy_64_tokens_through_the_graph_equal_transformers(built):
    hf, ref, _, (portable, _) = built
    ids = prompt(3 * WINDOW, seed=3)
    with torch.no_grad():
        want = hf.generate(ids[None], do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)
    assert greedy(portable, ref, ids, 64) == want[0, ids.shape[0]:].tolist()


def test_speculative_verify_through_the_graph_is_lossless_at_every_accepted_count(built):
    """Rounds of S drafts verified as one (S+1)-row step of the graph: the drafts are greedy's continuation with
    draft a replaced (a = round mod S+1; a = S: all right), so every accepted count 0..S occurs; only the accepted
    rows' K/V are kept (rollback), windows are crossed; the emitted ids are greedy's, token for token."""
    _, ref, drafter, (portable, _) = built
    S, ids, count = drafter.config.block_size - 1, prompt(2 * WINDOW + 3, seed=8), 64
    truth = greedy(portable, ref, ids, count + S + 1)
    out = step(portable, ids.numpy(), np.zeros((0, *ref.kv_row_shape()), np.float32))
    past, emitted, seen = out[N.NEW_KV], [int(out[N.NEXT_IDS][-1])], set()
    r = 0
    while len(emitted) < count:
        a = r % (S + 1)
        drafts = list(truth[len(emitted):len(emitted) + S])
        if a < S:
            drafts[a] = (drafts[a] + 1) % ref.config.vocab_size  # a wrong draft at slot a
        out = step(portable, [emitted[-1], *drafts], past)
        verified = out[N.NEXT_IDS].tolist()  # [S+1]: the target's choice after each row
        acc = next((j for j in range(S) if drafts[j] != verified[j]), S)
        assert acc == a
        past = np.concatenate([past, out[N.NEW_KV][:acc + 1]])  # rollback: the rejected rows' K/V dropped
        emitted += verified[:acc + 1]
        seen.add(acc)
        r += 1
    assert emitted[:count] == truth[:count] and seen == set(range(S + 1))
    assert past.shape[0] > 4 * WINDOW


# --- through dflash2-export and the runtime (the family's `plain` templates) ---

E2E_BLOCK = 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Muse-Glimmer pair as dflash2-make-tiny writes it (window 8, NoPE full layers, the image / video ids the
    last two of the vocabulary) with a DFlash2 drafter, exported fp32 through the standard-op templates."""
    from dflash2 import tiny
    from dflash2.export.api import export

    root = tmp_path_factory.mktemp("muse_export")
    target = tiny.make_target(root / "target", family="muse_glimmer")
    drafter = tiny.make_drafter(root / "drafter", target, version=2, block_size=E2E_BLOCK)
    m = export(drafter, target, root / "out", max_seq_len=160, quiet=True)
    return m, root / "out", target


def test_export_is_validated_and_row_invariant(exported):
    m, _, _ = exported
    assert all(v.ok for v in m.validation.values()), m.validation
    rows = m.validation["target.rows"]
    assert not rows.skipped and rows.steps["rows"] > 0 and rows.steps["differing"] == 0
    assert m.kv.target_attention == "plain"
    # dflash2-export's default: the sliding layers on the window buffer, both flavours, the row check through it
    window = m.graphs["target"].signature.window
    assert window.layers == [0, 1, 2] and window.keep == 7 and m.graphs["target"].tensorrt_signature.window.length
    assert rows.steps["window_compactions"] >= 1


def test_speculative_decoding_through_the_exported_graphs_is_lossless_past_the_window(exported):
    """The runtime's greedy ids (prompt 12 > window 8, 64 tokens) equal transformers' generate; speculative decoding
    with every accepted count 0..S (planned drafts) and with the pair's own drafter gives the same ids."""
    from transformers import MuseGlimmerForConditionalGeneration

    from dflash2.runtime.api import Runtime
    from dflash2.speculative import generate
    from tests.test_qwen3_5_export import PROMPT, PlannedDrafts

    _, out, target = exported
    rt = Runtime(out)
    rt.manifest.eos_token_ids = []
    truth = rt.generate(PROMPT, 64, speculative=False).ids
    hf = MuseGlimmerForConditionalGeneration.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert truth == want[0, len(PROMPT):].tolist() and len(PROMPT) > WINDOW
    s = PlannedDrafts(rt.manifest, rt.session.backend, truth, plan=list(range(E2E_BLOCK)) + [3, 0])
    g = generate(s, PROMPT, 64)
    assert g.ids == truth and set(g.stats.accepted) >= set(range(E2E_BLOCK))
    assert rt.generate(PROMPT, 64).ids == truth  # the pair's own drafter


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_exports_are_validated_and_fp16_is_lossless_past_the_window(exported, dtype, tmp_path):
    """--dtype float16 / bfloat16 (the checkpoints' own; TensorRT's): tests.exports.low_precision_checks on the pair,
    the prompt past the window (the window buffer in that dtype): validated (bf16 on its emulation), fp16 row check
    bitwise through compactions, fp16 speculative = the fp16 target's own greedy ids at every accepted count."""
    from tests.exports import low_precision_checks
    from tests.test_qwen3_5_export import PROMPT

    _, _, target = exported
    m = low_precision_checks((target.parent / "drafter", target), tmp_path / "out", dtype, PROMPT, 64,
                             list(range(E2E_BLOCK)) + [3, 0])
    assert m.graphs["target"].signature.window.layers == [0, 1, 2]
    if dtype == "float16":
        assert m.validation["target.rows"].steps["window_compactions"] >= 1


def test_the_plan_refuses_what_the_templates_do_not_do(exported, tmp_path):
    """Checked in fp32 / fp16 / bf16 (int4 / int8 weights: tests/test_lowbit_export.py): the TensorRT quantizations
    refused before anything is written, naming the family."""
    from dflash2.errors import Dflash2Error
    from dflash2.export.api import export
    from dflash2.export.plan import QuantFlags

    _, out, target = exported
    drafter = target.parent / "drafter"
    with pytest.raises(Dflash2Error, match=r"--quantize fp8: not yet for MuseGlimmerForConditionalGeneration"):
        export(drafter, target, tmp_path / "b", quiet=True, quantize=QuantFlags(method="fp8"))
    assert not list(tmp_path.iterdir())


def test_streamed_reference_equals_the_loaded_one(exported):
    """The layer-streamed reference the export validates real sizes against is the loaded one, bitwise."""
    from dflash2.checkpoint import Weights
    from dflash2.config import load_target_config
    from dflash2.reference.muse_glimmer import StreamedMuseGlimmerTarget
    from dflash2.reference.streamed import streamed_target

    _, _, target = exported
    tc = load_target_config(target)
    taps = (1, 2)
    whole, streamed = load_target(target, taps, config=tc), streamed_target(tc, taps, Weights(target))
    assert isinstance(streamed, StreamedMuseGlimmerTarget)
    ids = torch.tensor([5, 382, 9, 383] + list(range(20, 36)))  # the image / video ids (382, 383) among them
    with torch.no_grad():
        for x, y in zip(whole(ids, torch.zeros(0, *whole.kv_row_shape())),
                        streamed(ids, torch.zeros(0, *whole.kv_row_shape()))):
            assert torch.equal(x, y)


def test_past_the_budget_a_truncated_build_is_validated_against_the_streamed_reference(exported, tmp_path,
                                                                                        monkeypatch):
    from dflash2.export import stages
    from dflash2.export.api import export

    _, _, target = exported
    monkeypatch.setattr(stages, "WHOLE_GRAPH_BYTES", 0)
    m = export(target.parent / "drafter", target, tmp_path / "t", max_seq_len=160, quiet=True)
    for name in ("target.truncated", "target.truncated.trt"):
        assert m.validation[name].ok and not m.validation[name].skipped, name
    assert m.validation["target"].skipped


def test_the_trainer_refuses_it_in_one_line_before_anything_is_written(exported, tmp_path):
    from dflash2.errors import CheckpointError
    from dflash2.train.api import run_training
    from dflash2.train.options import TrainOptions

    _, _, target = exported
    with pytest.raises(CheckpointError) as e:
        run_training(TrainOptions(target=target, out=tmp_path / "drafter", corpus=[tmp_path / "corpus"], steps=1))
    msg = str(e.value)
    assert "architectures: expected one of ['LlamaForCausalLM'" in msg and "'MuseGlimmerForConditionalGeneration'" \
        in msg and "muse_glimmer, sliding-window / NoPE gated attention: reference and export only; training not " \
        "yet supported" in msg and "\n" not in msg
    assert not (tmp_path / "drafter").exists() and not (tmp_path / "corpus").exists()
