"""The Q4MatMul custom op (plugins/dflash2Q4MatMul) and the cpu_q4 flavour it runs in (dflash2.export.q4_flavour):
the kernel against ONNX Runtime's MatMulNBits on the same weights, a k-row call against k one-row calls bit for bit
(through ONNX Runtime's thread pool), refusals in one line, and an int4 export that writes, checks and runs the
flavour losslessly. Skipped where the library is not built or the CPU lacks AVX512-VNNI (a failure in CI,
DFLASH2_REQUIRE_PLUGINS=1, when it is not built)."""

import hashlib
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.export import q4_flavour
from dflash2.export import quantize as qz
from dflash2.export.api import export
from dflash2.native import q4
from dflash2.onnxrt import open_session
from dflash2.runtime.api import Runtime
from dflash2.speculative import generate

PROMPTS = [[5, 17, 42, 99, 7], list(range(40, 90))]


@pytest.fixture(scope="module", autouse=True)
def usable():
    reason = q4.why_not()
    if reason is None:
        return
    if os.environ.get("DFLASH2_REQUIRE_PLUGINS") == "1" and q4.find() is None:
        pytest.fail(f"DFLASH2_REQUIRE_PLUGINS=1 but {reason}")
    pytest.skip(reason)


def weights(k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8),
            (rng.random((n, k // 32), dtype=np.float32) * 0.02 + 1e-3))


def model(op: str, k: int, n: int, b, s, **attrs) -> bytes:
    return q4.model(k, n, [(b, s)], op=op, x_dims=("b", "m"), **attrs)


def session(blob: bytes, threads: int = 1, custom: bool = True):
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    if custom:
        q4.register(o)
    return ort.InferenceSession(blob, o, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("k,n", [(64, 16), (96, 40), (576, 960), (1536, 576), (576, 4099)])
def test_kernel_matches_matmulnbits(k, n):
    """The same arithmetic as MatMulNBits at accuracy level 4 (int8 activations per block of 32): only the fp32
    summation order differs. K = 96 and 576 end in a part-filled 128-weight load, N = 4099 in a part tile; 1, 2
    and 7 rows take the one-column walk, a two-row tile and three-row tiles with a one-row remainder."""
    b, s = weights(k, n)
    ref = session(model("MatMulNBits", k, n, b, s), custom=False)
    for m in (1, 2, 7):
        x = np.random.default_rng(m).standard_normal((1, m, k)).astype(np.float32)
        want = ref.run(None, {"x": x})[0][0]
        got = q4.matmul(x[0], b, s)
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), m
        assert not np.array_equal(got, np.zeros_like(got))


@pytest.mark.parametrize("threads,m,n", [(1, 17, 3072), (2, 17, 3072), (2, 40, 3070)])
def test_rows_bitwise_through_onnx_runtime(threads, m, n):
    """A k-row call equals k one-row calls bit for bit, with the rows split over ONNX Runtime's pool: what the
    export's row check (and a lossless verify) rests on. 40 rows quantize their activations over the pool too;
    N = 3070 ends in two columns outside the 4-column tile."""
    k = 576
    b, s = weights(k, n, seed=2)
    sess = session(model(q4.OP, k, n, b, s), threads)
    x = np.random.default_rng(3).standard_normal((1, m, k)).astype(np.float32)
    rows = sess.run(None, {"x": x})[0]
    ones = np.concatenate([sess.run(None, {"x": x[:, i:i + 1]})[0] for i in range(m)], axis=1)
    assert rows.shape == (1, m, n) and np.array_equal(rows, ones)
    np.testing.assert_array_equal(rows[0], q4.matmul(x[0], b, s))  # the pool's split changes nothing


@pytest.mark.parametrize("attrs,said", [({"accuracy_level": 0}, "accuracy_level 4 (int8 activations) expected, found 0"),
                                        ({"block_size": 64}, "bits 4 and block_size 32 expected, found 4 and 64")])
def test_refuses_what_it_does_not_compute(attrs, said):
    b, s = weights(64, 8)
    with pytest.raises(Exception, match=said.replace("(", r"\(").replace(")", r"\)")):
        session(model(q4.OP, 64, 8, b, s, **attrs)).run(None, {"x": np.ones((1, 1, 64), np.float32)})


def test_a_graph_with_the_op_where_it_cannot_run(tmp_path, monkeypatch):
    """Opening a Q4MatMul graph where the op is off (or not built, or the CPU lacks VNNI): one line naming the file."""
    b, s = weights(64, 8)
    path = tmp_path / "g.onnx"
    path.write_bytes(model(q4.OP, 64, 8, b, s))
    monkeypatch.setenv(q4.OFF_VAR, "0")
    with pytest.raises(Dflash2Error, match=f"g.onnx: a graph with ai.dflash2.Q4MatMul nodes cannot run here: "
                                           f"{q4.OFF_VAR}=0"):
        open_session(path)


def test_rewrite_keeps_the_data_file(tmp_path):
    """The flavour is the portable graph with its convertible nodes renamed, reading the same external data file
    (not rewritten); a node with zero points, or another block size, stays MatMulNBits."""
    b, s = weights(64, 8)
    nodes = [helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=64, N=8, bits=4,
                              block_size=32, accuracy_level=4),
             helper.make_node("MatMulNBits", ["x", "w", "s", "zp"], ["z"], domain="com.microsoft", K=64, N=8, bits=4,
                              block_size=32, accuracy_level=4)]
    zp = numpy_helper.from_array(np.full((8, 1), 0x88, np.uint8), "zp")
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, 8]) for o in "yz"],
                          [numpy_helper.from_array(b, "w"), numpy_helper.from_array(s, "s"), zp])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(m, str(tmp_path / "p.onnx"), save_as_external_data=True, location="p.onnx.data", size_threshold=0)
    before = hashlib.sha256((tmp_path / "p.onnx.data").read_bytes()).hexdigest()
    name = q4_flavour.rewrite(tmp_path, "p.onnx")
    assert name == "p.q4.onnx"
    assert hashlib.sha256((tmp_path / "p.onnx.data").read_bytes()).hexdigest() == before
    ops = [(n.op_type, n.domain) for n in onnx.load(str(tmp_path / name), load_external_data=False).graph.node]
    assert ops == [(q4.OP, q4.DOMAIN), ("MatMulNBits", "com.microsoft")]
    x = np.random.default_rng(4).standard_normal((1, 64)).astype(np.float32)
    want, got = open_session(tmp_path / "p.onnx").run(None, {"x": x}), open_session(tmp_path / name).run(None, {"x": x})
    np.testing.assert_array_equal(want[1], got[1])  # the zero-point node: the same kernel
    assert np.abs(want[0] - got[0]).max() <= 2e-6 * np.abs(want[0]).max()


