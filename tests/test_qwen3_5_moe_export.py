"""The Qwen3.5-MoE target through the pipeline: the hybrid's layer templates (dflash2.export.qwen3_5) with the experts'
block (dflash2.export.moe, shared expert included) on every layer, against the reference
(dflash2.reference.qwen3_5_moe); dflash2-export of a tiny pair as fp32 standard ops, fp32 ONNX Runtime MoE and int4 /
int8 QMoE, each validated and row-checked, with speculative decoding through the exported graphs equal to the
target's own greedy ids at every accepted count 0..S (fp32: also transformers' Qwen3_5MoeForCausalLM generate); the
fused expert layout under the ConditionalGeneration wrapper (what the published checkpoints hold) giving the same ids
as the per-expert layout; the plan's refusals; make-tiny then export from the command line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dflash2 import tiny
from dflash2.config import load_drafter_config
from dflash2.errors import Dflash2Error
from dflash2.export import qwen3_5 as Q
from dflash2.export import weights as W
from dflash2.export.api import export
from dflash2.export.plan import QuantFlags
from dflash2.reference.qwen3_5 import commit
from dflash2.reference.qwen3_5_moe import load_target
from dflash2.runtime.api import Runtime
from dflash2.speculative import generate
from tests.test_qwen3_5_export import PROMPT, PlannedDrafts, _feed, _ops, fp16_export_checks
from tests.test_qwen3_5_moe_reference import fuse

BLOCK = 8
PLAN = list(range(BLOCK)) + [3, 0, 7, 1]  # every accepted count 0..S, then a few rollbacks more


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 4-layer Qwen3_5MoeForCausalLM (2 GDN + 2 full-attention layers, 4 experts, top-2, shared expert 64 wide,
    per-expert layout) and a DFlash2 drafter, block 8."""
    root = tmp_path_factory.mktemp("qwen3_5_moe")
    target = tiny.make_target(root / "target", family="qwen3_5_moe", num_layers=4)
    drafter = tiny.make_drafter(root / "drafter", target, version=2, block_size=BLOCK)
    return drafter, target


@pytest.fixture(scope="module")
def fp32_ids(pair, tmp_path_factory):
    """The fp32 standard-op export's own greedy ids (the fused layout's export must give the same)."""
    out = tmp_path_factory.mktemp("qwen3_5_moe-fp32") / "out"
    export(*pair, out, max_seq_len=160, quiet=True)
    rt = Runtime(out)
    rt.manifest.eos_token_ids = []
    return rt.generate(PROMPT, 40, speculative=False).ids


def _hf_greedy(target, n: int) -> list[int]:
    from transformers import Qwen3_5MoeForCausalLM

    hf = Qwen3_5MoeForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("fused", [False, True], ids=["standard-ops", "ort-moe"])
def test_templates_match_the_reference(pair, fused):
    """The graph against Qwen35MoeTarget: a prefill past the window, then a verify of B rows from the committed
    state; the experts' block as standard ops (TopK) or ONNX Runtime's MoE, the dense MLP nowhere."""
    drafter, target = pair
    dc = load_drafter_config(drafter)
    ref = load_target(target, tuple(dc.target_layer_ids))
    model, _ = Q.build(ref.config, dc, W.ModuleWeights(ref), W.ModuleWeights(ref), fuse_context=False, fused=fused)
    ops = _ops(model.graph)
    assert ("MoE" in ops) == fused and ("TopK" in ops) != fused
    names = [n.name for n in model.graph.node]
    assert not [n for n in names if n.endswith(".gate_up_proj") or n.endswith(".down_proj")]  # no dense MLP
    assert sum(n.endswith("shared_gate.sigmoid") for n in names) == ref.config.num_layers  # shared expert each layer
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out_names = [o.name for o in sess.get_outputs()]
    run = lambda ids, s: dict(zip(out_names, sess.run(None, _feed(ids, s))))  # noqa: E731
    s0 = ref.empty_state()
    with torch.no_grad():
        logits, taps, step = ref(torch.tensor(PROMPT), s0)
    out = run(PROMPT, s0)
    for name, want in (("logits", logits[-BLOCK:]), ("context", taps), ("new_kv", step.kv)):
        assert np.abs(out[name] - want.numpy()).max() < 1e-4, name
    s1 = commit(s0, step, len(PROMPT))
    verify = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        vl, _, _ = ref(torch.tensor(verify), s1)
    assert np.abs(run(verify, s1)["logits"] - vl.numpy()).max() < 1e-4


