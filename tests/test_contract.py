"""One contract for the selector op: the ONNX schema and the torch op are checked against it."""

import onnx
import torch

import dflash2.reference.selector  # noqa: F401
from dflash2.export import selector_onnx as so
from dflash2.ops import contract as C


def test_onnx_schema_matches_contract():
    s = so.op_schema()
    assert (s.name, s.domain, s.since_version) == (C.OP_NAME, C.ONNX_DOMAIN, C.ONNX_OPSET)
    assert [p.name for p in s.inputs] == C.input_names()
    assert [p.name for p in s.outputs] == C.output_names()
    assert set(s.attributes) == {a.name for a in C.ATTRIBUTES} | {"plugin_version", "plugin_namespace"}
    for a in C.ATTRIBUTES:
        assert s.attributes[a.name].required == (a.default is None)
    assert not onnx.defs.has(C.OP_NAME)  # no standard ONNX op has this name (TensorRT dispatches on op_type)


def test_torch_op_matches_contract():
    schema = torch.ops.dflash2.select_path.default._schema
    args = [a.name for a in schema.arguments]
    assert args == C.input_names() + [a.name for a in C.ATTRIBUTES]
    for a in C.ATTRIBUTES:
        arg = next(x for x in schema.arguments if x.name == a.name)
        assert str(arg.type) == {"int": "int", "float": "float", "string": "str"}[a.kind]
        if a.default is not None:
            assert arg.default_value == a.default
    assert len(schema.returns) == len(C.OUTPUTS)


def test_node_builder_fills_defaults_and_plugin_attributes():
    node = so.selector_node(C.input_names(), C.output_names(), {"top_k": 16, "rank": 256})
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["output_multiplier"] == 1.0 and attrs["logit_softcap"] == 0.0 and attrs["mode"] == b"greedy"
    assert attrs["plugin_version"] == C.PLUGIN_VERSION.encode() and attrs["plugin_namespace"] == b""
    int_types = {a.name: a.type for a in node.attribute}
    assert int_types["top_k"] == onnx.AttributeProto.INT  # TensorRT's parser passes INT as int32 fields
