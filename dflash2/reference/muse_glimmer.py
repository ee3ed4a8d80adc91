"""The Muse-Glimmer text target (transformers `muse_glimmer`) as a pure function of (ids, past KV), for export.

The dense reference (dflash2.reference.target.Target) by composition: its forward (one KV tensor
[P, L, 2, kv, hd] for every layer, rollback = keep fewer rows, taps = layer outputs), with Muse-Glimmer's parts:
- `embed`: image / video placeholder ids -> 0, then the weightless RMSNorm (torch.pow(., -0.5), as transformers'
  MuseGlimmerRMSNorm); `embed_tokens.weight` stays the raw matrix, which a DFlash drafter embeds its block with
  (transformers' DFlash loop swaps the norm for Identity there);
- `layer_masks`: causal, and on sliding layers q - k < sliding_window (transformers' causal sliding mask). Every
  layer's K/V stays in the cache: the window is a mask, so memory is not bounded by it (a ring buffer is later);
- MuseGlimmerLayer: sigmoid-gated attention, scaleless QK norm with q times qk_scale_factor, no rotary on NoPE
  layers, zero-centred (1 + w) sandwich norms (dflash2.reference.qwen3_5.ZeroCentredRMSNorm, the same fp32 math);
- the final norm a plain w RMSNorm; `project`: T * tanh(lm_head(y) * output_multiplier / T).
The config reader is the family's (dflash2.families.muse_glimmer, torch-free). load_target(folder) is the family's
reference entry point.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash2.families.muse_glimmer import MuseGlimmerConfig, tensor_shapes
from dflash2.reference.layers import MLP, Fp32Rope, Projections, apply_rope, attend, rope_inv_freq
from dflash2.reference.qwen3_5 import ZeroCentredRMSNorm, load_hf_state_dict
from dflash2.reference.target import Target


def scaleless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' MuseGlimmerRMSNorm(with_scale=False): x * (mean(x^2) + eps)^-0.5 in fp32, cast back."""
    y = x.float()
    return (y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


class FinalNorm(nn.Module):
    """transformers' MuseGlimmerRMSNorm with its weight (plain w, NOT 1 + w; the product in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5) * self.weight.float()).type_as(x)


class GatedProjections(Projections):
    """q/k/v/o (+ biases with attention_bias) and the per-channel output gate `gate_proj` [nh*hd, H], no bias."""

    def __init__(self, c: MuseGlimmerConfig):
        super().__init__(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias, False,
                         c.rms_norm_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)


class MuseGlimmerLayer(nn.Module):
    def __init__(self, c: MuseGlimmerConfig, index: int):
        super().__init__()
        H = c.hidden_size
        self.rope, self.eps, self.qk_scale = c.layer_rope[index], c.rms_norm_eps, c.qk_scale_factor
        self.self_attn = GatedProjections(c)
        self.mlp = MLP(H, c.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(H, c.post_norm_eps)
        self.pre_feedforward_layernorm = ZeroCentredRMSNorm(H, c.rms_norm_eps)
        self.post_feedforward_layernorm = ZeroCentredRMSNorm(H, c.post_norm_eps)

    def forward(self, h, past_k, past_v, cos, sin, visible):
        """h [n, H], past_k / past_v [P, kv, hd], cos / sin [n, hd], visible [n, P+n] -> (h [n, H], [n, 2, kv, hd])."""
        a, n = self.self_attn, h.shape[0]
        u = self.input_layernorm(h)
        q = scaleless_rms(a.q_proj(u).view(n, a.heads, a.head_dim), self.eps) * self.qk_scale  # [n, nh, hd]
        k = scaleless_rms(a.k_proj(u).view(n, a.kv_heads, a.head_dim), self.eps)  # [n, kv, hd]
        v = a.v_proj(u).view(n, a.kv_heads, a.head_dim)
        if self.rope:  # a NoPE layer: q.k carries no position at all
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attend(q, torch.cat([past_k, k]), torch.cat([past_v, v]), visible)  # [n, nh*hd]
        o = a.o_proj(o * torch.sigmoid(a.gate_proj(u)))
        h = h + self.post_attention_layernorm(o)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h, torch.stack([k, v], dim=1)


class MuseGlimmerTarget(Target):
    """forward(ids [n], past_kv [P, L, 2, kv, hd], past_len=None) -> logits [n, V] (capped), taps, new_kv: Target's."""

    def __init__(self, c: MuseGlimmerConfig, tap_ids: tuple[int, ...] = ()):
        Fp32Rope.__init__(self)  # Target's fields, Muse-Glimmer's modules
        self.config, self.tap_ids = c, tuple(tap_ids)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(MuseGlimmerLayer(c, i) for i in range(c.num_layers))
        self.norm = FinalNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim), persistent=False)
        self.register_buffer("media_ids", torch.tensor(c.remapped_ids, dtype=torch.long), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, H]
        ids = torch.where(torch.isin(ids, self.media_ids), torch.zeros_like(ids), ids)
        return scaleless_rms(self.embed_tokens(ids), self.config.rms_norm_eps)

    def project(self, h: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]: capped logits, transformers' order
        T = self.config.final_logit_softcapping
        return torch.tanh(h @ self.head_weight.T * self.config.output_multiplier / T) * T

    def layer_masks(self, pos: torch.Tensor, k_pos: torch.Tensor) -> list[torch.Tensor]:
        causal = k_pos[None, :] <= pos[:, None]  # [n, P+n]
        return [causal if w is None else causal & (pos[:, None] - k_pos[None, :] < w)
                for w in self.config.layer_windows]


