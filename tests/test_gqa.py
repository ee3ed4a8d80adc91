"""dflash2-export --target-attention gqa: ONNX Runtime's fused-op target graph (GroupQueryAttention over
per-layer KV buffers shared in place), checked against the PyTorch reference and the plain graph."""

from collections import Counter

import numpy as np
import onnx
import pytest

from dflash2 import manifest as mf
from dflash2.engines.plan import PrecisionError, plan_build
from dflash2.export import gqa, templates
from dflash2.export import signature as sig
from dflash2.export import quantize as qz
from dflash2.export.api import OutputError, export
from dflash2.export.graphs import graph_specs
from dflash2.export.validate import validate_graph
from dflash2.reference.load import load_pair
from dflash2.runtime.api import Runtime
from dflash2.speculative import generate
from tests.exports import PROMPT

PROMPTS = [PROMPT, [1, 2, 3], list(range(40, 90)), [300, 8, 12, 12, 12, 12]]
FAMILIES = [("llama", 2), ("qwen3", 1)]  # packed q|k|v into the kernel; Qwen3's q/k norms split it first


@pytest.fixture(scope="module")
def gqa_exports(tmp_path_factory, pairs):
    """(family, version, quantized) -> a gqa export of the tiny pair."""
    root = tmp_path_factory.mktemp("gqa")
    out = {}
    for fam, ver in FAMILIES:
        for q in (False, True):
            folder = root / f"{fam}{ver}{'-int4' if q else ''}"
            export(*pairs[(fam, ver)], folder, max_seq_len=256, quiet=True, target_attention="gqa",
                   quantize=qz.OrtQuant("int4") if q else None)
            out[(fam, ver, q)] = folder
    return out


@pytest.fixture(scope="module")
def plain_exports(tmp_path_factory, pairs):
    root = tmp_path_factory.mktemp("gqa-plain")
    out = {}
    for fam, ver in FAMILIES:
        export(*pairs[(fam, ver)], root / f"{fam}{ver}", max_seq_len=256, quiet=True)
        out[(fam, ver)] = root / f"{fam}{ver}"
    return out


def ops(path):
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


@pytest.mark.parametrize("fam,ver", FAMILIES)
def test_graph_is_the_fused_one_and_validated(gqa_exports, fam, ver):
    folder = gqa_exports[(fam, ver, False)]
    m = mf.load(folder, mf.ExportManifest)
    L = m.target_config["num_layers"]
    assert m.kv.target_attention == "gqa" and "gqa-shared" in m.kv.binding
    assert m.validation["target"].ok and "target.trt" not in m.validation
    assert m.graphs["target"].flavours.tensorrt is None and not (folder / "target.trt.onnx").exists()
    c = ops(folder / "target.onnx")
    assert c["GroupQueryAttention"] == L and c["SkipSimplifiedLayerNormalization"] == 2 * L  # + 1 plain norm
    # no KV concatenation (at most the taps'); per layer the kernel's extra row (llama: packed q|k|v; qwen3:
    # q, k, v) and the slice of its output
    assert c["Concat"] <= 1 and c["Pad"] == (1 if ver == 2 else 3) * L and c["Slice"] == L + 1
    names = [i.name for i in m.graphs["target"].inputs]
    assert names[:2] == ["input_ids", "past_len"] and sig.gqa_kv_names(L)[0] == names[2:]
    assert m.graphs["drafter"].flavours.tensorrt is None  # the drafter from the same templates (fused_drafter)
    # validation compared every output, the present buffers' valid rows included, and they matched
    step = m.validation["target"].steps["step1"]
    assert step["next_ids"]["mismatches"] == 0 and "present.0.key" in step


@pytest.mark.parametrize("fam,ver", FAMILIES)
def test_same_answers_as_the_plain_graph_and_lossless(gqa_exports, plain_exports, fam, ver):
    plain, fused = Runtime(plain_exports[(fam, ver)]), Runtime(gqa_exports[(fam, ver, False)])
    assert fused.session.gqa and not plain.session.gqa
    for prompt in PROMPTS:
        want = generate(plain.session, prompt, 48, speculative=False).ids
        assert generate(fused.session, prompt, 48, speculative=False).ids == want
        for k in (None, 1, 3):  # rejections roll the in-place buffers back by past_len alone
            assert generate(fused.session, prompt, 48, draft_len=k).ids == want, (prompt, k)
        assert fused.generate(prompt, 48).ids == want  # the runtime's auto schedule


