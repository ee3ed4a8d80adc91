"""Export validation's provider branch for bfloat16 graphs: with ONNX Runtime's CUDA provider a bf16
graph is validated on it with bf16 feeds (it used to be opened on the CPU provider with fp32 feeds,
so `dflash2-export --dtype bfloat16` failed on any onnxruntime-gpu machine); without it, skipped."""

from __future__ import annotations

import numpy as np
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


def test_bf16_without_cuda_is_validated_on_its_emulation(bf16_graph, monkeypatch):
    """The CPU provider has no bf16 kernels: the graph runs as bf16_emulation writes it (each bf16 value rounded after
    its node), fed and compared as itself; the copy next to it is removed after."""
    spec, path = bf16_graph
    monkeypatch.setattr(validate.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    failures, report = validate.validate_graph(spec, path, "bfloat16")
    assert failures == [] and report["step0"]["y"]["max_abs"] == 0.0 and "emulated" in report["emulated"]
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def _bf16_in_a_subgraph() -> onnx.ModelProto:
    """y = If(true) { bf16(x) + bf16(x) }: a bf16 value inside a branch, which the emulation does not rewrite."""
    then = helper.make_graph([helper.make_node("Add", ["x", "x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.BFLOAT16, [5])])
    nodes = [helper.make_node("Constant", [], ["c"], value=helper.make_tensor("v", TensorProto.BOOL, [], [True])),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=then)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [5])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [5])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_bf16_that_cannot_be_emulated_is_skipped_with_the_reason(tmp_path, monkeypatch):
    path = tmp_path / "g.onnx"
    onnx.save(_bf16_in_a_subgraph(), str(path))
    x = torch.tensor([1.5, -2.25, 3.0, 0.0078125, 100.0], dtype=torch.bfloat16)
    spec = GraphSpec("g", _Double(), ["x"], ["y"], {}, (x,), lambda: [{"x": x}])
    monkeypatch.setattr(validate.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    failures, report = validate.validate_graph(spec, path, "bfloat16")
    assert failures == [] and "no bfloat16 kernels" in report["skipped"]
    assert "holds bf16 values in a subgraph" in report["skipped"]


def test_bf16_emulation_rounds_every_value_its_node_makes():
    """x * c + d in bf16: the emulation rounds the product before the sum, as a bf16 kernel per node would; fp32
    arithmetic without the rounding step gives other values (so the test can fail), and the io keeps bf16."""
    import ml_dtypes
    import onnxruntime as ort

    from dflash2.export.bf16_emulation import emulated

    c, d = 1.1015625, 0.30078125  # bf16 values
    consts = [helper.make_tensor(n, TensorProto.BFLOAT16, [1], [v]) for n, v in (("c", c), ("d", d))]
    g = helper.make_graph([helper.make_node("Mul", ["x", "c"], ["p"]), helper.make_node("Add", ["p", "d"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [64])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [64])], consts)
    m = emulated(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert not isinstance(m, str)
    assert [v.type.tensor_type.elem_type for v in [*m.graph.input, *m.graph.output]] == [TensorProto.BFLOAT16] * 2
    x = np.random.default_rng(0).standard_normal(64).astype(ml_dtypes.bfloat16)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = validate.run(sess, {"x": x}, ["y"])["y"]  # bf16 through OrtValues (numpy feeds do not take ml_dtypes')
    bf = lambda a: a.astype(ml_dtypes.bfloat16)  # noqa: E731
    x32 = x.astype(np.float32)
    per_node = bf(bf(x32 * np.float32(c)).astype(np.float32) + np.float32(d))
    assert np.array_equal(got.astype(np.float32), per_node.astype(np.float32))
    assert not np.array_equal(per_node.astype(np.float32), bf(x32 * np.float32(c) + np.float32(d)).astype(np.float32))


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


def _fp16_reordered(offset: float) -> onnx.ModelProto:
    """_Cancel's function in another order, each op rounded to fp16 (a Cast pair after it): (x * K) * w - x * (w * K)
    (+ offset: a wrong graph). As far from the exact function as PyTorch's fp16 order, elsewhere."""
    w = float(torch.tensor(1 / 3, dtype=torch.float16))
    consts = [helper.make_tensor(n, TensorProto.FLOAT, [1], [v]) for n, v in
              (("w", w), ("k", 1000.0), ("off", offset))]
    nodes = [helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT)]

    def op(kind: str, a: str, b: str, out: str) -> None:  # one fp16 op: computed in fp32, rounded to fp16
        nodes.extend([helper.make_node(kind, [a, b], [f"{out}.32"]),
                      helper.make_node("Cast", [f"{out}.32"], [f"{out}.16"], to=TensorProto.FLOAT16),
                      helper.make_node("Cast", [f"{out}.16"], [out], to=TensorProto.FLOAT)])
    op("Mul", "f", "k", "xk")
    op("Mul", "xk", "w", "a")
    op("Mul", "w", "k", "wk")
    op("Mul", "f", "wk", "b")
    op("Sub", "a", "b", "d")
    nodes += [helper.make_node("Add", ["d", "off"], ["e"]),
              helper.make_node("Cast", ["e"], ["y"], to=TensorProto.FLOAT16)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [6])], consts)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["right", "wrong"])
def test_a_graph_missing_both_references_is_judged_by_its_dtypes_own_error(tmp_path, offset):
    """Where PyTorch's own fp16 is past fp16's tolerance from the fp32 reference and the graph (fp16 in another order)
    misses both references, the step passes if the graph's error from fp32 is within 3x PyTorch fp16's
    (numerics.within_dtype_error, after torch._dynamo.utils.same's rule), recorded with both errors; a wrong graph
    fails, saying why."""
    path = tmp_path / "g.onnx"
    onnx.save(_fp16_reordered(offset), str(path))
    x = torch.tensor([3.0, 2.9, 1.7, 0.7, 2.2, 5.1], dtype=torch.float16)
    module = _Cancel()
    spec = GraphSpec("g", module, ["x"], ["y"], {}, (x,), lambda: [{"x": x}])
    got = validate.run(validate.open_session(path, ["CPUExecutionProvider"]), {"x": x.numpy()}, ["y"])["y"]
    own, exact = module(x)[0].numpy(), np.zeros(6, np.float32)  # fp32: (x w) K - x (w K) = 0 exactly here
    assert validate.compare("g", {"y": got}, {"y": own}, "float16", 0)[0]  # misses PyTorch's fp16
    assert validate.compare("g", {"y": got}, {"y": exact}, "float16", 0)[0]  # and the fp32 reference
    failures, report = validate.validate_graph(spec, path, "float16")
    if offset == 0.0:
        judged = report["step0"]["judged_by_dtype_error"]
        assert not failures and judged["own_dtype_failures"] and judged["fp32_failures"]
        rmse = judged["outputs"]["y"]["rmse_vs_fp32"]
        assert 0 < rmse["graph"] < rmse["own"]
    else:
        assert failures and "judged_by_dtype_error" not in report["step0"]
        assert any("not within PyTorch float16's own error" in line for line in failures), failures


def test_the_dtype_error_rule_applies_only_where_the_dtype_itself_misses_and_sees_one_bad_row():
    """numerics.within_dtype_error: no excuse where PyTorch's own dtype meets the fixed rule (floats and ids); an
    error confined to one row fails on its row's RMSE where the output's RMSE alone would pass it; shapes never."""
    from dflash2.numerics import within_dtype_error

    rng = np.random.default_rng(0)
    exact = rng.standard_normal((256, 32))
    own = exact + rng.choice([-0.08, 0.08], exact.shape)  # past fp16's 0.05 + 2% everywhere, RMSE 0.08
    assert within_dtype_error(exact + rng.choice([-0.1, 0.1], exact.shape), own, exact, "float16")[0]
    one_row = own.copy()
    one_row[-1] = -exact[-1]  # one row sign-flipped: the whole output's RMSE alone would pass it
    ok, report = within_dtype_error(one_row, own, exact, "float16")
    assert report["rmse_vs_fp32"]["graph"] <= 3 * report["rmse_vs_fp32"]["own"] + 0.005
    assert not ok and report["worst_row_rmse_vs_fp32"]["graph"] > 1
    assert not within_dtype_error(exact + 0.06, exact + 0.001, exact, "float16")[0]  # PyTorch's own within tolerance
    assert within_dtype_error(np.array([0, 1, 2]), np.array([0, 1, 3]), np.array([0, 1, 2]), "float16")[0]
    assert not within_dtype_error(np.array([5, 1, 2, 0]), np.array([0, 1, 2, 0]), np.array([0, 1, 2, 0]),
                                  "float16")[0]  # PyTorch's own ids all exact: the fixed id rule stands
    assert not within_dtype_error(np.zeros(4), np.zeros(3), np.zeros(3), "float16")[0]


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


@pytest.mark.parametrize("dtype, got, want_bad, want_ties", [("float16", [1, 1], 0, 1), ("float16", [2, 1], 1, 0),
                                                             ("float32", [1, 1], 1, 0)],
                         ids=["fp16-near-tie", "fp16-far", "fp32-none"])
def test_next_ids_that_differ_at_a_reference_near_tie_are_ties(dtype, got, want_bad, want_ties):
    """Row 0's best two logits are 0.01 apart: in fp16 / bf16 rounding may pick either (a tie, not a mismatch); a
    pick 5 below the best is a mismatch; fp32 allows none."""
    import numpy as np

    want = {"next_ids": np.array([0, 1], np.int32), "logits": np.array([[5.0, 4.99, 0.0], [1.0, 9.0, 0.0]], np.float32)}
    got = {"next_ids": np.array(got, np.int32), "logits": want["logits"]}
    failures, report = validate.compare("target", got, want, dtype, 0)
    assert report["next_ids"]["mismatches"] == want_bad and report["next_ids"].get("argmax_ties", 0) == want_ties
    assert bool(failures) == (want_bad > 0)


def test_a_bf16_weight_only_gathered_from_stays_bf16_in_the_emulation():
    """An embedding gathered from keeps its bf16 bytes (its fp32 copy would be 5 GB at a real vocabulary): the
    gathered rows are widened; a weight a MatMul reads is widened whole."""
    from dflash2.export.bf16_emulation import emulated

    emb = helper.make_tensor("emb", TensorProto.BFLOAT16, [4, 2], [0.5] * 8)
    w = helper.make_tensor("w", TensorProto.BFLOAT16, [2, 2], [1.0] * 4)
    g = helper.make_graph([helper.make_node("Gather", ["emb", "ids"], ["h"], axis=0),
                           helper.make_node("MatMul", ["h", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3, 2])], [emb, w])
    m = emulated(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    casts = {n.input[0] for n in m.graph.node if n.op_type == "Cast"}
    gather = next(n for n in m.graph.node if n.op_type == "Gather")
    assert gather.input[0] == "emb" and "emb" not in casts and "w" in casts
