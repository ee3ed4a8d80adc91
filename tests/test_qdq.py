"""dflash2-export --quantize int8_qdq / fp8 / int4_awq: ModelOpt's Q/DQ target as the TensorRT flavour,
checked by ONNX Runtime where its CPU provider runs it, and built through the fake TensorRT."""

from __future__ import annotations

import pytest

from dflash2 import manifest as mf
from dflash2 import tiny
from dflash2.engines import build as eb
from dflash2.engines import plan as ep
from dflash2.export.api import export
from dflash2.export.qdq import TrtQuant
from dflash2.export.quantize import QuantizeError
from dflash2.runtime.api import Runtime
from tests.exports import PROMPT

pytest.importorskip("modelopt.onnx.quantization", reason="nvidia-modelopt (ONNX quantizer) is not installed; "
                                                         "docs/quantization.md says how")


@pytest.fixture(scope="module")
def qdq_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("qdq")
    drafter, target = tiny.make_pair(root / "pair", family="qwen3", version=2)
    export(drafter, target, root / "int8", max_seq_len=48, quiet=True, quantize=TrtQuant("int8_qdq"))
    return root / "int8"


def test_qdq_export_is_the_tensorrt_flavour_of_the_target(qdq_export):
    m = mf.load(qdq_export)
    q = m.quantization
    assert q.method == "int8_qdq" and q.backend == "tensorrt" and list(q.graphs) == ["target"]
    assert "shipped prompts" in q.calibration  # the tiny target has a tokenizer: real text calibrated it
    g = m.graphs["target"]
    assert g.flavours.portable == "target.onnx" and g.flavours.tensorrt == "target.qdq.onnx"
    assert q.graphs["target"].fused["QuantizeLinear"] > 0 and q.graphs["target"].fused["DequantizeLinear"] > 0
    v = m.validation["target"]  # ONNX Runtime's CPU provider runs int8 Q/DQ: deviation measured
    assert v.ok and v.skipped is None and 0.0 <= v.deviation.top1_agreement <= 1.0


def test_build_takes_the_qdq_graph_and_runs_lossless(qdq_export, tmp_path, fake_plugin, fake):
    plan = ep.plan_build(qdq_export, tmp_path / "eng", max_seq_len=48, max_prefill=16, plugin=fake_plugin)
    assert plan.jobs[0].graph == "target" and plan.jobs[0].onnx.name == "target.qdq.onnx"
    eb.build(plan, quiet=True)
    m = mf.load(tmp_path / "eng", mf.EngineManifest)
    assert m.quantization.method == "int8_qdq" and m.engines["target"].onnx == "target.qdq.onnx"
    rt = Runtime(tmp_path / "eng")  # the fake TensorRT executes the Q/DQ graph with ONNX Runtime
    base = rt.generate(PROMPT, 20, speculative=False).ids
    assert rt.generate(PROMPT, 20).ids == base and len(base) == 20


def test_unknown_method():
    with pytest.raises(QuantizeError, match="int4_awq"):
        TrtQuant("int3_awq")
