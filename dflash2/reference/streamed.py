"""The target reference with bounded memory: each layer's weights read from safetensors as it runs.

`StreamedTarget` computes exactly `Target.forward` (the same function, the same layer module), but holds
only the embedding, the final norm, the LM head and ONE layer: before layer i runs, its weights are
read from the checkpoint (dflash2.checkpoint.Weights, pread in pieces) into the one `TargetLayer`.
A forward pass then reads the checkpoint's layers once (1.2 GB of bf16 for Qwen3-0.6B: about a second
from the page cache), and the export's reference never holds the model: validation and the deviation
measurement of a 30-layer target cost what a 1-layer one does, plus the embedding and the head.

`truncated(tc, dc, k)`: the configs of the same pair cut to the first k target layers (taps spread over
them), for the end-to-end check of a truncated build with the real embedding and head.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from dflash2.config import DrafterConfig, TargetConfig
from dflash2.reference.layers import RMSNorm, rope_inv_freq
from dflash2.reference.target import Target, TargetLayer


class StreamedTarget(nn.Module):
    """Target's interface (forward, head_weight, kv_row_shape, embed_tokens, config, tap_ids), one layer resident."""

    forward = Target.forward
    head_weight = Target.head_weight
    kv_row_shape = Target.kv_row_shape

    def __init__(self, c: TargetConfig, tap_ids: tuple[int, ...], weights, like: StreamedTarget | None = None):
        """like: a StreamedTarget of the same checkpoint whose embedding, final norm and head are reused (a
        truncated reference beside the whole one: not a second copy of the largest tensors)."""
        super().__init__()
        self.config, self.tap_ids, self.src = c, tuple(tap_ids), weights
        if like is not None:
            self.embed_tokens, self.norm, self.lm_head = like.embed_tokens, like.norm, like.lm_head
        else:
            self.embed_tokens = nn.Embedding.from_pretrained(self._tensor("embed_tokens.weight"), freeze=True)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.norm.weight = nn.Parameter(self._tensor("norm.weight"), requires_grad=False)
            self.lm_head = None
            if not c.tie_word_embeddings:
                self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device="meta")
                self.lm_head.weight = nn.Parameter(self._tensor("lm_head.weight"), requires_grad=False)
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim), persistent=False)
        self._layer = TargetLayer(c).requires_grad_(False)
        self._names = [n for n, _ in self._layer.named_parameters()]

    def _tensor(self, name: str) -> torch.Tensor:
        return torch.from_numpy(self.src.get(name))  # fp32, checked finite (numpy widens bf16 ~5x faster here)

    def iter_layers(self):
        for i in range(self.config.num_layers):
            state = {n: self._tensor(f"layers.{i}.{n}") for n in self._names}
            self._layer.load_state_dict(state, strict=True, assign=True)  # the fresh tensors themselves: no copy
            yield self._layer


def truncated(tc: TargetConfig, dc: DrafterConfig, k: int) -> tuple[TargetConfig, DrafterConfig]:
    """The first k layers of the target; the drafter's taps moved into them, spread in order over layers
    0..k-1 (the first tap taken inside the layer loop, the last after it, the rest as distinct as k allows:
    so a tap order or concatenation bug shows; the context width stays)."""
    k = min(k, tc.num_layers)
    unique = sorted(set(dc.target_layer_ids))
    spread = {t: (k - 1 if len(unique) == 1 else round(j * (k - 1) / (len(unique) - 1))) for j, t in enumerate(unique)}
    taps = tuple(spread[t] for t in dc.target_layer_ids)
    return dataclasses.replace(tc, num_layers=k), dataclasses.replace(dc, target_layer_ids=taps)
