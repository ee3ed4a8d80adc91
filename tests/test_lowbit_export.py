"""`dflash2-export --quantize int4|int8` of Muse-Glimmer and gpt-oss (their `fused` templates: export/lowbit.py,
export/gpt_oss_qmoe.py) on dflash2-make-tiny pairs: the export's own checks pass (the truncated fp32 build validated,
the quantized graph's deviation measured, the k-row == 1-row row check bitwise), the graph holds the low-bit ops
it should (MatMulNBits, GatherBlockQuantized with int4, QMoE for gpt-oss's experts: int8 from MXFP4 whatever
--quantize says), MXFP4's int8 expert blocks are the checkpoint's weights exactly, and speculative decoding through
the runtime gives the quantized target's own greedy ids at every accepted count 0..S (planned drafts) and with the
pair's own drafter (lossless). gpt-oss is built top-4 of 8 experts: QMoE's k >= 3 sum order is what the slot form
(gpt_oss_qmoe._slots) keeps out of the row check."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytest.importorskip("onnxruntime")

from dflash2 import tiny  # noqa: E402
from dflash2.export.api import export  # noqa: E402
from dflash2.export.plan import QuantFlags  # noqa: E402
from dflash2.runtime.api import Runtime  # noqa: E402
from dflash2.speculative import generate  # noqa: E402
from tests.test_qwen3_5_export import PROMPT as PLANNED_PROMPT  # noqa: E402
from tests.test_qwen3_5_export import PlannedDrafts, _ops  # noqa: E402

BLOCK = 8
MXFP4 = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
TOP4 = {"num_local_experts": 8, "num_experts_per_tok": 4}  # gpt-oss routes 4 (of 32 / 128)
# (family, checkpoint, --quantize): MXFP4 with int4 -> its experts int8 (exact), the rest int4
CASES = [("muse_glimmer", "float", "int4"), ("muse_glimmer", "float", "int8"), ("gpt_oss", "float", "int4"),
         ("gpt_oss", "float", "int8"), ("gpt_oss", "mxfp4", "int4")]
# past the window (8); the Muse-Glimmer tiny's image / video ids (vocab - 2, vocab - 1 = 382, 383) among them; as
# long as test_qwen3_5_export's PROMPT (PlannedDrafts counts positions from its length)
PROMPT = [11, 22, 382, 44, 55, 66, 383, 88, 99, 5, 6, 7]


def _pair(root, family: str, checkpoint: str):
    extra = {} if family == "muse_glimmer" else dict(TOP4, **(MXFP4 if checkpoint == "mxfp4" else {}))
    target = tiny.make_target(root / "target", family=family, extra=extra or None)
    return tiny.make_drafter(root / "drafter", target, version=2, block_size=BLOCK), target


@pytest.mark.parametrize("family, checkpoint, method", CASES, ids=["-".join(c) for c in CASES])
def test_quantized_export_is_checked_and_lossless(tmp_path, family, checkpoint, method):
    drafter, target = _pair(tmp_path, family, checkpoint)
    out = tmp_path / "out"
    m = export(drafter, target, out, max_seq_len=160, quiet=True, quantize=QuantFlags(method=method))
    assert all(v.ok for v in m.validation.values()), m.validation
    assert not m.validation["target.truncated"].skipped and not m.validation["target"].skipped
    rows = m.validation["target.rows"]
    assert not rows.skipped and rows.steps["rows"] > 0 and rows.steps["differing"] == 0
    assert m.kv.target_attention == "gqa"
    # the default: the sliding layers on the window buffer, the row check through its compactions
    assert m.graphs["target"].signature.window is not None and rows.steps["window_compactions"] >= 1
    dev = m.validation["target"].deviation
    print(f"{family} {checkpoint} {method}: top-1 agreement with fp32 {dev.top1_agreement}")

    g = onnx.load(str(out / "target.onnx"), load_external_data=False).graph
    ops = _ops(g)
    assert "MatMulNBits" in ops and ("GatherBlockQuantized" in ops) == (method == "int4"), ops
    bits = {n.name: {a.name: a.i for a in n.attribute} for n in g.node if n.op_type == "MatMulNBits"}
    assert bits and {a["bits"] for a in bits.values()} == {int(method[-1])}
    qmoe = [n for n in g.node if n.op_type == "QMoE"]
    if family == "gpt_oss":
        from dflash2.config import load_target_config

        layers = load_target_config(target).num_layers
        assert len(qmoe) == layers and "TopK" in ops  # one per layer, routed by the graph (the slot form)
        want = 8 if checkpoint == "mxfp4" else int(method[-1])
        assert {a.i for n in qmoe for a in n.attribute if a.name == "expert_weight_bits"} == {want}
        assert {a.i for n in qmoe for a in n.attribute if a.name == "k"} == {1}
    else:
        assert not qmoe
    if checkpoint == "mxfp4":
        _mxfp4_blocks_are_exact(out, target)

    rt = Runtime(out)
    rt.manifest.eos_token_ids = []
    assert len(PROMPT) == len(PLANNED_PROMPT)
    truth = rt.generate(PROMPT, 40, speculative=False).ids
    assert len(set(truth)) > 5
    s = PlannedDrafts(rt.manifest, rt.session.backend, truth, plan=list(range(BLOCK)) + [3, 0, 7, 1])
    g2 = generate(s, PROMPT, 40)
    assert g2.ids == truth and set(g2.stats.accepted) >= set(range(BLOCK))  # 0..S, each at least once
    assert rt.generate(PROMPT, 40).ids == truth  # the pair's own drafter


def _mxfp4_blocks_are_exact(out, target) -> None:
    """The int8 expert blocks in the exported data file dequantize to the MXFP4 checkpoint's decoded experts,
    bitwise (layer 0's gate|up and down)."""
    from dflash2.checkpoint import Weights
    from dflash2.reference.gpt_oss import DecodedExperts

    model = onnx.load(str(out / "target.onnx"))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if ".experts." in t.name}
    src = DecodedExperts(Weights(target))
    for fc in ("gate_up_proj", "down_proj"):
        codes = inits[f"layers.0.mlp.experts.{fc}_Q8"].astype(np.float32) - 128  # [E, N, K]
        scales = inits[f"layers.0.mlp.experts.{fc}_scales"]  # [E, N, K / 32]
        w = (codes.reshape(*scales.shape, 32) * scales[..., None]).reshape(codes.shape)
        want = src.get(f"layers.0.mlp.experts.{fc}").transpose(0, 2, 1)  # [E, in, out] -> [E, N, K]
        assert np.array_equal(w, want), fc