def test_kernel_writes_the_shared_buffers_in_place(gqa_exports, plain_exports):
    """After a prefill the session's [2L, kv, T, hd] buffer holds what the plain graph wrote to its
    [T, L, 2, kv, hd] one: the present outputs were bound to the past buffers and written there."""
    plain, fused = Runtime(plain_exports[("llama", 2)]), Runtime(gqa_exports[("llama", 2, False)])
    ptrs = fused.session.buffers()
    for rt in (plain, fused):
        rt.session.prefill(PROMPT)
    P = len(PROMPT)
    want = plain.session.kv.host[:P]  # [P, L, 2, kv, hd]
    got = fused.session.kv.host[:, :, :P]  # [2L, kv, P, hd]
    L = want.shape[1]
    np.testing.assert_allclose(got.reshape(L, 2, *got.shape[1:]).transpose(3, 0, 1, 2, 4), want, atol=1e-5)
    # the kernel's extra row (a copy of the last, dflash2.export.gqa) lands at P; nothing after it
    assert np.abs(fused.session.kv.host[:, :, P]).max() > 0 and np.abs(fused.session.kv.host[:, :, P + 1:]).max() == 0
    assert fused.session.buffers() == ptrs


@pytest.mark.parametrize("fam,ver", FAMILIES)
def test_int4_gqa_lossless_against_its_own_target(gqa_exports, fam, ver):
    folder = gqa_exports[(fam, ver, True)]
    m = mf.load(folder, mf.ExportManifest)
    assert m.quantization.method == "int4" and m.kv.target_attention == "gqa"
    assert ops(folder / "target.onnx")["MatMulNBits"] >= 3 * m.target_config["num_layers"]
    assert m.validation["target"].deviation.top1_agreement is not None
    rt = Runtime(folder)
    for prompt in PROMPTS:
        base = generate(rt.session, prompt, 40, speculative=False).ids
        for k in (None, 2):
            assert generate(rt.session, prompt, 40, draft_len=k).ids == base


def test_validation_catches_a_wrong_kernel_setting(tmp_path, pairs):
    """The reference check can fail: interleaved rotary halves (the wrong convention for Llama)."""
    target, drafter = load_pair(*pairs[("llama", 2)])
    spec = gqa.gqa_spec(graph_specs(target, drafter)[0])
    model = gqa.build_target(target, drafter, True, 64)
    for n in model.graph.node:
        if n.op_type == "GroupQueryAttention":
            next(a for a in n.attribute if a.name == "rotary_interleaved").i = 1
    onnx.save_model(model, str(tmp_path / "target.onnx"))
    failures, _ = validate_graph(spec, tmp_path / "target.onnx", "float32")
    assert any("target.context" in f for f in failures)
    assert any("target.present.0.key" in f for f in failures)


def test_bad_combinations_are_refused_before_writing(tmp_path, pairs):
    d, t = pairs[("llama", 2)]
    with pytest.raises(OutputError, match="--target-attention: expected one of"):
        export(d, t, tmp_path / "a", quiet=True, target_attention="flash")
    with pytest.raises(OutputError, match="--target-attention gqa: expected --dtype float32"):
        export(d, t, tmp_path / "b", dtype="float16", quiet=True, target_attention="gqa")
    with pytest.raises(OutputError, match="--target-attention gqa: expected --max-seq-len >= "):
        export(d, t, tmp_path / "c", max_seq_len=12, quiet=True, target_attention="gqa")
    assert not any((tmp_path / n).exists() for n in "abc")


