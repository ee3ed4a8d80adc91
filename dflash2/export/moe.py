"""The sparse mixture-of-experts MLP (dflash2.reference.moe.SparseMoE) as layer templates, both op sets; the Qwen3-MoE
target is the dense Qwen3 target (plain.py, gqa.py) with this block on its sparse layers.

Both add a shared expert where the config has one (Qwen3.5-MoE: sigmoid(x @ shared_expert_gate^T) * SwiGLU(x), beside
the routed sum): the Qwen3.5-MoE target is the Qwen3.5 hybrid (qwen3_5.py) with this block on every layer.

standard(): opset-17 ops only (TensorRT parses it, any provider runs it), the all-experts form: the router's fp32
softmax, TopK, the kept weights (renormalised when the config says so) scattered into a dense [n, E] routing matrix
(zeros elsewhere); every expert's gate|up as ONE MatMul [H, E*2I], SwiGLU, each expert's intermediate scaled by its
routing weight, and one down MatMul [E*I, H] that sums over the experts. Exactly SparseMoE's function (a zero weight
removes an expert's term), but every expert is computed for every row: E/k times the routed FLOPs and every expert's
weights read each step. Correct first; the gathered form (only the routed rows per expert) is left to do. Every row
is computed by the same MatMuls whatever the other rows of the step: row-invariant as the dense MLP is.

fused(): ONNX Runtime's com.microsoft `MoE` (fp32 weights) or `QMoE` (int4 / int8 blockwise weights, quantized
expert by expert as the checkpoint is read: ONNX Runtime's own block quantizer, dflash2.export.weights.NBits).
fc1 = the experts' gate and up rows INTERLEAVED ([E, 2I, H]: swiglu_fusion=1, the only layout the CPU kernel takes),
fc2 = down [E, H, I]; swiglu with alpha 1, beta 0 and no clamp is silu(gate) * up. The op computes the router's
softmax and top-k from the logits (normalize_routing_weights = norm_topk_prob). Row invariance: the CPU kernel runs
an expert's rows as one GEMM whose M is the number of rows routed to it, and M = 1 takes another path than M >= 2
(measured ~1e-7 apart, tests/test_qwen3_moe_export.py); so the op is given every row twice ([x; x], 2n rows: every
routed expert sees M >= 2) and the first n output rows are kept: measured bitwise row-invariant that way, at 1.3-1.7x
the block's time. QMoE also sums a row's k expert outputs in an order that depends on the step's other rows (k >= 3:
~1e-8 apart), so it gets one row per (row, slot), routed to that one expert with weight 1, and the k weighted outputs
are added here in slot order (_qmoe_slots); its int8-activation kernels (int4 weights at accuracy level 4, the
export's default, and every int8 QMoE) need no doubling. (docs/families/qwen3_moe.md has the measurements; the
export's row check runs on every export.)
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from dflash2.export.templates import silu


def is_sparse(c, i: int) -> bool:
    """Layer i of target config c has the mixture of experts (a MoeTargetConfig; dense configs: never)."""
    sparse = getattr(c, "is_sparse", None)
    return sparse is not None and sparse(i)


def _names(m: str, E: int, proj: str) -> list[str]:
    return [f"{m}.experts.{e}.{proj}.weight" for e in range(E)]


def standard(b, ops, u: str, src, c, m: str) -> str:
    """u [n, H] -> the block's output [n, H] (module docstring). b: a templates.Builder; ops: its StandardOps;
    src: the weights; m: the checkpoint's prefix of the block (`layers.{i}.mlp`)."""
    E, I, k = c.num_experts, c.moe_intermediate_size, c.num_experts_per_tok
    # the router is never quantized: a quantized router would change which experts run
    logits = b.linear(u, f"{m}.router", src, [f"{m}.gate"], quantize=False)  # [n, E]
    probs = b.op("Softmax", [ops.f32(logits, f"{m}.router")], f"{m}.softmax", axis=-1)[0]  # [n, E] fp32
    top, idx = b.op("TopK", [probs, b.const(f"{m}.k", [k])], f"{m}.topk", outputs=2, axis=-1)  # [n, k]
    if c.norm_topk_prob:
        total = b.op("ReduceSum", [top, b.const(f"{m}.last", [-1])], f"{m}.top_sum", keepdims=1)[0]  # [n, 1]
        top = b.op("Div", [top, total], f"{m}.top_norm")[0]
    # scattered in fp32, then the graph dtype, as SparseMoE.route casts (opset 17's ConstantOfShape has no bf16)
    zero = helper.make_tensor("value", TensorProto.FLOAT, [1], [0])
    zeros = b.op("ConstantOfShape", [b.op("Shape", [logits], f"{m}.router.shape")[0]], f"{m}.zeros", value=zero)[0]
    weights = b.op("ScatterElements", [zeros, idx, top], f"{m}.weights.f32", axis=1)[0]  # [n, E]: 0 where not kept
    weights = ops.back(weights, f"{m}.weights")
    gate_up = [n for e in range(E) for n in (f"{m}.experts.{e}.gate_proj", f"{m}.experts.{e}.up_proj")]
    gu = b.linear(u, f"{m}.experts.gate_up", src, gate_up)  # [n, E*2I]: expert e's gate then up
    gu = b.op("Reshape", [gu, b.const(f"{m}.gu_shape", [-1, E, 2, I])], f"{m}.gu4")[0]  # [n, E, 2, I]
    gate, up = b.op("Split", [gu], f"{m}.gate_up", outputs=2, axis=2)  # [n, E, 1, I] each
    act = b.op("Mul", [silu(b, gate, f"{m}.silu"), up], f"{m}.act")[0]
    w4 = b.op("Reshape", [weights, b.const(f"{m}.w_shape", [-1, E, 1, 1])], f"{m}.w4")[0]  # [n, E, 1, 1]
    act = b.op("Reshape", [b.op("Mul", [act, w4], f"{m}.routed")[0], b.const(f"{m}.act_shape", [-1, E * I])],
               f"{m}.act_flat")[0]  # [n, E*I]
    down = np.concatenate([src.get(n).T for n in _names(m, E, "down_proj")])  # [E*I, H]: the sum over experts
    y = b.matmul(act, f"{m}.experts.down", down)
    del down
    return _with_shared(b, u, y, src, c, m)


