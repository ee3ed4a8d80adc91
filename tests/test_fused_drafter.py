"""The drafter built from layer templates (dflash2.export.fused_drafter): ONNX Runtime's fused ops, checked
against the PyTorch reference on every config field that changes its graph, byte-equal whether its weights
come from the safetensors folders or the loaded modules, and in the gqa export lossless end to end."""

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from dflash2 import draft_vocab as dv
from dflash2 import manifest as mf
from dflash2 import tiny
from dflash2.checkpoint import Weights
from dflash2.config import load_target_config
from dflash2.export import fused_drafter as fd
from dflash2.export import quantize as qz
from dflash2.export import selector_onnx as so
from dflash2.export import weights as W
from dflash2.export.api import export
from dflash2.export.graphs import graph_specs
from dflash2.export.validate import validate_graph
from dflash2.reference.load import load_pair
from dflash2.runtime.api import Runtime
from dflash2.speculative import generate

WINDOWED = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
CASES = {  # name -> (family, version, make_drafter keywords)
    "llama-v2": ("llama", 2, dict(num_layers=2)),
    "qwen3-v1": ("qwen3", 1, {}),
    "qwen3-v2-window": ("qwen3", 2, dict(num_layers=2, extra=WINDOWED)),  # a sliding layer and a full one
    "llama-v2-conv3-softcap": ("llama", 2, dict(conv_kernel_size=3, softcap=5.0, output_multiplier=0.7)),
    "llama-v1-causal": ("llama", 1, dict(extra={"is_causal": True})),
}


def _pair(root, name):
    fam, ver, kw = CASES[name]
    return tiny.make_pair(root / name, family=fam, version=ver, **kw)


def _build(drafter, target, draft_ids=None, fuse_context=True, **kw):
    ids = None if draft_ids is None else np.asarray(draft_ids)
    m = fd.build(drafter.config, target.config, W.ModuleWeights(drafter), W.ModuleWeights(target), fuse_context,
                 64, ids, **kw)
    if drafter.config.version == 2:
        so.add_flavour(m, "portable", drafter.config.num_drafts)
    return m


def _validate(tmp_path, model, target, drafter, fuse_context=True):
    path = tmp_path / "drafter.onnx"
    onnx.save(model, str(path))
    spec = next(s for s in graph_specs(target, drafter, fuse_context) if s.name == "drafter")
    failures, report = validate_graph(spec, path, "float32", save_dir=tmp_path, name="drafter")
    return failures, report, spec


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_reference(tmp_path, case):
    target, drafter = load_pair(*_pair(tmp_path, case))
    c = drafter.config
    if case == "qwen3-v2-window":
        assert c.layer_window == (4, None)  # the mask is exercised: the feeds' context is longer than 4
    if case == "llama-v1-causal":
        assert all(c.layer_causal)
    failures, report, spec = _validate(tmp_path, _build(drafter, target), target, drafter)
    assert failures == []
    assert set(report["step1"]) == set(spec.outputs)  # every output compared, the sampled step included


def test_draft_vocabulary_and_raw_taps(tmp_path):
    """A draft vocabulary (head rows gathered chunk by chunk, ids mapped back) and unfused context (fc +
    hidden_norm inside the drafter graph)."""
    target, drafter = load_pair(*_pair(tmp_path, "llama-v2"))
    V = target.config.vocab_size
    ids = sorted(set(range(0, V, 3)) | {5, 7})
    drafter.set_draft_vocab(ids)
    for fuse in (True, False):
        failures, _, _ = _validate(tmp_path, _build(drafter, target, ids, fuse_context=fuse), target, drafter, fuse)
        assert failures == [], fuse


def test_head_rows_are_read_chunk_by_chunk(tmp_path):
    d, t = _pair(tmp_path, "llama-v2")
    w = Weights(t)
    full = w.get("embed_tokens.weight")
    ids = np.array([0, 3, 4, 200, full.shape[0] - 1])
    got = np.concatenate(list(fd.head_rows(w, "embed_tokens.weight", ids)))
    assert np.array_equal(got, full[ids])
    # small chunks: only those holding a wanted row yield (0, 3, 4 | 200 | the last)
    chunks = list(fd.head_rows(_Chunked(w, 7), "embed_tokens.weight", ids))
    assert len(chunks) == 3 and np.array_equal(np.concatenate(chunks), full[ids])