def test_auto_picks_gqa_only_where_the_kernel_fits():
    from types import SimpleNamespace as NS

    from dflash2.export.plan import resolve_attention as _attention
    from dflash2.export.qdq import TrtQuant

    dc, int4 = NS(block_size=8), qz.OrtQuant("int4")
    tc = lambda hd, family="llama": NS(head_dim=hd, family=family, arch="X")  # noqa: E731
    assert _attention("auto", int4, tc(64), dc, 256) == "gqa"
    assert _attention("auto", None, tc(64), dc, 256) == "plain"  # float exports keep TensorRT's flavour
    assert _attention("auto", TrtQuant("fp8"), tc(64), dc, 256) == "plain"
    assert _attention("auto", int4, tc(24), dc, 256) == "plain"  # the kernel's rotary wants hd % 16
    with pytest.raises(OutputError, match="head_dim divisible by 16"):
        _attention("gqa", int4, tc(24), dc, 256)
    # the hybrid's fused graph has no GroupQueryAttention: its head_dim rule does not apply
    assert _attention("auto", int4, tc(24, "qwen3_5"), dc, 256) == "gqa"
    assert _attention("auto", None, tc(24, "qwen3_5"), dc, 256) == "plain"


def test_tensorrt_build_refuses_a_gqa_export(gqa_exports, tmp_path):
    with pytest.raises(PrecisionError, match="target_attention is 'gqa'.*--target-attention plain"):
        plan_build(gqa_exports[("llama", 2, False)], tmp_path / "engines", mode="print")


@pytest.mark.parametrize("quantized", [False, True])
def test_a_decode_row_equals_the_verify_row_of_the_same_token(gqa_exports, quantized):
    """Bit for bit: the kernel's 1-row path differs from its multi-row one, so the graph gives it one
    extra row (dflash2.export.gqa); without it, greedy speculative output could leave the target's."""
    s = Runtime(gqa_exports[("llama", 2, quantized)]).session
    tokens = generate(s, PROMPT, 24, speculative=False).ids[:24]
    s.prefill(PROMPT)
    one = []
    for t in tokens:
        one.append(s.decode(t).logits().copy())  # [1, V]
    s.prefill(PROMPT)
    rows = []
    for i in range(0, len(tokens), 3):
        rows.append(s.verify(tokens[i:i + 3]).logits().copy())
        s.commit(3)
    np.testing.assert_array_equal(np.concatenate(rows), np.concatenate(one))


def test_manifest_kv_rows_are_checked_against_the_per_layer_buffers(gqa_exports, tmp_path):
    import shutil

    from tests.exports import edit_manifest

    folder = tmp_path / "edited"
    shutil.copytree(gqa_exports[("llama", 2, False)], folder)

    def wrong_heads(d):
        d["kv"]["rows"]["target"][2] += 1

    edit_manifest(folder, wrong_heads)
    with pytest.raises(mf.ManifestError, match=r"kv.rows.target\[2:\]: expected \[\d+, \d+\]"):
        Runtime(folder)


