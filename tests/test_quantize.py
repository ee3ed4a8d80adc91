"""dflash2-export --quantize int4|int8: ONNX Runtime's MatMulNBits graphs, the deviation report, the
manifest, and losslessness against the quantized target as deployed."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from dflash2 import manifest as mf
from dflash2 import tiny
from dflash2.errors import Dflash2Error
from dflash2.engines.plan import PrecisionError, plan_build
from dflash2.export import fuse
from dflash2.export import quantize as qz
from dflash2.export.api import OutputError, export
from dflash2.native import q4
from dflash2.onnxrt import open_session
from dflash2.quant_manifest import describe, label
from dflash2.runtime.api import Runtime
from dflash2.bench.quant import GenaiRunner, bench_quant, table
from dflash2.speculative import generate

PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], list(range(40, 90)), [300, 8, 12, 12, 12, 12]]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, pairs):
    """method -> export folder: int4 of the Llama DFlash2 pair, int8 of the Qwen3 DFlash pair."""
    root = tmp_path_factory.mktemp("quant")
    out = {"int4": root / "int4", "int8": root / "int8", "fp32": root / "fp32", "int4-plain": root / "int4-plain"}
    export(*pairs[("llama", 2)], out["int4"], max_seq_len=256, quiet=True, quantize=qz.OrtQuant("int4"))
    export(*pairs[("llama", 2)], out["int4-plain"], max_seq_len=256, quiet=True, quantize=qz.OrtQuant("int4"),
           target_attention="plain")  # the default for ONNX Runtime quantizations is the gqa graph
    export(*pairs[("qwen3", 1)], out["int8"], max_seq_len=256, quiet=True, quantize=qz.OrtQuant("int8", 16))
    export(*pairs[("llama", 2)], out["fp32"], max_seq_len=256, quiet=True)
    return out


def ops(path):
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


@pytest.mark.parametrize("method", ["int4", "int8", "int4-plain"])
def test_speculative_equals_quantized_target_greedy(quantized, method):
    rt = Runtime(quantized[method])
    assert rt.session.gqa == (method != "int4-plain")
    for prompt in PROMPTS:
        base = generate(rt.session, prompt, 48, speculative=False)
        for k in (None, 2):
            spec = generate(rt.session, prompt, 48, draft_len=k)
            assert spec.ids == base.ids and len(base.ids) == 48


@pytest.mark.parametrize("method", ["int4", "int8", "int4-plain"])
def test_graphs_and_manifest(quantized, method):
    out = quantized[method]
    method = method.split("-")[0]
    typed = mf.load(out)
    assert typed.quantization.method == method and typed.quantization.graphs["target"].quantized > 0
    m = json.loads((out / "manifest.json").read_text())
    q = m["quantization"]
    assert q["method"] == method and q["bits"] == {"int4": 4, "int8": 8}[method] and q["backend"] == "onnxruntime"
    assert set(q["graphs"]) == {"target", "drafter"}
    for graph, rep in q["graphs"].items():
        counts = ops(out / f"{graph}.onnx")
        # every weight MatMul (Gemm and the tied head's MatMul(Transpose) included) became MatMulNBits
        assert counts["MatMulNBits"] == rep["quantized"] == rep["weight_matmuls"] > 0
        assert counts["Gemm"] == 0 and len(rep["lm_heads"]) == 1
        assert rep["weight_mb_after"] < rep["weight_mb_before"]
        # no TensorRT flavour; int4 block 32: the Q4MatMul flavour where this CPU runs the op (test_q4_matmul.py)
        q4_flavour = {"cpu_q4": f"{graph}.q4.onnx"} if method == "int4" and q4.usable() else {}
        assert m["graphs"][graph]["flavours"] == {"portable": f"{graph}.onnx", **q4_flavour}
        assert not (out / f"{graph}.trt.onnx").exists()
    assert "MatMulNBits" not in ops(out / "selector.onnx") if (out / "selector.onnx").exists() else True
    v = m["validation"]["target"]
    assert v["ok"] and 0.0 <= v["deviation"]["top1_agreement"] <= 1.0
    assert v["deviation"]["max_logit_error"] > 0.0  # int4 / int8 weights are not the fp32 model
    assert label(typed) == method and method in describe(typed) and "top-1 agreement" in describe(typed)
    assert not any(p.name.startswith(".") for p in out.iterdir())  # the temporary logits probe is gone


@pytest.mark.parametrize("fused", [False, True])
def test_rewrites_keep_the_graph(quantized, fused):
    """The Gemm / Transpose rewrite, the MatMul merge and the norm fusion change no output (fp32, before
    any quantization)."""
    src = quantized["fp32"] / "target.onnx"
    model = onnx.load(str(src))
    n = qz.weights_as_matmul(model)
    assert n > 0 and not any(node.op_type in ("Gemm", "Transpose") and node.input[0] in
                             {t.name for t in model.graph.initializer} for node in model.graph.node)
    if fused:
        heads = qz.head_nodes(model)
        # the plain target's templates write q|k|v and gate|up packed already (dflash2.export.plain): nothing to merge
        assert fuse.merge_parallel_matmuls(model, keep=set(heads)) == 0
        assert sum(x.op_type == "MatMul" and x.input[1] in {t.name for t in model.graph.initializer}
                   for x in model.graph.node) == 4 * 4 + 2  # per layer q|k|v, o, gate|up, down (4 layers); fc, head
        # two per layer, the final norm, and the drafter's hidden_norm of the fused context
        assert fuse.fuse_norms(model)["SimplifiedLayerNormalization"] == 2 * 4 + 2
        assert Counter(x.op_type for x in model.graph.node)["Split"] >= 8
    rewritten = quantized["fp32"].parent / f"rewritten-{fused}.onnx"
    onnx.save_model(model, str(rewritten))
    feeds = {"input_ids": np.array([3, 9, 27, 81, 243], np.int32),
             "past_kv": np.random.default_rng(0).standard_normal((2, 4, 2, 2, 16)).astype(np.float32)}
    a, b = open_session(src).run(None, feeds), open_session(rewritten).run(None, feeds)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_tied_head_and_kept_head(tmp_path):
    target = tiny.make_target(tmp_path / "t", tie_word_embeddings=True)
    drafter = tiny.make_drafter(tmp_path / "d", target, version=1)
    export(drafter, target, tmp_path / "q", max_seq_len=128, quiet=True,
           quantize=qz.OrtQuant("int4", lm_head=False, drafter=False))
    typed = mf.load(tmp_path / "q")
    m = json.loads((tmp_path / "q" / "manifest.json").read_text())
    rep = m["quantization"]["graphs"]["target"]
    assert set(m["quantization"]["graphs"]) == {"target"}
    assert rep["kept_fp32"] == rep["lm_heads"] and rep["quantized"] == rep["weight_matmuls"] - 1
    g = onnx.load(str(tmp_path / "q" / "target.onnx"), load_external_data=False).graph
    head = next(n for n in g.node if n.name == rep["lm_heads"][0])
    # fp32: the embedding itself as a Gemm's transposed operand (no [K, V] copy on disk, none made at run time)
    assert head.op_type == "Gemm" and head.input[1] == "embed_tokens.weight"
    assert next(a.i for a in head.attribute if a.name == "transB") == 1
    assert ops(tmp_path / "q" / "target.onnx")["Gather"] >= 1  # the embedding lookup stays a plain Gather
    assert "MatMulNBits" not in ops(tmp_path / "q" / "drafter.onnx")
    assert (tmp_path / "q" / "drafter.onnx").exists() and "LM heads kept fp32" in describe(typed)
    rt = Runtime(tmp_path / "q")
    base = generate(rt.session, PROMPTS[2], 32, speculative=False)
    assert generate(rt.session, PROMPTS[2], 32).ids == base.ids


@pytest.mark.parametrize("kw,msg", [({"method": "int3"}, "--quantize"), ({"method": "int4", "block_size": 24},
                                                                          "power of two"),
                                    ({"method": "int4", "accuracy_level": 7}, "accuracy-level")])
def test_bad_options(kw, msg):
    with pytest.raises(qz.QuantizeError, match=msg):
        qz.OrtQuant(**kw)


def test_quantize_needs_fp32_and_writes_nothing(tmp_path, pairs):
    with pytest.raises(OutputError, match="expected --dtype float32"):
        export(*pairs[("llama", 2)], tmp_path / "x", dtype="float16", quantize=qz.OrtQuant("int4"), quiet=True)
    assert not (tmp_path / "x").exists() and list(tmp_path.iterdir()) == []


def test_tensorrt_build_refuses_onnxruntime_quantization(quantized, tmp_path):
    with pytest.raises(PrecisionError, match="MatMulNBits"):
        plan_build(quantized["int4"], tmp_path / "engines", mode="print")


def test_cli_prints_quantization(tmp_path, pairs):
    drafter, target = pairs[("qwen3", 1)]
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.export", "--model", str(drafter), "--target", str(target),
                        "--out", str(tmp_path / "o"), "--quantize", "int8", "--quant-block-size", "16",
                        "--max-seq-len", "64", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "quantization: int8 (MatMulNBits" in r.stdout and "block 16" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "dflash2.cli.export", "--model", str(drafter), "--target",
                          str(target), "--out", str(tmp_path / "p"), "--quantize", "int4", "--quant-block-size", "20"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "power of two >= 16, found 20" in bad.stderr and not (tmp_path / "p").exists()


def test_quant_bench_interleaved(quantized):
    fp32, int4 = quantized["fp32"], quantized["int4"]
    lines: list[str] = []
    typed = bench_quant([fp32, int4, fp32], PROMPTS[:2], max_new_tokens=24, draft_len="auto",  # each one's schedule
                        log=lines.append)
    r = typed.to_dict()
    assert len(lines) == 2 and lines[-1].startswith("[prompt 2/2]") and "int4 gqa speculative" in lines[-1]
    assert list(r["exports"]) == ["fp32", "int4 gqa", "fp32-2"]  # the label says the graph
    assert all(r["lossless"].values())
    assert r["top1_agreement_vs_first"]["fp32-2"] == 1.0  # the same target agrees with itself everywhere
    assert 0.0 <= r["top1_agreement_vs_first"]["int4 gqa"] <= 1.0
    assert set(r["tokens_per_second"]) == {f"{lab} {m}" for lab in r["exports"]
                                           for m in ("autoregressive", "speculative")}
    assert all(v > 0 for v in r["tokens_per_second"].values())
    assert r["draft_len"] == "auto" and "K=auto" in table(typed) and "int4 gqa speculative" in table(typed)
    assert "vs_genai_int4" not in r["best"] and typed.exports["int4 gqa"].quantization["bits"] == 4
    with pytest.raises(Dflash2Error, match="expected 'auto' or an integer"):
        bench_quant([fp32], PROMPTS[:1], max_new_tokens=4, draft_len="two")


def test_genai_runner_needs_a_builder_folder(tmp_path):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (the dflash2[genai] extra) not installed")
    with pytest.raises(Dflash2Error, match="genai_config.json"):
        GenaiRunner(tmp_path)


def test_compare_reports_quantized_deviation(quantized):
    from dflash2.engines.compare import compare

    report = compare(quantized["int4"])
    assert report.passed
    rows = {(r.graph, r.output): r for r in report.rows}
    assert "not judged" in rows[("target", "next_ids")].note and "% of" in rows[("target", "next_ids")].note
    assert rows[("target", "context")].max_abs > 0 and "not judged" in rows[("target", "context")].note
    assert all("not judged" not in r.note for r in report.rows if r.graph == "selector")  # fp32, judged
    assert any("reported, not judged" in n for n in report.notes)


def test_quant_bench_against_onnxruntime_genai(quantized, pairs, tmp_path):
    """onnxruntime-genai's own builder makes an int4 model of the same tiny target; the bench runs it greedily
    on the same prompt ids in the same interleaved loop."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (the dflash2[genai] extra) not installed")
    target = pairs[("llama", 2)][1]
    r = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(target), "-o",
                        str(tmp_path / "genai"), "-p", "int4", "-e", "cpu", "-c", str(tmp_path / "cache")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    typed = bench_quant([quantized["fp32"], quantized["int4"]], PROMPTS[:2], genai=tmp_path / "genai",
                        max_new_tokens=16, draft_len=2, threads=1)
    res = typed.to_dict()
    assert res["tokens_per_second"]["onnxruntime-genai int4"] > 0 and res["genai"]["version"] == "0.18.0"
    assert 0.0 <= res["genai_prefix_agreement_vs_first"] <= 1.0 and "vs_genai_int4" in res["best"]
    assert all(res["lossless"].values()) and "onnxruntime-genai int4" in table(typed)


