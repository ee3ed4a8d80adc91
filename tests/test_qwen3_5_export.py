"""The Qwen3.5 hybrid target through the whole pipeline: its layer templates (dflash2.export.qwen3_5) against the
reference, dflash2-export of a tiny pair, and speculative decoding through the exported graphs with the recurrent
state rolled back by the runtime's state rows: greedy ids equal transformers' own Qwen3_5ForCausalLM greedy generate,
for every accepted count 0..S (planned drafts) and for the pair's own drafter."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from dflash2 import tiny
from dflash2.checkpoint import Weights
from dflash2.config import load_drafter_config
from dflash2.errors import Dflash2Error
from dflash2.export import qwen3_5 as Q
from dflash2.export import signature as N
from dflash2.export import weights as W
from dflash2.export.api import export
from dflash2.reference.qwen3_5 import State, commit, load_target
from dflash2.runtime.api import Runtime
from dflash2.runtime.session import SpecSession
from dflash2.speculative import Drafted, generate

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7]  # longer than the block: the no-state prefill branch runs
BLOCK = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    target = tiny.make_target(root / "target", family="qwen3_5", num_layers=4)
    drafter = tiny.make_drafter(root / "drafter", target, version=2, block_size=BLOCK)
    return drafter, target


@pytest.fixture(scope="module")
def exported(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_5-export") / "out"
    manifest = export(*pair, out, max_seq_len=160, quiet=True)
    return out, manifest


def _feed(ids, s: State) -> dict:
    """Per GDN layer j: conv_state.{j} [1, C, K-1], rec_state.{j} [1, Hv, dk, dv] (signature.state_names)."""
    past = N.state_names(s.conv.shape[0])[0]
    per_layer = [t[j][None].numpy() for j in range(s.conv.shape[0]) for t in (s.conv, s.rec)]
    return {"input_ids": np.asarray(ids, np.int32), "past_kv": s.kv.numpy(), **dict(zip(past, per_layer))}


def _stacked(out: dict, stem: str) -> np.ndarray:
    """The graph's per-layer state outputs {stem}.{j} [W', *row] stacked as the reference keeps them: [W', Lg, *row]."""
    layers = sorted((k for k in out if k.startswith(stem + ".")), key=lambda k: int(k.rsplit(".", 1)[1]))
    return np.stack([out[k] for k in layers], axis=1)


def _ops(g) -> set[str]:
    """Op types of a graph and of every subgraph (If branches, Scan bodies)."""
    out = set()
    for n in g.node:
        out.add(n.op_type)
        for a in n.attribute:
            if a.type == a.GRAPH:
                out |= _ops(a.g)
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["standard-ops", "linear-attention"])
def test_templates_match_the_reference_and_keep_every_row_state(pair, fused):
    """The graph against Qwen35Target: a prefill past the window, then a verify of B rows whose per-row states,
    committed at every a, make the next 1-row step bitwise the verify's row a (what a rollback hands on); the
    recurrence in standard ops (portable + TensorRT) and as ONNX Runtime's LinearAttention (the fused graph)."""
    drafter, target = pair
    dc = load_drafter_config(drafter)
    ref = load_target(target, tuple(dc.target_layer_ids))
    model, _ = Q.build(ref.config, dc, W.ModuleWeights(ref), Weights(drafter), fuse_context=False, fused=fused)
    ops = _ops(model.graph)  # a decode's row, the rows before the window and the window's rows: LinearAttention
    assert ("LinearAttention" in ops) == fused and {"If", "Scan"} <= ops
    io = {v.name for v in model.graph.input} | {v.name for v in model.graph.output}
    past, present = N.state_names(len(ref.config.linear_layers))
    assert set(past + present) <= io and not {"conv_state", "rec_state", "conv_states", "rec_states"} & io
    readers = {n.op_type for n in model.graph.node if set(n.input) & set(past)}
    writers = {o: n.op_type for n in model.graph.node for o in n.output if o in present}
    assert not {"Split", "Gather"} & readers  # per layer: no stacked state split up, none joined
    assert {writers[n] for n in present[1::2]} == {"If"} and {writers[n] for n in present[0::2]} == {"Transpose"}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    run = lambda ids, s: dict(zip(names, sess.run(None, _feed(ids, s)))) # noqa: E731
    s0 = ref.empty_state()
    with torch.no_grad():
        logits, taps, step = ref(torch.tensor(PROMPT), s0)
    out = run(PROMPT, s0)
    out["conv_states"], out["rec_states"] = _stacked(out, "conv_states"), _stacked(out, "rec_states")
    assert out["rec_states"].shape[0] == out["conv_states"].shape[0] == BLOCK  # the last B rows only
    for name, want in (("logits", logits[-BLOCK:]), ("context", taps), ("new_kv", step.kv),
                       ("conv_states", step.conv[-BLOCK:]), ("rec_states", step.rec[-BLOCK:])):
        assert np.abs(out[name] - want.numpy()).max() < 1e-4, name
    s1 = commit(s0, step, len(PROMPT))
    verify = [3, 1, 4, 1, 5, 9, 2, 6]
    v = run(verify, s1)
    v["conv_states"], v["rec_states"] = _stacked(v, "conv_states"), _stacked(v, "rec_states")
    with torch.no_grad():
        vl, _, vstep = ref(torch.tensor(verify), s1)
    assert np.abs(v["logits"] - vl.numpy()).max() < 1e-4
    assert np.abs(v["rec_states"] - vstep.rec.numpy()).max() < 1e-4
    for a in range(1, BLOCK):  # the state the runtime commits: the graph's own row a-1
        kv = torch.cat([s1.kv, torch.from_numpy(v["new_kv"][:a])])
        s = State(kv, torch.from_numpy(v["conv_states"][a - 1]), torch.from_numpy(v["rec_states"][a - 1]))
        d = run([verify[a]], s)
        assert np.array_equal(d["logits"][0], v["logits"][a]), f"row {a}: decode != verify row"


