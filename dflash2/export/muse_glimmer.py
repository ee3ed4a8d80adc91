"""The Muse-Glimmer text target in standard ONNX ops, both flavours (plain.py's pattern and interface).

What dflash2.reference.muse_glimmer.MuseGlimmerTarget computes, written from the weights tensor by tensor, opset-17
ops only, one pass making the portable graph (KV binding "prefix": `past_kv` the valid rows) and the TensorRT
flavour (binding "fixed": the whole `kv_cache` + `past_len`, stale rows moved after every query); they share every
node and initializer but the prologue (plain._prefix / plain._fixed). Muse-Glimmer's parts:
- the image / video placeholder ids -> 0 before the embedding Gather (every step, generated ids included), the
  weightless RMSNorm after it;
- per layer one MatMul for q | k | v | gate; the scaleless QK norm (q times qk_scale_factor); rotary only on the
  layers whose layer_rope_theta is non-zero (NoPE: none); attention output times sigmoid(gate);
- the zero-centred sandwich norms with their weights as 1 + w (computed in fp32 at export, as transformers does at
  run time; the product taken in fp32), post-attention / post-feedforward at post_norm_eps;
- sliding-window layers: the causal mask narrowed to q - k < sliding_window, over the same full KV rows, or with
  window_kv over their own bounded buffer (`past_window_kv` + `window_base`, new rows in `new_window_kv`; the
  runtime compacts it at commit points: plan section 3.2, runtime/window.py);
- logits = T * tanh(lm_head(y) * output_multiplier / T) in fp32, the argmax over the capped logits.
Outputs as plain.build: next_ids [n] int32, context [n, C], new_kv [n, L, 2, kv, hd], logits [min(n, B), V].
In fp16 / bf16 the reference's own roundings (docs/families/muse_glimmer.md, "fp16 and bf16 graphs"): norms and their
weight products, silu, the scalar scales and the softmax in fp32, rounded once where torch rounds.
The family's `plain` templates (dflash2.families.muse_glimmer; fp32 / fp16 / bf16 graphs) and, through build_fused, its
`fused` ones: the same graph with int4 / int8 weights quantized as written (export/lowbit.py; docs/families/
muse_glimmer.md).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from dflash2 import dtypes
from dflash2.export import lowbit
from dflash2.export import signature as N
from dflash2.export.plain import attend, attention_consts, finish, kv_layout, kv_outputs, kv_row, masks
from dflash2.export.templates import Builder, StandardOps

DTYPES = ("float32", "float16", "bfloat16")


def build_fused(c, dc, src, dsrc, fuse_context: bool, max_seq_len: int, data=None, progress=None, quant=None,
                native=None, window_kv: bool = False) -> onnx.ModelProto:
    """The ONNX Runtime graph of `--quantize int4|int8` (the default attention then: "gqa"): build()'s portable
    flavour with every weight MatMul a MatMulNBits written as it is read (quant: an OrtQuant), the int4 embedding a
    GatherBlockQuantized, the head quantized unless --quant-keep-head (export/lowbit.py); quant None: the fp32
    graph (the export's truncated check). max_seq_len and native (GGUF blocks) are the dense fused builder's
    arguments: unused here; window_kv: build()'s (the sliding layers on the window buffer)."""
    lowbit.check("muse_glimmer", quant, data)
    return build(c, dc, src, dsrc, fuse_context, "float32", data, progress, quant, window_kv=window_kv)[0]


def build(c, dc, src, dsrc, fuse_context: bool, dtype: str = "float32", data=None,
          progress=None, quant=None, window_kv: bool = False) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(portable, TensorRT flavour); c: a MuseGlimmerConfig, dc: the drafter's config, src / dsrc: weights under the
    reference modules' names (dflash2.export.weights), data: a DataFile or None (inline), progress(i, L); quant:
    build_fused's (contrib ops: then the TensorRT flavour is not for use).
    window_kv: the sliding layers' K|V in their own bounded buffer (plain.KvLayout, manifest.WindowSignature)."""
    if dtype not in DTYPES:
        raise ValueError(f"muse_glimmer templates: expected a dtype in {DTYPES}, found {dtype!r}")
    np_dt = dtypes.numpy_dtype(dtype)  # bfloat16: ml_dtypes' (onnx writes it as BFLOAT16)
    onnx_dt = dtypes.onnx_type(dtype)
    if np_dt != np.float32 and quant is not None:
        raise ValueError(f"muse_glimmer templates: the quantized graph is float32, found {dtype!r}")
    nh, kv, hd, L = c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers
    g, eps, post = nh // kv, float(c.rms_norm_eps), float(c.post_norm_eps)
    tap_ids = tuple(dc.target_layer_ids)
    b = Builder(data, quant, dtype=np_dt)
    ops = StandardOps(b, c.rope, hd, eps)
    ax0, ax1 = b.const("axis0", [0]), b.const("axis1", [1])

    def matrix(name: str) -> str:
        return b.chunked(name, src.row_chunks(name), src.shape(name))

    def centred(x: str, name: str, eps: float | None = None) -> str:
        """MuseGlimmerTextCenteredRMSNorm: (1 + w) times the fp32 normalized x, in fp32, then cast (w as a reference
        in the graph dtype holds it)."""
        return ops.norm(x, 1.0 + b.held(src.get(f"{name}.weight")), name, eps=eps, fp32_weight=True)


    n = b.op("Shape", [N.INPUT_IDS], "n")[0]
    n0 = b.op("Squeeze", [n, ax0], "n.scalar", outputs=["n.scalar"])[0]
    b.op("Range", [b.const("zero", 0), n0, b.const("one", 1)], "steps", outputs=["steps"])  # [n]
    prologue_at = len(b.nodes)  # each flavour's prologue: start, pos [n] int64, k_pos [T] int64
    pos = "pos"
    rot = ops.at(pos, "rope")  # [n, 1, hd] each (read by the rotary layers only)
    layout = kv_layout(c.layer_windows, window_kv, "muse-glimmer target")
    visible = masks(b, c.layer_windows, layout, ax0, ax1)  # window -> [n, T] bool (q - k < window on sliding layers)
    consts = attention_consts(b, kv, g, hd, n)
    qk_scale = b.const("qk_scale", [c.qk_scale_factor], np.float32)  # StandardOps.times

    ids = b.op("Cast", [N.INPUT_IDS], "ids.i64", to=TensorProto.INT64)[0]
    media = [b.op("Equal", [ids, b.const(f"media.{m}", m)], f"media.{m}.hit")[0] for m in c.remapped_ids]
    if media:  # image / video placeholders embed as id 0
        hit = media[0] if len(media) == 1 else b.op("Or", media, "media.hit")[0]
        ids = b.op("Where", [hit, b.const("id0", 0), ids], "ids.remapped")[0]
    h = b.op("Gather", [matrix("embed_tokens.weight"), ids], "embed.raw", axis=0)[0] if quant is None else \
        lowbit.embed(b, src, quant, matrix, ids)  # [n, H]
    h = ops.norm(h, None, "embed")  # weightless
    taps, new_kv = {}, []
    for i in range(L):
        p, a = f"layers.{i}", f"layers.{i}.self_attn"
        if progress is not None:
            progress(i, L)
        u = centred(h, f"{p}.input_layernorm")
        proj = b.linear(u, f"{p}.qkvg_proj", src, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj", f"{a}.gate_proj"])
        q, k, v, gate = b.op("Split", [proj, b.const(f"{p}.qkvg_sizes", [nh * hd, kv * hd, kv * hd, nh * hd])],
                             f"{p}.qkvg", outputs=4, axis=-1)
        q = b.op("Reshape", [q, b.const(f"{p}.q_heads", [-1, nh, hd])], f"{p}.q_heads")[0]  # [n, nh, hd]
        k = b.op("Reshape", [k, b.const(f"{p}.k_heads", [-1, kv, hd])], f"{p}.k_heads")[0]  # [n, kv, hd]
        v = b.op("Reshape", [v, b.const(f"{p}.v_heads", [-1, kv, hd])], f"{p}.v_heads")[0]
        q = ops.times(ops.norm(q, None, f"{p}.q_norm"), qk_scale, f"{p}.q_scaled")  # scaleless QK norm
        k = ops.norm(k, None, f"{p}.k_norm")
        if c.layer_rope[i]:  # NoPE layers: no rotary
            q, k = ops.rotate(q, rot, f"{p}.q_rope"), ops.rotate(k, rot, f"{p}.k_rope")
        o = attend(b, ops, p, i, q, k, v, nh, kv, hd, consts, visible[c.layer_windows[i]],
                   slot=layout.slot(i))  # [n, nh hd]
        o = b.op("Mul", [o, b.op("Sigmoid", [gate], f"{p}.gate")[0]], f"{p}.gated")[0]
        o = b.linear(o, f"{p}.o_proj", src, [f"{a}.o_proj"])
        o = centred(o, f"{p}.post_attention_layernorm", eps=post)
        h = b.op("Add", [h, o], f"{p}.attn_residual")[0]
        u = centred(h, f"{p}.pre_feedforward_layernorm")
        m = f"{p}.mlp"
        gate_mlp, up = b.op("Split", [b.linear(u, f"{p}.gate_up_proj", src, [f"{m}.gate_proj", f"{m}.up_proj"]),
                                      b.const(f"{p}.gate_up_sizes", [c.intermediate_size] * 2)], f"{p}.gate_up",
                            outputs=2, axis=-1)
        act = ops.silu(gate_mlp, f"{p}.silu")
        mlp = b.linear(b.op("Mul", [act, up], f"{p}.act")[0], f"{p}.down_proj", src, [f"{m}.down_proj"])
        mlp = centred(mlp, f"{p}.post_feedforward_layernorm", eps=post)
        h = b.op("Add", [h, mlp], f"{p}.mlp_residual")[0]
        new_kv.append(kv_row(b, p, k, v, ax1))  # [n, 1, 2, kv, hd]
        if i in tap_ids:
            taps[i] = h  # the OUTPUT of layer i (HF hidden_states[i + 1])
    kv_outputs(b, new_kv, layout)  # new_kv [n, Lf, 2, kv, hd] (+ new_window_kv [n, Lw, 2, kv, hd])
    Lw = len(layout.windowed)
    window_row = [Lw, 2, kv, hd] if Lw else None
    # the final norm: plain w, the product in fp32 (MuseGlimmerRMSNorm)
    y = ops.norm(h, b.held(src.get("norm.weight")), "norm", fp32_weight=True)
    raw = ops.f32(lowbit.head(b, y, c, src, quant, matrix), "logits.raw")  # [n, V] fp32
    T = float(c.final_logit_softcapping)
    logits = b.op("Mul", [b.op("Tanh", [b.op("Div", [
        b.op("Mul", [raw, b.const("output_multiplier", [c.output_multiplier], np.float32)], "logits.mult")[0],
        b.const("softcap", [T], np.float32)], "logits.over_cap")[0]], "logits.tanh")[0], "softcap"], "logits.capped")[0]
    return finish(b, ops, logits, taps, tap_ids, c, dc, dsrc, fuse_context, [L - Lw, 2, kv, hd], onnx_dt, ax0,
                  "dflash2_muse_glimmer_target", prologue_at, domains=(("com.microsoft", 1),) if quant else (),
                  window_row=window_row)
