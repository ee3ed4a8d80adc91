"""The gpt-oss target in standard ONNX ops, both flavours (plain.py's pattern and interface).

What dflash2.reference.gpt_oss.GptOssTarget computes, written from the weights tensor by tensor, opset-17 ops only,
one pass making the portable graph (KV binding "prefix": `past_kv` the valid rows) and the TensorRT flavour (binding
"fixed": the whole `kv_cache` + `past_len`, stale rows moved after every query); they share every node and
initializer but the prologue (plain._prefix / plain._fixed). gpt-oss's parts:
- attention: one MatMul for q | k | v with their biases, o_proj with its bias; YaRN rotary (the reference's inv_freq
  as a constant, cos and sin both times the rope's attention factor, as GptOssLayer scales them);
- the sinks: one learnt logit per head joins the softmax as an extra score column (no value row), dropped after it
  (the first column: row invariance, below);
- sliding layers: the causal mask narrowed to q - k < sliding_window over the same full KV rows, or with window_kv
  over their own bounded buffer (`past_window_kv` + `window_base`, new rows in `new_window_kv`; the runtime
  compacts it at commit points: plan section 3.2, runtime/window.py), the sink column as on the full layers;
- the mixture of experts in the all-experts form (export/moe.py's standard() idea, gpt-oss's routing and experts):
  router logits with the bias (never quantized), TopK of the LOGITS, softmax over the k kept, scattered into a dense
  [n, E] routing matrix (zeros elsewhere); every expert's gate|up = u @ gate_up_proj[e] + bias (one MatMul per
  expert, columns interleaved: gate even, up odd), the clamped SwiGLU (gate = min(g, limit), up = clip(u, -limit,
  limit), (up + 1) * gate * sigmoid(alpha * gate)) times the expert's routing weight, one down MatMul [E I, H]
  summing over the experts, plus routing weights [n, E] @ the down biases [E, H]. Every expert runs on every row
  (E/k times the routed FLOPs; a zero weight removes its term, the clamp keeps every term finite); 2-D MatMuls only,
  row-invariant as the dense MLP;
- MXFP4 expert weights are decoded exactly as read (reference.gpt_oss.DecodedExperts), one expert at a time into the
  data file (Builder.chunked).
Outputs as plain.build: next_ids [n] int32, context [n, C], new_kv [n, L, 2, kv, hd], logits [min(n, B), V] fp32.
In fp16 / bf16 the reference's own roundings (docs/families/gpt_oss.md, "fp16 and bf16 graphs"): the norms and their
weight products, the rotary factor, the scalar scales, the softmaxes and TopK in fp32, rounded once where torch rounds
(the biased Linears one Gemm, rounded once as addmm; the experts' sum stays a rounding or two apart).
The family's `plain` templates (dflash2.families.gpt_oss; fp32 / fp16 / bf16) and, through build_fused, its `fused`
ones: the same graph with int4 / int8 weights quantized as written (export/lowbit.py) and the experts on QMoE
(export/gpt_oss_qmoe.py: int8 from MXFP4, block-exact); docs/families/gpt_oss.md.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from dflash2 import dtypes
from dflash2.export import lowbit
from dflash2.export import signature as N
from dflash2.export.plain import attend, attention_consts, finish, kv_layout, kv_outputs, kv_row, masks
from dflash2.export.templates import Builder, StandardOps
from dflash2.reference.gpt_oss import DecodedExperts

DTYPES = ("float32", "float16", "bfloat16")


def build_fused(c, dc, src, dsrc, fuse_context: bool, max_seq_len: int, data=None, progress=None, quant=None,
                native=None, window_kv: bool = False) -> onnx.ModelProto:
    """The ONNX Runtime graph of `--quantize int4|int8` (the default attention then: "gqa"): build()'s portable
    flavour with every weight MatMul a MatMulNBits written as it is read (quant: an OrtQuant), the int4 embedding a
    GatherBlockQuantized, the head quantized unless --quant-keep-head (export/lowbit.py), the experts on QMoE
    (gpt_oss_qmoe.quantized_experts); quant None: the fp32 standard-op graph (the export's truncated check).
    max_seq_len and native (GGUF blocks) are the dense fused builder's arguments: unused here."""
    lowbit.check("gpt_oss", quant, data)
    return build(c, dc, src, dsrc, fuse_context, "float32", data, progress,
                 experts_op="standard" if quant is None else "qmoe", quant=quant, window_kv=window_kv)[0]


def build(c, dc, src, dsrc, fuse_context: bool, dtype: str = "float32", data=None, progress=None,
          experts_op: str = "standard", quant=None, window_kv: bool = False) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(portable, TensorRT flavour); c: a GptOssConfig, dc: the drafter's config, src / dsrc: weights under the
    reference modules' names (dflash2.export.weights; an MXFP4 checkpoint's experts decoded as read), data: a
    DataFile or None (inline), progress(i, L). experts_op "qmoe-int8": the experts through ONNX Runtime's QMoE int8
    (export/gpt_oss_qmoe.py; MXFP4 checkpoints; the "TensorRT flavour" then only ONNX Runtime runs); "qmoe": QMoE
    with quant's weights (int8 from MXFP4 where the checkpoint has it). quant: build_fused's.
    window_kv: the sliding layers' K|V in their own bounded buffer (plain.KvLayout, manifest.WindowSignature)."""
    if dtype not in DTYPES:
        raise ValueError(f"gpt-oss templates: expected a dtype in {DTYPES}, found {dtype!r}")
    if dtype != "float32" and (quant is not None or experts_op != "standard"):
        raise ValueError(f"gpt-oss templates: the quantized / QMoE graph is float32, found {dtype!r}")
    if experts_op not in ("standard", "qmoe-int8", "qmoe"):
        raise ValueError(f"gpt-oss templates: experts_op standard, qmoe-int8 or qmoe, not {experts_op}")
    raw = src
    src = DecodedExperts(src)
    nh, kv, hd, L = c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers
    g, eps = nh // kv, float(c.rms_norm_eps)
    tap_ids = tuple(dc.target_layer_ids)
    b = Builder(data, quant, dtype=dtypes.numpy_dtype(dtype))  # bfloat16: ml_dtypes' (written as BFLOAT16)
    ops = StandardOps(b, c.rope, hd, eps)  # rope_inv_freq: YaRN's frequencies for a "yarn" rope
    ax0, ax1 = b.const("axis0", [0]), b.const("axis1", [1])

    def matrix(name: str) -> str:
        return b.chunked(name, src.row_chunks(name), src.shape(name))

    def norm(x: str, name: str) -> str:  # GptOssRMSNorm: (w * x) in fp32, then cast (w as the reference holds it)
        return ops.norm(x, b.held(src.get(f"{name}.weight")), name, fp32_weight=True)

    n = b.op("Shape", [N.INPUT_IDS], "n")[0]
    n0 = b.op("Squeeze", [n, ax0], "n.scalar", outputs=["n.scalar"])[0]
    b.op("Range", [b.const("zero", 0), n0, b.const("one", 1)], "steps", outputs=["steps"])  # [n]
    prologue_at = len(b.nodes)  # each flavour's prologue: start, pos [n] int64, k_pos [T] int64
    pos = "pos"
    rot = ops.at(pos, "rope", scale=c.rope.attention_factor)  # [n, 1, hd] each: YaRN's factor in fp32
    layout = kv_layout(c.layer_windows, window_kv, "gpt-oss target")
    visible = masks(b, c.layer_windows, layout, ax0, ax1)  # window -> [n, T] bool (q - k < window on sliding layers)
    consts = attention_consts(b, kv, g, hd, n, sinks=True)

    h = lowbit.embed(b, src, quant, matrix, N.INPUT_IDS)  # [n, H]: the fp32 Gather unless int4
    taps, new_kv = {}, []
    for i in range(L):
        p, a = f"layers.{i}", f"layers.{i}.self_attn"
        if progress is not None:
            progress(i, L)
        u = norm(h, f"{p}.input_layernorm")
        qkv = b.linear(u, f"{p}.qkv_proj", src, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"], rows=True)  # + biases
        q, k, v = b.op("Split", [qkv, b.const(f"{p}.qkv_sizes", [nh * hd, kv * hd, kv * hd])], f"{p}.qkv",
                       outputs=3, axis=-1)
        q = b.op("Reshape", [q, b.const(f"{p}.q_heads", [-1, nh, hd])], f"{p}.q_heads")[0]  # [n, nh, hd]
        k = b.op("Reshape", [k, b.const(f"{p}.k_heads", [-1, kv, hd])], f"{p}.k_heads")[0]  # [n, kv, hd]
        v = b.op("Reshape", [v, b.const(f"{p}.v_heads", [-1, kv, hd])], f"{p}.v_heads")[0]
        q, k = ops.rotate(q, rot, f"{p}.q_rope"), ops.rotate(k, rot, f"{p}.k_rope")
        o = attend(b, ops, p, i, q, k, v, nh, kv, hd, consts, visible[c.layer_windows[i]],
                   sinks=src.get(f"{a}.sinks"), slot=layout.slot(i))  # [n, nh hd]
        h = b.op("Add", [h, b.linear(o, f"{p}.o_proj", src, [f"{a}.o_proj"], rows=True)], f"{p}.attn_residual")[0]
        u = norm(h, f"{p}.post_attention_layernorm")
        if experts_op != "standard":
            from dflash2.export import gpt_oss_qmoe as qmoe

            mlp = (qmoe.int8_experts(b, u, raw, c, f"{p}.mlp") if experts_op == "qmoe-int8" else
                   qmoe.quantized_experts(b, u, src, c, f"{p}.mlp"))
        else:
            mlp = experts(b, ops, u, src, c, f"{p}.mlp")
        h = b.op("Add", [h, mlp], f"{p}.mlp_residual")[0]
        new_kv.append(kv_row(b, p, k, v, ax1))  # [n, 1, 2, kv, hd]
        if i in tap_ids:
            taps[i] = h  # the OUTPUT of layer i (HF hidden_states[i + 1])
    kv_outputs(b, new_kv, layout)  # new_kv [n, Lf, 2, kv, hd] (+ new_window_kv [n, Lw, 2, kv, hd])
    Lw = len(layout.windowed)
    window_row = [Lw, 2, kv, hd] if Lw else None
    y = norm(h, "norm")
    logits = ops.f32(lowbit.head(b, y, c, src, quant, matrix), "logits")  # [n, V] fp32
    domains = (("com.microsoft", 1),) if experts_op != "standard" or quant is not None else ()
    return finish(b, ops, logits, taps, tap_ids, c, dc, dsrc, fuse_context, [L - Lw, 2, kv, hd],
                  dtypes.onnx_type(dtype), ax0,
                  "dflash2_gpt_oss_target", prologue_at, domains=domains, window_row=window_row)


def experts(b: Builder, ops: StandardOps, u: str, src, c, m: str) -> str:
    """u [n, H] -> the mixture of experts' output [n, H] in the all-experts form (module docstring); m: the block's
    prefix (`layers.{i}.mlp`). The expert weights are written one expert at a time (gate|up: an initializer per
    expert; down: Builder.chunked)."""
    E, H, I, k = c.num_experts, c.hidden_size, c.intermediate_size, c.num_experts_per_tok
    x = f"{m}.experts"
    logits = b.linear(u, f"{m}.router", src, [f"{m}.router"], quantize=False, rows=True)  # [n, E] + bias
    # TopK of the logits widened to fp32 (exact; opset 17's TopK has no bf16), the softmax over the k kept in fp32
    top, idx = b.op("TopK", [ops.f32(logits, f"{m}.router"), b.const(f"{m}.k", [k])], f"{m}.topk", outputs=2,
                    axis=-1)  # [n, k]
    top = b.op("Softmax", [top], f"{m}.softmax", axis=-1)[0]
    # scattered in fp32, then rounded once (the reference's softmax in the logits' dtype; opset 17's ConstantOfShape
    # has no bf16)
    zero = helper.make_tensor("value", TensorProto.FLOAT, [1], [0])
    zeros = b.op("ConstantOfShape", [b.op("Shape", [logits], f"{m}.router.shape")[0]], f"{m}.zeros", value=zero)[0]
    weights = ops.back(b.op("ScatterElements", [zeros, idx, top], f"{m}.weights.f32", axis=1)[0],
                       f"{m}.weights")  # [n, E]: 0 where not kept
    w3 = b.op("Unsqueeze", [weights, b.const(f"{m}.last", [-1])], f"{m}.weights3")[0]  # [n, E, 1]
    # every expert's gate|up as its own [n, H] @ [H, 2I] MatMul (one expert's weights in memory as they are written),
    # joined along the columns; then export/moe.py standard()'s form: 2-D MatMuls only, row-invariant as the dense MLP
    gu = []
    for e in range(E):
        w = b.fw(f"{x}.{e}.gate_up_proj", src.get(f"{x}.gate_up_proj", slice(e, e + 1))[0])  # [H, 2I]
        y = b.op("MatMul", [u, w], f"{x}.{e}.gate_up")[0]
        gu.append(b.op("Add", [y, b.fw(f"{x}.{e}.gate_up_bias", src.get(f"{x}.gate_up_proj_bias")[e])],
                       f"{x}.{e}.gate_up.bias")[0])  # [n, 2I]
    gu = b.op("Concat", gu, f"{x}.gate_up", axis=-1)[0]  # [n, E 2I]
    gu = b.op("Reshape", [gu, b.const(f"{x}.pairs", [-1, E, I, 2])], f"{x}.pairs")[0]  # [n, E, I, 2]: gate, up
    gate, up = b.op("Split", [gu], f"{x}.gate_up.split", outputs=2, axis=-1)  # [n, E, I, 1] each
    # the clamps' bounds in the graph dtype (7.0 is exact in fp16 and bf16); each product rounded as the reference's
    # (alpha, a Python float there, multiplied in fp32: StandardOps.times)
    limit, dt = float(c.swiglu_limit), b.dtype
    gate = b.op("Min", [gate, b.const(f"{x}.limit", [limit], dt)], f"{x}.gate.clamp")[0]  # from above only
    up = b.op("Clip", [up, b.const(f"{x}.low", -limit, dt), b.const(f"{x}.high", limit, dt)], f"{x}.up.clamp")[0]
    alpha_gate = ops.times(gate, b.const(f"{x}.alpha", [c.swiglu_alpha], np.float32), f"{x}.alpha_gate")
    glu = b.op("Mul", [gate, b.op("Sigmoid", [alpha_gate], f"{x}.sigmoid")[0]], f"{x}.glu")[0]
    act = b.op("Mul", [b.op("Add", [up, b.const(f"{x}.one", [1.0], dt)], f"{x}.up1")[0], glu], f"{x}.act")[0]
    act = b.op("Reshape", [act, b.const(f"{x}.act_shape", [-1, E, I])], f"{x}.act3")[0]  # [n, E, I]
    act = b.op("Reshape", [b.op("Mul", [act, w3], f"{x}.routed")[0], b.const(f"{x}.act_flat", [-1, E * I])],
               f"{x}.act_flat")[0]  # [n, E I]: zero for the experts a row does not route to
    # one down MatMul [E I, H] sums over the experts (written an expert's [I, H] rows at a time); the biases
    # weighted by the routing: weights [n, E] @ down biases [E, H]
    down = b.chunked(f"{x}.down_proj", (src.get(f"{x}.down_proj", slice(e, e + 1))[0] for e in range(E)),
                     (E * I, H))
    y = b.op("MatMul", [act, down], f"{x}.down")[0]  # [n, H]
    bias = b.op("MatMul", [weights, b.fw(f"{x}.down_bias", src.get(f"{x}.down_proj_bias"))], f"{x}.down.bias")[0]
    return b.op("Add", [y, bias], f"{x}.out")[0]  # [n, H]
