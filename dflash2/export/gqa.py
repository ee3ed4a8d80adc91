"""The target as ONNX Runtime's fused-op graph (`dflash2-export --target-attention gqa`).

What onnxruntime-genai's builder emits for a Llama, written from the reference module's weights:
`GroupQueryAttention` (rotary inside, one past/present buffer per layer and K|V shared in place),
`SkipSimplifiedLayerNormalization` (residual add + RMSNorm), `SimplifiedLayerNormalization`,
packed q|k|v and gate|up MatMuls. The plain-op graph spends ~38% of an int4 decode step on data
movement (slicing each layer's past out of one [P, L, 2, kv, hd] buffer, concatenating the new rows,
the rotary halves; docs/quantization.md); here nothing is sliced or concatenated.

KV binding (dflash2.export.signature, kind gqa-shared): per layer `past_key_values.{i}.key|value` [1, kv, cap, hd] (rotated keys),
`past_len` [1] int32 the valid rows; the runtime binds `present.{i}.key|value` to the SAME memory, and
the kernel writes the step's rows at [past_len, past_len + n) in place. Rollback = a smaller past_len.
The kernel gets one more row than the step, a copy of its last (causal: no real row sees it), and its
K|V lands at past_len + n, overwritten by the next step; the runtime keeps that row free. Why: the
kernel's attention takes another path for a 1-row query (GEMMs with M = 1), ~1e-7 off the multi-row
one; with int8 activations that can flip an argmax, so a decode would not equal the verify of the
same token (measured on SmolLM2 int4). Padding the whole step to 2 rows instead made every int4
decode 39% slower (MatMulNBits' 1-row kernel is its fastest); padding the attention's inputs costs one
`Pad` (mode edge) per q|k|v input and one `Slice` of its output per layer.
Outputs otherwise as the plain target graph: next_ids [n], context [n, C], logits [min(n, B), V].

The graph is checked like every flavour: against the PyTorch reference (`GqaTargetGraph`, the plain
Target over the same past) on the target's validation feeds.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from torch import nn

from dflash2.export import moe
from dflash2.export import signature as N
from dflash2.export import weights as W
from dflash2.export.templates import OPSET, Builder, head_norm, rope_caches
from dflash2.export.graphs import STALE_ROWS, GraphSpec, TargetGraph
from dflash2.reference.drafter import Drafter
from dflash2.reference.target import Target

def unsupported(tc, dc, max_seq_len: int) -> str | None:
    """Why a target cannot have the gqa graph (None: it can). tc / dc: the target / drafter configs."""
    if tc.head_dim % 16:  # ONNX Runtime's GroupQueryAttention with a rotary cache
        return f"expected a head_dim divisible by 16 (ONNX Runtime's GroupQueryAttention), found {tc.head_dim}"
    need = 11 + dc.block_size + 1  # the validation feeds: an 11-token prompt, a verify, the kernel's extra row
    if max_seq_len < need:
        return f"expected --max-seq-len >= {need} (validation feeds + the kernel's extra row), found {max_seq_len}"
    return None


def build_target(target: Target, drafter: Drafter, fuse_context: bool, max_seq_len: int) -> onnx.ModelProto:
    """The fp32 fused-op target graph (module docstring) from loaded reference modules, weights inline."""
    if target.norm.weight.dtype != torch.float32:
        raise ValueError("the gqa target graph is built from fp32 weights")
    return build(target.config, drafter.config, W.ModuleWeights(target), W.ModuleWeights(drafter), fuse_context,
                 max_seq_len)


def build(c, dc, src, dsrc, fuse_context: bool, max_seq_len: int, data: W.DataFile | None = None,
          progress=None, quant=None, native=None) -> onnx.ModelProto:
    """The fused-op target graph (module docstring) from weight sources (dflash2.export.weights: a
    safetensors folder read tensor by tensor, or a loaded module). c / dc: the target / drafter configs;
    src / dsrc: their weights; data: where the initializers go (None: inline); progress(i, L): per layer;
    quant: an OrtQuant (dflash2.export.quantize): the MatMul weights written as MatMulNBits as they are
    read (needs `data`); the embedding's Gather stays fp32."""
    if quant is not None and data is None:
        raise ValueError("a quantized build writes through a DataFile")
    nh, kv, hd, L, H = c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers, c.hidden_size
    B = dc.block_size
    tap_ids = tuple(dc.target_layer_ids)
    b = Builder(data, quant, native)
    eps = float(c.rms_norm_eps)
    past, present = N.gqa_kv_names(L)

    cos_cache, sin_cache = rope_caches(b, c.rope, hd, max_seq_len)
    # The kernel sees n + 1 rows: the last one repeated (module docstring: one path for every step).
    n = b.op("Shape", [N.INPUT_IDS], "n")[0]  # [1] int64
    seqlens_k = b.op("Add", [N.PAST_LEN, b.op("Cast", [n], "n32", to=TensorProto.INT32)[0]], "seqlens_k")[0]
    total = b.op("Add", [seqlens_k, b.const("one32", [1], np.int32)], "total")[0]  # [1]: past + n + 1
    total_len = b.op("Squeeze", [total, b.const("axis0", [0])], "total_len")[0]  # [] int32
    first, last, end = b.const("first_row", [0]), b.const("last_row", [-1]), b.const("to_end", [2**62])
    axis1 = b.const("axis1", [1])

    edge_row = b.const("edge_row", [0, 0, 0, 0, 1, 0])  # Pad's [begins..., ends...]: one row after the last

    def pad(x: str, name: str) -> str:  # [1, n, W] -> [1, n + 1, W], the new row a copy of the last (one node)
        return b.op("Pad", [x, edge_row], f"{name}.pad", mode="edge")[0]

    embed = b.chunked("embed_tokens.weight", src.row_chunks("embed_tokens.weight"), (c.vocab_size, H))
    h = b.op("Gather", [embed, N.INPUT_IDS], "embed")[0]  # [n, H]
    h = b.op("Unsqueeze", [h, "axis0"], "embed.batch")[0]  # [1, n, H]
    pending = None  # the sublayer output not yet added to the residual h
    taps = {}

    def norm(weight: str, name: str) -> str:
        """RMSNorm of h + pending; updates h to the sum (SkipSimplifiedLayerNormalization's 4th output)."""
        nonlocal h, pending
        w = b.weight(f"{name}.weight", src.get(weight))
        if pending is None:
            return b.op("SimplifiedLayerNormalization", [h, w], name, axis=-1, epsilon=eps, stash_type=1)[0]
        y, _, _, h = b.op("SkipSimplifiedLayerNormalization", [pending, h, w], name, outputs=4,
                          domain="com.microsoft", epsilon=eps)
        pending = None
        return y

    for i in range(L):
        p, a = f"layers.{i}", f"layers.{i}.self_attn"
        if progress is not None:
            progress(i, L)
        u = norm(f"{p}.input_layernorm.weight", f"{p}.input_layernorm")
        if i - 1 in tap_ids:
            taps[i - 1] = h  # the OUTPUT of layer i-1 (HF hidden_states[i])
        qkv = b.linear(u, f"{p}.qkv_proj", src, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])  # [1, n, (nh+2kv) hd]
        if c.qk_norm:  # Qwen3: per-head RMSNorm of q and k before the rotary
            q, k, v = b.op("Split", [qkv, b.const(f"{p}.qkv_sizes", [nh * hd, kv * hd, kv * hd])], f"{p}.qkv",
                           outputs=3, axis=-1)
            q, k = (head_norm(b, t, heads, hd, src.get(f"{a}.{nm}.weight"), eps, f"{p}.{nm}")
                    for t, heads, nm in ((q, nh, "q_norm"), (k, kv, "k_norm")))
            qkv_in = [pad(q, f"{p}.q"), pad(k, f"{p}.k"), pad(v, f"{p}.v")]
        else:
            qkv_in = [pad(qkv, f"{p}.qkv"), "", ""]  # packed
        attn = b.op("GroupQueryAttention", qkv_in + [past[2 * i], past[2 * i + 1], seqlens_k, total_len, cos_cache,
                                                      sin_cache],
                    f"{p}.attn", outputs=[f"{p}.attn.out", present[2 * i], present[2 * i + 1]],
                    domain="com.microsoft", num_heads=nh, kv_num_heads=kv, do_rotary=1, rotary_interleaved=0,
                    scale=float(hd ** -0.5))[0]  # [1, n + 1, nh hd]
        attn = b.op("Slice", [attn, first, last, axis1], f"{p}.attn.rows")[0]  # [1, n, nh hd]
        pending = b.linear(attn, f"{p}.o_proj", src, [f"{a}.o_proj"])
        u = norm(f"{p}.post_attention_layernorm.weight", f"{p}.post_attention_layernorm")
        m = f"{p}.mlp"
        if moe.is_sparse(c, i):  # a MoE target's sparse layer: ONNX Runtime's MoE / QMoE (dflash2.export.moe)
            pending = moe.fused(b, u, src, c, m)
        else:
            gate, up = b.op("Split", [b.linear(u, f"{p}.gate_up_proj", src, [f"{m}.gate_proj", f"{m}.up_proj"]),
                                      b.const(f"{p}.gate_up_sizes", [c.intermediate_size] * 2)], f"{p}.gate_up",
                            outputs=2, axis=-1)
            act = b.op("Mul", [gate, b.op("Sigmoid", [gate], f"{p}.sigmoid")[0]], f"{p}.silu")[0]
            pending = b.linear(b.op("Mul", [act, up], f"{p}.act")[0], f"{p}.down_proj", src, [f"{m}.down_proj"])
    y = norm("norm.weight", "norm")  # h is now the last layer's output
    if L - 1 in tap_ids:
        taps[L - 1] = h

    y = b.op("Squeeze", [y, "axis0"], "norm.rows")[0]  # [n, H]: the LM head's MatMul feeds the ArgMax directly
    head_name = "embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    head_blocks = b.native_blocks([head_name], src) if quant is not None and quant.lm_head else None
    if head_blocks is not None:  # the checkpoint's own blocks (e.g. Q8_0) as they are
        logits = b.matmul_blocks(y, "lm_head", head_blocks)
    elif quant is not None and quant.lm_head:  # the [H, V] transpose quantized one vocabulary slice at a time
        logits = b.matmul_nbits(y, "lm_head", (H, c.vocab_size), (r.T for r in src.row_chunks(head_name)))
    else:
        head = embed if c.tie_word_embeddings else b.chunked("lm_head.weight", src.row_chunks("lm_head.weight"),
                                                              (c.vocab_size, H))
        logits = b.head(y, head, "lm_head")  # [n, V] fp32
    ids = b.op("ArgMax", [logits], "argmax", axis=-1, keepdims=0)[0]
    b.op("Cast", [ids], N.NEXT_IDS, outputs=[N.NEXT_IDS], to=TensorProto.INT32)
    b.op("Slice", [logits, b.const("last_b", [-B]), end, "axis0"], N.LOGITS,
         outputs=[N.LOGITS])
    tap_rows = [b.op("Squeeze", [taps[t], "axis0"], f"tap{j}.{t}")[0] for j, t in enumerate(tap_ids)]  # [n, H] each
    t = tap_rows[0] if len(tap_rows) == 1 else b.op("Concat", tap_rows, "taps", axis=-1)[0]
    if fuse_context:  # drafter.context: hidden_norm(fc(taps)), as TargetGraph fuses it
        t = b.linear(t, "context.fc", dsrc, ["fc"])
        b.op("SimplifiedLayerNormalization", [t, b.weight("context.hidden_norm.weight", dsrc.get("hidden_norm.weight"))],
             "context.hidden_norm", outputs=[N.CONTEXT], axis=-1, epsilon=float(dc.rms_norm_eps),
             stash_type=1)
    else:
        b.op("Identity", [t], N.CONTEXT, outputs=[N.CONTEXT])

    f32, buf = TensorProto.FLOAT, [1, kv, "cap", hd]
    inputs = ([helper.make_tensor_value_info(N.INPUT_IDS, TensorProto.INT32, ["n"]),
               helper.make_tensor_value_info(N.PAST_LEN, TensorProto.INT32, [1])]
              + [helper.make_tensor_value_info(name, f32, buf) for name in past])
    ctx_width = dc.hidden_size if fuse_context else len(tap_ids) * H
    outputs = ([helper.make_tensor_value_info(N.NEXT_IDS, TensorProto.INT32, ["n"]),
                helper.make_tensor_value_info(N.CONTEXT, f32, ["n", ctx_width]),
                helper.make_tensor_value_info(N.LOGITS, f32, ["rows", c.vocab_size])]
               + [helper.make_tensor_value_info(name, f32, buf) for name in present])
    graph = helper.make_graph(b.nodes, "dflash2_target_gqa", inputs, outputs, b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name="dflash2")
    model.ir_version = 8
    return model


