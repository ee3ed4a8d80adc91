"""The plain target (standard ONNX ops, both flavours) from the layer templates: checked against the PyTorch
reference by the one comparison rule on the target's validation feeds, fp32, fp16 and bf16, Llama (biased,
untied) and Qwen3 (q/k norms, tied); one data file for both flavours; a wrong graph is caught."""

from __future__ import annotations

import dataclasses

import onnx
import pytest
import torch

from dflash2 import dtypes, tiny
from dflash2.checkpoint import Weights
from dflash2.export import plain
from dflash2.export import trace as tr
from dflash2.export import weights as W
from dflash2.export.graphs import graph_specs
from dflash2.export.validate import validate_graph
from dflash2.reference.load import load_pair

CASES = [("llama", False, True, "float32"), ("qwen3", True, False, "float32"), ("qwen3", False, False, "float16"),
         ("llama", False, True, "bfloat16"), ("qwen3", True, False, "bfloat16")]


def _build(root, family, tied, bias, dtype, config=None):
    tgt = tiny.make_target(root / "target", family=family, tie_word_embeddings=tied, attention_bias=bias)
    drf = tiny.make_drafter(root / "drafter", tgt, version=2)
    target, drafter = load_pair(drf, tgt, dtypes.torch_dtype(dtype))
    spec = graph_specs(target, drafter, True)[0]
    with W.DataFile(root / "target.onnx.data") as data:
        port, fixed = plain.build(config or target.config, drafter.config, Weights(tgt), Weights(drf), True, dtype,
                                  data)
    onnx.save_model(port, str(root / "target.onnx"))
    onnx.save_model(fixed, str(root / "target.trt.onnx"))
    return spec, target


@pytest.mark.parametrize("family,tied,bias,dtype", CASES)
def test_both_flavours_match_the_reference(tmp_path, family, tied, bias, dtype, monkeypatch):
    from dflash2.export import validate

    monkeypatch.setattr(validate.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])  # bf16: emulated
    spec, _ = _build(tmp_path, family, tied, bias, dtype)
    for f in ("target.onnx", "target.trt.onnx"):
        onnx.checker.check_model(str(tmp_path / f), full_check=True)  # standard ops only: TensorRT's parser input
    failures, report = validate_graph(spec, tmp_path / "target.onnx", dtype)
    assert failures == [] and {"step0", "step1"} <= set(report)
    if dtype == "bfloat16":  # on the emulation here (no bf16 kernels on the CPU provider), said in the report
        assert report["emulated"].startswith("bf16 emulated"), report
    failures, trt = validate_graph(spec.tensorrt, tmp_path / "target.trt.onnx", dtype)  # stale rows past past_len
    assert failures == [] and "skipped" not in trt and "skipped" not in report
    assert tr.io_spec(tmp_path / "target.onnx")["inputs"] == [
        {"name": "input_ids", "dtype": "int32", "shape": ["n"]},
        {"name": "past_kv", "dtype": dtype, "shape": ["past", *spec.example[1].shape[1:]]}]
    stores = {m.graph.name: {(t.name, tuple((e.key, e.value) for e in t.external_data)) for t in m.graph.initializer
                             if t.data_location == onnx.TensorProto.EXTERNAL}
              for m in (onnx.load(str(tmp_path / f), load_external_data=False) for f in ("target.onnx", "target.trt.onnx"))}
    a, b = stores.values()
    assert a == b and a  # the same tensors at the same offsets of one file


def test_a_wrong_graph_is_caught(tmp_path):
    from dflash2.config import load_target_config

    wrong = dataclasses.replace(load_target_config(tiny.make_target(tmp_path / "probe")), rms_norm_eps=0.5)
    spec, _ = _build(tmp_path, "llama", False, False, "float32", config=wrong)
    failures, _ = validate_graph(spec, tmp_path / "target.onnx", "float32")
    assert any(f.startswith("target.context") or f.startswith("target.logits") for f in failures), failures


def test_an_export_with_the_shortest_max_seq_len_validates(tmp_path):
    """--max-seq-len B + 2 is accepted, and the target's validation feeds reach position 11 + B: the graph has no
    position table sized by the capacity to run off (a Gather out of range would fail the export)."""
    from dflash2 import manifest as mf
    from dflash2.config import load_drafter_config
    from dflash2.export.api import export

    drf, tgt = tiny.make_pair(tmp_path / "pair")
    B = load_drafter_config(drf).block_size
    export(drf, tgt, tmp_path / "out", max_seq_len=B + 2, quiet=True)
    m = mf.load(tmp_path / "out")
    assert m.max_seq_len == B + 2 and m.validation["target"].ok and m.validation["target.trt"].ok