def _swap_in(src: Path, dst: Path, names: list[str]) -> None:
    """dst's files `names` replaced by src's, the manifest's file entries updated and resealed: a forgery the seal
    cannot catch (tests.exports.edit_manifest)."""
    import hashlib
    import shutil

    from tests.exports import edit_manifest

    for n in names:
        (dst / n).unlink()
        shutil.copyfile(src / n, dst / n)

    def edit(d):
        for n in names:
            d["files"][n] = {"sha256": hashlib.sha256((dst / n).read_bytes()).hexdigest(), "bytes": (dst / n).stat().st_size}
    edit_manifest(dst, edit)


@pytest.mark.parametrize("into,source,want", [
    ("int4-plain", "fp32", "the manifest says quantized int4, the graph has no MatMulNBits nodes"),
    ("fp32", "int4-plain", "the manifest says not quantized, the graph has MatMulNBits nodes"),
    ("int4-plain", "int4", "inputs: the manifest lists"),  # the gqa graph into a plain-graph export
])
def test_a_resealed_graph_swap_is_refused_when_its_session_opens(quantized, tmp_path, into, source, want, monkeypatch):
    """The probe's forgeries that ran: a graph file of another export swapped in and the manifest resealed. Each graph
    is checked against the manifest on the file ONNX Runtime opened (io and weight format): one error naming the
    file, both sides and the fix; the folders given are not changed."""
    import shutil

    from dflash2.runtime.graphcheck import GraphMismatchError

    monkeypatch.setenv(q4.OFF_VAR, "0")  # the portable graphs run (the Q4MatMul flavour's swap: test_q4_matmul.py)
    forged = tmp_path / "forged"
    shutil.copytree(quantized[into], forged)
    names = [n for n in ("target.onnx", "target.onnx.data") if (quantized[source] / n).is_file()]
    _swap_in(quantized[source], forged, names)
    with pytest.raises(GraphMismatchError) as e:
        Runtime(forged).generate(PROMPTS[0], 4)
    msg = str(e.value)
    assert want in msg and "target.onnx" in msg and "re-export with dflash2-export" in msg
