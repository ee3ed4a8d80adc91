"""gpt-oss's standard-op target graphs (dflash2.export.gpt_oss: portable + TensorRT flavour) on ONNX Runtime against
the reference and transformers, on the tiny pairs of test_gpt_oss_reference (window 8, 4 experts top-2 routed at
std 0.5, sinks at std 1, YaRN; float experts and the same experts x25 as MXFP4 so the SwiGLU clamp is hit): a
prefill 5x the window (logits, next ids, new K/V, taps), the fixed-buffer flavour with stale rows, greedy ids over
64 tokens past the window equal to transformers' `generate`, and verification with rollback at every accepted count
0..S equal to greedy (lossless); then through dflash2-export (validated whole and truncated, row-checked) and the
runtime, float and MXFP4 checkpoints as dflash2-make-tiny writes them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from dflash2.export import gpt_oss as graph  # noqa: E402
from dflash2.export import signature as N  # noqa: E402
from dflash2.export.weights import ModuleWeights  # noqa: E402

from tests.test_gpt_oss_reference import WINDOW, pair, prompt  # noqa: E402

TOL = 1e-4
TAPS, BLOCK = (1, 3), 4
_BUILT: dict = {}


def built(name: str, tmp_path_factory):
    """(transformers model, reference, portable session, fixed session) of pair `name`; the graph built from the
    loaded reference's parameters (ModuleWeights), taps TAPS unfused (the context is the taps themselves)."""
    if name not in _BUILT:
        torch.set_num_threads(1)
        hf, ref, _ = pair(name, tmp_path_factory)
        dc = SimpleNamespace(block_size=BLOCK, target_layer_ids=TAPS)
        portable, fixed = graph.build(ref.config, dc, ModuleWeights(ref), None, fuse_context=False)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        _BUILT[name] = (hf, ref, *(ort.InferenceSession(m.SerializeToString(), opts,
                                                        providers=["CPUExecutionProvider"]) for m in (portable, fixed)))
    return _BUILT[name]


def step(sess, ids, past):
    out = sess.run(None, {N.INPUT_IDS: np.asarray(ids, np.int32), N.PAST_KV: past})
    return dict(zip([o.name for o in sess.get_outputs()], out))


def empty(ref):
    return np.zeros((0, *ref.kv_row_shape()), np.float32)


@pytest.mark.parametrize("name", ["float", "mxfp4"])
def test_prefill_past_the_window_matches_the_reference(name, tmp_path_factory):
    _, ref, portable, _ = built(name, tmp_path_factory)
    ids = prompt(5 * WINDOW, seed=2)
    out = step(portable, ids.numpy(), empty(ref))
    with torch.no_grad():
        logits, taps, kv = ref(ids, torch.zeros(0, *ref.kv_row_shape()))
    H = ref.config.hidden_size
    scale = max(1.0, float(logits.abs().max()))
    assert np.abs(out[N.LOGITS] - logits[-BLOCK:].numpy()).max() < TOL * scale
    assert (out[N.NEXT_IDS] == logits.argmax(-1).numpy()).all()
    assert np.abs(out[N.NEW_KV] - kv.numpy()).max() < TOL * max(1.0, float(kv.abs().max()))
    want = torch.cat([taps[:, t * H:(t + 1) * H] for t in TAPS], dim=-1).numpy()  # the reference taps every layer
    assert np.abs(out[N.CONTEXT] - want).max() < TOL * max(1.0, float(np.abs(want).max()))


def test_the_fixed_flavour_masks_stale_rows(tmp_path_factory):
    _, ref, portable, fixed = built("float", tmp_path_factory)
    ids = prompt(3 * WINDOW, seed=4)
    first = step(portable, ids[:20].numpy(), empty(ref))
    cache = np.random.default_rng(0).standard_normal((64, *ref.kv_row_shape())).astype(np.float32) * 50
    cache[:20] = first[N.NEW_KV]
    want = step(portable, ids[20:].numpy(), first[N.NEW_KV])
    got = fixed.run(None, {N.INPUT_IDS: ids[20:].numpy().astype(np.int32), N.KV_CACHE: cache,
                           N.PAST_LEN: np.array([20], np.int32)})
    got = dict(zip([o.name for o in fixed.get_outputs()], got))
    for key in (N.LOGITS, N.NEW_KV, N.CONTEXT):
        assert np.abs(got[key] - want[key]).max() < TOL * max(1.0, float(np.abs(want[key]).max())), key
    assert (got[N.NEXT_IDS] == want[N.NEXT_IDS]).all()


