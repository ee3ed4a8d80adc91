"""A reduced Qwen3.5-MoE-shaped random DFlash2 pair: Qwen3.5-35B-A3B's layout (hybrid 3 GDN : 1 full attention,
head_dim 256, GDN heads 16 / 32 of 128, top-8 routing, expert and shared-expert width 512 / 512 -> 256 / 256 here),
narrower and shallower: hidden 1024, 8 layers, 64 experts, the real 248,320-row vocabulary; drafter 1 layer, block 16.

    python scripts/experiments/qwen3_5_moe_reduced.py /tmp/moe2/reduced

Result: docs/results/qwen3_5_moe/ (docs/families/qwen3_moe.md, 2026-12-06)."""
import sys
from pathlib import Path
from dflash2.bench.scalecheck import Shape, make_pair, _hybrid, QWEN3_5_TOKENS
root = Path(sys.argv[1])
moe = (("num_experts", 64), ("num_experts_per_tok", 8), ("moe_intermediate_size", 256),
       ("shared_expert_intermediate_size", 256))
s = Shape("qwen3.5-moe-reduced", 1024, 8, 8, 2, 1024, 248_320, False, 1, (1, 4, 6), block=16, head_dim=256,
          tokens=QWEN3_5_TOKENS, max_positions=262_144, sliding_window=None, family="qwen3_5_moe",
          extra=_hybrid(16, 32) + moe)
print(make_pair(s, root))