class _Chunked:
    def __init__(self, w, rows):
        self.w, self.rows = w, rows

    def row_chunks(self, name):
        n = self.w.shape(name)[0]
        for i in range(0, n, self.rows):
            yield self.w.get(name, slice(i, min(n, i + self.rows)))


def test_streamed_build_equals_module_build(tmp_path):
    """Weights read from the safetensors folders give the same graph and bytes as the loaded modules."""
    d, t = _pair(tmp_path, "qwen3-v2-window")
    target, drafter = load_pair(d, t)
    with W.DataFile(tmp_path / "a.onnx.data") as data:
        a = fd.build(drafter.config, target.config, Weights(d), Weights(t), True, 64, None, data)
    with W.DataFile(tmp_path / "b.onnx.data") as data:
        b = fd.build(drafter.config, target.config, W.ModuleWeights(drafter), W.ModuleWeights(target), True, 64, None,
                     data)
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
    assert (tmp_path / "a.onnx.data").read_bytes() == (tmp_path / "b.onnx.data").read_bytes()


def test_few_nodes(tmp_path):
    """The point of the builder: few nodes per layer (measured: 42 + 68 per DFlash2 layer, its two convolutions
    32 of them; the traced graph of the shipped 2-layer drafter has 426 plus the selector's function)."""
    target, drafter = load_pair(*_pair(tmp_path, "llama-v2"))
    m = _build(drafter, target)
    ops = Counter(n.op_type for n in m.graph.node)
    L = drafter.config.num_layers
    assert len(m.graph.node) <= 45 + 70 * L, ops
    assert ops["RotaryEmbedding"] == 1 + 2 * L and ops["SkipSimplifiedLayerNormalization"] == 2 * L
    # context K|V; per layer qkv, o, gate_up, down, the two convolutions' projections, scores, attend; gate; the
    # head one Gemm (transB: no transposed copy of the vocabulary matrix)
    assert ops["MatMul"] == 1 + 8 * L + 1 and ops["Gemm"] == 1
    inits = {t.name for t in m.graph.initializer}
    assert not any(n.op_type == "Transpose" and n.input[0] in inits for n in m.graph.node)
    assert ops["DFlash2Selector"] == 1


@pytest.mark.parametrize("method", ["int4", "int8", "int8-dynamic"])
def test_quantized_build_deviates_little(tmp_path, method):
    """Every weight MatMul as MatMulNBits (int4 / int8) or DynamicQuantizeMatMul (int8-dynamic), the head
    included; its drafts are not the fp32 ones bit for bit, so the check is the deviation, as for the int4 target;
    the export stays lossless (test below)."""
    from dflash2.export import deviation

    target, drafter = load_pair(*_pair(tmp_path, "llama-v2"))
    q = qz.OrtQuant("int4", drafter_method=method).for_graph("drafter")
    assert q.method == method and q.dynamic == (method == "int8-dynamic")
    with W.DataFile(tmp_path / "drafter.onnx.data") as data:
        m = _build(drafter, target, data=data, quant=q)
    ops = Counter(n.op_type for n in m.graph.node)
    op = "DynamicQuantizeMatMul" if q.dynamic else "MatMulNBits"
    assert ops[op] == 1 + 4 * drafter.config.num_layers + 2 * drafter.config.num_layers + 2
    assert ops["MatMul"] == 2 * drafter.config.num_layers  # only the attention's activations
    bits = q.bits
    onnx.save(m, str(tmp_path / "drafter.onnx"))
    spec = next(s for s in graph_specs(target, drafter) if s.name == "drafter")
    failures, steps, dev = deviation.measure(spec, tmp_path / "drafter.onnx")
    assert failures == [] and steps
    # the quantized drafts against the fp32 build's: the same candidates mostly (measured 0.93-0.96 int8, 0.59-0.68
    # int4 on this random tiny drafter; a wrong nibble order or transposed head gives ~K / V = 0.02)
    onnx.save(_build(drafter, target), str(tmp_path / "fp32.onnx"))
    sessions = [ort.InferenceSession(str(tmp_path / f), providers=["CPUExecutionProvider"])
                for f in ("fp32.onnx", "drafter.onnx")]
    for feed in spec.feeds():
        f = {k: v.numpy() for k, v in feed.items()}
        want, got = (dict(zip([o.name for o in s.get_outputs()], s.run(None, f))) for s in sessions)
        overlap = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(want["cand_ids"], got["cand_ids"])])
        assert overlap >= (0.8 if bits == 8 else 0.4), overlap