def load_target(folder: str | Path, tap_ids: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                config: MuseGlimmerConfig | None = None) -> MuseGlimmerTarget:
    """A MuseGlimmerForConditionalGeneration folder (safetensors, sharded or not) -> the text reference, eval mode;
    the vision tensors are not read. The family's entry point (dflash2.families.muse_glimmer)."""
    from dflash2 import checkpoint as ckpt
    from dflash2 import families

    c = config or families.load(folder)[1]
    expected = tensor_shapes(c)
    ckpt.check_tensors(folder, expected, families.by_name("muse_glimmer").ignored)
    model = MuseGlimmerTarget(c, tap_ids)
    load_hf_state_dict(model, ckpt.load_tensors(folder, set(expected)), where=str(folder))
    return model.to(dtype).eval()


class StreamedMuseGlimmerTarget(MuseGlimmerTarget):
    """MuseGlimmerTarget's interface with dflash2.reference.streamed's memory: the embedding and LM head StreamedRows
    (read a slice at a time), one layer resident (read from the checkpoint when it runs), the final norm loaded.
    The same forward: it reads its weights through embed / iter_layers / project."""

    def __init__(self, c: MuseGlimmerConfig, tap_ids: tuple[int, ...], weights, like=None,
                 dtype: torch.dtype = torch.float32):
        from dflash2.reference.streamed import _tensor
        from dflash2.reference.vocab import StreamedRows

        Fp32Rope.__init__(self)
        self.config, self.tap_ids, self.src = c, tuple(tap_ids), weights
        self.dtype = like.dtype if like is not None else dtype
        if like is not None:
            self.embed_rows, self.head_rows, self.norm = like.embed_rows, like.head_rows, like.norm
        else:
            self.embed_rows = StreamedRows(weights, "embed_tokens.weight", self.dtype)
            self.head_rows = self.embed_rows if c.tie_word_embeddings else \
                StreamedRows(weights, "lm_head.weight", self.dtype)
            self.norm = FinalNorm(c.hidden_size, c.rms_norm_eps)
            self.norm.weight = nn.Parameter(_tensor(weights, "norm.weight").to(self.dtype), requires_grad=False)
        self.lm_head = None
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim), persistent=False)
        self.register_buffer("media_ids", torch.tensor(c.remapped_ids, dtype=torch.long), persistent=False)
        with torch.device("meta"):  # one template per layer (NoPE or not): shapes only, never given tensors
            self._layers = [MuseGlimmerLayer(c, i).requires_grad_(False) for i in range(c.num_layers)]

    @property
    def head_weight(self):
        return self.head_rows

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.where(torch.isin(ids, self.media_ids), torch.zeros_like(ids), ids)
        return scaleless_rms(self.embed_rows.rows(ids), self.config.rms_norm_eps)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        T = self.config.final_logit_softcapping
        return torch.tanh(self.head_rows.project(h) * self.config.output_multiplier / T) * T

    def iter_layers(self):
        from dflash2.reference.streamed import _stream

        return _stream(self._layers, self.src, self.dtype)
