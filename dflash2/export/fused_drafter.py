"""The drafter built from weights by layer templates, in two op sets from one body (`_body`):
- `build`: ONNX Runtime's fused ops, fp32, one graph (the CPU path; `--target-attention gqa`);
- `build_plain`: standard ONNX ops, fp32, fp16 or bf16, both flavours (portable + TensorRT's fixed shapes) from one
  pass sharing every initializer (the plain export: what was traced with torch.onnx before, at a fraction of its
  memory and time).

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
- with `quant`, every weight MatMul (the head included) as MatMulNBits, or DynamicQuantizeMatMul (per-column int8,
  `--quant-drafter int8-dynamic`: 2.5-2.9x faster at the drafter's 8 rows, where the weight MatMuls are most of a draft),
  quantized as written.

I/O, KV bindings (prefix; fixed for the TensorRT flavour) and outputs are exactly the traced graph's (graphs.DrafterGraph /
SamplingDrafterGraph): the signature is computed from the io names like every graph's, and the graph is
validated against the same PyTorch reference on the same feeds.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from dflash2 import dtypes
from dflash2.export import selector_onnx as so
from dflash2.export import signature as N
from dflash2.export import weights as W
from dflash2.export.templates import Builder, FusedOps, StandardOps, silu
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
    """ONNX Runtime's fused ops, fp32, KV binding "prefix". dc / tc: drafter / target configs; dsrc / tsrc: their
    weights (dflash2.export.weights: a safetensors folder read tensor by tensor, or a loaded module); draft_ids:
    the draft vocabulary (ascending token ids) or None; data: where initializers go (None: inline); quant: an
    OrtQuant (MatMulNBits weights)."""
    if quant is not None and data is None:
        raise ValueError("a quantized build writes through a DataFile")
    b = Builder(data, quant)
    ops = FusedOps(b, dc.rope, dc.head_dim, float(dc.rms_norm_eps), max_seq_len + dc.block_size)
    _consts(b)
    P = b.op("Gather", [b.op("Shape", [N.PAST_CTX_KV], "P.shape")[0], "zero"], "P")[0]  # [] int64
    _body(b, ops, dc, tc, dsrc, tsrc, fuse_context, draft_ids, quant, progress, N.PAST_CTX_KV, P, None)
    return _model(b, len(b.nodes), [], _io(dc, tc, fuse_context, ops.dt, fixed=False), "dflash2_drafter_fused",
                  fused=True)


def sliding(dc) -> tuple[list[int], int] | None:
    """(layers, keep) of a drafter whose every layer has a sliding window: its context KV on the window buffer
    (manifest.WindowSignature, runtime.window.CompactingKv), keep = W - 1 for the widest window W (as a layer's
    rule q - k < W reads it: Meta's inclusive window is stored as W + 1, drafter_formats). Why W - 1: context rows
    sit before the block, and the block's first query (at the block start, after the step's new rows) is the one
    that sees furthest back; the window's other side (k - q < W, Meta's bidirectional one) only reaches block keys,
    never the buffer. None: a layer without a window (mixed drafters keep every row: one KV tensor of every layer)."""
    windows = list(dc.layer_window)
    if not windows or any(w is None for w in windows):
        return None
    return list(range(len(windows))), max(windows) - 1


def build_plain(dc, tc, dsrc, tsrc, fuse_context: bool, dtype: str = "float32", draft_ids: np.ndarray | None = None,
                data: W.DataFile | None = None, progress=None,
                window: bool = False) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(portable, TensorRT flavour) in standard ONNX ops (templates.StandardOps), fp32, fp16 or bf16: what the traced
    DrafterGraph computes, both flavours from one pass sharing every initializer. They differ only in the
    prologue that says where the context cache is (as plain.py's target): portable `past_ctx_kv` [past, ...] is
    the valid prefix; TensorRT `ctx_kv_cache` [cap, ...] the whole buffer with `past_len` [1] valid rows, stale
    rows placed after the block so the context mask (position < block start) hides them. The selector node
    gets its portable function (or stays the plugin's bare node) when written (trace.write_graph).
    window (a drafter whose every layer slides, `sliding`): the portable flavour's `past_ctx_kv` is the window
    buffer's valid rows at real positions window_base .. (an int64 [1] input): the rotary and the window mask read
    real positions. The TensorRT flavour stays the max_seq_len-row buffer (its window binding is not written yet)."""
    np_dt = dtypes.numpy_dtype(dtype)  # bfloat16 (a hybrid target's pair): ml_dtypes', written as BFLOAT16
    b = Builder(data, dtype=np_dt)
    ops = StandardOps(b, dc.rope, dc.head_dim, float(dc.rms_norm_eps), opset=OPSET)
    _consts(b)
    b.op("Gather", [b.op("Shape", [N.CONTEXT], "ctx.n.shape")[0], "zero"], "ctx.n", outputs=["ctx.n"])
    at = len(b.nodes)  # each flavour's prologue: ctx.past, ctx.start [] int64, ctx.past_pos [rows] int64
    _body(b, ops, dc, tc, dsrc, tsrc, fuse_context, draft_ids, None, progress, "ctx.past", "ctx.start",
          "ctx.past_pos")
    portable = _io(dc, tc, fuse_context, ops.dt, fixed=False)
    if window:
        portable[0].append(helper.make_tensor_value_info(N.WINDOW_BASE, TensorProto.INT64, [1]))
    return (_model(b, at, _window_prefix() if window else _prefix(), portable, "dflash2_drafter"),
            _model(b, at, _fixed(), _io(dc, tc, fuse_context, ops.dt, fixed=True), "dflash2_drafter_fixed"))