def greedy(sess, ref, ids, count: int) -> list[int]:
    out = step(sess, ids.numpy(), empty(ref))
    past, got = out[N.NEW_KV], [int(out[N.NEXT_IDS][-1])]
    while len(got) < count:
        out = step(sess, [got[-1]], past)
        past = np.concatenate([past, out[N.NEW_KV]])
        got.append(int(out[N.NEXT_IDS][0]))
    return got


@pytest.mark.parametrize("name", ["float", "mxfp4"])
def test_greedy_64_tokens_through_the_graph_equal_transformers(name, tmp_path_factory):
    hf, ref, portable, _ = built(name, tmp_path_factory)
    ids = prompt(3 * WINDOW, seed=3)
    with torch.no_grad():
        want = hf.generate(ids[None], do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)
    got = greedy(portable, ref, ids, 64)
    assert got == want[0, ids.shape[0]:].tolist() and len(set(got)) > 8


def test_speculative_verify_through_the_graph_is_lossless_at_every_accepted_count(tmp_path_factory):
    """Rounds of S drafts verified as one (S+1)-row step: the drafts are greedy's continuation with draft a wrong
    (a = round mod S+1; a = S: all right), so every accepted count 0..S occurs; the rejected rows' K/V dropped; the
    emitted ids are greedy's, token for token, past several windows."""
    _, ref, portable, _ = built("mxfp4", tmp_path_factory)
    S, ids, count = BLOCK - 1, prompt(2 * WINDOW + 3, seed=8), 48
    truth = greedy(portable, ref, ids, count + S + 1)
    out = step(portable, ids.numpy(), empty(ref))
    past, emitted, seen, r = out[N.NEW_KV], [int(out[N.NEXT_IDS][-1])], set(), 0
    while len(emitted) < count:
        a = r % (S + 1)
        drafts = list(truth[len(emitted):len(emitted) + S])
        if a < S:
            drafts[a] = (drafts[a] + 1) % ref.config.vocab_size
        out = step(portable, [emitted[-1], *drafts], past)
        verified = out[N.NEXT_IDS].tolist()
        acc = next((j for j in range(S) if drafts[j] != verified[j]), S)
        assert acc == a
        past = np.concatenate([past, out[N.NEW_KV][:acc + 1]])
        emitted += verified[:acc + 1]
        seen.add(acc)
        r += 1
    assert emitted[:count] == truth[:count] and seen == set(range(S + 1))
    assert past.shape[0] > 4 * WINDOW


def test_the_sinks_and_the_clamp_are_in_the_graph(tmp_path_factory):
    """Zeroing the sinks or lifting the SwiGLU limit in the config changes the graph's logits (so the comparisons
    above would see either missing)."""
    import dataclasses

    _, ref, portable, _ = built("mxfp4", tmp_path_factory)
    ids = prompt(2 * WINDOW, seed=5)
    base = step(portable, ids.numpy(), empty(ref))[N.LOGITS]
    dc = SimpleNamespace(block_size=BLOCK, target_layer_ids=TAPS)
    unclamped = dataclasses.replace(ref.config, swiglu_limit=1e9)
    w = ModuleWeights(ref)
    for k in [k for k in w.params if k.endswith("sinks")]:
        w.params[k] = torch.zeros_like(w.params[k])
    for c, src in ((unclamped, ModuleWeights(ref)), (ref.config, w)):
        model = graph.build(c, dc, src, None, fuse_context=False)[0]
        s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        assert np.abs(step(s, ids.numpy(), empty(ref))[N.LOGITS] - base).max() > 1e-2


# --- through dflash2-export and the runtime (the family's `plain` templates) ---

E2E_BLOCK = 8
MXFP4 = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}


@pytest.fixture(scope="module", params=["float", "mxfp4"])
def exported(request, tmp_path_factory):
    """A tiny gpt-oss pair as dflash2-make-tiny writes it (window 8, 4 experts top-2, YaRN; float experts or MXFP4
    bytes) with a DFlash2 drafter, exported fp32 through the standard-op templates."""
    from dflash2 import tiny
    from dflash2.export.api import export

    root = tmp_path_factory.mktemp(f"gpt_oss_export_{request.param}")
    target = tiny.make_target(root / "target", family="gpt_oss", extra=MXFP4 if request.param == "mxfp4" else None)
    drafter = tiny.make_drafter(root / "drafter", target, version=2, block_size=E2E_BLOCK)
    m = export(drafter, target, root / "out", max_seq_len=160, quiet=True)
    return m, root / "out", target