def test_the_deviation_never_holds_its_session_beside_a_reference_pass(tmp_path, monkeypatch):
    """deviation.measure opens the quantized graph's session per feed, after that feed's reference pass, and closes
    it before the next: a session held across the feeds sat beside every pass (issue 48: the Muse-Glimmer-30B-shaped
    int4 export's peak, a 1.8 GiB fp32 layer and a 2,052-row prompt's activations beside the 2.8 GiB session)."""
    import weakref

    from dflash2.export import deviation

    target, drafter = load_pair(*_pair(tmp_path, "llama-v2"))
    with W.DataFile(tmp_path / "drafter.onnx.data") as data:
        m = _build(drafter, target, data=data, quant=qz.OrtQuant("int4").for_graph("drafter"))
    onnx.save(m, str(tmp_path / "drafter.onnx"))
    spec = next(s for s in graph_specs(target, drafter) if s.name == "drafter")
    opened, live_at_pass = [], []
    open_session, reference = deviation.open_session, deviation._reference

    def tracked_open(*a, **kw):
        sess = open_session(*a, **kw)
        opened.append(weakref.ref(sess))
        return sess

    def tracked_reference(*a, **kw):
        live_at_pass.append(sum(r() is not None for r in opened))
        return reference(*a, **kw)

    monkeypatch.setattr(deviation, "open_session", tracked_open)
    monkeypatch.setattr(deviation, "_reference", tracked_reference)
    failures, steps, _ = deviation.measure(spec, tmp_path / "drafter.onnx")
    assert failures == [] and len(steps) == len(live_at_pass) == len(opened) >= 2
    assert live_at_pass == [0] * len(steps)


@pytest.mark.parametrize("fam,ver", [("llama", 2), ("qwen3", 1)])
def test_gqa_export_uses_it_and_stays_lossless(tmp_path, pairs, fam, ver):
    d, t = pairs[(fam, ver)]
    prompt = [7, 1, 8, 2, 8, 1, 8]
    for i, q in enumerate((None, qz.OrtQuant("int4"), qz.OrtQuant("int4", drafter_method="int8-dynamic"))):
        if q is not None and q.drafter_method and ver == 1:
            continue  # one drafter method more on one pair is enough
        out = tmp_path / f"out-{i}"
        m = export(d, t, out, max_seq_len=256, quiet=True, target_attention="gqa", quantize=q)
        g = m.graphs["drafter"]
        assert g.flavours.portable == "drafter.onnx" and g.flavours.tensorrt is None
        assert not (out / "drafter.trt.onnx").exists()
        assert m.validation["drafter"].ok and g.signature.kv.kind == "prefix"
        ops = Counter(n.op_type for n in onnx.load(str(out / "drafter.onnx"), load_external_data=False).graph.node)
        dynamic = q is not None and q.drafter_method is not None
        assert ops["RotaryEmbedding"] >= 1 and (ops["MatMulNBits"] > 0) == (q is not None and not dynamic)
        assert (ops["DynamicQuantizeMatMul"] > 0) == dynamic
        if q is not None:
            assert m.quantization.graphs["drafter"].lm_heads == ["draft_head_I8" if dynamic else "draft_head_Q4"]
            assert m.quantization.drafter_method == q.drafter_method
            assert mf.load(out, mf.ExportManifest).quantization.drafter_method == q.drafter_method
            assert m.validation["drafter"].deviation is not None
        rt = Runtime(out)
        spec = generate(rt.session, prompt, 40)
        ar = generate(rt.session, prompt, 40, speculative=False)
        assert spec.ids == ar.ids  # lossless against the export's own target
        if q is None:  # fp32: the same drafts as the PyTorch reference, round by round
            from dflash2.reference.backend import TorchBackend

            ref = generate(TorchBackend(*load_pair(d, t), 512), prompt, 40)
            assert spec.ids == ref.ids and spec.stats.accepted == ref.stats.accepted
    if ver == 2:  # the int4 drafter swapped into the int8-dynamic export, the manifest resealed: named when it opens
        import shutil

        from dflash2.runtime.graphcheck import GraphMismatchError
        from tests.test_quantize import _swap_in

        shutil.copytree(tmp_path / "out-2", tmp_path / "forged")
        _swap_in(tmp_path / "out-1", tmp_path / "forged", ["drafter.onnx", "drafter.onnx.data"])
        with pytest.raises(GraphMismatchError, match="the manifest says DynamicQuantizeMatMul nodes, the graph has "
                                                     "MatMulNBits"):
            Runtime(tmp_path / "forged").generate(prompt, 4)
        # the fp32 pair's graphs in, the manifest's target entry made fp32 too: only the drafter is misdescribed
        from tests.exports import edit_manifest

        _swap_in(tmp_path / "out-0", tmp_path / "forged", ["target.onnx", "target.onnx.data", "drafter.onnx",
                                                           "drafter.onnx.data"])
        def fp32_target(d):  # and no Q4MatMul flavour of an int4 target left listed beside it
            d["quantization"]["graphs"].pop("target")
            d["graphs"]["target"]["flavours"].pop("cpu_q4", None)

        edit_manifest(tmp_path / "forged", fp32_target)
        with pytest.raises(GraphMismatchError, match="the manifest says quantized int8-dynamic, the graph has no "
                                                     "DynamicQuantizeMatMul nodes"):  # the drafter's method, not int4
            Runtime(tmp_path / "forged").generate(prompt, 4)


