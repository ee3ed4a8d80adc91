"""Qwen3.5-MoE targets (transformers `qwen3_5_moe`) as a pure function of (ids, state): the Qwen3.5 hybrid reference
(dflash2.reference.qwen3_5: the same layers, state, commit) with every layer's MLP the sparse mixture of experts
with a shared expert (dflash2.reference.moe.SparseMoE). The config reader is the family's, torch-free
(dflash2.families.qwen3_5_moe); load_target(folder) is the family's reference entry point."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dflash2.families.qwen3_5_moe import Qwen35MoeConfig
from dflash2.reference.moe import SparseMoE, unfuse_experts
from dflash2.reference.qwen3_5 import Qwen35Target, load_hf_state_dict


class Qwen35MoeTarget(Qwen35Target):
    """Qwen35Target whose layers' `mlp` is a SparseMoE (transformers' Qwen3_5MoeSparseMoeBlock, same names)."""

    def __init__(self, c: Qwen35MoeConfig, tap_ids: tuple[int, ...] = ()):
        super().__init__(dataclasses.replace(c, intermediate_size=1), tap_ids)  # (a 1-wide dense MLP, replaced)
        self.config = c
        for layer in self.layers:
            layer.mlp = SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                                  c.norm_topk_prob, c.shared_expert_intermediate_size)


def load_target(folder: str | Path, tap_ids: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                config: Qwen35MoeConfig | None = None) -> Qwen35MoeTarget:
    """A Qwen3.5-MoE checkpoint folder (either architecture, either expert layout; safetensors) -> the reference."""
    from dflash2 import checkpoint as ckpt
    from dflash2 import families
    from dflash2.families.qwen3_5_moe import QWEN3_5_MOE, tensor_shapes

    c = config or families.load(folder)[1]
    ckpt.check_tensors(folder, tensor_shapes(c), QWEN3_5_MOE.ignored)
    model = Qwen35MoeTarget(c, tap_ids)
    tensors = unfuse_experts(ckpt.load_tensors(folder, set(tensor_shapes(c))))
    load_hf_state_dict(model, tensors, where=str(folder))
    return model.to(dtype).eval()
