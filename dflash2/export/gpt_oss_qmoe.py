"""gpt-oss's experts on ONNX Runtime's com.microsoft `QMoE` int8, the MXFP4 bytes converted block-exactly.

The CPU path for the published (MXFP4) checkpoints (docs/families/plan_muse_glimmer_gpt_oss.md, section 3):
ONNX Runtime 1.32 has no working CPU MXFP4 kernel, but every E2M1 value is a multiple of 0.5 up to 6, so a block of
32 MXFP4 values is exactly int8 codes 2 * value in [-12, 12] times one fp32 scale 2^(s - 128)
(reference.gpt_oss.mxfp4_to_int8, checked bitwise against the decode): the WEIGHTS are exact, QMoE int8 stores the
codes + 128 (its default zero point 128) as uint8 [E, N, K] with [E, N, K / 32] scales. Its activations are
quantized to int8 inside the op (ONNX Runtime has no fp32-activation kernel for 8-bit experts): that, not the
weights, is where it departs from the fp32 reference (measured in tests/test_gpt_oss_export.py). int8 QMoE measured
row-invariant as it is (export/moe.py), so each row goes in once.

The op's SwiGLU is gpt-oss's: swiglu_fusion 1 (gate / up interleaved: gate_up_proj's even / odd columns, as the
checkpoint's [out, in] rows already are), G = min(g, limit), L = clamp(u, -limit, limit), G * sigmoid(alpha G) *
(L + beta) with alpha 1.702, beta 1, limit 7; normalize_routing_weights 1 (softmax over all experts, top-k,
renormalised: the softmax over the k kept logits), the router's logits (with their bias) its router_probs input.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash2.families.gpt_oss import MXFP4_BLOCK
from dflash2.reference.gpt_oss import mxfp4_to_int8


def int8_experts(b, u: str, src, c, m: str) -> str:
    """u [n, H] -> the experts' output [n, H] through QMoE int8 (module docstring). src: the checkpoint's weights
    (checkpoint.Weights: `raw` reads the MXFP4 bytes); the experts written one at a time (Builder.chunked)."""
    x = f"{m}.experts"
    if f"{x}.gate_up_proj_blocks" not in src:
        raise ValueError(f"{x}: QMoE int8 takes MXFP4 expert weights (block-exact); this checkpoint's are float")
    E, H, I = c.num_experts, c.hidden_size, c.intermediate_size
    logits = b.linear(u, f"{m}.router", src, [f"{m}.router"], quantize=False)  # [n, E] + bias: never quantized
    inputs = [u, logits]
    for fc, (N, K) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        scales = []

        def codes(fc=fc, scales=scales):  # one expert's [1, N, K] uint8 at a time
            for e in range(E):
                blocks, s = (torch.from_numpy(src.raw(f"{x}.{fc}_{part}", slice(e, e + 1)))
                             for part in ("blocks", "scales"))
                q, scale = mxfp4_to_int8(blocks, s)  # int8 [1, N, K], fp32 [1, N, K / 32]
                scales.append(scale.numpy())
                yield (q.numpy().astype(np.int16) + 128).astype(np.uint8)  # QMoE's zero point 128

        inputs.append(b.chunked(f"{x}.{fc}_Q8", codes(), (E, N, K), np.uint8))
        inputs.append(b.weight(f"{x}.{fc}_scales", np.concatenate(scales).astype(np.float32)))  # [E, N, K / 32]
        inputs.append(b.weight(f"{x}.{fc}_bias", src.get(f"{x}.{fc}_bias").astype(np.float32)))  # [E, N]
    return b.op("QMoE", inputs, f"{x}.qmoe", domain="com.microsoft", k=c.num_experts_per_tok,
                activation_type="swiglu", swiglu_fusion=1, activation_alpha=float(c.swiglu_alpha),
                activation_beta=1.0, swiglu_limit=float(c.swiglu_limit), normalize_routing_weights=1,
                expert_weight_bits=8, block_size=MXFP4_BLOCK)[0]