@pytest.mark.parametrize("attention", ["gqa", "plain"])
def test_a_shorter_draft_block_is_exported_validated_and_lossless(tmp_path, pairs, capsys, attention):
    """export(draft_block=N): the drafter drafts N rows a round instead of its training block; the graph is validated
    against the reference at that block, the runtime drafts what the reference drafts round by round, lossless;
    a block past the training one (positions it never drafted), under 2 or not an integer is refused before anything
    is written."""
    from dflash2.cli import export as export_cli
    from dflash2.config import load_drafter_config
    from dflash2.folders import OutputError
    from dflash2.reference.backend import TorchBackend

    d, t = pairs[("llama", 2)]
    trained = load_drafter_config(d).block_size
    n = trained - 2
    m = export(d, t, tmp_path / "out", max_seq_len=256, quiet=True, target_attention=attention, draft_block=n)
    assert m.block_size == n and m.num_drafts == n - 1 and m.drafter_config["block_size"] == n
    assert m.drafter_config["trained_block_size"] == trained  # the manifest says it drafts fewer rows than trained
    assert all(v.ok for v in m.validation.values())
    drafter_graph = onnx.load(str(tmp_path / "out" / "drafter.onnx"), load_external_data=False).graph
    dims = {o.name: [x.dim_value or x.dim_param for x in o.type.tensor_type.shape.dim] for o in drafter_graph.output}
    assert n - 1 in dims["draft_ids"] and trained - 1 not in dims["draft_ids"], dims
    rt = Runtime(tmp_path / "out")
    prompt = [7, 1, 8, 2, 8, 1, 8]
    spec = generate(rt.session, prompt, 40)
    assert spec.ids == generate(rt.session, prompt, 40, speculative=False).ids
    ref = generate(TorchBackend(*load_pair(d, t, block_size=n), 512), prompt, 40)
    assert spec.ids == ref.ids and spec.stats.accepted == ref.stats.accepted
    if attention == "plain":
        return
    for bad in (trained + 1, 1):
        out = tmp_path / f"bad{bad}"
        assert export_cli.main(["--model", str(d), "--target", str(t), "--out", str(out), "--quiet",
                                "--draft-block", str(bad)]) == 2
        assert f"--draft-block: expected an integer in 2..{trained} (the training block_size in " \
               f"{d / 'config.json'}), found {bad}" in capsys.readouterr().err
        assert not out.exists()
    with pytest.raises(OutputError, match=r"--draft-block: expected an integer .* found 3\.0"):
        export(d, t, tmp_path / "float", quiet=True, draft_block=3.0)
    assert not (tmp_path / "float").exists()


