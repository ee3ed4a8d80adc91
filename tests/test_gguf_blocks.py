"""A quantized GGUF's own blocks in MatMulNBits (dflash2.gguf_blocks, `dflash2-export --quant-from-gguf`):
each ggml type maps exactly (against gguf-py's own dequantizer and ONNX Runtime's kernel), llama's q / k rows
come back in HF order, a GGUF of another model is refused naming the tensor, and an export of a tiny target
written as Q4_1 carries its blocks unchanged and stays lossless."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

gguf = pytest.importorskip("gguf", reason="the smollm2 extra (gguf) is not installed")
from gguf import quants  # noqa: E402

from dflash2 import tiny  # noqa: E402
from dflash2.checkpoint import Weights  # noqa: E402
from dflash2.errors import CheckpointError  # noqa: E402
from dflash2.export import quantize as qz  # noqa: E402
from dflash2.export.api import export  # noqa: E402
from dflash2.gguf_blocks import GgufBlocks, _unpermute, from_ggml  # noqa: E402
from dflash2.runtime.api import Runtime  # noqa: E402
from dflash2.speculative import generate  # noqa: E402

TYPES = ["Q4_1", "Q4_0", "Q8_0"]


def _nbits(blocks, x: np.ndarray, accuracy: int) -> np.ndarray:
    N, K = blocks.shape
    inits = [numpy_helper.from_array(blocks.packed, "B"), numpy_helper.from_array(blocks.scales.reshape(-1), "s")]
    ins = ["x", "B", "s"]
    if blocks.zero_points is not None:
        inits.append(numpy_helper.from_array(blocks.zero_points.reshape(-1), "z"))
        ins.append("z")
    node = helper.make_node("MatMulNBits", ins, ["y"], domain="com.microsoft", K=K, N=N, bits=blocks.bits,
                            block_size=32, accuracy_level=accuracy)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_maps_exactly(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    w[3, :32] = 0.25  # a constant block (Q4_1: d = 0)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = quants.quantize(w, qtype)
    want = quants.dequantize(raw, qtype)  # gguf-py's (llama.cpp's) dequantization
    b = from_ggml(kind, raw)
    scale = float(np.abs(want).max())
    assert np.abs(b.dequantized() - want).max() <= 4 * np.finfo(np.float32).eps * scale
    x = np.eye(96, dtype=np.float32)  # one-hot rows: the kernel's own dequantized weights, column by column
    for acc in (0, 4):
        assert np.abs(_nbits(b, x, acc) - want.T).max() <= 1e-6 * scale, acc


def test_unpermute_inverts_the_llama_q_k_permutation():
    """convert_hf_to_gguf's permute (reshape heads, 2, half; swap) undone by _unpermute's row order."""
    heads, N = 4, 32
    hf = np.arange(N * 3).reshape(N, 3)
    stored = hf.reshape(heads, 2, N // heads // 2, 3).swapaxes(1, 2).reshape(N, 3)  # what llama.cpp writes
    assert np.array_equal(stored[_unpermute(heads, N)], hf)


def _write_gguf(path, target_dir, kind="Q4_1", seed_offset=0.0):
    """A GGUF of the tiny llama target as convert_hf_to_gguf writes one: q / k rows permuted, matrices in `kind`,
    the embedding Q8_0. Returns the dequantized HF-order tensors (what the target's checkpoint must then hold)."""
    c = json.loads((target_dir / "config.json").read_text())
    w = Weights(target_dir)
    writer = gguf.GGUFWriter(str(path), "llama")
    deq = {}
    names = {"embed_tokens.weight": ("token_embd.weight", "Q8_0")}
    if not c.get("tie_word_embeddings", False):
        names["lm_head.weight"] = ("output.weight", "Q8_0")
    for i in range(c["num_hidden_layers"]):
        for hf, short in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                          ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                          ("mlp.down_proj", "ffn_down")):
            names[f"layers.{i}.{hf}.weight"] = (f"blk.{i}.{short}.weight", kind)
    for hf, (g, k) in names.items():
        a = w.get(hf) + np.float32(seed_offset)
        heads = {"attn_q": c["num_attention_heads"], "attn_k": c["num_key_value_heads"]}.get(g.split(".")[2] if "blk" in g else "")
        if heads:
            N = a.shape[0]
            a = a.reshape(heads, 2, N // heads // 2, -1).swapaxes(1, 2).reshape(a.shape)
        qt = getattr(gguf.GGMLQuantizationType, k)
        raw = quants.quantize(a, qt)
        writer.add_tensor(g, raw, raw_shape=raw.shape, raw_dtype=qt)
        d = quants.dequantize(raw, qt)
        deq[hf] = d if not heads else d[_unpermute(heads, d.shape[0])]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return deq


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """A tiny llama pair whose target checkpoint IS the dequantized GGUF (as dflash2-prepare-smollm2 makes one)."""
    import torch

    root = tmp_path_factory.mktemp("gguf")
    d, t = tiny.make_pair(root / "pair", family="llama", version=2)
    deq = _write_gguf(root / "target.Q4_1.gguf", t)
    tensors = {k: torch.from_numpy(Weights(t).get(k)) for k in Weights(t).where}
    for hf, a in deq.items():
        tensors[hf if hf in tensors else f"model.{hf}"] = torch.from_numpy(np.ascontiguousarray(a))
    tiny.write_safetensors(t, tensors)
    return d, t, root


def test_export_carries_the_blocks_unchanged_and_stays_lossless(tmp_path, gguf_pair):
    d, t, root = gguf_pair
    q = qz.OrtQuant("int4", native=str(root / "target.Q4_1.gguf"))
    m = export(d, t, tmp_path / "native", max_seq_len=128, quiet=True, quantize=q)
    rep = m.quantization.graphs["target"]
    L = json.loads((t / "config.json").read_text())["num_hidden_layers"]
    assert rep.native == {"Q4_1": 4 * L, "Q8_0": 1}  # q|k|v, o, gate|up, down per layer; the head
    assert m.quantization.native == q.native
    ref = export(d, t, tmp_path / "requantized", max_seq_len=128, quiet=True, quantize=qz.OrtQuant("int4"))
    near = m.validation["target"].deviation.top1_agreement
    assert near >= ref.validation["target"].deviation.top1_agreement and near >= 0.9  # the fp32 weights, exactly
    rt = Runtime(tmp_path / "native")
    prompt = [5, 9, 14, 2, 7]
    assert generate(rt.session, prompt, 32).ids == generate(rt.session, prompt, 32, speculative=False).ids


def test_a_gguf_of_other_weights_is_refused(tmp_path, gguf_pair):
    d, t, root = gguf_pair
    _write_gguf(tmp_path / "other.gguf", t, seed_offset=0.5)
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_q\.weight: expected blocks that dequantize to"):
        export(d, t, tmp_path / "out", max_seq_len=128, quiet=True,
               quantize=qz.OrtQuant("int4", native=str(tmp_path / "other.gguf")))
    assert not (tmp_path / "out").exists()
    assert GgufBlocks(root / "target.Q4_1.gguf", 4, 2).gguf_name("model.layers.3.mlp.up_proj.weight") == \
        "blk.3.ffn_up.weight"


@pytest.mark.parametrize("args,words", [([], "expected with --quantize int4 or int8, found no --quantize"),
                                        (["--quantize", "int4"], "expected a GGUF file, found nothing there")])
def test_cli_refuses_the_flag_alone_or_a_missing_file(tmp_path, gguf_pair, capsys, args, words):
    from dflash2.cli import export as export_cli
    from tests.errorcheck import one_line_error

    d, t, root = gguf_pair
    gg = root / "target.Q4_1.gguf" if not args else tmp_path / "missing.gguf"
    code = export_cli.main(["--model", str(d), "--target", str(t), "--out", str(tmp_path / "out"), "--quiet",
                            "--quant-from-gguf", str(gg), *args])
    assert code == 2 and words in one_line_error(capsys.readouterr().err, "dflash2-export")
    assert not (tmp_path / "out").exists()


def test_refused_where_it_would_do_nothing(tmp_path, gguf_pair):
    """The blocks go into the fused-op target only: with the plain graph the flag would be silently ignored."""
    from dflash2.folders import OutputError

    d, t, root = gguf_pair
    with pytest.raises(OutputError, match="--quant-from-gguf: expected the fused-op target graph"):
        export(d, t, tmp_path / "out", max_seq_len=128, quiet=True, target_attention="plain",
               quantize=qz.OrtQuant("int4", native=str(root / "target.Q4_1.gguf")))
    assert not (tmp_path / "out").exists()