def _consts(b: Builder) -> None:
    b.const("axis0", [0]), b.const("axis1", [1]), b.const("zero", 0), b.const("one", 1)


def _body(b: Builder, ops, dc, tc, dsrc, tsrc, fuse_context: bool, draft_ids, quant, progress, past: str, P: str,
          past_pos: str | None) -> None:
    """The drafter after its prologue: `past` the context cache, P the position of the first new context row,
    past_pos the cache rows' positions (None: 0 .. P - 1, the prefix binding, whose rows are all visible)."""
    H, nh, kv, hd, Ld = dc.hidden_size, dc.num_heads, dc.num_kv_heads, dc.head_dim, dc.num_layers
    B, g = dc.block_size, dc.num_heads // dc.num_kv_heads
    v2 = dc.version == 2
    ax0, ax1, one = "axis0", "axis1", "one"

    # positions: context rows at P .. P+n-1, the block at P+n .. P+n+B-1
    n = b.op("Gather", [b.op("Shape", [N.CONTEXT], "n.shape")[0], "zero"], "n")[0] if past_pos is None else "ctx.n"
    start = b.op("Add", [P, n], "block_start")[0]
    ctx_pos = b.op("Range", [P, start, one], "ctx_pos")[0]  # [n]
    blk_pos = b.op("Range", [start, b.op("Add", [start, b.const("B", B)], "block_end")[0], one], "blk_pos")[0]
    ctx_at, blk_at = ops.at(ctx_pos, "rope.ctx"), ops.at(blk_pos, "rope.block")
    # activations are [1, rows, width] (a batch of one) from here: what RotaryEmbedding and the norms take

    # 1. the context rows' K|V, every layer in one MatMul: new_ctx_kv [n, Ld, 2, kv, hd]
    c = b.op("Unsqueeze", [N.CONTEXT, ax0], "context.batch")[0]  # [1, n, C]
    if not fuse_context:  # raw taps in: the drafter's fc + hidden_norm here
        c = ops.norm(b.linear(c, "fc", dsrc, ["fc"]), dsrc.get("hidden_norm.weight"), "hidden_norm")
    layers = [f"layers.{i}.self_attn" for i in range(Ld)]
    kv_rows = b.linear(c, "context.kv_proj", dsrc, [f"{a}.k_proj" for a in layers] + [f"{a}.v_proj" for a in layers])
    k, v = b.op("Split", [kv_rows, b.const("context.kv_sizes", [Ld * kv * hd] * 2)], "context.kv", outputs=2, axis=-1)
    k = ops.norm(k, None, "context.k_norm", heads=Ld * kv)  # the per-layer weights next (one norm for all layers)
    k_w = np.concatenate([np.tile(dsrc.get(f"{a}.k_norm.weight"), kv) for a in layers])  # [Ld*kv*hd]
    k = b.op("Mul", [k, b.fw("context.k_norm.weights", k_w)], "context.k_norm.per_layer")[0]
    k = ops.rotary(k, ctx_at, Ld * kv, "context.k_rope")
    row5 = b.const("context.row", [-1, Ld, 1, kv, hd])
    k5, v5 = (b.op("Reshape", [t, row5], f"context.{nm}.rows")[0] for t, nm in ((k, "k"), (v, "v")))
    b.op("Concat", [k5, v5], N.NEW_CTX_KV, outputs=[N.NEW_CTX_KV], axis=2)

    # 2. the whole cache per layer: keys transposed [Ld, kv, hd, T], values [Ld, kv, T, hd]
    cache = b.op("Concat", [past, N.NEW_CTX_KV], "cache", axis=0)[0]  # [T, Ld, 2, kv, hd]
    ck = b.op("Transpose", [b.op("Gather", [cache, "zero"], "cache.k", axis=2)[0]], "cache.k_t", perm=[1, 2, 3, 0])[0]
    cv = b.op("Transpose", [b.op("Gather", [cache, one], "cache.v", axis=2)[0]], "cache.v_t", perm=[1, 2, 0, 3])[0]
    masks = _masks(b, dc, P, past_pos, ctx_pos, blk_pos, start)
    kv_heads, q_groups = b.const("kv_heads", [B, kv, hd]), b.const("q_groups", [B, kv, g, hd])
    attn_flat = b.const("attn_flat", [1, B, nh * hd])

    # 3. the block: [anchor, MASK x S] embedded (the target's embedding), then the layers
    embed_name = "embed_tokens.weight"
    embed = b.chunked(embed_name, tsrc.row_chunks(embed_name), (tc.vocab_size, tc.hidden_size))
    scale = float(dc.input_embedding_scale)
    mask_row = tsrc.get(embed_name, slice(dc.mask_token_id, dc.mask_token_id + 1)) * np.float32(scale)  # [1, H]
    a_row = b.op("Gather", [embed, N.ANCHOR], "anchor.embed")[0]  # [1, H]
    if scale != 1.0:
        a_row = b.op("Mul", [a_row, b.fw("input_embedding_scale", np.float32([scale]))], "anchor.scale")[0]
    h = b.op("Concat", [a_row, b.fw("mask.embed", np.repeat(mask_row, B - 1, axis=0))], "block", axis=0)[0]
    h = b.op("Unsqueeze", [h, ax0], "block.batch")[0]  # [1, B, H]
    pending = None
    for i in range(Ld):
        p, a = f"layers.{i}", f"layers.{i}.self_attn"
        if progress is not None:
            progress(i, Ld)

        def norm(name: str) -> str:
            nonlocal h, pending
            w = dsrc.get(f"{p}.{name}.weight")
            if pending is None:
                return ops.norm(h, w, f"{p}.{name}")
            y, h = ops.add_norm(pending, h, w, f"{p}.{name}")
            pending = None
            return y

        def attention(x: str) -> str:  # [B, H] -> [B, H]
            qkv = b.linear(x, f"{p}.qkv_proj", dsrc, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])
            q, kb, vb = b.op("Split", [qkv, b.const(f"{p}.qkv_sizes", [nh * hd, kv * hd, kv * hd])], f"{p}.qkv",
                             outputs=3, axis=-1)
            q = ops.rotary(ops.norm(q, dsrc.get(f"{a}.q_norm.weight") * np.float32(hd ** -0.5), f"{p}.q_norm", nh),
                           blk_at, nh, f"{p}.q_rope")  # the softmax scale folded into q's norm weight
            kb = ops.rotary(ops.norm(kb, dsrc.get(f"{a}.k_norm.weight"), f"{p}.k_norm", kv), blk_at, kv,
                            f"{p}.k_rope")
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
            scores = ops.f32(scores, f"{p}.scores")  # masked and softmaxed in fp32 (reference.layers.attend)
            mask = masks.get((dc.layer_causal[i], dc.layer_window[i]))
            if mask is not None:  # [B, T + B] additive
                scores = b.op("Add", [scores, mask], f"{p}.masked")[0]
            probs = ops.back(b.op("Softmax", [scores], f"{p}.softmax", axis=-1)[0], f"{p}.probs")  # [kv, g, B, T+B]
            out = b.op("MatMul", [probs, b.op("Unsqueeze", [vals, ax1], f"{p}.values.g")[0]], f"{p}.attend")[0]
            out = b.op("Transpose", [out], f"{p}.attn.t", perm=[2, 0, 1, 3])[0]  # [B, kv, g, hd]
            out = b.op("Reshape", [out, attn_flat], f"{p}.attn.flat")[0]
            return b.linear(out, f"{p}.o_proj", dsrc, [f"{a}.o_proj"])

        def mlp(x: str) -> str:
            m = f"{p}.mlp"
            gate, up = b.op("Split", [b.linear(x, f"{m}.gate_up_proj", dsrc, [f"{m}.gate_proj", f"{m}.up_proj"]),
                                      b.const(f"{m}.sizes", [dc.intermediate_size] * 2)], f"{m}.gate_up", outputs=2,
                            axis=-1)
            act = silu(b, gate, f"{m}.silu")  # fp16 / bf16: in fp32, rounded once, as the reference's
            return b.linear(b.op("Mul", [act, up], f"{m}.act")[0], f"{m}.down_proj", dsrc, [f"{m}.down_proj"])

        u = norm("input_layernorm")
        pending = _sublayer(b, dc, dsrc, u, f"{p}.attention_conv", attention) if v2 else attention(u)
        u = norm("post_attention_layernorm")
        pending = _sublayer(b, dc, dsrc, u, f"{p}.mlp_conv", mlp) if v2 else mlp(u)
    y = ops.add_norm(pending, h, dsrc.get("norm.weight"), "norm")[0]  # [1, B, H]
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
        if v2:  # [1, S, H] -> [S, H]: Gemm takes matrices
            flat = b.op("Squeeze", [hidden, ax0], "draft_head.rows")[0]
            logits = b.op("Unsqueeze", [b.head(flat, rows, "draft_head"), ax0], "draft_head.batch")[0]
        else:
            logits = b.head(hidden, rows, "draft_head")
        logits = ops.f32(logits, "draft_head")  # [.., S, Nv] fp32: top-K and the selector read fp32 logits
    id_map = None if draft_ids is None else b.weight("draft_vocab.ids", np.asarray(draft_ids, np.int32))
    if v2:
        _selector(b, dc, dsrc, hidden, logits, id_map, ax0)
    else:
        _top1(b, dc, logits, id_map)