def test_the_gqa_graph_binds_the_conv_state_row_major(pair):
    """The gqa graph (build_fused's layout): each conv state bound as rows [1, K-1, C], so a GDN layer reads it as the
    window's first rows and writes its kept rows with the window's Gather (no Transpose in or out), q and k l2-normed
    by LpNormalization (no Sqrt); the reference's states meet the graph's through the spec's conv_major
    (qwen3_5_gqa)."""
    from dflash2.export.qwen3_5_gqa import conv_major

    drafter, target = pair
    dc = load_drafter_config(drafter)
    ref = load_target(target, tuple(dc.target_layer_ids))
    c = ref.config
    model, _ = Q.build(c, dc, W.ModuleWeights(ref), Weights(drafter), fuse_context=False, fused=True, gqa_kv=True)
    past, present = N.state_names(len(c.linear_layers))
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in [*model.graph.input, *model.graph.output]}
    K, C = c.linear_conv_kernel_dim, c.conv_dim
    assert all(shapes[n] == [1, K - 1, C] for n in past[0::2])
    assert all(shapes[n][1:] == [K - 1, C] for n in present[0::2])
    writers = {o: n.op_type for n in model.graph.node for o in n.output}
    assert {writers[n] for n in present[0::2]} == {"Gather"}
    ops = _ops(model.graph)
    assert "LpNormalization" in ops and not {"Transpose", "Sqrt"} & ops
    s = [torch.randn(1, C, K - 1), torch.randn(1, 2, 3), torch.randn(1, C, K - 1)]
    assert [tuple(t.shape) for t in conv_major(s)] == [(1, K - 1, C), (1, 2, 3), (1, K - 1, C)]
    assert torch.equal(conv_major(conv_major(s))[2], s[2])


def test_export_validates_every_graph(exported):
    out, m = exported
    assert all(v.ok and not v.skipped for v in m.validation.values()), m.validation
    sig = m.graphs["target"].signature
    assert sig.state is not None and sig.state.window == BLOCK
    assert m.graphs["target"].tensorrt_signature.state is not None  # the TensorRT flavour binds the same state


def _hf_greedy(target, n: int) -> list[int]:
    hf = Qwen3_5ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_greedy_equals_transformers_generate(pair, exported):
    rt = Runtime(exported[0])
    truth = _hf_greedy(pair[1], 48)
    rt.manifest.eos_token_ids = []
    assert rt.generate(PROMPT, 48, speculative=False).ids == truth
    assert rt.generate(PROMPT, 48, draft_len=BLOCK - 1).ids == truth


class PlannedDrafts(SpecSession):
    """The real drafter runs (its context rows are consumed); its drafts are replaced by the known greedy continuation
    with a planned number right, so every accepted count 0..S occurs and the recurrent state rolls back each time."""

    def __init__(self, manifest, backend, truth, plan):
        super().__init__(manifest, backend)
        self.truth, self.plan, self.r = truth, plan, 0

    def draft(self, anchor, uniforms=None, temperature=0.0):
        d = super().draft(anchor)
        S, start = self.block_size - 1, self.pos - len(PROMPT) + 1
        good = self.plan[self.r % len(self.plan)]
        self.r += 1
        nxt = (self.truth[start: start + S] + [0] * S)[:S]
        return Drafted([t if k < good else (t + 1) % self.vocab_size for k, t in enumerate(nxt)], d.confidence)