def test_export_with_a_draft_vocabulary(tmp_path, pairs):
    src, t = pairs[("llama", 2)]
    d = tmp_path / "drafter"
    import shutil

    shutil.copytree(src, d)
    V = load_target_config(t).vocab_size
    dv.write(d, list(range(0, V, 2)), V, "test")
    m = export(d, t, tmp_path / "out", max_seq_len=256, quiet=True, target_attention="gqa")
    assert m.draft_vocab.size == V // 2 and m.validation["drafter"].ok
    rt = Runtime(tmp_path / "out")
    prompt = [3, 9, 27, 81]
    assert generate(rt.session, prompt, 32).ids == generate(rt.session, prompt, 32, speculative=False).ids
    loaded = mf.load(tmp_path / "out", mf.ExportManifest)
    assert loaded.graphs["drafter"].flavours.tensorrt is None


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_plain_flavours_match_the_reference(tmp_path, case, dtype):
    """build_plain: standard ONNX ops, both flavours from one pass; the TensorRT flavour's stale cache rows
    hidden by its context mask (the fixed feeds carry garbage rows past past_len). fp16 against the streamed
    fp16 reference (what the export validates with), the walk judged on the graph's own candidates where they
    are the reference's top-K up to rounding (validate._on_graph_candidates)."""
    import torch

    from dflash2.export import trace as tr
    from dflash2.reference.load import load_streamed_pair

    d, t = _pair(tmp_path, case)
    target, drafter = load_streamed_pair(d, t, dtype=getattr(torch, dtype))
    spec = next(s for s in graph_specs(target, drafter, True) if s.name == "drafter")
    with W.DataFile(tmp_path / "drafter.onnx.data") as data:
        m, fixed = fd.build_plain(drafter.config, target.config, Weights(d), Weights(t), True, dtype, None, data)
    assert not any(n.domain == "com.microsoft" for n in m.graph.node)  # TensorRT parses every node
    files = tr.write_graph(m, tmp_path, spec, drafter.config.num_drafts, fixed)
    assert files == {"portable": "drafter.onnx", "tensorrt": "drafter.trt.onnx"}
    S = drafter.config.num_drafts if spec.has_selector else None
    assert validate_graph(spec, tmp_path / files["portable"], dtype, weights_in_place=True)[0] == []
    assert validate_graph(spec.tensorrt, tmp_path / files["tensorrt"], dtype, selector_drafts=S,
                          weights_in_place=True)[0] == []


def test_candidates_are_walked_only_when_they_tie(tmp_path):
    """The fp16 candidate rule accepts another order of near-equal logits and nothing else: a swapped pair of
    exactly tied candidates walks; a candidate from outside the top-K, a repeated one, or an id outside the draft
    vocabulary is refused (the plain comparison then judges, and fails)."""
    import torch

    d, t = _pair(tmp_path, "llama-v2")
    target, drafter = load_pair(d, t)
    S, K, H = drafter.config.num_drafts, drafter.config.selector_top_k, drafter.config.hidden_size
    hidden = torch.randn(1, S, H, generator=torch.Generator().manual_seed(0))
    logits, _ = drafter.draft_logits(hidden)
    own = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices  # [1, S, V]
    top = own[..., :K].int()
    vals, ids = drafter.candidates_from(hidden, top, 1e-4, 1e-3)
    assert torch.equal(ids, top) and torch.allclose(vals, logits.float().gather(-1, top.long()))
    swapped = top.clone()
    swapped[0, 0, [0, 1]] = swapped[0, 0, [1, 0]]  # the first two are not tied: refused at 1e-4 ...
    assert drafter.candidates_from(hidden, swapped, 1e-4, 1e-3) is None
    gap = float((logits[0, 0, top[0, 0, 0]] - logits[0, 0, top[0, 0, 1]]).abs())
    assert drafter.candidates_from(hidden, swapped, 2 * gap, 0.0) is not None  # ... a tie at 2x the gap's tolerance
    outside = top.clone()
    outside[0, 1, K - 1] = own[0, 1, -1]  # the lowest logit of the row
    assert drafter.candidates_from(hidden, outside, 1e-4, 1e-3) is None
    repeated = top.clone()
    repeated[0, 2, 1] = repeated[0, 2, 0]
    assert drafter.candidates_from(hidden, repeated, 1e2, 1.0) is None
    beyond = top.clone()
    beyond[0, 3, 0] = logits.shape[-1]
    assert drafter.candidates_from(hidden, beyond, 1e2, 1.0) is None
    # a walked row: greedy picks tie only within the tolerance; sampled, only where u sits on a boundary
    from dflash2.reference.selector import walk_tie

    row = torch.tensor([5.0, 4.99, 1.0, -2.0])
    assert walk_tie(row, 0.0, 0.0, 0, 1, 5e-2, 0.0) and not walk_tie(row, 0.0, 0.0, 0, 2, 5e-2, 0.0)
    q0 = float(torch.softmax(row, -1)[0])
    assert walk_tie(row, 1.0, q0 + 0.01, 0, 1, 5e-2, 0.0) and not walk_tie(row, 1.0, q0 + 0.2, 0, 1, 5e-2, 0.0)


