"""The target LLM (Llama / Qwen3 dense) as a pure function of (ids, past KV) for export.

KV layout: ONE tensor per model, sequence-major [T, L, 2, kv, hd]. A prefix of a preallocated
[max_seq, L, 2, kv, hd] buffer is then a contiguous view: the graph reads `past_kv` = buffer[:P]
and its `new_kv` output is written straight into buffer[P:P+n]. Rollback = move P.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash2.config import TargetConfig
from dflash2.reference.layers import Fp32Rope, Projections, RMSNorm, attend, rope_cos_sin, rope_inv_freq
from dflash2.reference.moe import mlp_for


class TargetLayer(nn.Module):
    def __init__(self, c: TargetConfig, index: int = 0):
        """index: the layer's place (a MoE target's MLP is sparse on some layers only, dflash2.reference.moe)."""
        super().__init__()
        self.self_attn = Projections(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                     c.attention_bias, c.qk_norm, c.rms_norm_eps)
        self.mlp = mlp_for(c, index)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, past_k, past_v, cos, sin, visible):
        u = self.input_layernorm(h)
        q = self.self_attn.query(u, cos, sin)  # [n, nh, hd]
        k, v = self.self_attn.key_value(u, cos, sin)  # [n, kv, hd]
        a = attend(q, torch.cat([past_k, k]), torch.cat([past_v, v]), visible)
        h = h + self.self_attn.o_proj(a)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, torch.stack([k, v], dim=1)  # [n, 2, kv, hd]


class Target(Fp32Rope):
    """forward(ids [n], past_kv [P, L, 2, kv, hd]) -> logits [n, V], taps [n, n_taps*H], new_kv [n, L, 2, kv, hd]."""

    def __init__(self, c: TargetConfig, tap_ids: tuple[int, ...] = ()):
        super().__init__()
        self.config, self.tap_ids = c, tuple(tap_ids)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim), persistent=False)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, H]
        return self.embed_tokens(ids)

    def project(self, h: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]: the LM head
        return h @ self.head_weight.T

    def iter_layers(self):
        """The layers in order (dflash2.reference.streamed reads each one from disk as it is reached, and
        its embed / project read the vocabulary matrices a slice at a time)."""
        return iter(self.layers)

    def layer_masks(self, pos: torch.Tensor, k_pos: torch.Tensor) -> list[torch.Tensor]:
        """pos [n] (the queries'), k_pos [P+n] (the keys') -> per layer the visible keys [n, P+n]: causal on every
        layer here (a family with sliding-window layers narrows its own, dflash2.reference.muse_glimmer)."""
        return [k_pos[None, :] <= pos[:, None]] * self.config.num_layers

    def kv_row_shape(self) -> tuple[int, int, int, int]:
        c = self.config
        return (c.num_layers, 2, c.num_kv_heads, c.head_dim)

    def forward(self, input_ids: torch.Tensor, past_kv: torch.Tensor, past_len: torch.Tensor | None = None):
        """past_len None: past_kv holds exactly the P rows before this step. past_len [1]: past_kv is the
        whole [cap, ...] buffer, rows >= past_len are stale and masked by position (fixed step shapes)."""
        n, P = input_ids.shape[0], past_kv.shape[0]
        if past_len is None:
            start, k_pos = P, torch.arange(P + n)
        else:
            start, rows = past_len.reshape(1).long(), torch.arange(P)
            stale = rows + P + n  # a position after every query of this step: never visible
            k_pos = torch.cat([torch.where(rows < start, rows, stale), start + torch.arange(n)])
        pos = torch.arange(n) + start  # [n]
        cos, sin = rope_cos_sin(pos, self.inv_freq)
        masks = self.layer_masks(pos, k_pos)  # per layer [n, P+n] bool
        h = self.embed(input_ids)  # [n, H]
        taps, new_kv = {}, []
        for i, layer in enumerate(self.iter_layers()):
            h, kv = layer(h, past_kv[:, i, 0], past_kv[:, i, 1], cos, sin, masks[i])
            new_kv.append(kv)
            if i in self.tap_ids:
                taps[i] = h  # the OUTPUT of layer i (HF hidden_states[i + 1])
        logits = self.project(self.norm(h))  # [n, V]
        tap_out = torch.cat([taps[i] for i in self.tap_ids], dim=-1) if self.tap_ids else h[:, :0]
        return logits, tap_out, torch.stack(new_kv, dim=1)