def test_every_accepted_count_rolls_the_state_back(pair, exported):
    rt = Runtime(exported[0])
    truth = _hf_greedy(pair[1], 90)
    s = PlannedDrafts(rt.manifest, rt.session.backend, truth, plan=list(range(BLOCK)) + [3, 0, 7, 1])
    g = generate(s, PROMPT, 90)
    assert g.ids == truth
    assert set(g.stats.accepted) >= set(range(BLOCK))  # 0..S, each at least once


def _low_precision_io(out, m, dtype: str) -> None:
    """Both target flavours of an fp16 / bf16 export bind the conv state and the KV rows in that dtype, the recurrent
    state and the logits in fp32; the manifest's state signature says the same."""
    import onnx

    from dflash2 import dtypes

    low = dtypes.onnx_type(dtype)
    for f in ("target.onnx", "target.trt.onnx"):
        g = onnx.load(str(out / f), load_external_data=False).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output]}
        assert types["conv_state.0"] == types["conv_states.0"] == low
        assert types["rec_state.0"] == types["rec_states.0"] == types["logits"] == onnx.TensorProto.FLOAT
        assert types["past_kv" if f == "target.onnx" else "kv_cache"] == low
    assert m.graphs["target"].signature.state.dtypes[:2] == [dtype, "float32"]
    assert m.graphs["target"].tensorrt_signature.state is not None


def fp16_export_checks(pair, out, block: int, plan: list[int]) -> None:
    """An fp16 export of a hybrid pair: tests.exports.low_precision_checks (validated, row check bitwise, speculative
    decoding = the fp16 target's own greedy ids at every accepted count 0..S and with the pair's drafter), and the
    conv state bound in fp16, the recurrent state in fp32."""
    from tests.exports import low_precision_checks

    m = low_precision_checks(pair, out, "float16", PROMPT, 48, plan)
    assert set(m.validation["target.rows"].steps["per_k"]) >= {str(k) for k in range(2, block + 1)}
    _low_precision_io(out, m, "float16")


