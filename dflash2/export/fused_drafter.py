"""The drafter as ONNX Runtime's fused-op graph, built from weights (the CPU path; `--target-attention gqa`).

The traced drafter graph is ~430 nodes plus the selector's function (~420) for a 2-layer drafter: on the
int4 SmolLM2 default a draft cost 77% of a target decode step, most of it ONNX Runtime's per-node overhead
and fp32 weights (docs/quantization.md). Here the same computation in few nodes, from the same templates as
the fused target (dflash2.export.templates):
- the context rows' K|V for every layer in ONE packed MatMul, one per-head norm, one RotaryEmbedding;
- per layer: packed q|k|v and gate|up MatMuls, SkipSimplifiedLayerNormalization for residual + norm,
  RotaryEmbedding, attention as two batched MatMuls over [context cache | block] (non-causal inside the
  block; an additive mask only where a layer is causal or has a sliding window), the DFlash2 convolutions
  as one stacked multiply-sum per side;
- the LM head over the draft vocabulary, TopK, the gate, the selector node (its portable function, or the
  TensorRT plugin's bare node) - or, DFlash v1, the scaled argmax and its top-1 probability;
- with `quant`, every weight MatMul (the head included) as MatMulNBits, quantized as written.

I/O, KV binding (prefix) and outputs are exactly the traced graph's (graphs.DrafterGraph /
SamplingDrafterGraph): the signature is computed from the io names like every graph's, and the graph is
validated against the same PyTorch reference on the same feeds.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from dflash2.export import selector_onnx as so
from dflash2.export import signature as N
from dflash2.export import weights as W
from dflash2.export.templates import Builder, rope_caches
from dflash2.ops import contract as C

OPSET = 18  # the selector's portable function is written for opset 18 (ReduceMax's axes as an input)
MASKED = float(np.finfo(np.float32).min)  # the reference's masked_fill value (reference.layers.attend)


def head_rows(src, name: str, ids: np.ndarray | None):
    """The LM head's rows for the draft vocabulary ids (ascending), as consecutive [r, H] row blocks read
    chunk by chunk: never the whole [V, H] head in memory. ids None: every row."""
    start = 0
    for chunk in src.row_chunks(name):
        stop = start + chunk.shape[0]
        if ids is None:
            yield chunk
        else:
            lo, hi = np.searchsorted(ids, [start, stop])
            if hi > lo:
                yield chunk[ids[lo:hi] - start]
        start = stop


def build(dc, tc, dsrc, tsrc, fuse_context: bool, max_seq_len: int, draft_ids: np.ndarray | None = None,
          data: W.DataFile | None = None, quant=None, progress=None) -> onnx.ModelProto:
    """dc / tc: drafter / target configs; dsrc / tsrc: their weights (dflash2.export.weights: a safetensors
    folder read tensor by tensor, or a loaded module); draft_ids: the draft vocabulary (ascending token ids)
    or None; data: where initializers go (None: inline); quant: an OrtQuant (MatMulNBits weights)."""
    if quant is not None and data is None:
        raise ValueError("a quantized build writes through a DataFile")
    H, nh, kv, hd, Ld = dc.hidden_size, dc.num_heads, dc.num_kv_heads, dc.head_dim, dc.num_layers
    B, S, g, eps = dc.block_size, dc.num_drafts, dc.num_heads // dc.num_kv_heads, float(dc.rms_norm_eps)
    v2 = dc.version == 2
    b = Builder(data, quant)
    cos, sin = rope_caches(b, dc.rope, hd, max_seq_len + B)  # block positions reach max_seq_len + B - 1
    ax0, ax1 = b.const("axis0", [0]), b.const("axis1", [1])

    # positions: context rows at P .. P+n-1, the block at P+n .. P+n+B-1 (P = the cache's rows)
    P = b.op("Gather", [b.op("Shape", [N.PAST_CTX_KV], "P.shape")[0], b.const("zero", 0)], "P")[0]  # [] int64
    n = b.op("Gather", [b.op("Shape", [N.CONTEXT], "n.shape")[0], "zero"], "n")[0]
    start = b.op("Add", [P, n], "block_start")[0]
    one = b.const("one", 1)
    ctx_pos = b.op("Range", [P, start, one], "ctx_pos")[0]  # [n]
    blk_pos = b.op("Range", [start, b.op("Add", [start, b.const("B", B)], "block_end")[0], one], "blk_pos")[0]
    # activations are [1, rows, width] (a batch of one) from here: what RotaryEmbedding and the norms take
    ctx_pos2, blk_pos2 = (b.op("Unsqueeze", [t, ax0], f"{t}.batch")[0] for t in (ctx_pos, blk_pos))

    def rotary(x: str, pos: str, heads: int, name: str) -> str:  # [1, rows, heads*hd] at positions pos [1, rows]
        return b.op("RotaryEmbedding", [x, pos, cos, sin], name, domain="com.microsoft", interleaved=0,
                    num_heads=heads)[0]

    def rms(x: str, weight: np.ndarray, name: str, heads: int = 0) -> str:
        """RMSNorm over the last axis ([1, rows, heads*hd] normed per head when heads)."""
        if heads:
            x = b.op("Reshape", [x, b.const(f"{name}.heads", [0, 0, heads, hd])], f"{name}.split")[0]
        y = b.op("SimplifiedLayerNormalization", [x, b.weight(f"{name}.weight", weight)], name, axis=-1,
                 epsilon=eps, stash_type=1)[0]
        return b.op("Reshape", [y, b.const(f"{name}.flat", [0, 0, heads * hd])], f"{name}.merge")[0] if heads else y

    # 1. the context rows' K|V, every layer in one MatMul: new_ctx_kv [n, Ld, 2, kv, hd]
    c = b.op("Unsqueeze", [N.CONTEXT, ax0], "context.batch")[0]  # [1, n, C]
    if not fuse_context:  # raw taps in: the drafter's fc + hidden_norm here
        c = rms(b.linear(c, "fc", dsrc, ["fc"]), dsrc.get("hidden_norm.weight"), "hidden_norm")
    layers = [f"layers.{i}.self_attn" for i in range(Ld)]
    kv_rows = b.linear(c, "context.kv_proj", dsrc, [f"{a}.k_proj" for a in layers] + [f"{a}.v_proj" for a in layers])
    k, v = b.op("Split", [kv_rows, b.const("context.kv_sizes", [Ld * kv * hd] * 2)], "context.kv", outputs=2, axis=-1)
    k = b.op("Reshape", [k, b.const("context.k_heads", [0, 0, Ld * kv, hd])], "context.k.split")[0]
    k = b.op("SimplifiedLayerNormalization", [k, b.weight("ones.hd", np.ones(hd, np.float32))], "context.k_norm",
             axis=-1, epsilon=eps, stash_type=1)[0]  # the per-layer weights next (one norm for all layers)
    k_w = np.concatenate([np.tile(dsrc.get(f"{a}.k_norm.weight"), (kv, 1)) for a in layers])  # [Ld*kv, hd]
    k = b.op("Mul", [k, b.weight("context.k_norm.weights", k_w)], "context.k_norm.scale")[0]
    k = rotary(b.op("Reshape", [k, b.const("context.k_flat", [0, 0, Ld * kv * hd])], "context.k.merge")[0], ctx_pos2,
               Ld * kv, "context.k_rope")
    row5 = b.const("context.row", [-1, Ld, 1, kv, hd])
    k5, v5 = (b.op("Reshape", [t, row5], f"context.{nm}.rows")[0] for t, nm in ((k, "k"), (v, "v")))
    b.op("Concat", [k5, v5], N.NEW_CTX_KV, outputs=[N.NEW_CTX_KV], axis=2)

    # 2. the whole cache per layer: keys transposed [Ld, kv, hd, T], values [Ld, kv, T, hd]
    cache = b.op("Concat", [N.PAST_CTX_KV, N.NEW_CTX_KV], "cache", axis=0)[0]  # [T, Ld, 2, kv, hd]
    ck = b.op("Transpose", [b.op("Gather", [cache, "zero"], "cache.k", axis=2)[0]], "cache.k_t", perm=[1, 2, 3, 0])[0]
    cv = b.op("Transpose", [b.op("Gather", [cache, one], "cache.v", axis=2)[0]], "cache.v_t", perm=[1, 2, 0, 3])[0]
    masks = _masks(b, dc, ctx_pos, blk_pos, P)
    kv_heads, q_groups = b.const("kv_heads", [B, kv, hd]), b.const("q_groups", [B, kv, g, hd])
    attn_flat = b.const("attn_flat", [1, B, nh * hd])

    # 3. the block: [anchor, MASK x S] embedded (the target's embedding), then the layers
    embed_name = "embed_tokens.weight"
    embed = b.chunked(embed_name, tsrc.row_chunks(embed_name), (tc.vocab_size, tc.hidden_size))
    scale = float(dc.input_embedding_scale)
    mask_row = tsrc.get(embed_name, slice(dc.mask_token_id, dc.mask_token_id + 1)) * np.float32(scale)  # [1, H]
    a_row = b.op("Gather", [embed, N.ANCHOR], "anchor.embed")[0]  # [1, H]
    if scale != 1.0:
        a_row = b.op("Mul", [a_row, b.weight("input_embedding_scale", np.float32([scale]))], "anchor.scale")[0]
    h = b.op("Concat", [a_row, b.weight("mask.embed", np.repeat(mask_row, B - 1, axis=0))], "block", axis=0)[0]
    h = b.op("Unsqueeze", [h, ax0], "block.batch")[0]  # [1, B, H]
    pending = None
    for i in range(Ld):
        p, a = f"layers.{i}", f"layers.{i}.self_attn"
        if progress is not None:
            progress(i, Ld)

        def norm(name: str) -> str:
            nonlocal h, pending
            w = b.weight(f"{p}.{name}.weight", dsrc.get(f"{p}.{name}.weight"))
            if pending is None:
                return b.op("SimplifiedLayerNormalization", [h, w], f"{p}.{name}", axis=-1, epsilon=eps,
                            stash_type=1)[0]
            y, _, _, h = b.op("SkipSimplifiedLayerNormalization", [pending, h, w], f"{p}.{name}", outputs=4,
                              domain="com.microsoft", epsilon=eps)
            pending = None
            return y

        def attention(x: str) -> str:  # [B, H] -> [B, H]
            qkv = b.linear(x, f"{p}.qkv_proj", dsrc, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])
            q, kb, vb = b.op("Split", [qkv, b.const(f"{p}.qkv_sizes", [nh * hd, kv * hd, kv * hd])], f"{p}.qkv",
                             outputs=3, axis=-1)
            q = rotary(rms(q, dsrc.get(f"{a}.q_norm.weight") * np.float32(hd ** -0.5), f"{p}.q_norm", nh),
                       blk_pos2, nh, f"{p}.q_rope")  # the softmax scale folded into q's norm weight
            kb = rotary(rms(kb, dsrc.get(f"{a}.k_norm.weight"), f"{p}.k_norm", kv), blk_pos2, kv, f"{p}.k_rope")
            li = b.const(f"{p}.index", i)
            keys = b.op("Concat", [b.op("Gather", [ck, li], f"{p}.cache.k")[0],
                                   b.op("Transpose", [b.op("Reshape", [kb, kv_heads],
                                                           f"{p}.k.heads")[0]], f"{p}.k.t", perm=[1, 2, 0])[0]],
                        f"{p}.keys", axis=2)[0]  # [kv, hd, T + B]
            vals = b.op("Concat", [b.op("Gather", [cv, li], f"{p}.cache.v")[0],
                                   b.op("Transpose", [b.op("Reshape", [vb, kv_heads], f"{p}.v.heads")[0]],
                                        f"{p}.v.t", perm=[1, 0, 2])[0]], f"{p}.values", axis=1)[0]  # [kv, T + B, hd]
            qg = b.op("Transpose", [b.op("Reshape", [q, q_groups], f"{p}.q.groups")[0]],
                      f"{p}.q.t", perm=[1, 2, 0, 3])[0]  # [kv, g, B, hd]
            scores = b.op("MatMul", [qg, b.op("Unsqueeze", [keys, ax1], f"{p}.keys.g")[0]], f"{p}.scores")[0]
            mask = masks.get((dc.layer_causal[i], dc.layer_window[i]))
            if mask is not None:  # [B, T + B] additive
                scores = b.op("Add", [scores, mask], f"{p}.masked")[0]
            probs = b.op("Softmax", [scores], f"{p}.softmax", axis=-1)[0]  # [kv, g, B, T + B]
            out = b.op("MatMul", [probs, b.op("Unsqueeze", [vals, ax1], f"{p}.values.g")[0]], f"{p}.attend")[0]
            out = b.op("Transpose", [out], f"{p}.attn.t", perm=[2, 0, 1, 3])[0]  # [B, kv, g, hd]
            out = b.op("Reshape", [out, attn_flat], f"{p}.attn.flat")[0]
            return b.linear(out, f"{p}.o_proj", dsrc, [f"{a}.o_proj"])

        def mlp(x: str) -> str:
            m = f"{p}.mlp"
            gate, up = b.op("Split", [b.linear(x, f"{m}.gate_up_proj", dsrc, [f"{m}.gate_proj", f"{m}.up_proj"]),
                                      b.const(f"{m}.sizes", [dc.intermediate_size] * 2)], f"{m}.gate_up", outputs=2,
                            axis=-1)
            act = b.op("Mul", [gate, b.op("Sigmoid", [gate], f"{m}.sigmoid")[0]], f"{m}.silu")[0]
            return b.linear(b.op("Mul", [act, up], f"{m}.act")[0], f"{m}.down_proj", dsrc, [f"{m}.down_proj"])

        u = norm("input_layernorm")
        pending = _sublayer(b, dc, dsrc, u, f"{p}.attention_conv", attention) if v2 else attention(u)
        u = norm("post_attention_layernorm")
        pending = _sublayer(b, dc, dsrc, u, f"{p}.mlp_conv", mlp) if v2 else mlp(u)
    y = b.op("SkipSimplifiedLayerNormalization", [pending, h, b.weight("norm.weight", dsrc.get("norm.weight"))],
             "norm", outputs=4, domain="com.microsoft", epsilon=eps)[0]  # [1, B, H]
    hidden = b.op("Slice", [y, ax1, b.const("to_end", [2**62]), ax1], "drafts")[0]  # [1, S, H]: rows 1..S
    if not v2:
        hidden = b.op("Squeeze", [hidden, ax0], "drafts.rows")[0]  # [S, H]

    # 4. the LM head over the draft vocabulary, then the selector (v2) or the top-1 (v1)
    head_name = "embed_tokens.weight" if tc.tie_word_embeddings else "lm_head.weight"
    Nv = tc.vocab_size if draft_ids is None else len(draft_ids)
    if b.nbits is not None and quant.lm_head:  # quantized one vocabulary slice at a time
        logits = b.matmul_nbits(hidden, "draft_head", (H, Nv), (r.T for r in head_rows(tsrc, head_name, draft_ids)))
    else:
        if draft_ids is None and tc.tie_word_embeddings:
            rows = embed  # the embedding itself, read through a Transpose: no second copy on disk
        else:
            rows = b.chunked("draft_head.weight", head_rows(tsrc, head_name, draft_ids), (Nv, H))
        logits = b.op("MatMul", [hidden, b.op("Transpose", [rows], "draft_head.t", perm=[1, 0])[0]], "draft_head")[0]
    id_map = None if draft_ids is None else b.weight("draft_vocab.ids", np.asarray(draft_ids, np.int32))
    if v2:
        _selector(b, dc, dsrc, hidden, logits, id_map, ax0)
    else:
        _top1(b, dc, logits, id_map)

    f32, ctx_w = TensorProto.FLOAT, dc.hidden_size if fuse_context else len(dc.target_layer_ids) * tc.hidden_size
    kv_row = [Ld, 2, kv, hd]
    inputs = [helper.make_tensor_value_info(N.CONTEXT, f32, ["n", ctx_w]),
              helper.make_tensor_value_info(N.PAST_CTX_KV, f32, ["past", *kv_row]),
              helper.make_tensor_value_info(N.ANCHOR, TensorProto.INT32, [1])]
    outputs = [helper.make_tensor_value_info(N.DRAFT_IDS, TensorProto.INT32, [S])]
    if v2:
        K = dc.selector_top_k
        inputs += [helper.make_tensor_value_info(N.UNIFORMS, f32, [S]),
                   helper.make_tensor_value_info(N.TEMPERATURE, f32, [1])]
        outputs += [helper.make_tensor_value_info(N.CAND_IDS, TensorProto.INT32, [S, K]),
                    helper.make_tensor_value_info(N.CONFIDENCE, f32, [S]),
                    helper.make_tensor_value_info(N.DRAFT_PROBS, f32, [S, K])]
    else:
        outputs += [helper.make_tensor_value_info(N.CONFIDENCE, f32, [S])]
    outputs.append(helper.make_tensor_value_info(N.NEW_CTX_KV, f32, ["n", *kv_row]))
    graph = helper.make_graph(b.nodes, "dflash2_drafter_fused", inputs, outputs, b.inits)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    if v2:
        opsets.append(helper.make_opsetid(C.ONNX_DOMAIN, C.ONNX_OPSET))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="dflash2")
    model.ir_version = 8
    return model


def _masks(b: Builder, dc, ctx_pos: str, blk_pos: str, P: str) -> dict:
    """(causal, window) -> an additive [B, T + B] mask for each rule a layer uses that hides something
    (reference.layers.visibility over the context's and the block's absolute positions); none for the
    plain non-causal block over all context (the default DFlash layer)."""
    out = {}
    k_pos = q_pos = None
    for rule in sorted(set(zip(dc.layer_causal, dc.layer_window)), key=str):
        causal, window = rule
        if not causal and window is None:
            continue
        if k_pos is None:
            past_pos = b.op("Range", ["zero", P, "one"], "past_pos")[0]
            k_pos = b.op("Concat", [past_pos, ctx_pos, blk_pos], "key_pos", axis=0)[0]  # [T + B]
            k_pos = b.op("Unsqueeze", [k_pos, "axis0"], "key_pos.row")[0]  # [1, T + B]
            q_pos = b.op("Unsqueeze", [blk_pos, "axis1"], "query_pos.col")[0]  # [B, 1]
        tag = f"mask.{'causal' if causal else 'full'}.{window}"
        ok = None
        diff = b.op("Sub", [q_pos, k_pos], f"{tag}.diff")[0]  # [B, T + B]: q - k
        if causal:
            ok = b.op("GreaterOrEqual", [diff, "zero"], f"{tag}.causal")[0]
        if window is not None:
            w = b.const(f"{tag}.w", window)
            near = b.op("Less", [diff, w], f"{tag}.behind")[0]
            if not causal:
                ahead = b.op("Less", [b.op("Neg", [diff], f"{tag}.neg")[0], w], f"{tag}.ahead")[0]
                near = b.op("And", [near, ahead], f"{tag}.window")[0]
            ok = near if ok is None else b.op("And", [ok, near], f"{tag}.both")[0]
        out[rule] = b.op("Where", [ok, b.weight(f"{tag}.open", np.float32([0.0])),
                                   b.weight(f"{tag}.hidden", np.float32([MASKED]))], tag)[0]
    return out


def _sublayer(b: Builder, dc, src, u: str, conv: str, fn) -> str:
    """DFlash2: conv(fn(conv(u, side 0)), side 1), the coefficients of both sides from u
    (reference.drafter.GroupedDynamicConv): coef[side, k] = base[side, k] + projection(u) repeated per group."""
    Tk, grp, H, B = dc.conv_kernel_size, dc.conv_group_size, dc.hidden_size, dc.block_size
    G = H // grp
    delta = b.linear(u, f"{conv}.kernel_projection", src, [f"{conv}.kernel_projection"])  # [B, 2*Tk*G]
    delta = b.op("Reshape", [delta, b.const(f"{conv}.groups", [B, 2, Tk, G, 1])], f"{conv}.groups")[0]
    delta = b.op("Expand", [delta, b.const(f"{conv}.repeat", [B, 2, Tk, G, grp])], f"{conv}.repeat")[0]
    delta = b.op("Reshape", [delta, b.const(f"{conv}.rows", [B, 2, Tk, H])], f"{conv}.per_channel")[0]
    coef = b.op("Add", [delta, b.weight(f"{conv}.base_kernel", src.get(f"{conv}.base_kernel"))], f"{conv}.coef")[0]
    coef = b.op("Transpose", [coef], f"{conv}.coef.t", perm=[1, 2, 0, 3])[0]  # [2, Tk, B, H]
    sides = [b.op("Gather", [coef, b.const(f"{conv}.side{s}", s)], f"{conv}.side{s}")[0] for s in (0, 1)]

    pad = b.const(f"{conv}.pad", [0, Tk - 1, 0, 0, 0, 0])  # Tk - 1 zero rows above: the anchor has no predecessor
    rows = b.const(f"{conv}.shifts", [[Tk - 1 - k + t for t in range(B)] for k in range(Tk)])  # [Tk, B]

    def convolve(z: str, side: int) -> str:  # [B, H]: sum_k coef[side, k] * (z shifted down k rows)
        zp = b.op("Pad", [z, pad], f"{conv}.pad{side}")[0]  # [1, B + Tk - 1, H]
        stack = b.op("Gather", [zp, rows], f"{conv}.shifted{side}", axis=1)[0]  # [1, Tk, B, H]: [k, t] = z[t - k]
        prod = b.op("Mul", [stack, sides[side]], f"{conv}.mul{side}")[0]
        return b.op("ReduceSum", [prod, "axis1"], f"{conv}.y{side}", keepdims=0)[0]  # [1, B, H]

    return convolve(fn(convolve(u, 0)), 1)


def _selector(b: Builder, dc, src, hidden: str, logits: str, id_map: str | None, ax0: str) -> None:
    """Top-K of the draft logits (ONNX TopK: ties -> lower index = lower token id, ids ascending), the gate,
    the selector node in mode "sample" (its portable function attached at write time, selector_onnx)."""
    K, R, S = dc.selector_top_k, dc.selector_rank, dc.num_drafts
    vals, idx = b.op("TopK", [logits, b.const("top_k", [K])], "top_k", outputs=2, axis=-1, largest=1, sorted=1)
    cand = b.op("Cast", [idx], "cand.int32", to=TensorProto.INT32)[0]  # [1, S, K]: a batch of one, as the op takes
    if id_map is not None:
        cand = b.op("Gather", [id_map, cand], "cand.ids")[0]
    b.op("Squeeze", [cand, ax0], N.CAND_IDS, outputs=[N.CAND_IDS])
    gate = b.linear(hidden, "selector.gate", src, ["candidate_selector.hidden_projection"])  # [1, S, R]
    inputs = [vals, cand, gate, N.ANCHOR,
              b.weight("candidate_selector.predecessor_codebook", src.get("candidate_selector.predecessor_codebook")),
              b.weight("candidate_selector.successor_codebook", src.get("candidate_selector.successor_codebook")),
              b.op("Unsqueeze", [N.UNIFORMS, ax0], "selector.uniforms")[0], N.TEMPERATURE]
    outs = [f"selector.{o}" for o in C.output_names()]
    b.nodes.append(so.selector_node(inputs, outs, dict(top_k=K, rank=R, output_multiplier=float(dc.output_multiplier),
                                                       logit_softcap=float(dc.logit_softcap), mode="sample")))
    named = dict(zip(C.output_names(), outs))
    for role, out in ((N.DRAFT_IDS, "draft_ids"), (N.CONFIDENCE, "confidence"), (N.DRAFT_PROBS, "draft_probs")):
        b.op("Squeeze", [named[out], ax0], role, outputs=[role])


def _top1(b: Builder, dc, logits: str, id_map: str | None) -> None:
    """DFlash v1: the argmax of the scaled logits and its softmax probability (Drafter.propose)."""
    x = logits
    if dc.output_multiplier != 1.0:
        x = b.op("Mul", [x, b.weight("output_multiplier", np.float32([dc.output_multiplier]))], "scaled")[0]
    if dc.logit_softcap > 0:
        cap = b.weight("logit_softcap", np.float32([dc.logit_softcap]))
        x = b.op("Mul", [b.op("Tanh", [b.op("Div", [x, cap], "softcap.div")[0]], "softcap.tanh")[0], cap], "softcap")[0]
    best = b.op("Cast", [b.op("ArgMax", [x], "argmax", axis=-1, keepdims=0)[0]], "argmax.int32", to=TensorProto.INT32)[0]
    b.op("Identity" if id_map is None else "Gather", [best] if id_map is None else [id_map, best], N.DRAFT_IDS,
         outputs=[N.DRAFT_IDS])
    b.op("ReduceMax", [b.op("Softmax", [x], "softmax", axis=-1)[0], b.const("last_axis", [-1])], N.CONFIDENCE,
         outputs=[N.CONFIDENCE], keepdims=0)