def test_streamed_build_writes_the_same_weights_as_the_module_build(tmp_path, pairs):
    """gqa.build from the safetensors folders through a DataFile (what the export runs) and from loaded modules
    with inline weights: the same nodes and the same initializer bytes; the streamed proto holds no weight."""
    from onnx import numpy_helper

    from dflash2.checkpoint import Weights
    from dflash2.export import weights as W

    d, t = pairs[("qwen3", 2)]
    target, drafter = load_pair(d, t)
    inline = gqa.build_target(target, drafter, True, 64)
    with W.DataFile(tmp_path / "target.onnx.data") as data:
        streamed = gqa.build(target.config, drafter.config, Weights(t), Weights(d), True, 64, data)
    assert [n.SerializeToString() for n in streamed.graph.node] == [n.SerializeToString() for n in inline.graph.node]
    big = [i.name for i in streamed.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert "embed_tokens.weight" in big and len(streamed.SerializeToString()) < 64 * 1024
    onnx.save_model(streamed, str(tmp_path / "target.onnx"))
    loaded = onnx.load(str(tmp_path / "target.onnx"))
    want = {i.name: numpy_helper.to_array(i) for i in inline.graph.initializer}
    got = {i.name: numpy_helper.to_array(i) for i in loaded.graph.initializer}
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_weights_are_read_as_stored(tmp_path, monkeypatch):
    """bf16 / fp16 / fp32 safetensors widened exactly; rows read alone; NaN named with its tensor."""
    import torch
    from safetensors.torch import save_file

    from dflash2.checkpoint import Weights
    from dflash2.errors import CheckpointError

    from dflash2 import checkpoint

    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 10)  # many pieces per tensor
    g = torch.Generator().manual_seed(0)
    ts = {"model.a": torch.randn(7, 5, generator=g).bfloat16(), "b": torch.randn(3, generator=g).half(),
          "c": torch.randn(4, 4, generator=g)}
    save_file(ts, str(tmp_path / "model.safetensors"))
    w = Weights(tmp_path)
    np.testing.assert_array_equal(w.get("a"), ts["model.a"].float().numpy())  # "model." looked up behind
    np.testing.assert_array_equal(w.get("b"), ts["b"].float().numpy())
    np.testing.assert_array_equal(w.get("a", slice(2, 4)), ts["model.a"][2:4].float().numpy())
    np.testing.assert_array_equal(np.concatenate(list(w.row_chunks("c", max_bytes=32))), ts["c"].numpy())
    ts["c"][1, 2] = float("nan")
    save_file(ts, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="c: expected finite values .*1 NaN"):
        Weights(tmp_path).get("c")
    with pytest.raises(CheckpointError, match="1 NaN, 0 inf in rows 1..1"):
        Weights(tmp_path).get("c", slice(1, 2))


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True)])
def test_quantized_as_written_equals_the_whole_graph_quantizer(tmp_path, bits, symmetric):
    """dflash2.export.weights.NBits per weight, the head in column slices, = ONNX Runtime's MatMulNBitsQuantizer
    over the whole graph (same packed bytes, scales, zero points, attributes); K = 80 is not a multiple of 32."""
    from onnx import TensorProto, helper, numpy_helper

    from dflash2.export import weights as W

    rng = np.random.default_rng(0)
    w = rng.standard_normal((80, 24)).astype(np.float32)  # [K, N]
    q = qz.OrtQuant(f"int{bits}", symmetric=symmetric)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 80])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g", [x], [y],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    quantizer = qz._quantizer_class()(model, bits=bits, block_size=q.block_size, is_symmetric=symmetric,
                                      accuracy_level=q.accuracy_level)
    quantizer.process()
    want = sorted(numpy_helper.to_array(t).reshape(-1).tobytes() for t in quantizer.model.model.graph.initializer)
    want_node = next(n for n in quantizer.model.model.graph.node if n.op_type == "MatMulNBits")
    with W.DataFile(tmp_path / "g.onnx.data") as data:
        b = templates.Builder(data, q)
        b.matmul_nbits("x", "mm", (80, 24), [w[:, :10], w[:, 10:]])  # two column slices
    assert {a.name: helper.get_attribute_value(a) for a in b.nodes[0].attribute} == \
        {a.name: helper.get_attribute_value(a) for a in want_node.attribute}
    onnx.save_model(helper.make_model(helper.make_graph(b.nodes, "g", [x], [y], b.inits)), str(tmp_path / "g.onnx"))
    got = sorted(numpy_helper.to_array(t).reshape(-1).tobytes()
                 for t in onnx.load(str(tmp_path / "g.onnx")).graph.initializer)
    assert got == want  # packed weights, scales (, zero points): the same bytes


def test_int4_past_the_budget_measures_the_truncated_build_and_says_so(tmp_path, pairs, monkeypatch):
    """Past WHOLE_GRAPH_BYTES (the 8B int4 session alone holds 6.3 GiB) the int4 deviation is measured on a
    truncated build quantized the same way, the whole graph recorded as not measured, with why; decoding stays
    lossless against the int4 target itself."""
    from dflash2.export import stages
    from dflash2.runtime.api import Runtime
    from dflash2.speculative import generate

    monkeypatch.setattr(stages, "WHOLE_GRAPH_BYTES", 0)
    m = export(*pairs[("qwen3", 2)], tmp_path / "out", max_seq_len=64, quiet=True, quantize=qz.OrtQuant("int4"))
    v = m.validation
    assert v["target.truncated"].ok and v["target.truncated.int4"].ok
    assert v["target.truncated.int4"].deviation.top1_agreement is not None
    assert "layer" in v["target.truncated.int4"].deviation.judged
    assert not v["target"].ok and "not measured whole" in v["target"].skipped
    assert not any("truncated" in p.name for p in (tmp_path / "out").iterdir())
    rt = Runtime(tmp_path / "out")
    prompt = [3, 9, 27, 81]
    assert generate(rt.session, prompt, 24).ids == generate(rt.session, prompt, 24, speculative=False).ids