def _with_shared(b, u: str, y: str, src, c, m: str) -> str:
    """y + sigmoid(u @ shared_expert_gate^T) * shared_expert(u) where the config has a shared expert (Qwen3.5-MoE's
    `shared_expert_intermediate_size`), else y. Standard ops on any leading shape ([n, H] or [1, n, H]); the gate's
    [H, 1] weight is not quantized (as the router)."""
    S = getattr(c, "shared_expert_intermediate_size", 0)
    if not S:
        return y
    p = f"{m}.shared_expert"
    gate, up = b.op("Split", [b.linear(u, f"{p}.gate_up", src, [f"{p}.gate_proj", f"{p}.up_proj"]),
                              b.const(f"{p}.sizes", [S, S])], f"{p}.split", outputs=2, axis=-1)
    act = b.op("Mul", [silu(b, gate, f"{p}.silu"), up], f"{p}.act")[0]
    shared = b.linear(act, f"{p}.down", src, [f"{p}.down_proj"])
    g = b.op("Sigmoid", [b.linear(u, f"{m}.shared_gate", src, [f"{m}.shared_expert_gate"], quantize=False)],
             f"{m}.shared_gate.sigmoid")[0]  # [.., 1]
    return b.op("Add", [y, b.op("Mul", [g, shared], f"{p}.gated")[0]], f"{m}.with_shared")[0]


def _fc1(src, m: str, e: int) -> np.ndarray:
    """Expert e's gate and up rows interleaved: [2I, H] (row 2j gate_j, row 2j+1 up_j)."""
    g, u = src.get(f"{m}.experts.{e}.gate_proj.weight"), src.get(f"{m}.experts.{e}.up_proj.weight")
    return np.stack([g, u], axis=1).reshape(-1, g.shape[1])