# (--quantize, --target-attention): fp32 standard ops (portable + TensorRT flavour), fp32 ONNX Runtime MoE (every row
# fed twice: its fp32 kernel is not row-invariant otherwise, docs/families/qwen3_moe.md), int4 / int8 QMoE
ROUTES = [(None, "auto"), (None, "gqa"), ("int4", "auto"), ("int8", "auto")]


@pytest.mark.parametrize("method, attention", ROUTES, ids=["fp32-standard-ops", "fp32-ort-moe", "int4-qmoe",
                                                           "int8-qmoe"])
def test_export_is_validated_row_invariant_and_lossless(pair, tmp_path, method, attention):
    m = export(*pair, tmp_path / "out", max_seq_len=160, quiet=True, target_attention=attention,
               quantize=QuantFlags(method=method) if method else None)
    assert all(v.ok for v in m.validation.values()), m.validation
    rows = m.validation["target.rows"]
    assert not rows.skipped and rows.steps["rows"] > 0 and rows.steps["differing"] == 0
    g = onnx.load(str(tmp_path / "out" / "target.onnx"), load_external_data=False).graph
    ops = _ops(g)
    # QMoE after the graph's own routing (TopK: moe._qmoe_slots); MoE routes inside the op
    want = {None: {"TopK"}, "int4": {"QMoE", "TopK"}, "int8": {"QMoE", "TopK"}}[method] if attention == "auto" \
        else {"MoE"}
    assert want <= ops and not {"TopK", "MoE", "QMoE"} - want & ops, ops
    assert m.kv.target_attention == ("plain" if method is None and attention == "auto" else "gqa")
    rt = Runtime(tmp_path / "out")
    rt.manifest.eos_token_ids = []
    truth = rt.generate(PROMPT, 40, speculative=False).ids
    if method is None:
        assert truth == _hf_greedy(pair[1], 40)
    s = PlannedDrafts(rt.manifest, rt.session.backend, truth, plan=PLAN)
    g2 = generate(s, PROMPT, 40)
    assert g2.ids == truth and set(g2.stats.accepted) >= set(range(BLOCK))  # 0..S, each at least once
    assert rt.generate(PROMPT, 40).ids == truth  # the pair's own drafter


def test_the_fused_expert_layout_under_the_wrapper_gives_the_same_ids(pair, fp32_ids, tmp_path):
    """The published layout: Qwen3_5MoeForConditionalGeneration (text under text_config, `model.language_model.*`)
    with each layer's experts fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), the same
    weights: the export reads an expert at a time through UnfusedExperts and generates the per-expert export's ids,
    fp32 and int4 (QMoE's experts quantized from the fused tensors)."""
    from dflash2 import families

    drafter, target = pair
    wrapped = shutil.copytree(target, tmp_path / "wrapped")
    fuse(wrapped)
    fam, c = families.load(wrapped)
    assert fam.name == "qwen3_5_moe" and c.fused_experts and c.arch == "Qwen3_5MoeForConditionalGeneration"
    export(drafter, wrapped, tmp_path / "out", max_seq_len=160, quiet=True)
    rt = Runtime(tmp_path / "out")
    rt.manifest.eos_token_ids = []
    assert rt.generate(PROMPT, 40, speculative=False).ids == fp32_ids
    assert rt.generate(PROMPT, 40).ids == fp32_ids
    for src, out in ((target, "int4-per-expert"), (wrapped, "int4-fused")):
        export(drafter, src, tmp_path / out, max_seq_len=160, quiet=True, quantize=QuantFlags(method="int4"))
    ids = []
    for out in ("int4-per-expert", "int4-fused"):
        rt = Runtime(tmp_path / out)
        rt.manifest.eos_token_ids = []
        ids.append(rt.generate(PROMPT, 40, speculative=False).ids)
    assert ids[0] == ids[1]