def test_a_wrong_path_is_not_excused_by_a_tie(tmp_path):
    """The fp16 rule takes a graph's pick only at a row that ties, and walks on from it itself: a graph path that
    is wrong after its first row (each later draft a repeat of the first) still fails, whatever the tolerance."""
    from dflash2.export.validate import _on_graph_candidates, compare, reference_outputs

    target, drafter = load_pair(*_pair(tmp_path, "llama-v2"))
    spec = next(s for s in graph_specs(target, drafter, True) if s.name == "drafter")
    feed = spec.feeds()[0]
    ref = reference_outputs(spec, [feed])[0]
    got = dict(ref)
    bad = got["draft_ids"].copy()
    bad[1:] = bad[0]
    assert (bad != ref["draft_ids"]).any()
    got["draft_ids"] = bad
    judged, taken = _on_graph_candidates(spec, feed, got, "float16")
    assert taken <= 1 and compare("drafter", got, judged, "float16", 0)[0]
    assert _on_graph_candidates(spec, feed, ref, "float16")[1] == 0  # the reference itself: nothing taken


def test_dynamic_int8_weights_follow_onnxruntimes_per_channel_rule():
    """weights.DynamicInt8 against onnxruntime.quantization's own per-channel symmetric QInt8 (quantize_data per
    column): the same int8 values and scales; a zero column gets scale 1 (not a division by zero)."""
    from onnxruntime.quantization.quant_utils import quantize_data

    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 12)).astype(np.float32) * rng.uniform(0.01, 3, 12).astype(np.float32)
    w[:, 5] = 0
    q, scales = W.DynamicInt8().quantize(w)
    assert q.dtype == np.int8 and scales.shape == (12,)
    assert scales[5] == 1 and not q[:, 5].any()
    for c in (0, 3, 11):
        _, scale, ref = quantize_data(w[:, c], onnx.TensorProto.INT8, symmetric=True)
        np.testing.assert_allclose(scales[c], np.float32(scale), rtol=1e-6)
        np.testing.assert_array_equal(q[:, c], ref)


def test_drafter_methods_without_effect_are_refused():
    with pytest.raises(qz.QuantizeError, match="expected a quantized drafter, found --quant-target-only"):
        qz.OrtQuant("int4", drafter=False, drafter_method="int8")
    with pytest.raises(qz.QuantizeError, match="--quant-drafter-block-size: no effect with --quant-drafter int8-dynamic"):
        qz.OrtQuant("int4", drafter_method="int8-dynamic", drafter_block_size=64)
    q = qz.OrtQuant("int4", 32, drafter_method="int8", drafter_block_size=128).for_graph("drafter")
    assert (q.method, q.block_size, q.bits) == ("int8", 128, 8)
    assert qz.OrtQuant("int4", drafter_method="int8").for_graph("target").method == "int4"


def test_a_dynamic_target_is_refused(tmp_path, pairs):
    """int8-dynamic quantizes activations per tensor: a target so quantized is not row-invariant (not lossless)."""
    from dflash2.folders import OutputError

    d, t = pairs[("llama", 2)]
    with pytest.raises(OutputError, match=r"expected int4 or int8 for the target .*\(--quant-drafter int8-dynamic\)"):
        export(d, t, tmp_path / "out", max_seq_len=256, quiet=True, quantize=qz.OrtQuant("int8-dynamic"))
    assert not (tmp_path / "out").exists()
