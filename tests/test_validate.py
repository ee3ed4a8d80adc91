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


class _Cancel(torch.nn.Module):
    """(x * w) * K - x * (w * K): zero in exact arithmetic; in fp16 each product rounds at K's scale (~0.5 apart)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1 / 3], dtype=torch.float16), requires_grad=False)
        self.register_buffer("k", torch.tensor([1000.0], dtype=torch.float16))

    def forward(self, x):
        return ((x * self.w) * self.k - x * (self.w * self.k),)


def _fp32_cancel(offset: float) -> onnx.ModelProto:
    """The same function in fp32 between fp16 casts (+ offset: a wrong graph)."""
    w = float(torch.tensor(1 / 3, dtype=torch.float16))
    consts = [helper.make_tensor(n, TensorProto.FLOAT, [1], [v]) for n, v in
              (("w", w), ("k", 1000.0), ("wk", w * 1000.0), ("off", offset))]
    nodes = [helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["f", "w"], ["a"]), helper.make_node("Mul", ["a", "k"], ["b"]),
             helper.make_node("Mul", ["f", "wk"], ["c"]), helper.make_node("Sub", ["b", "c"], ["d"]),
             helper.make_node("Add", ["d", "off"], ["e"]), helper.make_node("Cast", ["e"], ["y"], to=TensorProto.FLOAT16)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [6])], consts)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["right", "wrong"])
def test_a_low_precision_graph_off_its_dtypes_reference_is_judged_against_fp32(tmp_path, offset):
    """fp16 PyTorch is one rounding of the function, the graph another: where they land apart past fp16's tolerance,
    the step is judged by the same rule against the reference computed in fp32 (reference.streamed.widened), and
    recorded so; a graph that is wrong stays failed, and the reference keeps its fp16 tensors after."""
    path = tmp_path / "g.onnx"
    onnx.save(_fp32_cancel(offset), str(path))
    x = torch.tensor([3.0, 2.9, 1.7, 0.7, 2.2, 5.1], dtype=torch.float16)
    module = _Cancel()
    spec = GraphSpec("g", module, ["x"], ["y"], {}, (x,), lambda: [{"x": x}])
    own, _ = validate.compare("g", {"y": validate.run(validate.open_session(path, ["CPUExecutionProvider"]),
                                                       {"x": x.numpy()}, ["y"])["y"]},
                              {"y": module(x)[0].numpy()}, "float16", 0)
    assert own  # fp16 PyTorch itself is past fp16's tolerance from the fp32-computed graph
    failures, report = validate.validate_graph(spec, path, "float16")
    if offset == 0.0:
        assert not failures and report["step0"]["judged_against_fp32"]["own_dtype_failures"]
    else:
        assert failures and "judged_against_fp32" not in report["step0"]
    assert module.w.dtype == module.k.dtype == torch.float16  # put back after the fp32 pass