@pytest.fixture(scope="module")
def exported16(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_5-fp16") / "out"
    export(*pair, out, max_seq_len=160, quiet=True, dtype="float16")
    return out


def test_fp16_is_validated_row_invariant_and_lossless(pair, exported16):
    fp16_export_checks(pair, exported16, BLOCK, list(range(BLOCK)) + [3, 0, 7, 1])


def test_fp16_engines_on_the_fake_tensorrt_match_onnxruntime(exported16, tmp_path, fake_plugin, fake):
    """dflash2-build's real code over the fake TensorRT (tests/fake_trt.py: engines run the TensorRT flavour,
    `kv_cache` + `past_len` and the state rows on device buffers, set_input_shape held to the active profile):
    generation on the engines gives ONNX Runtime's ids, speculative (every verify's rows rolled back by pointer) and
    not. The real TensorRT build is scripts/gpu_check.sh's."""
    from dflash2.engines import build as eb
    from dflash2.engines import plan as ep

    plan = ep.plan_build(exported16, tmp_path / "engines", max_seq_len=160, max_prefill=32, plugin=fake_plugin,
                         timing_cache=tmp_path / "timing.cache", workspace_mb=256)
    eb.build(plan, quiet=True)
    for speculative in (True, False):
        ort_rt, trt_rt = Runtime(exported16), Runtime(tmp_path / "engines")
        for rt in (ort_rt, trt_rt):
            rt.manifest.eos_token_ids = []
        assert trt_rt.backend_name == "tensorrt"
        assert trt_rt.generate(PROMPT, 40, speculative=speculative).ids == \
            ort_rt.generate(PROMPT, 40, speculative=speculative).ids


def test_bf16_is_validated_on_its_emulation(pair, tmp_path, monkeypatch):
    """bf16 (the checkpoints' own dtype; TensorRT's): target and drafter from the templates, weights streamed, the
    conv state and KV rows bf16 and the recurrent state fp32; where no provider has bf16 kernels (this CPU) every
    graph validated as export.bf16_emulation runs it, and the row check runs on the graphs' emulating copies."""
    from dflash2.export import validate

    monkeypatch.setattr(validate.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    out = tmp_path / "bf16"
    m = export(*pair, out, max_seq_len=160, quiet=True, dtype="bfloat16")
    graphs = {k: v for k, v in m.validation.items() if k != "target.rows"}
    assert set(graphs) == {"target", "target.trt", "drafter", "drafter.trt", "selector"}
    assert all(v.ok and v.steps["emulated"].startswith("bf16 emulated") for v in graphs.values()), m.validation
    rows = m.validation["target.rows"]
    assert rows.ok and rows.steps["rows"] > 0 and rows.steps["differing"] == 0 and "emulated" in rows.steps
    _low_precision_io(out, m, "bfloat16")


def test_the_plan_refuses_what_the_hybrid_templates_do_not_do(pair, tmp_path):
    from dflash2.export.plan import QuantFlags

    drafter, target = pair
    with pytest.raises(Dflash2Error, match="not yet for"):
        export(drafter, target, tmp_path / "b", quiet=True, quantize=QuantFlags(method="fp8"))
    with pytest.raises(Dflash2Error, match="writes int4 as the graph is built"):
        export(drafter, target, tmp_path / "c", quiet=True, quantize=QuantFlags(method="int4"),
               target_attention="plain")
    assert not [p for p in tmp_path.iterdir()]


def test_int4_is_lossless_against_its_own_target(pair, tmp_path):
    """int4 weights written as the graph is built (the embedding too): speculative ids equal the int4 target's own greedy ids, and the
    export's row check (k-row verify vs 1-row decode, bitwise) passed on the quantized graph."""
    from dflash2.export.plan import QuantFlags

    import onnx

    m = export(*pair, tmp_path / "int4", max_seq_len=160, quiet=True, quantize=QuantFlags(method="int4"))
    assert m.validation["target.rows"].ok and not m.validation["target.rows"].skipped
    assert m.kv.target_attention == "gqa" and m.validation["target.truncated"].ok  # written quantized, fp32 checked
    g = onnx.load(str(tmp_path / "int4" / "target.onnx"), load_external_data=False).graph
    weights = {t.name for t in g.initializer}
    assert {"MatMulNBits", "GatherBlockQuantized", "Scan", "LinearAttention", "GroupQueryAttention"} <= _ops(g)
    # the full-attention layers' KV bound in place per layer (qwen3_5_gqa.py), no new_kv output to copy
    sig = m.graphs["target"].signature
    assert sig.kv.kind == "gqa-shared" and sig.state is not None and "new_kv" not in {o.name for o in g.output}
    assert not [n.name for n in g.node if n.op_type in ("MatMul", "Gemm") and weights & set(n.input)]  # all int4
    rt = Runtime(tmp_path / "int4")
    rt.manifest.eos_token_ids = []
    truth = rt.generate(PROMPT, 40, speculative=False).ids
    s = PlannedDrafts(rt.manifest, rt.session.backend, truth, plan=[0, 7, 3, 1, 5])
    assert generate(s, PROMPT, 40).ids == truth


def test_past_the_budget_a_truncated_build_is_validated_against_the_streamed_reference(pair, tmp_path, monkeypatch):
    from dflash2.export import stages

    monkeypatch.setattr(stages, "WHOLE_GRAPH_BYTES", 0)
    m = export(*pair, tmp_path / "t", max_seq_len=160, quiet=True)
    for name in ("target.truncated", "target.truncated.trt"):
        assert m.validation[name].ok and not m.validation[name].skipped, name
    assert m.validation["target"].skipped  # said, not passed: the whole graph was not run


def test_quantized_export_past_the_fp32_check_budget_measures_the_quantized_truncated_build(pair, tmp_path,
                                                                                              monkeypatch):
    """The 27B shape's fp32 check (4 layers, a 248,320 x 5120 head) would hold 10.4 GiB: a quantized export past
    TRUNCATED_CHECK_BYTES says it did not build it, why, and measures the int4 truncated build in its place."""
    from dflash2.export import stages
    from dflash2.export.plan import QuantFlags

    monkeypatch.setattr(stages, "WHOLE_GRAPH_BYTES", 0)
    monkeypatch.setattr(stages, "TRUNCATED_CHECK_BYTES", 0)
    m = export(*pair, tmp_path / "q", max_seq_len=160, quiet=True, quantize=QuantFlags(method="int4"))
    fp32 = m.validation["target.truncated"]
    assert not fp32.ok and "past the 0 GiB a quantized export's fp32 check maps" in fp32.skipped
    assert m.validation["target.truncated.int4"].ok and not m.validation["target.truncated.int4"].skipped
    assert not list((tmp_path / "q").glob("target.truncated*"))


def test_streamed_reference_equals_the_loaded_one(pair):
    from dflash2.reference.streamed import StreamedQwen35Target

    drafter, target = pair
    taps = tuple(load_drafter_config(drafter).target_layer_ids)
    whole = load_target(target, taps)
    streamed = StreamedQwen35Target(whole.config, taps, Weights(target))
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        a, b = whole(ids, whole.empty_state()), streamed(ids, streamed.empty_state())
    for x, y in zip((a[0], a[1], *a[2]), (b[0], b[1], *b[2])):
        assert torch.equal(x, y)


def test_widened_runs_the_fp16_streamed_reference_in_fp32_then_gives_it_back(pair):
    """What an fp16 graph is judged against where it misses the fp16 reference (export.validate._against_fp32): the
    streamed reference's layers and vocabulary rows read in fp32 inside `widened`, its resident weights cast; after,
    its own fp16 outputs, bitwise."""
    from dflash2.reference.streamed import StreamedQwen35Target, widened

    drafter, target = pair
    taps = tuple(load_drafter_config(drafter).target_layer_ids)
    c = load_target(target, taps).config
    half = StreamedQwen35Target(c, taps, Weights(target), dtype=torch.float16)
    full = StreamedQwen35Target(c, taps, Weights(target))
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        before, exact = half(ids, half.empty_state()), full(ids, full.empty_state())
        with widened(half):
            wide = half(ids, full.empty_state())
        after = half(ids, half.empty_state())
    assert wide[0].dtype == torch.float32 and half.dtype == torch.float16
    # the final norm's weight stays its fp16 rounding, widened: all else is the fp32 reference's own
    assert (wide[0] - exact[0]).abs().max() < 0.05 * (before[0].float() - exact[0]).abs().max()
    assert torch.equal(wide[1], exact[1])  # the taps: every layer streamed in fp32
    for x, y in zip((before[0], before[1], *before[2]), (after[0], after[1], *after[2])):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_the_conditional_generation_wrapper_exports_with_its_vision_tower_and_mtp_head_ignored(pair, tmp_path):
    """What users download: Qwen3_5ForConditionalGeneration (text under text_config, `model.language_model.*`
    names, a vision tower, an MTP head). The export skips the tower and the head by name and generates transformers'
    own greedy ids of the wrapper."""
    from tests.qwen3_5_wrapper import make_wrapper

    hf, target = make_wrapper(pair[1], tmp_path / "wrapper")
    drafter = tiny.make_drafter(tmp_path / "drafter", target, version=1, block_size=BLOCK)
    export(drafter, target, tmp_path / "out", max_seq_len=128, quiet=True)
    rt = Runtime(tmp_path / "out")
    rt.manifest.eos_token_ids = []
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert rt.generate(PROMPT, 24, speculative=False).ids == want
    assert rt.generate(PROMPT, 24).ids == want


@pytest.mark.parametrize("method", [None, "int4"], ids=["standard-ops", "gqa-int4"])
def test_head_dim_256_stays_row_invariant_past_64_keys(tmp_path, method):
    """Qwen3.5's head_dim 256: MLAS's SGEMM computes a 256-long q.k one way up to 64 keys and another past them, so a
    3-row verify at 62 past rows and the 1-row decode at the same position differed in the last bits, and the
    speculative output with them (seen at the 0.8B shape). Scores summed over 128-wide chunks keep them equal: rows of
    every step of a verify-3 / commit-1 walk across 64 keys are bitwise the 1-row decode's. The int4 graph's
    GroupQueryAttention has the same break (one pass up to 64 keys): every call padded past 64 keys keeps it off."""
    from dflash2.export.plan import QuantFlags

    target = tiny.make_target(tmp_path / "target", family="qwen3_5", num_heads=2, num_kv_heads=1, head_dim=256)
    drafter = tiny.make_drafter(tmp_path / "drafter", target, version=1, block_size=4)
    m = export(drafter, target, tmp_path / "out", max_seq_len=128, quiet=True,
               quantize=QuantFlags(method=method) if method else None)
    assert m.validation["target.rows"].ok and m.validation["target.rows"].steps["rows"] > 0
    assert m.kv.target_attention == ("gqa" if method else "plain")
    s = Runtime(tmp_path / "out").session
    prompt = [(7 * i + 3) % 300 + 2 for i in range(56)]
    v = s.prefill(prompt)
    t, want = int(v.ids[-1]), []
    for _ in range(16):
        v = s.decode(t)
        want.append(v.logits()[0].copy())
        t = int(v.ids[0])
    v = s.prefill(prompt)
    t = int(v.ids[-1])
    for i in range(16):  # positions 56..71: the 3-row verifies cross 64 keys before the decodes do
        v = s.verify([t, 7, 9])
        assert np.array_equal(v.logits()[0], want[i]), f"position {56 + i}"
        s.commit(1)
        t = int(v.ids[0])
