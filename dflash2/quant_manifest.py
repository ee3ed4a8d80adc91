"""The manifest's `quantization` section as a label and one line, for dflash2-export, -run and -bench.

No onnx, no torch (the runtime prints it on edge boards).
"""

from __future__ import annotations

SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# the op types of a quantized ONNX Runtime graph: MatMulNBits (weight-only blocks, int4 / int8), or a drafter's
# DynamicQuantizeMatMul (--quant-drafter int8-dynamic); written by the export, checked by the runtime
QUANT_OPS = ("MatMulNBits", "DynamicQuantizeMatMul")
DYNAMIC = "int8-dynamic"  # DynamicQuantizeMatMul's method: activations quantized per tensor, so the drafter's only


def graph_method(q, graph: str) -> str:
    """The method graph `graph` of a quantization `q` (a manifest Quantization) was written with: the drafter's own
    where the export gave it one (--quant-drafter), else the export's."""
    return (getattr(q, "drafter_method", None) if graph == "drafter" else None) or q.method


def quant_op(q, graph: str) -> str:
    """The op type graph `graph` of an ONNX Runtime quantization `q` is written with."""
    return "DynamicQuantizeMatMul" if graph_method(q, graph) == DYNAMIC else "MatMulNBits"


def label(manifest) -> str:
    """'int4', 'int8', 'int4_awq', 'fp8' for a quantized export or engine folder, else 'fp32' / 'fp16' / 'bf16'.
    manifest: a dflash2.manifest.ExportManifest or EngineManifest."""
    q = manifest.quantization
    return q.method if q else SHORT_DTYPES.get(manifest.dtype, manifest.dtype)


def describe(manifest) -> str:
    """One line: the method, its parameters, the graphs it covers, and the deviation the export measured."""
    q = manifest.quantization
    if not q:
        return f"quantization: none ({manifest.dtype} weights){attention(manifest)}"
    parts = [q.format]
    if q.block_size:
        parts.append(f"block {q.block_size}")
    if q.accuracy_level is not None:
        parts.append(f"accuracy level {q.accuracy_level}")
    if q.calibration:
        parts.append(f"calibrated on {q.calibration}")
    head = "" if q.lm_head else ", LM heads kept fp32"
    own = [x for x in (getattr(q, "drafter_method", None),
                       f"block {q.drafter_block_size}" if getattr(q, "drafter_block_size", None) else None) if x]
    if own and "drafter" in q.graphs:
        head += f"; the drafter {' '.join(own)}"
    target = (getattr(manifest, "validation", None) or {}).get("target")
    top1 = target.deviation.top1_agreement if target is not None and target.deviation else None
    dev = (f"; top-1 agreement with fp32 {100 * top1:.0f}% on the export's validation feeds (random ids, the "
           f"hardest case: on chat text it is higher, dflash2-bench-quant measures it)" if top1 is not None else "")
    return f"quantization: {q.method} ({', '.join(parts)}) in {', '.join(q.graphs)}{head}{dev}{attention(manifest)}"


def attention(manifest) -> str:
    """'; target attention: gqa (...)' when the target graph is ONNX Runtime's fused-op one, else ''."""
    kv = getattr(manifest, "kv", None)
    if kv is None or kv.target_attention == "plain":
        return ""
    return f"; target graph: {kv.target_attention} (ONNX Runtime's GroupQueryAttention, KV shared in place)"
