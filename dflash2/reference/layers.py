"""Building blocks shared by the target and the drafter, written for export: plain tensors,
no batch axis (batch 1 on the edge), shapes spelled out, RMSNorm and softmax in fp32."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies, with HF's linear and llama3 scaling rules."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    elif rope.type == "yarn":  # transformers' _compute_yarn_parameters (a gpt-oss YarnRope, dflash2.families.gpt_oss)
        inv = yarn_inv_freq(rope, head_dim)
    return inv


def yarn_inv_freq(rope, dim: int) -> torch.Tensor:
    """[dim/2] YaRN inverse frequencies: interpolated (/ factor) below the correction range, extrapolated above it,
    a linear ramp between; the attention factor (rope.attention_factor) scales cos and sin apart."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations):
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / \
            (2 * math.log(rope.theta))
    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the extrapolated share
    return interpolated * (1 - keep) + extrapolated * keep


class Fp32Rope(nn.Module):
    """A module whose `inv_freq` buffer stays the fp32 values whatever `.to(dtype)` does to the weights: an fp16
    copy is off by up to 2^-11 relative, i.e. a rotary angle off by 0.24 rad at position 2,000 (transformers'
    from_pretrained(dtype=...) keeps it fp32 too). Subclasses have `config.rope` and `config.head_dim`."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        inv = getattr(self, "inv_freq", None)
        if isinstance(inv, torch.Tensor) and inv.dtype != torch.float32:
            self.inv_freq = rope_inv_freq(self.config.rope, self.config.head_dim).to(inv.device)
        return self


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [n, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [n, hd]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, hd]; cos/sin [n, hd]; HF's rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :].to(x.dtype) + rotated * sin[:, None, :].to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, nh, hd], k/v [T, kv, hd], visible [n, T] bool -> [n, nh*hd]. GQA by reshape, MatMul only.
    sinks [nh] (gpt-oss): one more logit per head in the softmax's denominator, with no value row."""
    n, nh, hd = q.shape
    kv = k.shape[1]
    g = nh // kv
    qh = q.transpose(0, 1).reshape(kv, g * n, hd)  # [kv, g*n, hd]
    scores = torch.matmul(qh, k.permute(1, 2, 0)) * hd ** -0.5  # [kv, g*n, T]
    scores = scores.view(kv, g, n, -1).float()
    scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # head h = kv index * g + group index, as the reshape above lays the heads out
        col = sinks.float().view(kv, g, 1, 1).expand(kv, g, n, 1)
        probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
    probs = probs.to(v.dtype).view(kv, g * n, -1)
    out = torch.matmul(probs, v.transpose(0, 1))  # [kv, g*n, hd]
    return out.view(nh, n, hd).transpose(0, 1).reshape(n, nh * hd)


def visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """[n, T] bool from absolute positions (z-lab's _attention_mask rule)."""
    qp, kp = q_pos[:, None], k_pos[None, :]
    ok = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool)
    if causal:
        ok = ok & (kp <= qp)
    if window is not None:
        ok = ok & (qp - kp < window)
        if not causal:
            ok = ok & (kp - qp < window)
    return ok


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Projections(nn.Module):
    """q/k/v/o projections (+ optional per-head q/k RMSNorm) with HF parameter names; `bias` (the config's
    attention_bias) puts a bias on all four, as transformers' Llama and Qwen3 do."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                 qk_norm: bool, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)  # transformers' Llama / Qwen3: q, k, v and o
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def query(self, x: torch.Tensor, cos, sin) -> torch.Tensor:  # [n, H] -> [n, nh, hd]
        q = self.q_proj(x).view(x.shape[0], self.heads, self.head_dim)
        q = self.q_norm(q) if self.q_norm is not None else q
        return apply_rope(q, cos, sin)

    def key_value(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:  # [n, kv, hd] x2
        k = self.k_proj(x).view(x.shape[0], self.kv_heads, self.head_dim)
        k = self.k_norm(k) if self.k_norm is not None else k
        v = self.v_proj(x).view(x.shape[0], self.kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v
