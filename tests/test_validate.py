"""Export validation's provider branch for bfloat16 graphs: with ONNX Runtime's CUDA provider a bf16
graph is validated on it with bf16 feeds (it used to be opened on the CPU provider with fp32 feeds,
so `dflash2-export --dtype bfloat16` failed on any onnxruntime-gpu machine); without it, skipped."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from dflash2.export import validate
from dflash2.export.graphs import GraphSpec


class _Double(torch.nn.Module):
    def forward(self, x):
        return (x + x,)


def _bf16_double() -> onnx.ModelProto:
    """y = bf16(2 * float(x)): bf16 in and out, kernels ONNX Runtime's CPU provider has (Cast, fp32 Add)."""
    nodes = [helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT), helper.make_node("Add", ["f", "f"], ["s"]),
             helper.make_node("Cast", ["s"], ["y"], to=TensorProto.BFLOAT16)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [5])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [5])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def bf16_graph(tmp_path):
    path = tmp_path / "g.onnx"
    onnx.save(_bf16_double(), str(path))
    x = torch.tensor([1.5, -2.25, 3.0, 0.0078125, 100.0], dtype=torch.bfloat16)
    spec = GraphSpec("g", _Double(), ["x"], ["y"], {}, (x,), lambda: [{"x": x}])
    return spec, path


def test_bf16_validates_on_the_cuda_provider_with_bf16_feeds(bf16_graph, monkeypatch):
    spec, path = bf16_graph
    opened = []

    def open_session(p, providers=("CPUExecutionProvider",), *a, **kw):
        opened.append(list(providers))  # the branch's choice; run on the CPU provider, the stand-in here
        return real(p, ["CPUExecutionProvider"], *a, **kw)

    real = validate.open_session
    monkeypatch.setattr(validate.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(validate, "open_session", open_session)
    failures, report = validate.validate_graph(spec, path, "bfloat16")
    assert opened == [["CUDAExecutionProvider", "CPUExecutionProvider"]]
    assert failures == [] and report["step0"]["y"]["max_abs"] == 0.0 == report["step0"]["y"]["max_rel"]


def test_bf16_without_cuda_is_skipped_with_the_reason(bf16_graph, monkeypatch):
    spec, path = bf16_graph
    monkeypatch.setattr(validate.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    failures, report = validate.validate_graph(spec, path, "bfloat16")
    assert failures == [] and "no bfloat16 kernels" in report["skipped"]