def _io(dc, tc, fuse_context: bool, dt: int, fixed: bool) -> tuple[list, list]:
    """(inputs, outputs) value infos: DrafterGraph / SamplingDrafterGraph's, the cache in the graph dtype."""
    f32, v2 = TensorProto.FLOAT, dc.version == 2
    ctx_w = dc.hidden_size if fuse_context else len(dc.target_layer_ids) * tc.hidden_size
    kv_row = [dc.num_layers, 2, dc.num_kv_heads, dc.head_dim]
    S = dc.num_drafts
    cache = (helper.make_tensor_value_info(N.CTX_KV_CACHE, dt, ["cap", *kv_row]) if fixed else
             helper.make_tensor_value_info(N.PAST_CTX_KV, dt, ["past", *kv_row]))
    inputs = [helper.make_tensor_value_info(N.CONTEXT, dt, ["n", ctx_w]), cache,
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
    if fixed:
        inputs.append(helper.make_tensor_value_info(N.PAST_LEN, TensorProto.INT32, [1]))
    outputs.append(helper.make_tensor_value_info(N.NEW_CTX_KV, dt, ["n", *kv_row]))
    return inputs, outputs


def _prefix() -> list[onnx.NodeProto]:
    """past_ctx_kv is the valid prefix: its rows at positions 0 .. past - 1, the new rows from past."""
    return [helper.make_node("Identity", [N.PAST_CTX_KV], ["ctx.past"], name="ctx.past"),
            helper.make_node("Shape", [N.PAST_CTX_KV], ["ctx.past.rows"], name="ctx.past.rows", end=1),
            helper.make_node("Squeeze", ["ctx.past.rows", "axis0"], ["ctx.start"], name="ctx.start"),
            helper.make_node("Range", ["zero", "ctx.start", "one"], ["ctx.past_pos"], name="ctx.past_pos")]


def _window_prefix() -> list[onnx.NodeProto]:
    """past_ctx_kv is the window buffer's valid rows, row r at real position window_base + r: the new rows from
    window_base + past (runtime.window.CompactingKv keeps base + rows = the committed context length)."""
    return [helper.make_node("Identity", [N.PAST_CTX_KV], ["ctx.past"], name="ctx.past"),
            helper.make_node("Shape", [N.PAST_CTX_KV], ["ctx.past.rows"], name="ctx.past.rows", end=1),
            helper.make_node("Squeeze", ["ctx.past.rows", "axis0"], ["ctx.rows"], name="ctx.rows"),
            helper.make_node("Squeeze", [N.WINDOW_BASE, "axis0"], ["ctx.base"], name="ctx.base"),
            helper.make_node("Add", ["ctx.base", "ctx.rows"], ["ctx.start"], name="ctx.start"),
            helper.make_node("Range", ["ctx.base", "ctx.start", "one"], ["ctx.past_pos"], name="ctx.past_pos")]


def _fixed() -> list[onnx.NodeProto]:
    """ctx_kv_cache is the whole buffer, past_len its valid rows: the new rows from past_len; a stale row
    r >= past_len gets position r + cap + n, after the block (DrafterGraph._fixed): the context mask hides it."""
    return [helper.make_node("Identity", [N.CTX_KV_CACHE], ["ctx.past"], name="ctx.past"),
            helper.make_node("Cast", [N.PAST_LEN], ["ctx.past_len"], name="ctx.past_len", to=TensorProto.INT64),
            helper.make_node("Squeeze", ["ctx.past_len", "axis0"], ["ctx.start"], name="ctx.start"),
            helper.make_node("Shape", [N.CTX_KV_CACHE], ["ctx.cap.rows"], name="ctx.cap.rows", end=1),
            helper.make_node("Squeeze", ["ctx.cap.rows", "axis0"], ["ctx.cap"], name="ctx.cap"),
            helper.make_node("Range", ["zero", "ctx.cap", "one"], ["ctx.rows"], name="ctx.rows"),
            helper.make_node("Less", ["ctx.rows", "ctx.start"], ["ctx.rows.valid"], name="ctx.rows.valid"),
            helper.make_node("Add", ["ctx.cap", "ctx.n"], ["ctx.cap_n"], name="ctx.cap_n"),
            helper.make_node("Add", ["ctx.rows", "ctx.cap_n"], ["ctx.rows.stale"], name="ctx.rows.stale"),
            helper.make_node("Where", ["ctx.rows.valid", "ctx.rows", "ctx.rows.stale"], ["ctx.past_pos"],
                             name="ctx.past_pos")]


def _model(b: Builder, at: int, prologue, io, name: str, fused: bool = False) -> onnx.ModelProto:
    domains = ((("com.microsoft", 1),) if fused else ()) + (
        ((C.ONNX_DOMAIN, C.ONNX_OPSET),) if any(n.domain == C.ONNX_DOMAIN for n in b.nodes) else ())
    return b.model(name, *io, opset=OPSET, prologue_at=at, prologue=prologue, domains=domains)


def _masks(b: Builder, dc, P: str, past_pos: str | None, ctx_pos: str, blk_pos: str, blk_start: str) -> dict:
    """(causal, window) -> an additive fp32 [B, T + B] mask for each rule a layer uses that hides something
    (reference.layers.visibility over the context's and the block's absolute positions). past_pos None (the
    prefix binding: every cache row is context before the block): none for the plain non-causal block over all
    context (the default DFlash layer); given (a fixed binding whose stale rows sit after the block): every rule
    also hides context rows at or after the block start (DrafterGraph._fixed's ctx_ok)."""
    out = {}
    k_pos = q_pos = ctx_ok = None
    for rule in sorted(set(zip(dc.layer_causal, dc.layer_window)), key=str):
        causal, window = rule
        if not causal and window is None and past_pos is None:
            continue
        if k_pos is None:
            past = b.op("Range", ["zero", P, "one"], "past_pos")[0] if past_pos is None else past_pos
            ctx = b.op("Concat", [past, ctx_pos], "context_pos", axis=0)[0]  # [T]
            k_pos = b.op("Concat", [ctx, blk_pos], "key_pos", axis=0)[0]  # [T + B]
            k_pos = b.op("Unsqueeze", [k_pos, "axis0"], "key_pos.row")[0]  # [1, T + B]
            q_pos = b.op("Unsqueeze", [blk_pos, "axis1"], "query_pos.col")[0]  # [B, 1]
            if past_pos is not None:
                block_keys = b.weight("block_keys", np.ones(dc.block_size, bool))
                ctx_ok = b.op("Concat", [b.op("Less", [ctx, blk_start], "context_ok")[0], block_keys], "key_ok",
                              axis=0)[0]  # [T + B]
        tag = f"mask.{'causal' if causal else 'full'}.{window}"
        ok = ctx_ok
        diff = b.op("Sub", [q_pos, k_pos], f"{tag}.diff")[0]  # [B, T + B]: q - k
        if causal:
            c = b.op("GreaterOrEqual", [diff, "zero"], f"{tag}.causal")[0]
            ok = c if ok is None else b.op("And", [ok, c], f"{tag}.causal_ok")[0]
        if window is not None:
            w = b.const(f"{tag}.w", window)
            near = b.op("Less", [diff, w], f"{tag}.behind")[0]
            if not causal:
                ahead = b.op("Less", [b.op("Neg", [diff], f"{tag}.neg")[0], w], f"{tag}.ahead")[0]
                near = b.op("And", [near, ahead], f"{tag}.window")[0]
            ok = near if ok is None else b.op("And", [ok, near], f"{tag}.both")[0]
        if ok is ctx_ok:  # [T + B] -> [1, T + B]
            ok = b.op("Unsqueeze", [ok, "axis0"], f"{tag}.row")[0]
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
    coef = b.op("Add", [delta, b.fw(f"{conv}.base_kernel", src.get(f"{conv}.base_kernel"))], f"{conv}.coef")[0]
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
    K, R = dc.selector_top_k, dc.selector_rank
    vals, idx = b.op("TopK", [logits, b.const("top_k", [K])], "top_k", outputs=2, axis=-1, largest=1, sorted=1)
    cand = b.op("Cast", [idx], "cand.int32", to=TensorProto.INT32)[0]  # [1, S, K]: a batch of one, as the op takes
    if id_map is not None:
        cand = b.op("Gather", [id_map, cand], "cand.ids")[0]
    b.op("Squeeze", [cand, ax0], N.CAND_IDS, outputs=[N.CAND_IDS])
    gate = b.linear(hidden, "selector.gate", src, ["candidate_selector.hidden_projection"])  # [1, S, R]
    inputs = [vals, cand, gate, N.ANCHOR,
              b.fw("candidate_selector.predecessor_codebook", src.get("candidate_selector.predecessor_codebook")),
              b.fw("candidate_selector.successor_codebook", src.get("candidate_selector.successor_codebook")),
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
