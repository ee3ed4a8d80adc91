"""gpt-oss's experts on ONNX Runtime's com.microsoft `QMoE`: int8 from the MXFP4 bytes (block-exact), or the float
experts quantized by the export's block quantizer (int4 / int8). `dflash2-export --quantize int4|int8` of gpt-oss.

The CPU path for the published (MXFP4) checkpoints (docs/families/plan_muse_glimmer_gpt_oss.md, section 3):
ONNX Runtime 1.32 has no working CPU MXFP4 kernel, but every E2M1 value is a multiple of 0.5 up to 6, so a block of
32 MXFP4 values is exactly int8 codes 2 * value in [-12, 12] times one fp32 scale 2^(s - 128)
(reference.gpt_oss.mxfp4_to_int8, checked bitwise against the decode): the WEIGHTS are exact, QMoE int8 stores the
codes + 128 (its default zero point 128) as uint8 [E, N, K] with [E, N, K / 32] scales. So an MXFP4 checkpoint's
experts are int8 under --quantize int4 too (MXFP4 does not convert exactly to int4; re-rounding it would add a
second error for no memory saved that matters on CPU). Its activations are quantized to int8 inside the op (ONNX
Runtime has no fp32-activation kernel for 8-bit experts): that, not the weights, is where it departs from the fp32
reference (measured in tests/test_gpt_oss_export.py). A float checkpoint's experts go through ONNX Runtime's block
quantizer (dflash2.export.weights.NBits: the --quantize bits, block size, accuracy level), one expert at a time.

Row invariance (the export's k-row == 1-row check): QMoE's CPU kernel sums a row's k weighted expert outputs in an
order that depends on the step's other rows once k >= 3 (export/moe.py, measured; gpt-oss routes k = 4), so, as
moe._qmoe_slots does, the routing is computed here (the router's logits with their bias, never quantized; TopK of
the LOGITS; softmax over the k kept: gpt-oss's rule) and QMoE gets one row per (row, slot) with one-hot logits
(k = 1: weight exactly 1); the k outputs, each with its expert's down bias, are weighted and added in slot order.
int4 at accuracy level < 4 keeps fp32 activations, whose M = 1 GEMM path differs: those rows go in twice.

The op's SwiGLU is gpt-oss's: swiglu_fusion 1 (gate / up interleaved: gate_up_proj's even / odd columns, as the
checkpoint's [out, in] rows already are), G = min(g, limit), L = clamp(u, -limit, limit), G * sigmoid(alpha G) *
(L + beta) with alpha 1.702, beta 1, limit 7.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash2.export.moe import slot_feed, slot_sum
from dflash2.families.gpt_oss import MXFP4_BLOCK
from dflash2.reference.gpt_oss import mxfp4_to_int8


def int8_experts(b, u: str, src, c, m: str) -> str:
    """u [n, H] -> the experts' output [n, H] through QMoE int8 from the MXFP4 bytes (module docstring). src: the
    checkpoint's weights (checkpoint.Weights: `raw` reads the MXFP4 bytes); the experts written one at a time."""
    x = f"{m}.experts"
    if f"{x}.gate_up_proj_blocks" not in src:
        raise ValueError(f"{x}: QMoE int8 takes MXFP4 expert weights (block-exact); this checkpoint's are float")
    E = c.num_experts
    fcs = []
    for fc in ("gate_up_proj", "down_proj"):
        scales = []

        def codes(fc=fc, scales=scales):  # one expert's [1, N, K] uint8 at a time
            for e in range(E):
                blocks, s = (torch.from_numpy(src.raw(f"{x}.{fc}_{part}", slice(e, e + 1)))
                             for part in ("blocks", "scales"))
                q, scale = mxfp4_to_int8(blocks, s)  # int8 [1, N, K], fp32 [1, N, K / 32]
                scales.append(scale.numpy())
                yield (q.numpy().astype(np.int16) + 128).astype(np.uint8)  # QMoE's zero point 128

        fcs.append((fc, codes(), lambda scales=scales: np.concatenate(scales).astype(np.float32)))
    return _slots(b, u, src, c, m, fcs, bits=8, block=MXFP4_BLOCK, accuracy_level=0)


