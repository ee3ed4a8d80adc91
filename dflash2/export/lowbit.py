"""ONNX Runtime's int4 / int8 weights for the standard-op targets on the dense KV binding (muse_glimmer.py,
gpt_oss.py): `dflash2-export --quantize int4|int8` of those families.

The same graphs as their fp32 templates, with the weights quantized as they are read (a templates.Builder given the
OrtQuant: every weight MatMul a MatMulNBits, ONNX Runtime's own block quantizer, memory bounded by one tensor), as
the Qwen3.5 hybrid's fused build does (qwen3_5.build_fused):
- the embedding with int4 as GatherBlockQuantized over the same int4 blocks along H (qwen3_5._embed); with int8 an
  fp32 Gather (ONNX Runtime's GatherBlockQuantized takes 4-bit blocks only here);
- the LM head as MatMulNBits over the [H, V] transpose written one vocabulary slice at a time, unless
  --quant-keep-head (then the fp32 Gemm, which reads the fp32 embedding when the head is tied);
- the router (gpt-oss) never quantized: a quantized router would change which experts run.
The portable flavour only: contrib ops, so the TensorRT flavour is not for use (the export keeps one graph). The
row check (k-row verify == 1-row decodes, bitwise) holds because MatMulNBits computes every row alone (int8
activations quantized per row at accuracy level 4) and GatherBlockQuantized is a lookup.
"""

from __future__ import annotations

from dflash2.export.qwen3_5 import _embed


def check(family: str, quant, data) -> None:
    """The one refusal the builders share: a quantized build writes through a DataFile with blockwise weights."""
    if quant is not None and (data is None or quant.dynamic):
        raise ValueError(f"{family} fused: a quantized build writes through a DataFile, int4 / int8 (not dynamic), "
                         f"found {'no DataFile' if data is None else quant.method}")


def embed(b, src, quant, matrix, ids: str) -> str:
    """The embedding rows [n, H] of `ids`: GatherBlockQuantized with int4 weights, else the fp32 Gather."""
    return _embed(b, src, quant, matrix, ids)


def head(b, y: str, c, src, quant, matrix) -> str:
    """y [n, H] -> the raw logits [n, V] fp32: MatMulNBits over the head's transpose when quant quantizes the head
    (one vocabulary slice at a time), else the fp32 Gemm over the head's rows (the embedding's when tied: the fp32
    matrix already written when the lookup was a plain Gather, written here when it was GatherBlockQuantized)."""
    name = "embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    if quant is not None and quant.lm_head:
        return b.matmul_nbits(y, "lm_head", (c.hidden_size, c.vocab_size), (r.T for r in src.row_chunks(name)))
    rows = name if name in b.names else matrix(name)
    return b.head(y, rows, "lm_head")