def test_export_is_validated_and_row_invariant(exported):
    m, _, target = exported
    assert all(v.ok for v in m.validation.values()), m.validation
    rows = m.validation["target.rows"]
    assert not rows.skipped and rows.steps["rows"] > 0 and rows.steps["differing"] == 0
    assert m.kv.target_attention == "plain"
    # dflash2-export's default: the sliding layers on the window buffer, both flavours, the row check through it
    window = m.graphs["target"].signature.window
    assert window.layers == [0, 2] and window.keep == 7 and m.graphs["target"].tensorrt_signature.window.length
    assert rows.steps["window_compactions"] >= 1


def test_speculative_decoding_through_the_exported_graphs_is_lossless_past_the_window(exported):
    """The runtime's greedy ids (prompt 12 > window 8, 64 tokens) equal transformers' generate (which dequantizes
    the MXFP4 experts itself); speculative decoding with every accepted count 0..S (planned drafts) and with the
    pair's own drafter gives the same ids."""
    from transformers import GptOssForCausalLM

    from dflash2.runtime.api import Runtime
    from dflash2.speculative import generate
    from tests.test_qwen3_5_export import PROMPT, PlannedDrafts

    _, out, target = exported
    rt = Runtime(out)
    rt.manifest.eos_token_ids = []
    truth = rt.generate(PROMPT, 64, speculative=False).ids
    hf = GptOssForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert truth == want[0, len(PROMPT):].tolist() and len(PROMPT) > WINDOW and len(set(truth)) > 8
    s = PlannedDrafts(rt.manifest, rt.session.backend, truth, plan=list(range(E2E_BLOCK)) + [3, 0])
    g = generate(s, PROMPT, 64)
    assert g.ids == truth and set(g.stats.accepted) >= set(range(E2E_BLOCK))
    assert rt.generate(PROMPT, 64).ids == truth  # the pair's own drafter


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_exports_are_validated_and_fp16_is_lossless_past_the_window(exported, dtype, tmp_path):
    """--dtype float16 / bfloat16 (gpt-oss ships bf16 beside its MXFP4 experts; TensorRT's dtypes), float and MXFP4
    experts (decoded exactly, then held in that dtype as the reference holds them): tests.exports.low_precision_checks
    (validated, bf16 on its emulation; fp16 row check bitwise, fp16 speculative = the fp16 target's own greedy ids at
    every accepted count 0..S and with the pair's drafter)."""
    from tests.exports import low_precision_checks
    from tests.test_qwen3_5_export import PROMPT

    _, _, target = exported
    low_precision_checks((target.parent / "drafter", target), tmp_path / "out", dtype, PROMPT, 64,
                         list(range(E2E_BLOCK)) + [3, 0])


def test_the_plan_refuses_what_the_templates_do_not_do(exported, tmp_path):
    """Checked in fp32 / fp16 / bf16 (int4 / int8 weights: tests/test_lowbit_export.py): the TensorRT quantizations
    refused before anything is written, naming the family."""
    from dflash2.errors import Dflash2Error
    from dflash2.export.api import export
    from dflash2.export.plan import QuantFlags

    _, _, target = exported
    drafter = target.parent / "drafter"
    with pytest.raises(Dflash2Error, match=r"--quantize fp8: not yet for GptOssForCausalLM"):
        export(drafter, target, tmp_path / "b", quiet=True, quantize=QuantFlags(method="fp8"))
    assert not list(tmp_path.iterdir())


def test_streamed_reference_equals_the_loaded_one(exported):
    """The layer-streamed reference the export validates against (MXFP4 experts decoded as read) is the loaded one,
    bitwise."""
    from dflash2.checkpoint import Weights
    from dflash2.config import load_target_config
    from dflash2.reference.gpt_oss import StreamedGptOssTarget, load_target
    from dflash2.reference.streamed import streamed_target

    _, _, target = exported
    tc = load_target_config(target)
    taps = (1, 2)
    whole, streamed = load_target(target, taps, config=tc), streamed_target(tc, taps, Weights(target))
    assert isinstance(streamed, StreamedGptOssTarget)
    ids = torch.arange(3, 3 + 3 * WINDOW)
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


# --- the experts on QMoE int8, the MXFP4 bytes converted block-exactly (export/gpt_oss_qmoe.py) ---

def _q8(t: torch.Tensor) -> torch.Tensor:
    """int8 per 32 values, symmetric (amax / 127): what QMoE int8 does to its activations."""
    blocks = t.reshape(*t.shape[:-1], -1, 32)
    s = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (torch.round(blocks / s) * s).reshape(t.shape)


