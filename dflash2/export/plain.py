"""The target in standard ONNX ops, both flavours, from the layer templates (`--target-attention plain`).

What `TargetGraph` traced with torch.onnx computes, written from the checkpoint's weights tensor by tensor
(no trace, no loaded module): opset-17 ops only (MatMul, Softmax, Gather, Where, ...), so TensorRT parses it
and any ONNX Runtime provider runs it. One pass over the layers makes both flavours; they share every
initializer (one data file) and differ only in the prologue that says where the past is:
- portable (KV binding "prefix"): `past_kv` [past, L, 2, kv, hd] is the valid prefix; the step's rows sit at
  positions past .. past + n - 1;
- TensorRT (binding "fixed"): `kv_cache` [cap, L, 2, kv, hd] is the whole buffer and `past_len` [1] the valid
  rows; stale rows get a position after every query, so the causal mask hides them (as Target.forward does).
Outputs as TargetGraph: next_ids [n] int32, context [n, C], new_kv [n, L, 2, kv, hd], logits [min(n, B), V]
fp32. Numerics mirror the reference (dflash2.reference.layers): RMSNorm and softmax in fp32, everything else
in the graph dtype, the rotary angles computed as rope_cos_sin does (fp32 positions x inverse frequencies).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from dflash2 import dtypes
from dflash2.export import moe
from dflash2.export import signature as N
from dflash2.export.templates import Builder, StandardOps

F32 = TensorProto.FLOAT
DTYPES = ("float32", "float16", "bfloat16")


def build(c, dc, src, dsrc, fuse_context: bool, dtype: str = "float32", data=None,
          progress=None) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(portable, TensorRT flavour) of the plain target (module docstring). c / dc: target / drafter configs;
    src / dsrc: their weights (dflash2.export.weights: a checkpoint read tensor by tensor, or a module);
    data: a DataFile both graphs point into (None: inline); progress(i, L) per layer."""
    if dtype not in DTYPES:
        raise ValueError(f"plain templates: expected a dtype in {DTYPES}, found {dtype!r}")
    np_dt, onnx_dt = dtypes.numpy_dtype(dtype), dtypes.onnx_type(dtype)  # bfloat16: ml_dtypes' (BFLOAT16)
    nh, kv, hd, L = c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers
    g, eps = nh // kv, float(c.rms_norm_eps)
    tap_ids = tuple(dc.target_layer_ids)
    b = Builder(data, dtype=np_dt)
    ops = StandardOps(b, c.rope, hd, eps)
    ax0, ax1 = b.const("axis0", [0]), b.const("axis1", [1])  # (the prologues name "axis0" too)

    def matrix(name: str) -> str:  # a vocabulary matrix, written a row slice at a time in the graph dtype
        return b.chunked(name, src.row_chunks(name), src.shape(name))

    # --- shared by every layer: positions, the rotary rows, the causal visibility (prologues below)
    n = b.op("Shape", [N.INPUT_IDS], "n")[0]  # [1] int64
    n0 = b.op("Squeeze", [n, ax0], "n.scalar", outputs=["n.scalar"])[0]
    b.op("Range", [b.const("zero", 0), n0, b.const("one", 1)], "steps", outputs=["steps"])  # [n]
    prologue_at = len(b.nodes)  # each flavour's prologue goes here: start, pos [n] int64, k_pos [T] int64
    pos = "pos"
    # rope_cos_sin in the graph: any position (a table of max_seq_len rows would refuse the validation feeds or
    # ModelOpt's calibration prompts past a short --max-seq-len)
    rot = ops.at(pos, "rope")  # [n, 1, hd] each
    visible = b.op("LessOrEqual", [b.op("Unsqueeze", ["k_pos", ax0], "k_pos.row")[0],
                                   b.op("Unsqueeze", [pos, ax1], "pos.col")[0]], "visible")[0]  # [n, T] bool
    consts = attention_consts(b, kv, g, hd, n)

    h = b.op("Gather", [matrix("embed_tokens.weight"), N.INPUT_IDS], "embed", axis=0)[0]  # [n, H]
    taps, new_kv = {}, []
    for i in range(L):
        p, a = f"layers.{i}", f"layers.{i}.self_attn"
        if progress is not None:
            progress(i, L)
        u = ops.norm(h, src.get(f"{p}.input_layernorm.weight"), f"{p}.input_layernorm")
        qkv = b.linear(u, f"{p}.qkv_proj", src, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"],
                       rows=True)  # [n, (nh + 2kv) hd]
        q, k, v = b.op("Split", [qkv, b.const(f"{p}.qkv_sizes", [nh * hd, kv * hd, kv * hd])], f"{p}.qkv",
                       outputs=3, axis=-1)
        q = b.op("Reshape", [q, b.const(f"{p}.q_heads", [-1, nh, hd])], f"{p}.q_heads")[0]  # [n, nh, hd]
        k = b.op("Reshape", [k, b.const(f"{p}.k_heads", [-1, kv, hd])], f"{p}.k_heads")[0]  # [n, kv, hd]
        v = b.op("Reshape", [v, b.const(f"{p}.v_heads", [-1, kv, hd])], f"{p}.v_heads")[0]
        if c.qk_norm:  # Qwen3: per-head RMSNorm of q and k before the rotary
            q = ops.norm(q, src.get(f"{a}.q_norm.weight"), f"{p}.q_norm")
            k = ops.norm(k, src.get(f"{a}.k_norm.weight"), f"{p}.k_norm")
        q, k = ops.rotate(q, rot, f"{p}.q_rope"), ops.rotate(k, rot, f"{p}.k_rope")  # [n, heads, hd]
        o = attend(b, ops, p, i, q, k, v, nh, kv, hd, consts, visible)  # [n, nh hd]
        h = b.op("Add", [h, b.linear(o, f"{p}.o_proj", src, [f"{a}.o_proj"], rows=True)], f"{p}.attn_residual")[0]
        u = ops.norm(h, src.get(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attention_layernorm")
        m = f"{p}.mlp"
        if moe.is_sparse(c, i):  # a MoE target's sparse layer: the experts' block (dflash2.export.moe)
            mlp = moe.standard(b, ops, u, src, c, m)
        else:
            gate, up = b.op("Split", [b.linear(u, f"{p}.gate_up_proj", src, [f"{m}.gate_proj", f"{m}.up_proj"],
                                               rows=True),
                                      b.const(f"{p}.gate_up_sizes", [c.intermediate_size] * 2)], f"{p}.gate_up",
                            outputs=2, axis=-1)
            act = ops.silu(gate, f"{p}.silu")  # fp16: in fp32, rounded once, as the reference's
            mlp = b.linear(b.op("Mul", [act, up], f"{p}.act")[0], f"{p}.down_proj", src, [f"{m}.down_proj"],
                           rows=True)
        h = b.op("Add", [h, mlp], f"{p}.mlp_residual")[0]
        new_kv.append(kv_row(b, p, k, v, ax1))  # [n, 1, 2, kv, hd]
        if i in tap_ids:
            taps[i] = h  # the OUTPUT of layer i (HF hidden_states[i + 1])
    b.op("Concat", new_kv, N.NEW_KV, outputs=[N.NEW_KV], axis=1)  # [n, L, 2, kv, hd]
    y = ops.norm(h, src.get("norm.weight"), "norm")
    head = "embed_tokens.weight" if c.tie_word_embeddings else matrix("lm_head.weight")
    logits = ops.f32(b.head(y, head, "lm_head"), "logits")  # [n, V] fp32
    return finish(b, ops, logits, taps, tap_ids, c, dc, dsrc, fuse_context, [L, 2, kv, hd], onnx_dt, ax0,
                  "dflash2_target", prologue_at)


class AttentionConsts(NamedTuple):
    """The constants every layer's `attend` reads (one set per graph)."""
    four: str  # [4] int64: scores as [kv, g, n, T]
    neg: str  # the fp32 value of a masked score
    scale: str  # head_dim ** -0.5, fp32 (StandardOps.times)
    kv_index: list[str]  # the K and V indices of a layer's past rows
    sink_shape: str | None  # [4] int64: a sink column [kv, g, n, 1]
    drop_first: list[str] | None  # Slice's (starts, ends, axes): every column but the first


def attention_consts(b: Builder, kv: int, g: int, hd: int, n: str, sinks: bool = False) -> AttentionConsts:
    four = b.op("Concat", [b.const("kv_g", [kv, g]), n, b.const("minus1", [-1])], "scores4.shape", axis=0)[0]
    sink_shape = b.op("Concat", [b.const("kv_g.sink", [kv, g]), n, b.const("one.sink", [1])], "sink.shape",
                      axis=0)[0] if sinks else None  # [kv, g, n, 1]
    neg = b.const("masked", [np.finfo(np.float32).min], np.float32)
    scale = b.const("attn.scale", [hd ** -0.5], np.float32)
    kv_index = [b.const(f"kv.{j}", j) for j in (0, 1)]
    drop_first = [b.const("second", [1]), b.const("to_end.cols", [2**62]), b.const("last_axis", [-1])] \
        if sinks else None
    return AttentionConsts(four, neg, scale, kv_index, sink_shape, drop_first)


def attend(b: Builder, ops: StandardOps, p: str, i: int, q: str, k: str, v: str, nh: int, kv: int, hd: int,
           at: AttentionConsts, mask: str, sinks: np.ndarray | None = None, slot: tuple[str, int] | None = None) -> str:
    """Layer i's attention on the dense KV binding: q [n, nh, hd], k, v [n, kv, hd] (rotated where the layer
    rotates) over the layer's past rows and the step's -> o [n, nh hd]. GQA by reshape, MatMul only; the scores
    masked (mask [n, T] bool: causal, or a sliding window) and softmaxed in fp32. sinks [nh] (gpt-oss): a learned
    logit per head joining each row's softmax as one more column, dropped after it. The column goes FIRST: a k-row
    verify has masked columns after a row's last key that a 1-row decode has not, and a sink after them would sit
    in another SIMD lane of the softmax's sum (measured not row-invariant, ~1e-7).
    slot: (the past tensor, the layer's index in it), KvLayout.slot; None: layer i of "past" (every layer there)."""
    past, index = slot or ("past", i)
    layer_kv = b.op("Gather", [past, b.const(f"{p}.index", index)], f"{p}.past", axis=1)[0]  # [P, 2, kv, hd]
    pk, pv = (b.op("Gather", [layer_kv, at.kv_index[j]], f"{p}.past_{nm}", axis=1)[0]
              for j, nm in ((0, "k"), (1, "v")))  # [P, kv, hd]
    keys = b.op("Concat", [pk, k], f"{p}.keys", axis=0)[0]  # [T, kv, hd]
    vals = b.op("Concat", [pv, v], f"{p}.values", axis=0)[0]
    qh = b.op("Reshape", [b.op("Transpose", [q], f"{p}.q_t", perm=[1, 0, 2])[0],
                          b.const(f"{p}.q_groups", [kv, -1, hd])], f"{p}.q_groups")[0]  # [kv, g n, hd]
    s = b.op("MatMul", [qh, b.op("Transpose", [keys], f"{p}.k_t", perm=[1, 2, 0])[0]], f"{p}.scores")[0]  # [kv, g n, T]
    s3 = b.op("Shape", [s], f"{p}.scores.shape")[0]
    s = b.op("Reshape", [ops.times(s, at.scale, f"{p}.scaled"), at.four], f"{p}.scores4")[0]  # [kv, g, n, T]
    s = b.op("Where", [mask, ops.f32(s, f"{p}.scores"), at.neg], f"{p}.masked")[0]
    if sinks is None:
        probs = ops.back(b.op("Softmax", [s], f"{p}.softmax", axis=-1)[0], f"{p}.probs")
    else:  # head h = kv index * g + group index (the reshape above): the sinks [nh] as [kv, g, 1, 1]
        # the sinks join the fp32 scores as the reference holds them (rounded to the graph dtype, widened)
        sink = b.weight(f"{p}.self_attn.sinks", b.held(sinks).reshape(kv, nh // kv, 1, 1))
        col = b.op("Expand", [sink, at.sink_shape], f"{p}.sink_col")[0]  # [kv, g, n, 1]
        s = b.op("Concat", [col, s], f"{p}.with_sink", axis=-1)[0]  # [kv, g, n, 1 + T]
        probs = b.op("Softmax", [s], f"{p}.softmax", axis=-1)[0]
        probs = ops.back(b.op("Slice", [probs, *at.drop_first], f"{p}.sink_dropped")[0], f"{p}.probs")  # [kv, g, n, T]
    probs = b.op("Reshape", [probs, s3], f"{p}.probs3")[0]  # [kv, g n, T]
    o = b.op("MatMul", [probs, b.op("Transpose", [vals], f"{p}.v_t", perm=[1, 0, 2])[0]], f"{p}.attend")[0]
    o = b.op("Transpose", [b.op("Reshape", [o, b.const(f"{p}.o_heads", [nh, -1, hd])], f"{p}.o_heads")[0]],
             f"{p}.o_t", perm=[1, 0, 2])[0]  # [n, nh, hd]
    return b.op("Reshape", [o, b.const(f"{p}.o_flat", [-1, nh * hd])], f"{p}.o_flat")[0]  # [n, nh hd]


class KvLayout(NamedTuple):
    """Where each layer's K|V rows live. windowed: the sliding layers kept in the bounded window buffer
    (`window.past`, manifest.WindowSignature), in its order; the others on the ordinary `past`. Empty: every layer on
    `past` (the sliding layers masked over the full rows). keep: the past rows a sliding layer's query can see."""
    windowed: tuple[int, ...]
    keep: int

    def slot(self, i: int) -> tuple[str, int]:
        """(past tensor, index in it) of layer i, for attend."""
        if i in self.windowed:
            return "window.past", self.windowed.index(i)
        return "past", i - sum(1 for j in self.windowed if j < i)


def sliding(tc) -> tuple[list[int], int] | None:
    """(the sliding layers, keep) of a target config whose layers mix sliding-window and full attention: what the
    window buffer holds, and the past rows a sliding layer's query can see (W - 1). None: no window binding (no
    sliding layer, or none of full attention to carry the positions). dflash2-export writes the windowed target
    wherever this is not None (unless --window-kv off)."""
    windows = list(getattr(tc, "layer_windows", None) or [])
    slide = [i for i, w in enumerate(windows) if w is not None]
    if not slide or len(slide) == len(windows):
        return None
    return slide, max(windows[i] for i in slide) - 1


def kv_layout(windows: list, window_kv: bool, where: str) -> KvLayout:
    """windows: per layer its sliding window W (q - k < W) or None (full attention); window_kv: give the sliding
    layers the bounded window buffer. The window buffer's positions come from window_base, the full layers' from
    their own rows, so a graph needs at least one full layer (and, asked for the buffer, one sliding layer)."""
    slide = tuple(i for i, w in enumerate(windows) if w is not None)
    if not window_kv:
        return KvLayout((), 0)
    if not slide or len(slide) == len(windows):
        raise ValueError(f"{where}: the window KV buffer expects both sliding and full-attention layers, found "
                         f"layer windows {list(windows)}")
    return KvLayout(slide, max(windows[i] for i in slide) - 1)


def masks(b: Builder, windows: list, layout: KvLayout, ax0: str, ax1: str) -> dict:
    """Each window's visibility [n, T] bool: None -> causal over `k_pos` (the full layers' keys); W -> causal and
    q - k < W (transformers' sliding mask), over `window.k_pos` (the window buffer's real positions) where the
    layout has the buffer, else over `k_pos`."""
    q_col = b.op("Unsqueeze", ["pos", ax1], "pos.col")[0]  # [n, 1]
    rows = {"k_pos": b.op("Unsqueeze", ["k_pos", ax0], "k_pos.row")[0]}  # [1, T]
    if layout.windowed:
        rows["window.k_pos"] = b.op("Unsqueeze", ["window.k_pos", ax0], "window.k_pos.row")[0]  # [1, Tw]
    out = {None: b.op("LessOrEqual", [rows["k_pos"], q_col], "visible")[0]}
    for w in sorted({x for x in windows if x is not None}):
        k_row = rows["window.k_pos" if layout.windowed else "k_pos"]
        causal = b.op("LessOrEqual", [k_row, q_col], f"window{w}.causal")[0] if layout.windowed else out[None]
        near = b.op("Less", [b.op("Sub", [q_col, k_row], f"window{w}.distance")[0], b.const(f"window{w}", w)],
                    f"window{w}.near")[0]
        out[w] = b.op("And", [causal, near], f"window{w}.visible")[0]
    return out


def kv_outputs(b: Builder, rows: list[str], layout: KvLayout) -> None:
    """Every layer's kv_row [n, 1, 2, kv, hd] (layer order) -> new_kv [n, Lf, 2, kv, hd] (the layers on `past`) and,
    with a window buffer, new_window_kv [n, Lw, 2, kv, hd] (its layers, its order)."""
    full = [r for i, r in enumerate(rows) if i not in layout.windowed]
    b.op("Concat", full, N.NEW_KV, outputs=[N.NEW_KV], axis=1)
    if layout.windowed:
        b.op("Concat", [rows[i] for i in layout.windowed], N.NEW_WINDOW_KV, outputs=[N.NEW_WINDOW_KV], axis=1)


def kv_row(b: Builder, p: str, k: str, v: str, ax1: str) -> str:
    """Layer p's new K|V rows as its slice of `new_kv`: k, v [n, kv, hd] -> [n, 1, 2, kv, hd]."""
    kv = b.op("Concat", [b.op("Unsqueeze", [t, ax1], f"{p}.new_{nm}")[0] for t, nm in ((k, "k"), (v, "v"))],
              f"{p}.new_kv", axis=1)[0]  # [n, 2, kv, hd]
    return b.op("Unsqueeze", [kv, ax1], f"{p}.new_kv.layer")[0]


def finish(b: Builder, ops: StandardOps, logits: str, taps: dict, tap_ids, c, dc, dsrc, fuse_context: bool,
           kv_row: list[int], onnx_dt: int, ax0: str, name: str, prologue_at, domains=(),
           window_row: list[int] | None = None) -> tuple:
    """The tail every target on the dense KV binding shares (this module, muse_glimmer.py, gpt_oss.py): logits
    [n, V] fp32 -> next_ids (argmax), the last B logits rows, the drafter's context rows from the taps (fused:
    hidden_norm(fc(taps))), the graph io, and both flavours: (portable over `past_kv`, TensorRT's fixed buffer).
    kv_row: the row of `past_kv` (the layers on it); window_row: the window buffer's row [Lw, 2, kv, hd] of a graph
    with one (KvLayout), None: none."""
    B, H = dc.block_size, c.hidden_size
    ids = b.op("ArgMax", [logits], "argmax", axis=-1, keepdims=0)[0]
    b.op("Cast", [ids], N.NEXT_IDS, outputs=[N.NEXT_IDS], to=TensorProto.INT32)
    b.op("Slice", [logits, b.const("last_b", [-B]), b.const("to_end", [2**62]), ax0], N.LOGITS,
         outputs=[N.LOGITS])
    tap_rows = [taps[t] for t in tap_ids]
    t = tap_rows[0] if len(tap_rows) == 1 else b.op("Concat", tap_rows, "taps", axis=-1)[0]  # [n, n_taps H]
    if fuse_context:  # drafter.context: hidden_norm(fc(taps))
        t = ops.norm(b.linear(t, "context.fc", dsrc, ["fc"]), dsrc.get("hidden_norm.weight"), "context.hidden_norm",
                     eps=float(dc.rms_norm_eps))
    b.op("Identity", [t], N.CONTEXT, outputs=[N.CONTEXT])

    ctx_width = dc.hidden_size if fuse_context else len(tap_ids) * H
    outputs = [helper.make_tensor_value_info(N.NEXT_IDS, TensorProto.INT32, ["n"]),
               helper.make_tensor_value_info(N.CONTEXT, onnx_dt, ["n", ctx_width]),
               helper.make_tensor_value_info(N.NEW_KV, onnx_dt, ["n", *kv_row]),
               helper.make_tensor_value_info(N.LOGITS, F32, [f"Min(n, {B})", c.vocab_size])]  # the last B rows
    ids_in = helper.make_tensor_value_info(N.INPUT_IDS, TensorProto.INT32, ["n"])
    past = [ids_in, helper.make_tensor_value_info(N.PAST_KV, onnx_dt, ["past", *kv_row])]
    cache = [ids_in, helper.make_tensor_value_info(N.KV_CACHE, onnx_dt, ["cap", *kv_row]),
             helper.make_tensor_value_info(N.PAST_LEN, TensorProto.INT32, [1])]
    prefix, fixed = _prefix(), _fixed()
    if window_row is not None:  # the window buffer: its own view, valid rows and real positions (window.k_pos)
        base = helper.make_tensor_value_info(N.WINDOW_BASE, TensorProto.INT64, [1])
        outputs.append(helper.make_tensor_value_info(N.NEW_WINDOW_KV, onnx_dt, ["n", *window_row]))
        past += [helper.make_tensor_value_info(N.PAST_WINDOW_KV, onnx_dt, ["window_past", *window_row]), base]
        cache += [helper.make_tensor_value_info(N.WINDOW_CACHE, onnx_dt, ["window_cap", *window_row]),
                  helper.make_tensor_value_info(N.WINDOW_LEN, TensorProto.INT32, [1]), base]
        prefix, fixed = prefix + _window_prefix(), fixed + _window_fixed()
    return (b.model(name, past, outputs, prologue_at=prologue_at, prologue=prefix, domains=domains),
            b.model(f"{name}_fixed", cache, outputs, prologue_at=prologue_at, prologue=fixed, domains=domains))


def _prefix() -> list[onnx.NodeProto]:
    """past_kv is the valid prefix: start = its rows; key positions 0 .. past + n - 1."""
    return [helper.make_node("Identity", [N.PAST_KV], ["past"], name="past.view"),
            helper.make_node("Shape", [N.PAST_KV], ["past.rows"], name="past.rows", end=1),
            helper.make_node("Squeeze", ["past.rows", "axis0"], ["start"], name="start"),
            helper.make_node("Add", ["start", "n.scalar"], ["total"], name="total"),
            helper.make_node("Add", ["steps", "start"], ["pos"], name="pos"),
            helper.make_node("Range", ["zero", "total", "one"], ["k_pos"], name="k_pos")]


def _fixed() -> list[onnx.NodeProto]:
    """kv_cache is the whole buffer, past_len its valid rows: start = past_len; a stale row r >= past_len gets
    position r + cap + n (after every query: never visible), the step's rows start .. start + n - 1."""
    return [helper.make_node("Identity", [N.KV_CACHE], ["past"], name="past.view"),
            helper.make_node("Cast", [N.PAST_LEN], ["past_len.i64"], name="past_len.i64", to=TensorProto.INT64),
            helper.make_node("Squeeze", ["past_len.i64", "axis0"], ["start"], name="start"),
            helper.make_node("Shape", [N.KV_CACHE], ["cap.rows"], name="cap.rows", end=1),
            helper.make_node("Squeeze", ["cap.rows", "axis0"], ["cap"], name="cap"),
            helper.make_node("Range", ["zero", "cap", "one"], ["rows"], name="rows"),
            helper.make_node("Less", ["rows", "start"], ["rows.valid"], name="rows.valid"),
            helper.make_node("Add", ["cap", "n.scalar"], ["cap_n"], name="cap_n"),
            helper.make_node("Add", ["rows", "cap_n"], ["rows.stale"], name="rows.stale"),
            helper.make_node("Where", ["rows.valid", "rows", "rows.stale"], ["past.pos"], name="past.pos"),
            helper.make_node("Add", ["steps", "start"], ["pos"], name="pos"),
            helper.make_node("Concat", ["past.pos", "pos"], ["k_pos"], name="k_pos", axis=0)]



def _window_prefix() -> list[onnx.NodeProto]:
    """past_window_kv is the window buffer's valid rows [0, v), row 0 at real position window_base: key positions
    base .. base + v + n - 1 (the runtime keeps base + v equal to past_kv's rows, so the step's rows sit at pos)."""
    return [helper.make_node("Identity", [N.PAST_WINDOW_KV], ["window.past"], name="window.past.view"),
            helper.make_node("Shape", [N.PAST_WINDOW_KV], ["window.rows"], name="window.rows", end=1),
            helper.make_node("Squeeze", ["window.rows", "axis0"], ["window.v"], name="window.v"),
            helper.make_node("Squeeze", [N.WINDOW_BASE, "axis0"], ["window.base"], name="window.base"),
            helper.make_node("Add", ["window.v", "n.scalar"], ["window.total"], name="window.total"),
            helper.make_node("Add", ["window.base", "window.total"], ["window.end"], name="window.end"),
            helper.make_node("Range", ["window.base", "window.end", "one"], ["window.k_pos"], name="window.k_pos")]


def _window_fixed() -> list[onnx.NodeProto]:
    """window_cache is the whole window buffer, window_len its valid rows v: row r < v at base + r; a stale row at
    base + r + cap + n (after every query: never visible); the step's rows at base + v .. base + v + n - 1."""
    return [helper.make_node("Identity", [N.WINDOW_CACHE], ["window.past"], name="window.past.view"),
            helper.make_node("Cast", [N.WINDOW_LEN], ["window.len.i64"], name="window.len.i64", to=TensorProto.INT64),
            helper.make_node("Squeeze", ["window.len.i64", "axis0"], ["window.v"], name="window.v"),
            helper.make_node("Squeeze", [N.WINDOW_BASE, "axis0"], ["window.base"], name="window.base"),
            helper.make_node("Shape", [N.WINDOW_CACHE], ["window.cap.rows"], name="window.cap.rows", end=1),
            helper.make_node("Squeeze", ["window.cap.rows", "axis0"], ["window.cap"], name="window.cap"),
            helper.make_node("Range", ["zero", "window.cap", "one"], ["window.rows"], name="window.rows"),
            helper.make_node("Less", ["window.rows", "window.v"], ["window.valid"], name="window.valid"),
            helper.make_node("Add", ["window.rows", "window.base"], ["window.real"], name="window.real"),
            helper.make_node("Add", ["window.cap", "n.scalar"], ["window.cap_n"], name="window.cap_n"),
            helper.make_node("Add", ["window.real", "window.cap_n"], ["window.stale"], name="window.stale"),
            helper.make_node("Where", ["window.valid", "window.real", "window.stale"], ["window.past.pos"],
                             name="window.past.pos"),
            helper.make_node("Add", ["window.base", "window.v"], ["window.start"], name="window.start"),
            helper.make_node("Add", ["steps", "window.start"], ["window.new.pos"], name="window.new.pos"),
            helper.make_node("Concat", ["window.past.pos", "window.new.pos"], ["window.k_pos"], name="window.k_pos",
                             axis=0)]