def test_the_plan_refuses_what_the_quantized_templates_do_not_do(tmp_path):
    """Refused before anything is written, each naming what it expected: ONNX Runtime's after-validation quantizer
    (--target-attention plain), the TensorRT quantizations, a block size the float experts' widths do not divide
    (QMoE), and int4 weights with fp16 activations; MXFP4 experts ignore the block size (their int8 blocks are
    MXFP4's 32)."""
    from dflash2.errors import Dflash2Error

    drafter, target = _pair(tmp_path / "pair", "gpt_oss", "float")
    with pytest.raises(Dflash2Error, match=r"--quantize int4 --target-attention plain: not for GptOssForCausalLM"):
        export(drafter, target, tmp_path / "a", quiet=True, quantize=QuantFlags(method="int4"),
               target_attention="plain")
    with pytest.raises(Dflash2Error, match=r"--quantize fp8: not yet for GptOssForCausalLM"):
        export(drafter, target, tmp_path / "b", quiet=True, quantize=QuantFlags(method="fp8"))
    with pytest.raises(Dflash2Error, match=r"QMoE needs hidden_size and intermediate_size divisible by the block "
                                           r"size 128, found 64 and"):
        export(drafter, target, tmp_path / "c", quiet=True, quantize=QuantFlags(method="int4", block_size=128))
    muse_drafter, muse = _pair(tmp_path / "muse", "muse_glimmer", "float")
    with pytest.raises(Dflash2Error, match=r"--quantize int4: expected --dtype float32 \(weights are quantized from "
                                           r"fp32; activations stay fp32\), found float16"):
        export(muse_drafter, muse, tmp_path / "d", quiet=True, dtype="float16", quantize=QuantFlags(method="int4"))
    assert not [p for p in tmp_path.iterdir() if p.name not in ("pair", "muse")]


@pytest.mark.slow
def test_make_tiny_export_int8_then_run_from_the_command_line(tmp_path):
    """dflash2-make-tiny --family gpt_oss, dflash2-export --quantize int8 (QMoE int8 experts, MatMulNBits), then
    dflash2-run: --check-rows passes on this machine, and the speculative ids equal --no-spec's (greedy). Five
    command-line processes: ~2 min on a loaded 2-core machine."""
    import json
    import subprocess
    import sys

    pair, out = tmp_path / "pair", tmp_path / "out"

    def cli(module: str, *args: str) -> str:
        r = subprocess.run([sys.executable, "-m", f"dflash2.cli.{module}", *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    cli("make_tiny", "--out", str(pair), "--family", "gpt_oss")
    cli("export", "--target", str(pair / "target"), "--model", str(pair / "drafter"), "--out", str(out),
        "--max-seq-len", "128", "--quantize", "int8")
    m = json.loads((out / "manifest.json").read_text())
    assert m["kv"]["target_attention"] == "gqa" and m["validation"]["target.rows"]["ok"]
    assert {"QMoE", "MatMulNBits"} <= _ops(onnx.load(str(out / "target.onnx"), load_external_data=False).graph)
    cli("run", str(out), "--check-rows")
    ids = ",".join(str(i) for i in PROMPT[:-2] + [9, 10])
    runs = [json.loads(cli("run", str(out), "--prompt-ids", ids, "--max-new-tokens", "32", "--json", *flag))
            for flag in ((), ("--no-spec",))]
    assert runs[0]["ids"] == runs[1]["ids"] and len(runs[0]["ids"]) > 0