def test_fp16_references_keep_fp32_rotary_frequencies(tmp_path):
    """.to(float16) would round inv_freq (0.24 rad off at position 2,000); the references keep it fp32, as the
    graph computes the angles, and the streamed fp16 reference equals the loaded one."""
    from dflash2.reference.load import load_streamed_pair

    drf, tgt = tiny.make_pair(tmp_path / "pair")
    loaded, ld = load_pair(drf, tgt, torch.float16)
    streamed, sd = load_streamed_pair(drf, tgt, dtype=torch.float16)
    assert loaded.inv_freq.dtype == streamed.inv_freq.dtype == ld.inv_freq.dtype == sd.inv_freq.dtype == torch.float32
    ids, past = torch.arange(7), torch.zeros(0, *loaded.kv_row_shape(), dtype=torch.float16)
    with torch.no_grad():
        a, b = loaded(ids, past), streamed(ids, past)
    assert all(x.dtype == torch.float16 and torch.equal(x, y) for x, y in zip(a, b))


def test_a_target_past_the_budget_is_checked_truncated_and_said_so(tmp_path, pairs, monkeypatch):
    """Past WHOLE_GRAPH_BYTES the plain target is validated as a truncated build of the same templates (both
    flavours, the real embedding and head), the whole graph recorded as not run, with why; ids stay those of
    target-only decoding. A template that breaks still fails there, and the export keeps nothing."""
    from dflash2.errors import ValidationError
    from dflash2.export import stages, validate
    from dflash2.export.api import export
    from dflash2.runtime.api import Runtime
    from dflash2.speculative import generate

    monkeypatch.setattr(stages, "WHOLE_GRAPH_BYTES", 0)
    m = export(*pairs[("qwen3", 2)], tmp_path / "out", max_seq_len=64, quiet=True)
    v = m.validation
    assert v["target.truncated"].ok and v["target.truncated.trt"].ok
    assert v["drafter.truncated"].ok and v["drafter.truncated.trt"].ok
    assert not v["target"].ok and "not run whole" in v["target"].skipped and v["target"].failures == []
    assert not v["target.trt"].ok and "target.truncated.trt" in v["target.trt"].skipped
    assert not v["drafter"].ok and "drafter.truncated (1 of 2 layers" in v["drafter"].skipped
    assert not v["drafter.trt"].ok and "drafter.truncated.trt" in v["drafter.trt"].skipped
    assert v["selector"].ok
    assert not any("truncated" in p.name for p in (tmp_path / "out").iterdir())
    rt = Runtime(tmp_path / "out")
    prompt = [3, 9, 27, 81]
    assert generate(rt.session, prompt, 24).ids == generate(rt.session, prompt, 24, speculative=False).ids
    monkeypatch.setitem(validate.TOLERANCES, "float32", (0.0, 0.0))
    with pytest.raises(ValidationError) as e:
        export(*pairs[("qwen3", 2)], tmp_path / "bad", max_seq_len=64, quiet=True)
    assert "target.truncated" in str(e.value) and not (tmp_path / "bad").exists()


def test_the_truncated_drafter_keeps_every_kind_of_layer():
    import types

    from dflash2.export.stages import truncated_drafter

    def dc(causal, window):
        return types.SimpleNamespace(num_layers=len(causal), layer_causal=tuple(causal), layer_window=tuple(window))

    same = dc([False] * 5, [2048] * 5)
    assert truncated_drafter(_dc(same)).num_layers == 1
    mixed = dc([True, True, False], [4, 4, None])
    short = truncated_drafter(_dc(mixed))
    assert short.num_layers == 3 and short.layer_window == (4, 4, None)
    three = dc([True, False, False, True], [4, None, 8, 4])  # three kinds: the third first appears at layer 2
    assert truncated_drafter(_dc(three)).num_layers == 3


def _dc(ns):
    """A real DrafterConfig with these layer kinds (dataclasses.replace needs the dataclass)."""
    from dflash2.config import load_drafter_config

    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp())
    d, _ = tiny.make_pair(root / "p", num_layers=ns.num_layers)
    c = load_drafter_config(d)
    return dataclasses.replace(c, layer_causal=ns.layer_causal, layer_window=ns.layer_window)
