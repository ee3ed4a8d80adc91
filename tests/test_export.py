"""dflash2-export: graphs, flavours, validation, manifest, ONNX-Runtime-only greedy loop, bad input."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from dflash2 import manifest as mf
from dflash2.errors import CheckpointError, TensorSetError, ValidationError
from dflash2.export import selector_onnx as so
from dflash2.export import trace as tr
from dflash2.export.api import OutputError, export
from dflash2.ops import contract as C
from dflash2.reference.backend import TorchBackend
from dflash2.reference.load import load_pair
from dflash2.runtime.api import Runtime
from dflash2.speculative import generate

COMBOS = [("llama", 1), ("llama", 2), ("qwen3", 1), ("qwen3", 2)]


@pytest.mark.parametrize("family,version", COMBOS)
def test_export_validates_and_ort_loop_equals_reference(exports, pairs, family, version):
    out = exports[(family, version)]
    m = json.loads((out / "manifest.json").read_text())
    so.register_schema()
    for g in m["graphs"].values():
        for f in g["flavours"].values():
            onnx.checker.check_model(str(out / f), full_check=True)
    assert all(v["ok"] for v in m["validation"].values())
    assert set(m["graphs"]) == ({"target", "drafter", "selector"} if version == 2 else {"target", "drafter"})
    # a greedy loop driven only by ONNX Runtime sessions over the portable graphs
    prompt = [7, 1, 8, 2, 8, 1, 8]
    ort_gen = generate(Runtime(out).session, prompt, 64)
    target, drafter = load_pair(*pairs[(family, version)])
    ref = generate(TorchBackend(target, drafter, 512), prompt, 64)
    assert ort_gen.ids == ref.ids and len(ref.ids) == 64
    assert ort_gen.stats.accepted == ref.stats.accepted


def test_flavours(exports):
    out = exports[("qwen3", 2)]
    trt = onnx.load(str(out / "drafter.trt.onnx"), load_external_data=False)
    portable = onnx.load(str(out / "drafter.onnx"), load_external_data=False)
    nodes = [n for n in trt.graph.node if n.op_type == C.OP_NAME]
    assert len(nodes) == 1 and nodes[0].domain == C.ONNX_DOMAIN
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["plugin_version"] == C.PLUGIN_VERSION.encode() and attrs["plugin_namespace"] == b""
    assert attrs["top_k"] == 8 and attrs["rank"] == 16 and attrs["mode"] == b"sample"  # T = 0 walks greedily
    assert len(trt.functions) == 0  # TensorRT's parser must fall through to the plugin registry
    assert [f.name for f in portable.functions] == [C.OP_NAME]
    # both flavours read the same external data: the drafter's own file and the target's embedding / head
    locations = {e.value for t in trt.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {e.value for t in portable.graph.initializer for e in t.external_data
                         if e.key == "location"} == {"drafter.onnx.data", "target.onnx.data"}
    # the custom node's outputs are int32, int32, fp32 as the contract says
    sel = onnx.load(str(out / "selector.trt.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in sel.graph.output}
    assert types == {"draft_ids": onnx.TensorProto.INT32, "path_index": onnx.TensorProto.INT32,
                     "path_scores": onnx.TensorProto.FLOAT, "confidence": onnx.TensorProto.FLOAT,
                     "draft_probs": onnx.TensorProto.FLOAT}


def test_manifest_contents(exports):
    out = exports[("llama", 2)]
    m = json.loads((out / "manifest.json").read_text())
    assert m["contract_version"] == C.CONTRACT_VERSION and m["kv"]["layout"][0] == "seq"
    assert m["graphs"]["target"]["inputs"][1] == {"name": "past_kv", "dtype": "float32",
                                                   "shape": ["past", *m["kv"]["rows"]["target"]]}
    assert {"torch", "onnx", "onnxruntime", "onnxscript"} <= set(m["tools"])
    assert (out / "tokenizer.json").is_file() and "tokenizer.json" in m["files"]
    for name in ("target.inputs.json", "target.reference.json", "drafter.onnx.data"):
        assert name in m["files"]


def test_polygraphy_cli_replays_reference(exports):
    out = exports[("llama", 2)]
    polygraphy = str(Path(sys.executable).parent / "polygraphy")
    r = subprocess.run([polygraphy, "run", "target.onnx", "--onnxrt", "--load-inputs",
                        "target.inputs.json", "--load-outputs", "target.reference.json", "--atol", "1e-4",
                        "--rtol", "1e-3"], cwd=out, capture_output=True, text=True)
    assert r.returncode == 0 and "PASSED" in r.stdout + r.stderr


def test_tied_embedding_stored_once(tmp_path):
    from dflash2 import tiny

    t = tiny.make_target(tmp_path / "t", tie_word_embeddings=True)
    d = tiny.make_drafter(tmp_path / "d", t, version=2)
    out = tmp_path / "out"
    export(d, t, out, quiet=True)
    assert tr.duplicate_initializers(out / "target.onnx") == []
    assert tr.duplicate_initializers(out / "drafter.onnx") == []


def test_fp16_export_validates(tmp_path, pairs):
    out = tmp_path / "fp16"
    m = export(*pairs[("qwen3", 2)], out, dtype="float16", quiet=True)
    assert all(v.ok for v in m.validation.values())
    assert m.graphs["target"].inputs[1].dtype == "float16"
    # selector scores and unary logits stay fp32 inside an fp16 graph
    model = onnx.load(str(out / "drafter.trt.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == C.OP_NAME)
    vi = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    assert vi.get(node.input[0]) == onnx.TensorProto.FLOAT  # cand_logits fp32
    assert vi.get(node.input[2]) == onnx.TensorProto.FLOAT16  # gate in the graph dtype


def test_validation_failure_lists_every_output_and_writes_nothing(tmp_path, pairs, monkeypatch):
    from dflash2.export import validate

    monkeypatch.setitem(validate.TOLERANCES, "float32", (0.0, 0.0))
    out = tmp_path / "bad"
    with pytest.raises(ValidationError) as e:
        export(*pairs[("llama", 2)], out, quiet=True)
    text = str(e.value)
    assert "target.context" in text and "target.new_kv" in text and "max abs" in text
    assert "drafter" not in text  # the export stops at the first failing graph
    kept = tmp_path / "bad.failed"
    assert f"kept for inspection in {kept}" in text
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["bad.failed"]
    assert {"target.onnx", "target.inputs.json", "target.reference.json", "VALIDATION_FAILED.txt"} <= \
        {p.name for p in kept.iterdir()}
    mark = (kept / "VALIDATION_FAILED.txt").read_text()  # the failing lines travel with the kept graphs
    assert "failed: target.context (step 0): max abs" in mark and "failed: target.new_kv" in mark
    with pytest.raises(ValidationError) as e:  # again: our earlier .failed folder is replaced
        export(*pairs[("llama", 2)], out, quiet=True)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.failed"]
    user = tmp_path / "user.failed"  # a folder of that name dflash2 did not write is left alone
    user.mkdir()
    (user / "mine.txt").write_text("x")
    with pytest.raises(ValidationError) as e:
        export(*pairs[("llama", 2)], tmp_path / "user", quiet=True)
    assert (user / "mine.txt").read_text() == "x" and (tmp_path / "user.failed-2" / "target.onnx").is_file()


def _no_leftovers(folder):
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


@pytest.mark.parametrize("case", ["wrong_folder", "missing_tensor", "hidden", "vocab", "architecture"])
def test_bad_checkpoints(tmp_path, pairs, case):
    import shutil

    from safetensors.torch import load_file, save_file

    drafter = tmp_path / "drafter"
    shutil.copytree(pairs[("llama", 2)][0], drafter)
    target = pairs[("llama", 2)][1]
    cfg = json.loads((drafter / "config.json").read_text())
    err, match = CheckpointError, None
    if case == "wrong_folder":
        drafter, match = tmp_path / "nope", "no such directory"
    elif case == "missing_tensor":
        t = load_file(str(drafter / "model.safetensors"))
        del t["norm.weight"]
        save_file(t, str(drafter / "model.safetensors"))
        err, match = TensorSetError, r"missing \(1\): norm.weight"
    elif case == "hidden":
        cfg.update(hidden_size=32, head_dim=8)
        match = "drafter hidden_size 32 != target hidden_size 64"
    elif case == "vocab":
        cfg["vocab_size"] = 999
        match = "drafter vocab_size .* != target vocab_size"
    else:
        cfg["architectures"] = ["MedusaModel"]
        match = "unsupported architecture"
    (drafter / "config.json").write_text(json.dumps(cfg)) if drafter.exists() else None
    out = tmp_path / "out"
    with pytest.raises(err, match=match):
        export(drafter, target, out, quiet=True)
    assert not out.exists() and _no_leftovers(tmp_path)


def test_output_rules(tmp_path, pairs):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="is a file, not a folder"):
        export(*pairs[("llama", 1)], blocker / "out", quiet=True)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="exists; pass --force"):
        export(*pairs[("llama", 1)], existing, quiet=True)
    assert (existing / "keep.txt").read_text() == "mine"
    with pytest.raises(OutputError, match="--force replaces only a folder written by dflash2"):
        export(*pairs[("llama", 1)], existing, force=True, quiet=True)  # not ours: never deleted
    assert (existing / "keep.txt").read_text() == "mine"
    ours = tmp_path / "ours"  # an earlier export's folder (its manifest says so): --force replaces it
    ours.mkdir()
    (ours / "manifest.json").write_text(json.dumps({"format": "dflash2-export"}))
    (ours / "stale.onnx").write_text("old")
    export(*pairs[("llama", 1)], ours, force=True, quiet=True)
    assert json.loads((ours / "manifest.json").read_text())["graphs"] and not (ours / "stale.onnx").exists()
    assert _no_leftovers(tmp_path)


def test_cli_prints_time_and_sizes(tmp_path, pairs):
    drafter, target = pairs[("qwen3", 1)]
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.export", "--model", str(drafter), "--target", str(target),
                        "--out", str(tmp_path / "o"), "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "exported" in r.stdout and " s (dtype float32" in r.stdout and "target.onnx.data" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.export", "--model", str(drafter), "--target", str(target),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2 and "exists; pass --force" in r.stderr


def test_portable_selector_function_matches_torch_op():
    import onnxruntime as ort
    import torch

    so.register_schema()
    rng = np.random.default_rng(0)
    feeds = dict(cand_logits=rng.standard_normal((3, 7, 16), dtype=np.float32),
                 cand_ids=rng.integers(0, 300, (3, 7, 16)).astype(np.int32),
                 gate=rng.standard_normal((3, 7, 256), dtype=np.float32), anchor=np.array([1, 2, 3], np.int32),
                 pred_codebook=rng.standard_normal((300, 256), dtype=np.float32) / 4,
                 succ_codebook=rng.standard_normal((300, 256), dtype=np.float32) / 4,
                 uniforms=rng.random((3, 7), dtype=np.float32), temperature=np.array([0.0, 0.7, 1.5], np.float32))
    feeds["cand_logits"][0, 2, 3] = np.nan
    feeds["cand_logits"][1, 4] = -np.inf
    greedy_rows = dict(feeds, temperature=np.zeros(3, np.float32))  # mode sample's greedy branch, B = 3
    for mode, feeds in [(m, feeds) for m in C.MODES] + [("sample", greedy_rows)]:
        attrs = {"output_multiplier": 0.5, "logit_softcap": 2.0, "mode": mode}
        m = so.selector_model(7, 16, 256, 300, "portable", attrs)
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        got = sess.run(None, feeds)
        want = torch.ops.dflash2.select_path(*[torch.from_numpy(v) for v in feeds.values()], top_k=16, rank=256,
                                             **attrs)
        np.testing.assert_array_equal(got[0], want[0].numpy())
        np.testing.assert_array_equal(got[1], want[1].numpy())
        np.testing.assert_allclose(got[2], want[2].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[3], want[3].numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got[4], want[4].numpy(), rtol=1e-5, atol=1e-7)
        for b in range(3):
            for s in range(7):
                row = got[2][b, s].tolist()
                index, q = C.walk_row(row, float(feeds["temperature"][b]), float(feeds["uniforms"][b, s]), mode)
                assert index == got[1][b, s], (mode, b, s)
                np.testing.assert_allclose(got[4][b, s], q, rtol=1e-5, atol=1e-7)
                assert got[3][b, s] == pytest.approx(C.path_confidence(row, index), rel=1e-5, abs=1e-7)
        if mode == "sample" and feeds is greedy_rows:  # all rows greedy: the greedy walk's own outputs
            for a, b in zip(got, want_greedy):
                np.testing.assert_array_equal(a, b)
        elif mode == "sample":  # the sampled rows really left the argmax somewhere
            assert (got[1][1:] != want_greedy[1][1:]).any()
        else:
            want_greedy = got


def test_portable_selector_confidence_special_rows():
    """Zero codebooks, no softcap: each row is its logits, so the contract's edge rules show."""
    import onnxruntime as ort

    so.register_schema()
    m = so.selector_model(4, 4, 3, 50, "portable")
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    nan, inf = np.nan, np.inf
    logits = np.array([[[1, 3, 3, 2], [nan, -inf, -inf, nan], [1, inf, 5, inf], [0, 0, np.log(2), 0]]], np.float32)
    feeds = dict(cand_logits=logits, cand_ids=np.arange(16, dtype=np.int32).reshape(1, 4, 4),
                 gate=np.ones((1, 4, 3), np.float32), anchor=np.array([5], np.int32),
                 pred_codebook=np.zeros((50, 3), np.float32), succ_codebook=np.zeros((50, 3), np.float32),
                 uniforms=np.zeros((1, 4), np.float32), temperature=np.zeros(1, np.float32))
    conf = sess.run(None, feeds)[3]
    want = [1 / (2 + np.exp(-1) + np.exp(-2)), 0.0, 0.5, 2 / 5]  # tie of two 3s; nothing scored; two +inf; 2/(2+3)
    np.testing.assert_allclose(conf[0], want, rtol=1e-6)