def quantized_experts(b, u: str, src, c, m: str) -> str:
    """u [n, H] -> the experts' output [n, H] through QMoE with the builder's quantization (b.nbits): int8 from the
    MXFP4 bytes where the checkpoint has them, else the float experts (src: a float-name source such as
    reference.gpt_oss.DecodedExperts, gate_up_proj [E, H, 2I], down_proj [E, I, H]) quantized one expert at a time
    by ONNX Runtime's block quantizer."""
    x, q, E = f"{m}.experts", b.nbits, c.num_experts
    if f"{x}.gate_up_proj_blocks" in src:
        return int8_experts(b, u, src, c, m)
    if q is None or q.dynamic:
        raise ValueError(f"{x}: QMoE takes blockwise int4 / int8 expert weights (the builder's quantization), found "
                         f"{'none' if q is None else 'dynamic int8'}")
    fcs = []
    for fc in ("gate_up_proj", "down_proj"):
        scales, zeros = [], []

        def packed(fc=fc, scales=scales, zeros=zeros):
            for e in range(E):
                w = src.get(f"{x}.{fc}", slice(e, e + 1))[0].astype(np.float32)  # [K, N]: [in, out]
                pk, sc, zp = q.quantize(w)  # ONNX Runtime's block quantizer on the [K, N] weight
                N = w.shape[1]
                scales.append(np.asarray(sc, np.float32).reshape(N, -1))  # [N, K / block]
                zeros.append(None if q.symmetric else np.asarray(zp).reshape(N, -1))
                yield np.asarray(pk).reshape(1, N, -1)  # [1, N, K * bits / 8]

        fcs.append((fc, packed(), lambda scales=scales: np.stack(scales),
                    None if q.symmetric else (lambda zeros=zeros: np.stack(zeros))))
    return _slots(b, u, src, c, m, fcs, bits=q.bits, block=q.block_size, accuracy_level=q.accuracy_level)


def _slots(b, u: str, src, c, m: str, fcs, bits: int, block: int, accuracy_level: int) -> str:
    """The routing, the (row, slot) rows through one QMoE, the weighted slot-order sum (module docstring). fcs:
    per fc (gate_up_proj, down_proj): (name, its experts' packed uint8 [1, N, K bits / 8] one expert at a time,
    scales() [E, N, K / block] once they are written[, zero_points()])."""
    x, E, H, I, k = f"{m}.experts", c.num_experts, c.hidden_size, c.intermediate_size, c.num_experts_per_tok
    logits = b.linear(u, f"{m}.router", src, [f"{m}.router"], quantize=False)  # [n, E] + bias: never quantized
    top, idx = b.op("TopK", [logits, b.const(f"{m}.k", [k])], f"{m}.topk", outputs=2, axis=-1)  # [n, k]: of logits
    top = b.op("Softmax", [top], f"{m}.softmax", axis=-1)[0]  # over the k kept
    twice = bits == 4 and accuracy_level < 4
    slot_rows, slot_logits, per_slot = slot_feed(b, u, idx, E, k, H, m, twice)
    inputs, zps = [slot_rows, slot_logits], []
    for (fc, packed, scales, *zeros), (N, K) in zip(fcs, ((2 * I, H), (H, I))):
        inputs.append(b.chunked(f"{x}.{fc}_Q{bits}", packed, (E, N, K * bits // 8), np.uint8))
        inputs.append(b.weight(f"{x}.{fc}_scales", scales()))  # after the codes: filled as they were written
        inputs.append(b.weight(f"{x}.{fc}_bias", src.get(f"{x}.{fc}_bias").astype(np.float32)))  # [E, N]
        zps.append(b.weight(f"{x}.{fc}_zero_points", zeros[0]()) if zeros and zeros[0] is not None else "")
    if any(zps):
        inputs += ["", "", ""] + zps  # no fc3 (gate|up interleaved in fc1); then fc1 / fc2 zero points
    attrs = dict(k=1, activation_type="swiglu", swiglu_fusion=1, activation_alpha=float(c.swiglu_alpha),
                 activation_beta=1.0, swiglu_limit=float(c.swiglu_limit), normalize_routing_weights=1,
                 expert_weight_bits=bits, block_size=block)
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    y = b.op("QMoE", inputs, f"{x}.qmoe", domain="com.microsoft", **attrs)[0]  # [(2) n k, H]: expert(row) + bias
    return slot_sum(b, y, top, per_slot, k, H, m, twice, f"{m}.out")  # [n, H]