def fused(b, u: str, src, c, m: str) -> str:
    """u [1, n, H] (gqa.py) or [n, H] -> the same shape, through ONNX Runtime's MoE / QMoE (module docstring); QMoE
    when b quantizes. The expert tensors are written expert by expert (b.chunked: with a DataFile, one expert's
    weights in memory)."""
    E, H, I, k = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    rows = b.op("Reshape", [u, b.const(f"{m}.rows_shape", [-1, H])], f"{m}.rows")[0]  # [n, H]
    q = b.nbits
    fcs = (("fc1", lambda e: _fc1(src, m, e), (2 * I, H)),  # [N, K] per expert
           ("fc2", lambda e: src.get(f"{m}.experts.{e}.down_proj.weight"), (H, I)))
    if q is None:
        # fp32 activations take the M = 1 path: every row twice, so every routed expert sees M >= 2
        twice = b.op("Concat", [rows, rows], f"{m}.twice", axis=0)[0]  # [2n, H]
        logits = b.linear(twice, f"{m}.router", src, [f"{m}.gate"], quantize=False)  # [2n, E]
        fc1, fc2 = (b.chunked(f"{m}.experts.{fc}", (get(e)[None] for e in range(E)), (E, *nk), np.float32)
                    for fc, get, nk in fcs)
        y = b.op("MoE", [twice, logits, fc1, "", fc2], f"{m}.moe", domain="com.microsoft",
                 **_attrs(k, c.norm_topk_prob))[0]
        n = b.op("Shape", [rows], f"{m}.n", start=0, end=1)[0]
        y = b.op("Slice", [y, b.const(f"{m}.first", [0]), n, b.const(f"{m}.axis0", [0])], f"{m}.kept")[0]  # [n, H]
    else:
        y = _qmoe_slots(b, rows, src, c, m, fcs)
    y = b.op("Reshape", [y, b.op("Shape", [u], f"{m}.in_shape")[0]], f"{m}.out")[0]  # u's shape: [1, n, H] or [n, H]
    return _with_shared(b, u, y, src, c, m)  # (ONNX Runtime's MoE has no shared expert: added beside it)


def _attrs(k: int, norm: bool) -> dict:
    """MoE / QMoE attributes: swiglu with alpha 1, beta 0, no clamp (silu(gate) * up) on interleaved gate|up rows."""
    return dict(k=k, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                normalize_routing_weights=int(norm))