def test_qmoe_int8_is_the_reference_block_with_int8_activations(tmp_path):
    """The QMoE int8 block alone, on a dflash2-make-tiny MXFP4 checkpoint (random biases and router bias), equals
    the reference's experts with the activations (x and the SwiGLU output) rounded to int8 per 32 values, the
    weights exact: so routing, the interleaved clamped SwiGLU, the +1 and both biases are wired as gpt-oss's."""
    from onnx import TensorProto, helper

    from dflash2 import tiny
    from dflash2.checkpoint import Weights
    from dflash2.export.gpt_oss_qmoe import int8_experts
    from dflash2.export.templates import Builder
    from dflash2.reference.gpt_oss import load_target

    folder = tiny.make_target(tmp_path / "t", family="gpt_oss", extra=MXFP4)
    ref = load_target(folder)
    c, mlp = ref.config, ref.layers[1].mlp
    assert float(mlp.experts.gate_up_proj_bias.abs().max()) > 0 and float(mlp.router.bias.abs().max()) > 0
    b = Builder(None)
    y = int8_experts(b, "u", Weights(folder), c, "layers.1.mlp")
    u = helper.make_tensor_value_info("u", TensorProto.FLOAT, ["n", c.hidden_size])
    g = helper.make_graph(b.nodes, "qmoe", [u], [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)], b.inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    x = torch.randn(6, c.hidden_size, generator=torch.Generator().manual_seed(0)) * 4
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {
        "u": x.numpy()})[0]
    ex, want, exact = mlp.experts, torch.zeros_like(x), torch.zeros_like(x)
    with torch.no_grad():
        w, idx = mlp.route(x)
        for r in range(x.shape[0]):
            for j, e in enumerate(idx[r].tolist()):
                for q, out in ((_q8, want), (lambda t: t, exact)):
                    gu = q(x[r]) @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
                    gate, up = gu[::2].clamp(max=ex.limit), gu[1::2].clamp(-ex.limit, ex.limit)
                    a = (up + 1) * (gate * torch.sigmoid(gate * ex.alpha))
                    out[r] += (q(a) @ ex.down_proj[e] + ex.down_proj_bias[e]) * w[r, j]
        assert torch.allclose(exact, mlp(x), rtol=1e-5, atol=1e-3)  # the emulation without rounding: the reference
    scale = float(want.abs().max())
    d, d_exact = np.abs(got - want.numpy()).max() / scale, np.abs(got - exact.numpy()).max() / scale
    print(f"QMoE int8 vs int8-activation emulation {d:.1e}, vs the fp32 block {d_exact:.1e} (of max {scale:.2f})")
    assert d < 1e-4 < d_exact


def test_qmoe_int8_target_is_row_invariant_and_its_agreement_is_printed(tmp_path_factory):
    """The whole target with QMoE int8 experts (the MXFP4 pair, experts x25): a k-row verify gives each row
    bitwise what 1-row decode steps give (lossless speculative decoding on it); its agreement with the fp32
    reference printed (the int8 activations' cost, not the weights')."""
    from dflash2.checkpoint import Weights

    _, ref, folder = pair("mxfp4", tmp_path_factory)
    dc = SimpleNamespace(block_size=BLOCK, target_layer_ids=TAPS)
    model = graph.build(ref.config, dc, Weights(folder), None, fuse_context=False, experts_op="qmoe-int8")[0]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    ids = prompt(3 * WINDOW, seed=6)
    first = step(sess, ids.numpy(), empty(ref))
    rows = step(sess, ids[:5].numpy(), first[N.NEW_KV])  # a 5-row verify after the prompt
    past = first[N.NEW_KV]
    for j in range(5):
        one = step(sess, ids[j:j + 1].numpy(), past)
        assert np.array_equal(one[N.NEW_KV], rows[N.NEW_KV][j:j + 1]) and one[N.NEXT_IDS][0] == rows[N.NEXT_IDS][j]
        if j >= 5 - BLOCK:  # logits come for the last BLOCK rows only
            assert np.array_equal(one[N.LOGITS][0], rows[N.LOGITS][j - 5 + BLOCK])
        past = np.concatenate([past, one[N.NEW_KV]])
    with torch.no_grad():
        logits = ref(ids, torch.zeros(0, *ref.kv_row_shape()))[0]
    d = np.abs(first[N.LOGITS] - logits[-BLOCK:].numpy()).max()
    agree = float((first[N.NEXT_IDS] == logits.argmax(-1).numpy()).mean())
    print(f"QMoE int8 target vs the fp32 reference: max |logit difference| {d:.3f} (logits up to "
          f"{float(logits.abs().max()):.2f}), argmax agreement {agree:.0%} over {len(ids)} prompt rows")
    assert d > 0 and agree > 0.3