@pytest.fixture(scope="module")
def int4(tmp_path_factory, pairs):
    out = tmp_path_factory.mktemp("q4") / "int4"
    export(*pairs[("llama", 2)], out, max_seq_len=256, quiet=True, quantize=qz.OrtQuant("int4"))
    return out


def test_export_writes_checks_and_runs_the_flavour(int4):
    """The int4 export carries target.q4.onnx (sealed, checked against the portable graph, the row check run on it),
    the runtime opens it, and speculative decoding on it equals its own autoregressive decoding."""
    m = mf.load(int4)
    assert m.graphs["target"].flavours.cpu_q4 == "target.q4.onnx"
    assert m.graphs["target"].data == "target.onnx.data"  # the same weights, once
    v = m.validation[f"target.{mf.Q4_FLAVOUR}"]
    assert v.ok and v.steps["outputs"] > 0 and 0.0 < v.steps["worst_share"] <= q4_flavour.SHARE
    assert v.steps["nodes"] > 0 and v.steps["node_max_rel"] <= q4_flavour.NODE_TOLERANCE
    assert m.validation[mf.ROW_CHECK].ok and not m.validation[mf.ROW_CHECK].skipped
    rt = Runtime(int4)
    assert rt.graph_files["target"] == "target.q4.onnx"
    for ids in PROMPTS:
        ar = generate(rt.session, ids, 24, rt.eos_ids, speculative=False)
        sp = generate(rt.session, ids, 24, rt.eos_ids, schedule=rt.schedule("auto"))
        assert sp.ids == ar.ids and len(ar.ids) > 0


def test_off_runs_the_portable_graph(int4, monkeypatch):
    monkeypatch.setenv(q4.OFF_VAR, "0")
    rt = Runtime(int4)
    assert rt.graph_files["target"] == "target.onnx"
    out = generate(rt.session, PROMPTS[0], 8, rt.eos_ids, speculative=False)
    assert len(out.ids) == 8 or out.ids[-1] in rt.eos_ids  # the new ids


def test_a_swapped_flavour_is_refused(int4, tmp_path, pairs):
    """The flavour is checked against the manifest like any graph file ONNX Runtime opens: a fp32 export's target
    put in its place (the file table rewritten and resealed, a forgery the seal cannot catch) is refused, the file
    named."""
    import hashlib

    from dflash2.runtime.graphcheck import GraphMismatchError
    from tests.exports import edit_manifest

    fp32 = tmp_path / "fp32"
    export(*pairs[("llama", 2)], fp32, max_seq_len=256, quiet=True)
    forged = tmp_path / "forged"
    shutil.copytree(int4, forged)
    for src, dst in (("target.onnx", "target.q4.onnx"), ("target.onnx.data", "target.onnx.data")):
        (forged / dst).unlink()
        shutil.copyfile(fp32 / src, forged / dst)

    def edit(d):
        for n in ("target.q4.onnx", "target.onnx.data"):
            d["files"][n] = {"sha256": hashlib.sha256((forged / n).read_bytes()).hexdigest(),
                             "bytes": (forged / n).stat().st_size}

    edit_manifest(forged, edit)
    with pytest.raises(GraphMismatchError, match="target.q4.onnx: the manifest does not describe this target graph"):
        rt = Runtime(forged)
        generate(rt.session, PROMPTS[0], 4, rt.eos_ids, speculative=False)


def test_export_without_the_op_writes_no_flavour(pairs, tmp_path, monkeypatch):
    monkeypatch.setenv(q4.OFF_VAR, "0")
    out = tmp_path / "int4"
    export(*pairs[("llama", 2)], out, max_seq_len=256, quiet=True, quantize=qz.OrtQuant("int4"))
    m = mf.load(out)
    assert m.graphs["target"].flavours.cpu_q4 is None and not (out / "target.q4.onnx").exists()
    assert f"target.{mf.Q4_FLAVOUR}" not in m.validation


def test_past_the_budget_each_node_is_checked(pairs, tmp_path, monkeypatch):
    """A target validated on a truncated build has no whole-graph feeds: its flavour is checked node by node on its
    own weights, and the record says the whole graph was not compared."""
    from dflash2.export import stages

    monkeypatch.setattr(stages, "WHOLE_GRAPH_BYTES", 0)
    out = tmp_path / "int4"
    export(*pairs[("llama", 2)], out, max_seq_len=256, quiet=True, quantize=qz.OrtQuant("int4"))
    v = mf.load(out).validation[f"target.{mf.Q4_FLAVOUR}"]
    assert v.ok and v.steps["nodes"] > 0 and v.steps["node_max_rel"] <= q4_flavour.NODE_TOLERANCE
    assert v.steps["graph"].startswith("not compared whole: no target.inputs.json") and "outputs" not in v.steps