def test_fp16_is_validated_row_invariant_and_lossless(pair, tmp_path):
    """The experts' block in fp16 standard ops (the all-experts MatMuls, the router's softmax and top-k in fp32) under
    the hybrid's fp16 layers: tests.test_qwen3_5_export.fp16_export_checks."""
    fp16_export_checks(pair, tmp_path / "fp16", BLOCK, PLAN)


def test_bf16_is_validated_on_its_emulation(pair, tmp_path):
    """bf16 (the dtype Qwen3.5 / 3.6-MoE checkpoints ship in; TensorRT's): the experts' block in bf16 standard ops under
    the hybrid's bf16 layers, within bf16's fixed tolerance of PyTorch's own bf16 on the emulation
    (tests.exports.low_precision_checks), the conv state and KV rows bf16, the recurrent state fp32."""
    from tests.exports import low_precision_checks
    from tests.test_qwen3_5_export import _low_precision_io

    m = low_precision_checks(pair, tmp_path / "bf16", "bfloat16", PROMPT, 40, PLAN)
    _low_precision_io(tmp_path / "bf16", m, "bfloat16")
    ops = {n.op_type for n in onnx.load(str(tmp_path / "bf16" / "target.onnx"), load_external_data=False).graph.node}
    assert "TopK" in ops and "MoE" not in ops


def test_the_plan_refuses_what_the_templates_do_not_do(pair, tmp_path):
    """The hybrid's refusal (no TensorRT quantization) and the MoE one (QMoE's blocks must tile both widths), before
    anything is written."""
    drafter, target = pair
    with pytest.raises(Dflash2Error, match="not yet for Qwen3_5MoeForCausalLM"):
        export(drafter, target, tmp_path / "fp8", quiet=True, quantize=QuantFlags(method="fp8"))
    with pytest.raises(Dflash2Error, match="QMoE needs hidden_size and moe_intermediate_size divisible by the "
                                           "block size 64, found 64 and 32"):  # the tiny experts are 32 wide
        export(drafter, target, tmp_path / "q", quiet=True, quantize=QuantFlags(method="int4", block_size=64))
    assert not list(tmp_path.iterdir())


def test_past_the_budget_a_truncated_build_is_validated_against_the_streamed_reference(pair, tmp_path, monkeypatch):
    from dflash2.export import stages

    monkeypatch.setattr(stages, "WHOLE_GRAPH_BYTES", 0)
    m = export(*pair, tmp_path / "t", max_seq_len=160, quiet=True)
    for name in ("target.truncated", "target.truncated.trt"):
        assert m.validation[name].ok and not m.validation[name].skipped, name
    assert m.validation["target"].skipped


def test_make_tiny_then_export_from_the_command_line(tmp_path):
    """dflash2-make-tiny --family qwen3_5_moe, then dflash2-export --quantize int4 of its pair: the fused graph with
    QMoE, validated and row-checked."""
    pair = tmp_path / "pair"
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.make_tiny", "--out", str(pair), "--family",
                        "qwen3_5_moe"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((pair / "target" / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForCausalLM"]
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.export", "--target", str(pair / "target"), "--model",
                        str(pair / "drafter"), "--out", str(out), "--max-seq-len", "128", "--quantize", "int4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["kv"]["target_attention"] == "gqa" and m["validation"]["target.rows"]["ok"]
    assert "QMoE" in _ops(onnx.load(str(out / "target.onnx"), load_external_data=False).graph)