class GqaTargetGraph(nn.Module):
    """The reference of the gqa graph: the plain TargetGraph over the same past.
    (input_ids [n], past_len [1], per-layer buffers [1, kv, cap, hd]) -> (next_ids, context, logits,
    the buffers with rows [past_len, past_len + n) written). Rows past that are not compared (`trim`)."""

    def __init__(self, plain: TargetGraph):
        super().__init__()
        self.plain = plain
        self.target = plain.target  # the deviation measurement reads the target's logits

    def forward(self, input_ids: torch.Tensor, past_len: torch.Tensor, *buffers: torch.Tensor):
        P, n = int(past_len[0]), input_ids.shape[0]
        past_kv = to_rows(buffers, P)
        next_ids, context, new_kv, logits = self.plain(input_ids, past_kv)
        present = []
        for j, buf in enumerate(buffers):
            out = buf.clone()
            out[0, :, P:P + n] = new_kv[:, j // 2, j % 2].transpose(0, 1)  # [kv, n, hd]
            present.append(out)
        return (next_ids, context, logits, *present)

    def target_logits(self, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        buffers = [v for k, v in feed.items() if k.startswith("past_key_values.")]
        past = to_rows(buffers, int(feed[N.PAST_LEN][0]))
        return self.target(feed[N.INPUT_IDS].long(), past)[0].float()


def to_rows(buffers, P: int) -> torch.Tensor:
    """Per-layer [1, kv, cap, hd] buffers -> the plain layout's past [P, L, 2, kv, hd]."""
    ks = torch.stack([buf[0, :, :P].transpose(0, 1) for buf in buffers])  # [2L, P, kv, hd]
    return ks.view(len(buffers) // 2, 2, P, *ks.shape[2:]).permute(2, 0, 1, 3, 4)


def gqa_spec(plain: GraphSpec) -> GraphSpec:
    """The gqa flavour of the target's spec: the plain feeds moved into per-layer buffers with
    STALE_ROWS random rows past the valid ones (the kernel must not read them), same reference."""
    L = plain.module.target.config.num_layers
    past_names, present_names = N.gqa_kv_names(L)

    def convert(feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return per_layer_past(feed, past_names, feed[N.PAST_KV].shape[0] + feed[N.INPUT_IDS].shape[0] + STALE_ROWS)

    def trim(name: str, value: np.ndarray, feed: dict) -> np.ndarray:
        if name not in present_names:
            return value
        return value[:, :, :int(feed[N.PAST_LEN][0]) + feed[N.INPUT_IDS].shape[0]]

    return GraphSpec("target", GqaTargetGraph(plain.module), [N.INPUT_IDS, N.PAST_LEN, *past_names],
                     [N.NEXT_IDS, N.CONTEXT, N.LOGITS, *present_names], {}, (),
                     lambda: [convert(f) for f in plain.feeds()], trim=trim)


def per_layer_past(feed: dict[str, torch.Tensor], past_names: list[str], cap: int) -> dict[str, torch.Tensor]:
    """A plain feed's past_kv [P, L, 2, kv, hd] as GroupQueryAttention's per-layer buffers [1, kv, cap, hd] (rows
    past P random: the kernel must not read them) with past_len, beside input_ids."""
    p = feed[N.PAST_KV]
    g = torch.Generator().manual_seed(cap)
    out = {N.INPUT_IDS: feed[N.INPUT_IDS], N.PAST_LEN: torch.tensor([p.shape[0]], dtype=torch.int32)}
    for j, name in enumerate(past_names):
        buf = torch.randn(1, p.shape[3], cap, p.shape[4], generator=g).to(p.dtype)
        buf[0, :, :p.shape[0]] = p[:, j // 2, j % 2].transpose(0, 1)
        out[name] = buf
    return out
