"""The Qwen3.5 hybrid target (dflash2.families.qwen3_5) in standard ONNX ops: its layer templates, both flavours.

What dflash2.reference.qwen3_5.Qwen35Target computes, written from the checkpoint's weights tensor by tensor (as
plain.py writes the dense target), opset-17 ops only: Gated DeltaNet layers and gated full-attention layers.
The full-attention layers keep the dense target's KV binding (portable: `past_kv` the valid prefix; TensorRT
flavour: `kv_cache` + `past_len`, plain.py's prologues), over the La full layers only. The Gated DeltaNet layers
(their template: qwen3_5_gdn.py) carry a state instead of K/V rows, bound as state rows
(dflash2.runtime.state.RowStates), one pair of tensors per GDN layer j (signature.state_names):

    conv_state.{j}   [1, C, K-1]          graph dtype   the last K-1 conv inputs before the step
    rec_state.{j}    [1, Hv, dk, dv]      float32       the delta-rule state before the step
    conv_states.{j}  [W', C, K-1]         out           the conv state after each of the LAST W' = min(n, W) rows
    rec_states.{j}   [W', Hv, dk, dv]     out, float32  the delta-rule state after each of those rows

(the gqa graph, build_fused, binds the conv states row-major: [1, K-1, C] in, [W', K-1, C] out; qwen3_5_gdn.Gdn)
W = the block size: a verify of k <= B rows returns the state after every row, and the runtime commits the one
after the last accepted row by pointing the next step at it (no copy, no re-decode; docs/families/qwen3_5.md).
A prefill of n > W rows returns only the last W: its rows before them run in one pass that keeps no per-row
state, so a long prompt holds one state per layer, not n.

The recurrence applies one row at a time exactly the reference's per-row operations (gated_delta_rows), in fp32
(a 1-row decode without a Scan, a verify's rows in a Scan of the same one-row op: qwen3_5_gdn.py); the causal
conv is the reference's explicit sum over the K taps in tap order, so a k-row verify row equals the 1-row decode
of the same token. fp32, fp16 or bf16 graphs. In fp16 / bf16 the graph follows the reference's own low-precision
numerics (dflash2.reference.qwen3_5 loaded in that dtype): weights, activations, the KV rows and the conv states in
the graph dtype; the recurrence, its state (rec_state, always fp32), the gates g and beta, the l2 norms, every
RMSNorm's inside, the attention softmax and the logits in fp32, cast where the reference casts.

Qwen3.5-MoE (dflash2.families.qwen3_5_moe) is the same hybrid with every layer's MLP the experts' block and its
shared expert (moe.py: the all-experts standard ops in build(), ONNX Runtime's MoE / QMoE in build_fused()), the
experts read one at a time from either checkpoint layout through UnfusedExperts.

Attention scores are q.k summed over head_dim in chunks of at most 128: at head_dim 256 MLAS's SGEMM computes a
256-long dot product one way for at most 64 columns (keys) and another past 64 (a k-row verify and the 1-row decode
of the same position then differ in the last bits once one of them is past 64 keys: speculative output differed
from autoregressive output at Qwen3.5-0.8B's shape); at K <= 128 both ways agree bit for bit (measured, K 16..128).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from dflash2 import dtypes
from dflash2.config import RopeConfig
from dflash2.export import moe
from dflash2.export import qwen3_5_gqa as q35g
from dflash2.export import signature as N
from dflash2.export.plain import _fixed, _prefix
from dflash2.export.qwen3_5_gdn import Gdn, GdnShared
from dflash2.export.templates import Builder, StandardOps
from dflash2.reference.moe import UnfusedExperts

F32 = TensorProto.FLOAT
DTYPES = ("float32", "float16", "bfloat16")


def _embed(b: Builder, src, quant, matrix, ids: str = N.INPUT_IDS) -> str:
    """The embedding lookup [n, H] of `ids` (int32 or int64): an fp32 Gather, or with int4 weights
    GatherBlockQuantized over the embedding's int4 blocks along H (ONNX Runtime's block quantizer, zero point 8:
    MatMulNBits' layout, row by row). Also the standard-op targets' (export/lowbit.py)."""
    name = "embed_tokens.weight"
    if quant is None or b.nbits.bits != 4 or not b.nbits.symmetric or src.shape(name)[1] % b.nbits.block_size:
        return b.op("Gather", [matrix(name), ids], "embed", axis=0)[0]
    q, (V, H) = b.nbits, src.shape(name)
    scales = []

    def packed():
        for rows in src.row_chunks(name):  # [r, H]: as MatMulNBits' column block [H, r] of the transpose
            pk, sc, _ = q.quantize(rows.T)  # [r, H/32, 16], [r * H/32]
            scales.append(np.asarray(sc, np.float32).reshape(len(rows), -1))
            yield pk.reshape(len(rows), -1)

    b.inits.append(b.data.add_chunks(b._name("embed.weight_Q4"), packed(), np.uint8, (V, H // 2)))
    sc = b.weight("embed.weight_scales", np.concatenate(scales))
    return b.op("GatherBlockQuantized", ["embed.weight_Q4", ids, sc], "embed", domain="com.microsoft",
                gather_axis=0, quantize_axis=1, block_size=q.block_size, bits=4)[0]


def build_fused(c, dc, src, dsrc, fuse_context: bool, max_seq_len: int, data=None, progress=None, quant=None,
                native=None) -> onnx.ModelProto:
    """The ONNX Runtime graph (`--target-attention gqa`, the default with --quantize int4 / int8): the same layers,
    every weight MatMul written as MatMulNBits as it is read (quant: an OrtQuant; memory bounded by one tensor), the
    LM head too unless --quant-keep-head, and with int4 the embedding as GatherBlockQuantized (the same int4 blocks
    along H: a 248,320-row vocabulary is 1 GB fp32 at hidden 1024, 5 GB at 5120). Portable flavour only (contrib
    ops); the state rows as in build(). max_seq_len and native (GGUF blocks) are the dense fused builder's
    arguments: unused here."""
    if quant is not None and (data is None or quant.dynamic):
        raise ValueError("qwen3_5 fused: a quantized build writes through a DataFile, int4 / int8 (not dynamic)")
    why = q35g.unsupported(max_seq_len)
    if why:
        raise ValueError(f"qwen3_5 fused: {why}")
    return build(c, dc, src, dsrc, fuse_context, "float32", data, progress, quant, fused=True, gqa_kv=True)[0]


def build(c, dc, src, dsrc, fuse_context: bool, dtype: str = "float32", data=None,
          progress=None, quant=None, fused: bool = False,
          gqa_kv: bool = False) -> tuple[onnx.ModelProto, onnx.ModelProto | None]:
    """(portable, TensorRT flavour) of the Qwen3.5 target (module docstring). c: Qwen35Config; dc: the drafter's;
    src / dsrc: their weights (dflash2.export.weights); data: a DataFile both graphs point into; progress(i, L);
    quant, fused: build_fused's (contrib ops: then the TensorRT flavour is not for use); gqa_kv: the full-attention
    layers on GroupQueryAttention with per-layer KV bound in place (qwen3_5_gqa.py; no TensorRT flavour: None)."""
    if dtype not in DTYPES:
        raise ValueError(f"qwen3_5 templates: expected a dtype in {DTYPES}, found {dtype!r}")
    nh, kvh, hd, L, H = c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers, c.hidden_size
    La, Lg, rd = len(c.full_layers), len(c.linear_layers), c.rotary_dim
    Hk, Hv, dk, dv, K = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                         c.linear_value_head_dim, c.linear_conv_kernel_dim)
    C, rep = c.conv_dim, Hv // Hk
    g, B, eps = nh // kvh, dc.block_size, float(c.rms_norm_eps)
    tap_ids = tuple(dc.target_layer_ids)
    sparse = hasattr(c, "num_experts")  # Qwen3.5-MoE: every layer's MLP the experts' block (dflash2.export.moe)
    src = UnfusedExperts(src) if sparse else src  # either expert layout read as per-expert names, one expert at a time
    np_dt = dtypes.numpy_dtype(dtype)  # bfloat16: ml_dtypes' (onnx writes it as BFLOAT16)
    onnx_dt = dtypes.onnx_type(dtype)
    if np_dt != np.float32 and (fused or gqa_kv or quant is not None):
        raise ValueError(f"qwen3_5 templates: the fused / quantized graph is float32, found {dtype!r}")
    b = Builder(data, quant, dtype=np_dt)
    ops = StandardOps(b, RopeConfig(c.rope_theta), rd, eps)  # the rotary over the first rd channels (text M-RoPE)
    ax0, ax1 = b.const("axis0", [0]), b.const("axis1", [1])

    def matrix(name: str) -> str:  # a vocabulary matrix, written a row slice at a time
        return b.chunked(name, src.row_chunks(name), src.shape(name))

    # --- shared: positions, rotary rows, causal visibility, the state window
    n = b.op("Shape", [N.INPUT_IDS], "n")[0]  # [1] int64
    n0 = b.op("Squeeze", [n, ax0], "n.scalar", outputs=["n.scalar"])[0]
    b.op("Range", [b.const("zero", 0), n0, b.const("one", 1)], "steps", outputs=["steps"])  # [n]
    prologue_at = len(b.nodes)  # each flavour's prologue (plain.py): start, pos [n], k_pos [T]
    rot = ops.at("pos", "rope")  # [n, 1, rd] each
    if gqa_kv:  # the kernel masks and reads its own past (qwen3_5_gqa.py)
        kernel = q35g.GqaShared(b, n)
    else:
        visible = b.op("LessOrEqual", [b.op("Unsqueeze", ["k_pos", ax0], "k_pos.row")[0],
                                       b.op("Unsqueeze", ["pos", ax1], "pos.col")[0]], "visible")[0]  # [n, T]
        four = b.op("Concat", [b.const("kv_g", [kvh, g]), n, b.const("minus1", [-1])], "scores4.shape", axis=0)[0]
        neg = b.const("masked", [np.finfo(np.float32).min], np.float32)  # the scores masked in fp32 (reference)
        scale = b.const("attn.scale", [hd ** -0.5], np_dt)
        kv_index = [b.const(f"kv.{j}", j) for j in (0, 1)]
    w_rows = b.op("Min", [n, b.const("window", [B])], "window.rows")[0]  # [1] W' = min(n, W)
    split_at = b.op("Sub", [n, w_rows], "window.start")[0]  # [1] n - W': rows before it keep no state
    end = b.const("to_end", [2**62])
    has_head = b.op("Squeeze", [b.op("Greater", [split_at, b.const("zero1", [0])], "window.has_head")[0], ax0],
                    "window.has_head.scalar")[0]  # [] bool: a prefill longer than the window
    fused = quant is not None or fused

    def norm(x: str, w, name: str, eps: float | None = None, dim: int | None = None, zc: bool = False) -> str:
        """RMSNorm over the last axis (weight w; None: none, of width dim; zc: zero-centred, the norm multiplies
        1 + w in fp32, w as the reference holds it). fused: ONNX Runtime's SimplifiedLayerNormalization, one node
        per norm where the standard ops take seven (a row's result still depends on that row alone: row invariance
        holds); standard ops: StandardOps.norm."""
        if zc:
            w = 1.0 + b.held(w)
        if not fused:  # the zero-centred product in fp32, as the reference takes it
            return ops.norm(x, w, name, eps=eps, fp32_weight=zc)
        w = np.ones(dim, np.float32) if w is None else np.asarray(w, np.float32)
        return b.op("SimplifiedLayerNormalization", [x, b.weight(f"{name}.weight", w)], name, axis=-1,
                    epsilon=float(c.rms_norm_eps) if eps is None else eps, stash_type=1)[0]

    def heads(x: str, count: int, dim: int, name: str) -> str:  # [n, count*dim] -> [n, count, dim]
        return b.op("Reshape", [x, b.const(f"{name}.shape", [-1, count, dim])], name)[0]

    def l2norm(x: str, name: str) -> str:  # reference l2norm: x * rsqrt(sum(x^2) + 1e-6)
        if fused:  # x / ||x|| in one node where the standard ops take six (no eps: 1e-6 against sum(x^2) of a
            # conv output row; per (row, head), row-invariant), as onnxruntime-genai writes it
            return b.op("LpNormalization", [x], name, axis=-1, p=2)[0]
        s = b.op("ReduceSum", [b.op("Mul", [x, x], f"{name}.sq")[0], b.const(f"{name}.last", [-1])],
                 f"{name}.sum", keepdims=1)[0]
        r = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [s, b.const(f"{name}.eps", 1e-6, np.float32)],
                                                   f"{name}.add_eps")[0]], f"{name}.sqrt")[0]], f"{name}.rsqrt")[0]
        return b.op("Mul", [x, r], name)[0]

    def repeat_heads(x: str, name: str) -> str:  # [n, Hk, dk] -> [n, Hv, dk], head h reads key head h // rep
        if rep == 1:
            return x
        x4 = b.op("Unsqueeze", [x, b.const(f"{name}.ax2", [2])], f"{name}.unsq")[0]  # [n, Hk, 1, dk]
        shape = b.op("Concat", [n, b.const(f"{name}.rep", [Hk, rep, dk])], f"{name}.rep_shape", axis=0)[0]
        x4 = b.op("Expand", [x4, shape], f"{name}.expand")[0]
        return b.op("Reshape", [x4, b.const(f"{name}.flat", [-1, Hv, dk])], name)[0]

    def attention(u: str, p: str, ia: int) -> tuple[str, str]:
        """Gated full attention: (y [n, H], new K/V rows [n, 1, 2, kv, hd])."""
        a = f"{p}.self_attn"
        qkv = b.linear(u, f"{p}.qkv_proj", src, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])
        qg, k, v = b.op("Split", [qkv, b.const(f"{p}.qkv_sizes", [2 * nh * hd, kvh * hd, kvh * hd])], f"{p}.qkv",
                        outputs=3, axis=-1)
        q, gate = b.op("Split", [heads(qg, nh, 2 * hd, f"{p}.qg_heads"), b.const(f"{p}.qg_sizes", [hd, hd])],
                       f"{p}.q_gate", outputs=2, axis=-1)  # [n, nh, hd] each
        gate = b.op("Reshape", [gate, b.const(f"{p}.gate_flat", [-1, nh * hd])], f"{p}.gate_flat")[0]
        k, v = heads(k, kvh, hd, f"{p}.k_heads"), heads(v, kvh, hd, f"{p}.v_heads")
        q = norm(q, src.get(f"{a}.q_norm.weight"), f"{p}.q_norm", zc=True)
        k = norm(k, src.get(f"{a}.k_norm.weight"), f"{p}.k_norm", zc=True)
        q, k = (partial_rope(t, f"{p}.{nm}_rope") for t, nm in ((q, "q"), (k, "k")))
        if gqa_kv:  # writes present.{ia}.key|value itself
            o = q35g.attention(b, kernel, q, k, v, nh, kvh, hd, ia, p)
            o = b.op("Mul", [o, b.op("Sigmoid", [gate], f"{p}.gate")[0]], f"{p}.gated")[0]
            return b.linear(o, f"{p}.o_proj", src, [f"{a}.o_proj"]), None
        layer_kv = b.op("Gather", ["past", b.const(f"{p}.index", ia)], f"{p}.past", axis=1)[0]  # [P, 2, kv, hd]
        pk, pv = (b.op("Gather", [layer_kv, kv_index[j]], f"{p}.past_{nm}", axis=1)[0] for j, nm in ((0, "k"), (1, "v")))
        keys = b.op("Concat", [pk, k], f"{p}.keys", axis=0)[0]  # [T, kv, hd]
        vals = b.op("Concat", [pv, v], f"{p}.values", axis=0)[0]
        qh = b.op("Reshape", [b.op("Transpose", [q], f"{p}.q_t", perm=[1, 0, 2])[0],
                              b.const(f"{p}.q_groups", [kvh, -1, hd])], f"{p}.q_groups")[0]  # [kv, g n, hd]
        kt = b.op("Transpose", [keys], f"{p}.k_t", perm=[1, 2, 0])[0]  # [kv, hd, T]
        if score_split is None:
            s = b.op("MatMul", [qh, kt], f"{p}.scores")[0]  # [kv, g n, T]
        else:  # q.k over head_dim in chunks of <= 128 (module docstring: row invariance past 64 keys)
            qs = b.op("Split", [qh, score_split], f"{p}.q_chunks", outputs=len(chunks), axis=-1)
            ks = b.op("Split", [kt, score_split], f"{p}.k_chunks", outputs=len(chunks), axis=1)
            s = None
            for j, (qj, kj) in enumerate(zip(qs, ks)):
                part = b.op("MatMul", [qj, kj], f"{p}.scores{j}")[0]
                s = part if s is None else b.op("Add", [s, part], f"{p}.scores.sum{j}")[0]
        s3 = b.op("Shape", [s], f"{p}.scores.shape")[0]
        s = b.op("Reshape", [b.op("Mul", [s, scale], f"{p}.scaled")[0], four], f"{p}.scores4")[0]  # [kv, g, n, T]
        s = b.op("Where", [visible, ops.f32(s, f"{p}.scores4"), neg], f"{p}.masked")[0]  # fp32 from here
        probs = ops.back(b.op("Softmax", [s], f"{p}.softmax", axis=-1)[0], f"{p}.probs")  # graph dtype, as v
        probs = b.op("Reshape", [probs, s3], f"{p}.probs3")[0]
        o = b.op("MatMul", [probs, b.op("Transpose", [vals], f"{p}.v_t", perm=[1, 0, 2])[0]], f"{p}.attend")[0]
        o = b.op("Transpose", [b.op("Reshape", [o, b.const(f"{p}.o_heads", [nh, -1, hd])], f"{p}.o_heads")[0]],
                 f"{p}.o_t", perm=[1, 0, 2])[0]  # [n, nh, hd]
        o = b.op("Reshape", [o, b.const(f"{p}.o_flat", [-1, nh * hd])], f"{p}.o_flat")[0]
        o = b.op("Mul", [o, b.op("Sigmoid", [gate], f"{p}.gate")[0]], f"{p}.gated")[0]
        kv_i = b.op("Concat", [b.op("Unsqueeze", [t, ax1], f"{p}.new_{nm}")[0] for t, nm in ((k, "k"), (v, "v"))],
                    f"{p}.new_kv", axis=1)[0]  # [n, 2, kv, hd]
        return b.linear(o, f"{p}.o_proj", src, [f"{a}.o_proj"]), b.op("Unsqueeze", [kv_i, ax1], f"{p}.kv_row")[0]

    gdn = Gdn(b, src, c, fused, GdnShared(n, split_at, has_head, end, ax0),
              dict(norm=norm, heads=heads, l2norm=l2norm, silu=ops.silu, repeat_heads=repeat_heads, f32=ops.f32,
                   back=ops.back), conv_rows=gqa_kv)
    rope_split = b.const("rope.split", [rd, hd - rd]) if rd < hd else None
    chunks = [min(128, hd - i) for i in range(0, hd, 128)]
    score_split = b.const("scores.split", chunks) if len(chunks) > 1 else None

    def partial_rope(x: str, name: str) -> str:  # [n, heads, hd]: rotate-half on the first rd channels only
        if rope_split is None:
            return ops.rotate(x, rot, name)
        xr, xp = b.op("Split", [x, rope_split], f"{name}.parts", outputs=2, axis=-1)
        return b.op("Concat", [ops.rotate(xr, rot, name), xp], f"{name}.joined", axis=-1)[0]

    h = _embed(b, src, quant, matrix)  # [n, H]
    taps, new_kv, gdn_layers = {}, [], 0
    for i, kind in enumerate(c.layer_types):
        p = f"layers.{i}"
        if progress is not None:
            progress(i, L)
        u = norm(h, src.get(f"{p}.input_layernorm.weight"), f"{p}.input_layernorm", zc=True)
        if kind == "full_attention":
            y, kv_row = attention(u, p, len(new_kv))
            new_kv.append(kv_row)
        else:
            y, _, _ = gdn(u, p, gdn_layers)  # writes conv_states.{j}, rec_states.{j} itself
            gdn_layers += 1
        h = b.op("Add", [h, y], f"{p}.mix_residual")[0]
        u = norm(h, src.get(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attention_layernorm", zc=True)
        m = f"{p}.mlp"
        if sparse:  # u [n, H] -> [n, H]: ONNX Runtime's MoE / QMoE (fused graph) or the all-experts standard ops
            mlp = moe.fused(b, u, src, c, m) if fused else moe.standard(b, ops, u, src, c, m)
        else:
            gate, up = b.op("Split", [b.linear(u, f"{p}.gate_up_proj", src, [f"{m}.gate_proj", f"{m}.up_proj"]),
                                      b.const(f"{p}.gate_up_sizes", [c.intermediate_size] * 2)], f"{p}.gate_up",
                            outputs=2, axis=-1)
            mlp = b.linear(b.op("Mul", [ops.silu(gate, f"{p}.silu"), up], f"{p}.act")[0], f"{p}.down_proj", src,
                           [f"{m}.down_proj"])
        h = b.op("Add", [h, mlp], f"{p}.mlp_residual")[0]
        if i in tap_ids:
            taps[i] = h  # the OUTPUT of layer i (HF hidden_states[i + 1])
    if not gqa_kv:
        b.op("Concat", new_kv, N.NEW_KV, outputs=[N.NEW_KV], axis=1)
    y = norm(h, src.get("norm.weight"), "norm", zc=True)
    head_name = "embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    if quant is not None and quant.lm_head:  # the [H, V] transpose quantized one vocabulary slice at a time
        logits = b.matmul_nbits(y, "lm_head", (H, c.vocab_size), (r.T for r in src.row_chunks(head_name)))
    else:
        head = "embed_tokens.weight" if c.tie_word_embeddings and "embed_tokens.weight" in b.names else \
            matrix(head_name)
        logits = ops.f32(b.head(y, head, "lm_head"), "logits")  # [n, V] fp32
    ids = b.op("ArgMax", [logits], "argmax", axis=-1, keepdims=0)[0]
    b.op("Cast", [ids], N.NEXT_IDS, outputs=[N.NEXT_IDS], to=TensorProto.INT32)
    b.op("Slice", [logits, b.const("last_b", [-B]), end, ax0], N.LOGITS, outputs=[N.LOGITS])
    tap_rows = [taps[t] for t in tap_ids]
    t = tap_rows[0] if len(tap_rows) == 1 else b.op("Concat", tap_rows, "taps", axis=-1)[0]  # [n, n_taps H]
    if fuse_context:  # drafter.context: hidden_norm(fc(taps))
        t = norm(b.linear(t, "context.fc", dsrc, ["fc"]), dsrc.get("hidden_norm.weight"), "context.hidden_norm",
                     eps=float(dc.rms_norm_eps))
    b.op("Identity", [t], N.CONTEXT, outputs=[N.CONTEXT])

    ctx_width = dc.hidden_size if fuse_context else len(tap_ids) * H
    row, W = [La, 2, kvh, hd], f"Min(n, {B})"
    past_state, present_state = N.state_names(Lg)
    # per GDN layer: conv, rec (signature.state_names' order); the gqa graph's conv state row-major (Gdn's conv_rows)
    state_rows = [[K - 1, C] if gqa_kv else [C, K - 1], [Hv, dk, dv]] * Lg
    state_types = [onnx_dt, F32] * Lg  # the conv state in the graph dtype, the delta-rule state fp32
    outputs = [helper.make_tensor_value_info(N.NEXT_IDS, TensorProto.INT32, ["n"]),
               helper.make_tensor_value_info(N.CONTEXT, onnx_dt, ["n", ctx_width]),
               helper.make_tensor_value_info(N.NEW_KV, onnx_dt, ["n", *row]),
               helper.make_tensor_value_info(N.LOGITS, F32, [W, c.vocab_size])]
    outputs += [helper.make_tensor_value_info(nm, t, [W, *r])
                for nm, r, t in zip(present_state, state_rows, state_types)]
    ids_in = helper.make_tensor_value_info(N.INPUT_IDS, TensorProto.INT32, ["n"])
    states = [helper.make_tensor_value_info(nm, t, [1, *r]) for nm, r, t in zip(past_state, state_rows, state_types)]
    if gqa_kv:  # no new_kv: the kernel writes the bound buffers
        kv_in, kv_out = q35g.io(La, kvh, hd)
        outputs = outputs[:2] + [outputs[3]] + kv_out + outputs[4:]
        return (b.model("dflash2_target_qwen3_5_gqa", [ids_in, *kv_in, *states], outputs, prologue_at=prologue_at,
                        prologue=q35g.prologue()), None)
    past = [ids_in, helper.make_tensor_value_info(N.PAST_KV, onnx_dt, ["past", *row]), *states]
    cache = [ids_in, helper.make_tensor_value_info(N.KV_CACHE, onnx_dt, ["cap", *row]),
             helper.make_tensor_value_info(N.PAST_LEN, TensorProto.INT32, [1]), *states]
    return (b.model("dflash2_target_qwen3_5", past, outputs, prologue_at=prologue_at, prologue=_prefix()),
            b.model("dflash2_target_qwen3_5_fixed", cache, outputs, prologue_at=prologue_at, prologue=_fixed()))