def _qmoe_slots(b, rows: str, src, c, m: str, fcs) -> str:
    """rows [n, H] -> the routed experts' weighted sum [n, H] through QMoE, one QMoE row per (row, slot).

    QMoE's CPU kernel sums a row's k weighted expert outputs in an order that depends on the other rows of the step
    (measured, ONNX Runtime 1.32: with k >= 3 a row alone and the same row in a 16-row step differ by ~1e-8 for int4
    and int8, either accuracy level; k = 2 commutes, which is why the 4-expert top-2 tiny pairs passed). So the
    router, its top-k and the renormalisation are computed here (standard ops, as standard() does), each (row, slot)
    is fed as its own row with one-hot logits ([n k, E]: 0 for its expert, -1e9 elsewhere; QMoE with k = 1 gives it
    weight softmax = exactly 1), and the k outputs are weighted and added here in slot order. QMoE still batches each
    expert's rows: every touched expert is read once per step."""
    E, H, k, q = c.num_experts, c.hidden_size, c.num_experts_per_tok, b.nbits
    if q.dynamic:
        raise ValueError("QMoE takes blockwise int4 / int8 expert weights, not dynamic int8")
    logits = b.linear(rows, f"{m}.router", src, [f"{m}.gate"], quantize=False)  # [n, E]: never quantized
    probs = b.op("Softmax", [logits], f"{m}.softmax", axis=-1)[0]  # [n, E] fp32
    top, idx = b.op("TopK", [probs, b.const(f"{m}.k", [k])], f"{m}.topk", outputs=2, axis=-1)  # [n, k]
    if c.norm_topk_prob:
        top = b.op("Div", [top, b.op("ReduceSum", [top, b.const(f"{m}.last", [-1])], f"{m}.top_sum",
                                     keepdims=1)[0]], f"{m}.top_norm")[0]
    # int4 at accuracy level < 4 keeps fp32 activations: their M = 1 path (see fused) is avoided by feeding twice
    twice = q.bits == 4 and q.accuracy_level < 4
    slot_rows, slot_logits, per_slot = slot_feed(b, rows, idx, E, k, H, m, twice)
    inputs, zps = [slot_rows, slot_logits], []
    for fc, get, (N, K) in fcs:
        scales, zeros = [], []

        def packed(get=get, N=N, scales=scales, zeros=zeros):
            for e in range(E):
                pk, sc, zp = q.quantize(get(e).T)  # ONNX Runtime's block quantizer on the [K, N] weight
                scales.append(np.asarray(sc, np.float32).reshape(N, -1))  # [N, K / block]
                zeros.append(None if q.symmetric else np.asarray(zp).reshape(N, -1))
                yield np.asarray(pk).reshape(1, N, -1)  # [1, N, K * bits / 8]

        inputs.append(b.chunked(f"{m}.experts.{fc}_Q{q.bits}", packed(), (E, N, K * q.bits // 8), np.uint8))
        inputs += [b.weight(f"{m}.experts.{fc}_scales", np.stack(scales)), ""]  # (no bias)
        zps.append("" if q.symmetric else b.weight(f"{m}.experts.{fc}_zero_points", np.stack(zeros)))
    inputs += ["", "", ""] + zps  # no fc3 (gate|up are fused in fc1); then fc1 / fc2 zero points
    attrs = _attrs(1, False)
    if q.accuracy_level:
        attrs["accuracy_level"] = q.accuracy_level
    y = b.op("QMoE", inputs, f"{m}.qmoe", domain="com.microsoft", expert_weight_bits=q.bits,
             block_size=q.block_size, **attrs)[0]  # [(2) n k, H]: expert(row) per (row, slot)
    return slot_sum(b, y, top, per_slot, k, H, m, twice, f"{m}.routed")


def slot_feed(b, rows: str, idx: str, E: int, k: int, H: int, m: str, twice: bool) -> tuple[str, str, str]:
    """QMoE's slot form, its input side: each (row, slot) of rows [n, H] one row of [n k, H] with one-hot logits
    [n k, E] (0 for the slot's expert idx [n, k], -1e9 elsewhere: QMoE with k = 1 weighs it exactly 1); twice: the
    rows fed twice (an M = 1 path avoided). -> (slot_rows, slot_logits, per_slot [n, k, H])."""
    onehot = b.op("OneHot", [idx, b.const(f"{m}.depth", [E]), b.const(f"{m}.onehot_values", [-1e9, 0.0], np.float32)],
                  f"{m}.onehot", axis=-1)[0]  # [n, k, E]
    slot_logits = b.op("Reshape", [onehot, b.const(f"{m}.slot_logits_shape", [-1, E])], f"{m}.slot_logits")[0]
    per_slot = b.op("Expand", [b.op("Unsqueeze", [rows, b.const(f"{m}.ax1", [1])], f"{m}.rows3")[0],
                               b.const(f"{m}.slots_shape", [1, k, 1])], f"{m}.per_slot")[0]  # [n, k, H]
    slot_rows = b.op("Reshape", [per_slot, b.const(f"{m}.slot_rows_shape", [-1, H])], f"{m}.slot_rows")[0]  # [n k, H]
    if twice:
        slot_rows = b.op("Concat", [slot_rows, slot_rows], f"{m}.twice", axis=0)[0]  # [2 n k, H]
        slot_logits = b.op("Concat", [slot_logits, slot_logits], f"{m}.twice_logits", axis=0)[0]
    return slot_rows, slot_logits, per_slot


def slot_sum(b, y: str, top: str, per_slot: str, k: int, H: int, m: str, twice: bool, out: str) -> str:
    """QMoE's slot form, its output side: y [(2) n k, H] (one expert output per (row, slot)) weighted by top [n, k]
    and added in slot order, the same for every row whatever the step's other rows -> out [n, H]."""
    if twice:
        half = b.op("Shape", [per_slot], f"{m}.nk", start=0, end=1)[0]  # n (the first dim of [n, k, H])
        nk = b.op("Mul", [half, b.const(f"{m}.k1", [k])], f"{m}.nk_rows")[0]
        y = b.op("Slice", [y, b.const(f"{m}.first", [0]), nk, b.const(f"{m}.axis0", [0])], f"{m}.kept")[0]
    y = b.op("Reshape", [y, b.const(f"{m}.y3_shape", [-1, k, H])], f"{m}.y3")[0]  # [n, k, H]
    y = b.op("Mul", [y, b.op("Unsqueeze", [top, b.const(f"{m}.ax2", [2])], f"{m}.w3")[0]], f"{m}.weighted")[0]
    parts = b.op("Split", [y], f"{m}.slots", outputs=k, axis=1) if k > 1 else [y]  # k x [n, 1, H]
    acc = parts[0]
    for j in range(1, k):
        acc = b.op("Add", [acc, parts[j]], f"{m}.sum{j}")[0]
    return b.op("Reshape", [acc, b.const(f"{m}.out_rows", [-1, H])], out)[0]  # [n, H]
