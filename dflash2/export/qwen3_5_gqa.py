"""The Qwen3.5 hybrid's full-attention layers on ONNX Runtime's GroupQueryAttention (the fused graph,
qwen3_5.build_fused), with the dense gqa graph's KV binding (signature kind gqa-shared, dflash2.export.gqa): per
full-attention layer i (0 .. La-1) `past_key_values.{i}.key|value` [1, kv, cap, hd] and `past_len` [1] int32 in,
`present.{i}.key|value` bound by the runtime to the same memory, the step's rows written at [past_len, ...) in
place. The standard-op layers sliced each layer's past out of one [P, La, 2, kv, hd] buffer and concatenated the
new rows every step (a Split of 4.4 ms per step at Qwen3.5-0.8B's shape, 2 threads). The GDN state rows are the
standard-op graph's but for the conv state, bound row-major ([1, K-1, C] in, [W', K-1, C] out: conv_major()).

What stays outside the kernel, as onnxruntime-genai's Qwen35TextModel writes it: QK norm, the partial rotary
(rotate-half over the first rotary_dim channels, our standard ops: the kernel runs with do_rotary=0) and the
sigmoid output gate.

Row invariance (a k-row verify row == the 1-row decode of that token, bit for bit; the export's row check):
- the kernel takes another path for a 1-row query: every call gets at least one extra row, a copy of the last
  (causal: no real row sees it), as the dense gqa graph does;
- at head_dim 256 the CPU kernel sums q.k in one pass up to 64 keys and in two 128-wide passes past 64, so a
  k-row verify ending past 64 keys differed from 1-row decodes that did not
  (scripts/experiments/gqa_rows_head_dim_256.py, docs/results/qwen3_5/gqa_rows_hd256_*.json). Every call is
  therefore padded with copies of its last row until past_len + rows >= MIN_KEYS (65): every call takes the
  past-64 path. The padded rows' K/V land at [past_len + n, max(past_len + n + 1, 65)), past the valid rows,
  overwritten by later steps: the buffers need max_seq_len >= 65 (unsupported()).
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper
from torch import nn

from dflash2.export import signature as N
from dflash2.export.gqa import per_layer_past
from dflash2.export.graphs import STALE_ROWS, GraphSpec

MIN_KEYS = 65  # past the kernel's 64-key one-pass path (module docstring)


def unsupported(max_seq_len: int) -> str | None:
    """Why the hybrid's gqa graph cannot serve max_seq_len (None: it can)."""
    if max_seq_len < MIN_KEYS:
        return f"expected --max-seq-len >= {MIN_KEYS} (the attention's padded rows reach row {MIN_KEYS - 1}), " \
               f"found {max_seq_len}"
    return None


def prologue() -> list:
    """start = past_len (int64 scalar), the step's positions pos [n] (what the partial rotary reads)."""
    return [helper.make_node("Cast", [N.PAST_LEN], ["past_len.i64"], name="past_len.i64", to=TensorProto.INT64),
            helper.make_node("Squeeze", ["past_len.i64", "axis0"], ["start"], name="start"),
            helper.make_node("Add", ["steps", "start"], ["pos"], name="pos")]


class GqaShared:
    """The kernel's shared inputs (built once): the padded row count and the lengths it reads."""

    def __init__(self, b, n: str):
        self.b = b
        n32 = b.op("Cast", [n], "gqa.n32", to=TensorProto.INT32)[0]
        end = b.op("Add", [N.PAST_LEN, n32], "gqa.end")[0]  # [1] past_len + n
        one = b.const("gqa.one", [1], np.int32)
        pad = b.op("Max", [one,
                           b.op("Sub", [b.const("gqa.min_keys", [MIN_KEYS], np.int32), end], "gqa.short")[0]],
                   "gqa.pad")[0]  # [1] int32: extra rows, >= 1
        total = b.op("Add", [end, pad], "gqa.total")[0]  # [1] past_len + n + pad >= 65
        self.seqlens_k = b.op("Sub", [total, one], "gqa.seqlens_k")[0]  # the kernel reads total - 1
        self.total_len = b.op("Squeeze", [total, b.const("gqa.axis0", [0])], "gqa.total_len")[0]  # [] int32
        self.pads = b.op("Concat", [b.const("gqa.z4", [0, 0, 0, 0]),
                                    b.op("Cast", [pad], "gqa.pad64", to=TensorProto.INT64)[0],
                                    b.const("gqa.z1", [0])], "gqa.pads", axis=0)[0]  # [0,0,0, 0,pad,0]
        self.rows = n  # [1] int64: the real rows, sliced back out