def test_bf16_dense_is_row_invariant_and_lossless_on_its_emulation(tmp_path, pairs, monkeypatch):
    """A dense DFlash2 pair in bf16 (the templates' graphs): validated within bf16's fixed tolerance, the row check
    bitwise and speculative decoding = the bf16 target's own greedy ids at every accepted count and with the pair's
    drafter, all on the graphs' emulation (tests.exports.low_precision_checks)."""
    from dflash2.export import validate
    from tests.exports import low_precision_checks
    from tests.test_qwen3_5_export import PROMPT  # the prompt PlannedDrafts counts from

    monkeypatch.setattr(validate.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    low_precision_checks(pairs[("qwen3", 2)], tmp_path / "bf16", "bfloat16", PROMPT, 40, list(range(8)) + [3, 0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_biased_projections_in_16_bits(tmp_path, monkeypatch, dtype):
    """A Llama target and a drafter with attention_bias: the target's biased Linears one Gemm each (rounded once, as
    nn.Linear), the drafter's ([1, n, K] activations: no Gemm) a MatMul and an Add; validated, rows bitwise and
    speculative = the target's own (bf16: on the emulation)."""
    from dflash2 import tiny
    from dflash2.export import validate
    from tests.exports import low_precision_checks
    from tests.test_qwen3_5_export import PROMPT

    monkeypatch.setattr(validate.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    target = tiny.make_target(tmp_path / "target", family="llama", attention_bias=True)
    drafter = tiny.make_drafter(tmp_path / "drafter", target, extra={"attention_bias": True})
    low_precision_checks((drafter, target), tmp_path / "out", dtype, PROMPT, 40, list(range(8)) + [3, 0])
    gemms = [n for n in onnx.load(str(tmp_path / "out" / "target.onnx"), load_external_data=False).graph.node
             if n.op_type == "Gemm" and len(n.input) == 3]
    assert {n.name for n in gemms} >= {"layers.0.qkv_proj", "layers.0.o_proj"}, [n.name for n in gemms]
    drafter_ops = {n.name: n.op_type for n in onnx.load(str(tmp_path / "out" / "drafter.onnx"),
                                                        load_external_data=False).graph.node}
    assert any(k.endswith(".bias") and v == "Add" for k, v in drafter_ops.items())


@pytest.mark.slow
def test_bf16_without_a_bf16_provider_is_validated_on_its_emulation(tmp_path, pairs, capsys, monkeypatch):
    """bf16 without a bf16-capable provider: each graph validated as export.bf16_emulation runs it on the CPU provider
    (every bf16 value rounded after its node), and recorded so; the row check runs the loop's bf16 buffers over the
    graphs' emulating copies (removed after), recorded so, untimed (no cost prior from an emulation)."""
    from dflash2.export import validate

    monkeypatch.setattr(validate.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    m = export(*pairs[("llama", 1)], tmp_path / "bf16", dtype="bfloat16")
    err = capsys.readouterr().err
    graphs = {k: v for k, v in m.validation.items() if k != "target.rows"}
    assert set(graphs) == {"target", "target.trt", "drafter", "drafter.trt"}
    assert all(v.ok and v.steps["emulated"].startswith("bf16 emulated") for v in graphs.values())
    rows = m.validation["target.rows"]
    assert rows.ok and rows.steps["rows"] > 0 and rows.steps["differing"] == 0 and "emulated" in rows.steps
    assert "costs_ms" not in rows.steps and not any(".bf16emu." in p.name for p in (tmp_path / "bf16").iterdir())
    assert "validating against PyTorch on ONNX Runtime: done" in err and "target.onnx: validating" in err
    # target and drafter from the layer templates, weights streamed (no trace of a loaded model), both flavours
    for g in ("target", "drafter"):
        assert f"{g}.onnx + {g}.trt.onnx: standard ONNX ops from the layer templates, bfloat16, streamed" in err
    assert not any("judged_by_dtype_error" in r for v in graphs.values() for r in v.steps.values()
                   if isinstance(r, dict)), m.validation  # within bf16's fixed tolerance of PyTorch's own


@pytest.mark.parametrize("key", [("llama", 2), ("qwen3", 1)])
def test_no_tensor_is_stored_twice(exports, key):
    """Each weight once: the drafter graphs read the target's embedding / head, the selector the drafter's
    codebooks (dflash2.export.dedupe); the manifest names the data files each graph reads."""
    from dflash2.export import dedupe

    folder = exports[key]
    assert dedupe.duplicates(folder) == []
    m = mf.load(folder)
    assert "target.onnx.data" in m.graphs["drafter"].data  # the embedding is read from the target's file
    for g in m.graphs.values():
        for f in g.data.split(", "):
            assert (folder / f).is_file()


def test_sharing_changes_no_output(tmp_path, pairs):
    """The same graphs before and after sharing give bit-identical outputs on the validation feeds."""
    import shutil

    from dflash2.export import dedupe
    from dflash2.onnxrt import open_session

    out = tmp_path / "e"
    export(*pairs[("qwen3", 2)], out, quiet=True, max_seq_len=64)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("*.trt.onnx"))  # the portable graphs alone
    models = {g: onnx.load(str(copy / g)) for g in ("target.onnx", "drafter.onnx", "selector.onnx")}
    for g, model in models.items():  # back to one self-contained file per graph
        onnx.save_model(model, str(copy / g), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{g}.alone", size_threshold=1024)
    assert dedupe.duplicates(copy) != []
    from polygraphy.json import load_json

    def outputs():
        return {g: [open_session(copy / f"{g}.onnx").run(None, feed) for feed in load_json(str(out / f"{g}.inputs.json"))]
                for g in ("target", "drafter")}

    alone = outputs()  # each graph self-contained, nothing shared
    report = dedupe.share(copy, list(models))
    assert report["tensors_shared"] > 0 and report["bytes_after"] < report["bytes_before"]
    assert dedupe.duplicates(copy) == []
    shared = outputs()
    for g in alone:
        for a, b in zip(alone[g], shared[g]):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    (copy / "extra.onnx").write_bytes((copy / "selector.onnx").read_bytes())
    with pytest.raises(ValueError, match="not in the list"):  # a graph it would not rewrite: refused
        dedupe.share(copy, list(models))