def attention(b, sh: GqaShared, q: str, k: str, v: str, nh: int, kvh: int, hd: int, ia: int, p: str) -> str:
    """q [n, nh, hd], k / v [n, kv, hd] (normed, rotated) -> the attention output [n, nh hd]; writes
    present.{ia}.key|value (the per-layer buffers, rows [past_len, past_len + n) the step's)."""
    past, present = N.gqa_kv_names(ia + 1)
    flat = []
    for t, heads, nm in ((q, nh, "q"), (k, kvh, "k"), (v, kvh, "v")):
        t = b.op("Reshape", [t, b.const(f"{p}.{nm}_batch", [1, -1, heads * hd])], f"{p}.{nm}_batch")[0]
        flat.append(b.op("Pad", [t, sh.pads], f"{p}.{nm}_pad", mode="edge")[0])  # [1, n + pad, heads hd]
    o = b.op("GroupQueryAttention", flat + [past[-2], past[-1], sh.seqlens_k, sh.total_len], f"{p}.attn",
             outputs=[f"{p}.attn.out", present[-2], present[-1]], domain="com.microsoft", num_heads=nh,
             kv_num_heads=kvh, do_rotary=0, scale=float(hd ** -0.5))[0]
    o = b.op("Slice", [o, b.const(f"{p}.attn.first", [0]), sh.rows, b.const(f"{p}.attn.axis", [1])],
             f"{p}.attn.rows")[0]  # [1, n, nh hd]
    return b.op("Reshape", [o, b.const(f"{p}.o_flat", [-1, nh * hd])], f"{p}.o_flat")[0]


def io(La: int, kvh: int, hd: int) -> tuple[list, list]:
    """(inputs after input_ids, outputs) of the KV binding: past_len, the per-layer buffers."""
    past, present = N.gqa_kv_names(La)
    buf = [1, kvh, "cap", hd]
    return ([helper.make_tensor_value_info(N.PAST_LEN, TensorProto.INT32, [1])]
            + [helper.make_tensor_value_info(nm, TensorProto.FLOAT, buf) for nm in past],
            [helper.make_tensor_value_info(nm, TensorProto.FLOAT, buf) for nm in present])


class HybridGqaGraph(nn.Module):
    """The reference of the hybrid gqa graph: the plain HybridTargetGraph over the same past and states.
    (input_ids, past_len, per-layer buffers..., states...) -> (next_ids, context, logits, buffers with rows
    [past_len, past_len + n) written, per-row states)."""

    def __init__(self, plain: nn.Module, La: int):
        super().__init__()
        self.plain, self.La = plain, La
        self.target = plain.target

    def forward(self, input_ids, past_len, *rest):
        from dflash2.export.gqa import to_rows

        P, n = int(past_len[0]), input_ids.shape[0]
        buffers, states = rest[:2 * self.La], rest[2 * self.La:]
        next_ids, context, new_kv, logits, *per_row = self.plain(input_ids, to_rows(buffers, P), *conv_major(states))
        present = []
        for j, buf in enumerate(buffers):
            out = buf.clone()
            out[0, :, P:P + n] = new_kv[:, j // 2, j % 2].transpose(0, 1)  # [kv, n, hd]
            present.append(out)
        return (next_ids, context, logits, *present, *conv_major(per_row))

    def target_logits(self, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        from dflash2.export.gqa import to_rows

        buffers = [feed[nm] for nm in N.gqa_kv_names(self.La)[0]]
        plain = {N.INPUT_IDS: feed[N.INPUT_IDS], N.PAST_KV: to_rows(buffers, int(feed[N.PAST_LEN][0]))}
        plain |= {k: v.transpose(-1, -2).contiguous() if k.startswith(f"{N.CONV_STATE}.") else v
                  for k, v in feed.items() if N.is_state(k)}  # the conv state channel-major again (conv_major)
        return self.plain.target_logits(plain)


def conv_major(states) -> list:
    """Per-layer states in signature.state_names' order (conv, rec per GDN layer): each conv state's last two axes
    swapped, [., K-1, C] <-> [., C, K-1]: the gqa graph binds it row-major (qwen3_5_gdn.Gdn's conv_rows), the
    reference keeps it channel-major."""
    return [t.transpose(-1, -2).contiguous() if j % 2 == 0 else t for j, t in enumerate(states)]


def hybrid_gqa_spec(plain: GraphSpec) -> GraphSpec:
    """The gqa flavour of the hybrid target's spec: the plain feeds' past moved into per-layer buffers with
    STALE_ROWS random rows past the room the padded kernel writes (it must not read them), same reference."""
    La = len(plain.module.target.config.full_layers)
    past_names, present_names = N.gqa_kv_names(La)
    state_in = [nm for nm in plain.inputs if N.is_state(nm)]
    state_out = [nm for nm in plain.outputs if N.is_state(nm)]

    def convert(feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cap = max(feed[N.PAST_KV].shape[0] + feed[N.INPUT_IDS].shape[0] + 1, MIN_KEYS) + STALE_ROWS
        return per_layer_past(feed, past_names, cap) | dict(zip(state_in, conv_major([feed[nm] for nm in state_in])))

    def trim(name: str, value: np.ndarray, feed: dict) -> np.ndarray:
        if name not in present_names:
            return value
        return value[:, :, :int(feed[N.PAST_LEN][0]) + feed[N.INPUT_IDS].shape[0]]

    return GraphSpec("target", HybridGqaGraph(plain.module, La), [N.INPUT_IDS, N.PAST_LEN, *past_names, *state_in],
                     [N.NEXT_IDS, N.CONTEXT, N.LOGITS, *present_names, *state_out], {}, (),
                     lambda: [convert(f) for f in plain.feeds()], trim=trim)
