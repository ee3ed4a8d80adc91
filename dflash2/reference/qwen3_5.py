"""Qwen3.5 / 3.6 / 3.8 dense hybrid targets (transformers `qwen3_5`) as a pure function of (ids, state), for export.

Layers: `layer_types` (default: every `full_attention_interval`-th layer full attention, the rest Gated DeltaNet,
dflash2.reference.gated_deltanet). Differences from Qwen3 (dflash2.reference.target), checked against transformers'
modeling_qwen3_5.py:
- RMSNorms (input, post-attention, final, q_norm, k_norm) are zero-centred: x_hat * (1 + w), the product in fp32;
  the GDN output norm is the exception (plain w, gated by silu(z));
- full attention: q_proj emits [query ; gate] per head (2 * head_dim), output = o_proj(attn * sigmoid(gate));
  QK norm; RoPE on the first rotary_dim = head_dim * partial_rotary_factor channels only (rotate-half inside that
  slice), the rest pass through;
- interleaved M-RoPE: frequency i takes its angle from the T, H or W position (mrope_section); for text all three
  positions are the token index, so the angles are plain RoPE's (mrope_cos_sin; the tests check both cases);
- an in-checkpoint MTP head (`mtp.*`) and the vision tower (`model.visual.*`) are ignored by name.
The config reader (Qwen35Config, read_qwen3_5_config) is the family's, torch-free: dflash2.families.qwen3_5;
re-exported here. load_target(folder) is the family's reference entry point.

State (batch 1, no batch axis):
    kv   [P, La, 2, kv_heads, head_dim]   the full-attention layers' K/V, sequence-major (a prefix of a
                                          preallocated buffer is a view; rollback = keep fewer rows), La = full layers
    conv [Lg, conv_dim, K-1]              per GDN layer: the last K-1 inputs of its causal conv
    rec  [Lg, v_heads, k_dim, v_dim] fp32 per GDN layer: the delta-rule state
A step over n rows returns Step(kv [n, La, 2, kv, hd], conv [n, Lg, C, K-1], rec [n, Lg, Hv, dk, dv]): the new K/V
rows and the GDN states after EACH row. commit(state, step, a) keeps a of the n rows: nothing is recomputed.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from dflash2.errors import TensorSetError
from dflash2.families.qwen3_5 import (ARCHS, LAYER_TYPES, Qwen35Config, load_qwen3_5_config,  # noqa: F401 (re-exported)
                                      read_qwen3_5_config)
from dflash2.reference.gated_deltanet import GatedDeltaNet, compute_dtype
from dflash2.reference.layers import MLP

class ZeroCentredRMSNorm(nn.Module):
    """transformers' Qwen3_5RMSNorm: (x_hat * (1 + w)) in fp32, then cast (weights stored as w, zero at init)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cdt = compute_dtype(x.dtype)
        y = x.to(cdt)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(cdt))).type_as(x)


def mrope_inv_freq(c: Qwen35Config) -> torch.Tensor:
    return 1.0 / (c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float) / c.rotary_dim))


def mrope_cos_sin(pos3: torch.Tensor, inv_freq: torch.Tensor, section) -> tuple[torch.Tensor, torch.Tensor]:
    """pos3 [3, n] (T, H, W positions; text: the token index three times) -> cos, sin [n, rotary_dim].
    Interleaved: frequency i uses H for i % 3 == 1 and i < 3 * section[1], W for i % 3 == 2 and i < 3 * section[2],
    else T (transformers' recomposition_frequencies)."""
    freqs = pos3.float()[..., None] * inv_freq  # [3, n, rd/2]
    i = torch.arange(inv_freq.shape[0])
    pick = torch.zeros_like(i)
    pick = torch.where((i % 3 == 1) & (i < 3 * section[1]), 1, pick)
    pick = torch.where((i % 3 == 2) & (i < 3 * section[2]), 2, pick)
    f = torch.gather(freqs, 0, pick[None, None, :].expand(1, freqs.shape[1], -1))[0]  # [n, rd/2]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, hd]; cos/sin [n, rd]: rotate-half on the first rd channels, the rest unchanged."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    rot = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], dim=-1)
    xr = xr * cos[:, None, :].to(x.dtype) + rot * sin[:, None, :].to(x.dtype)
    return torch.cat([xr, xp], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """layers.attend with the softmax in compute_dtype (fp32, or fp64 for fp64 inputs): q [n, nh, hd],
    k/v [T, kv, hd], visible [n, T] -> [n, nh*hd]; GQA by reshape, MatMul only."""
    n, nh, hd = q.shape
    kv = k.shape[1]
    qh = q.transpose(0, 1).reshape(kv, nh // kv * n, hd)
    scores = (torch.matmul(qh, k.permute(1, 2, 0)) * hd ** -0.5).view(kv, nh // kv, n, -1)
    cdt = compute_dtype(scores.dtype)
    scores = scores.to(cdt).masked_fill(~visible, torch.finfo(cdt).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(kv, nh // kv * n, -1)
    return torch.matmul(probs, v.transpose(0, 1)).view(nh, n, hd).transpose(0, 1).reshape(n, nh * hd)


class GatedAttention(nn.Module):
    """Full attention with transformers' names (`self_attn.*`): q_proj -> [query ; sigmoid gate] per head."""

    def __init__(self, c: Qwen35Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        b = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim * 2, bias=b)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=b)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=b)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=b)
        self.q_norm = ZeroCentredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, u, past_kv, cos, sin, visible):
        """u [n, H], past_kv [P, 2, kv, hd] -> (out [n, H], new rows [n, 2, kv, hd])."""
        n, hd = u.shape[0], self.head_dim
        q, gate = self.q_proj(u).view(n, self.heads, 2 * hd).chunk(2, dim=-1)
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = apply_partial_rope(self.k_norm(self.k_proj(u).view(n, self.kv_heads, hd)), cos, sin)
        v = self.v_proj(u).view(n, self.kv_heads, hd)
        a = attend(q, torch.cat([past_kv[:, 0], k]), torch.cat([past_kv[:, 1], v]), visible)
        return self.o_proj(a * torch.sigmoid(gate.reshape(n, -1))), torch.stack([k, v], dim=1)


class Qwen35Layer(nn.Module):
    def __init__(self, c: Qwen35Config, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
                                             c.linear_key_head_dim, c.linear_value_head_dim,
                                             c.linear_conv_kernel_dim, c.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)


class State(NamedTuple):
    kv: torch.Tensor  # [P, La, 2, kv, hd]
    conv: torch.Tensor  # [Lg, C, K-1]
    rec: torch.Tensor  # [Lg, Hv, dk, dv] fp32


class Step(NamedTuple):
    kv: torch.Tensor  # [n, La, 2, kv, hd]: the step's new K/V rows
    conv: torch.Tensor  # [n, Lg, C, K-1]: conv state after each row
    rec: torch.Tensor  # [n, Lg, Hv, dk, dv] fp32: recurrent state after each row


def commit(state: State, step: Step, a: int) -> State:
    """The state after the first `a` rows of `step` (0 <= a <= n): K/V rows 0..a-1 appended, the GDN states of
    row a-1 selected (a = 0: unchanged). A pure selection: no row is recomputed."""
    n = step.kv.shape[0]
    if not 0 <= a <= n:
        raise ValueError(f"commit: accepted count {a} outside 0..{n}")
    kv = torch.cat([state.kv, step.kv[:a]])
    if a == 0:
        return State(kv, state.conv, state.rec)
    if a == n:
        return State(kv, step.conv[-1], step.rec[-1])
    if step.rec.shape[0] != n:
        raise ValueError(f"commit: this step kept only its final GDN state (a chunked prefill): commit 0 or {n} rows, "
                         f"not {a}")
    return State(kv, step.conv[a - 1], step.rec[a - 1])


class Qwen35Target(nn.Module):
    """forward(ids [n], state) -> logits [n, V], taps [n, n_taps*H], Step. Parameter names are transformers'
    with the leading `model.` (or `model.language_model.`) removed: load_hf_state_dict."""

    def __init__(self, c: Qwen35Config, tap_ids: tuple[int, ...] = ()):
        super().__init__()
        self.config, self.tap_ids = c, tuple(tap_ids)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Qwen35Layer(c, t) for t in c.layer_types)
        self.norm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", mrope_inv_freq(c), persistent=False)

    def _apply(self, fn, recurse=True):  # inv_freq stays fp32 whatever .to(dtype) does (as in layers.Fp32Rope)
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = mrope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    # the three places a streamed reference (dflash2.reference.streamed.StreamedQwen35Target) reads its checkpoint
    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, H]
        return self.embed_tokens(ids)

    def iter_layers(self):
        return iter(self.layers)

    def project(self, h: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]
        return h @ self.head_weight.T

    def kv_row_shape(self) -> tuple[int, int, int, int]:
        """One sequence row of the full-attention layers' K/V (the runtime's KV rows; the GDN state is apart)."""
        c = self.config
        return len(c.full_layers), 2, c.num_kv_heads, c.head_dim

    def empty_state(self, dtype: torch.dtype | None = None) -> State:
        c = self.config
        dtype = dtype or self.dtype
        La, Lg = len(c.full_layers), len(c.linear_layers)
        return State(torch.zeros(0, La, 2, c.num_kv_heads, c.head_dim, dtype=dtype),
                     torch.zeros(Lg, c.conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype),
                     torch.zeros(Lg, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                                 dtype=compute_dtype(dtype)))

    def forward(self, input_ids: torch.Tensor, state: State, pos3: torch.Tensor | None = None,
                chunk: int | None = None):
        """pos3 [3, n]: M-RoPE positions (None: text, P .. P+n-1 on all three axes). chunk: run the GDN recurrence
        chunk-parallel (prefill; Step then holds only the final GDN states, [1, ...]: commit all n rows or none)."""
        n, P = input_ids.shape[0], state.kv.shape[0]
        pos = torch.arange(n) + P
        cos, sin = mrope_cos_sin(pos3 if pos3 is not None else pos.expand(3, n), self.inv_freq,
                                 self.config.mrope_section)
        visible = torch.arange(P + n)[None, :] <= pos[:, None]
        h = self.embed(input_ids)
        taps, new_kv, convs, recs = {}, [], [], []
        ia = ig = 0
        for i, layer in enumerate(self.iter_layers()):
            u = layer.input_layernorm(h)
            if layer.kind == "full_attention":
                y, kv = layer.self_attn(u, state.kv[:, ia], cos, sin, visible)
                new_kv.append(kv)
                ia += 1
            else:
                y, conv, rec = layer.linear_attn(u, state.conv[ig], state.rec[ig], chunk)
                convs.append(conv)
                recs.append(rec)
                ig += 1
            h = h + y
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in self.tap_ids:
                taps[i] = h  # the OUTPUT of layer i (HF hidden_states[i + 1])
        logits = self.project(self.norm(h))
        tap_out = torch.cat([taps[i] for i in self.tap_ids], dim=-1) if self.tap_ids else h[:, :0]
        c = self.config
        rows = 1 if chunk is not None else n
        step = Step(torch.stack(new_kv, dim=1) if new_kv else state.kv.new_zeros(n, 0, *state.kv.shape[2:]),
                    torch.stack(convs, dim=1) if convs else state.conv.new_zeros(rows, 0, c.conv_dim, 0),
                    torch.stack(recs, dim=1) if recs else state.rec.new_zeros(rows, *state.rec.shape))
        return logits, tap_out, step


IGNORED_PREFIXES = ("mtp.", "model.visual.")


def hf_name(name: str) -> str | None:
    """A transformers / safetensors tensor name -> this module's name (None: not part of the text target)."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name  # lm_head.weight


def load_hf_state_dict(model: Qwen35Target, tensors: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """Load transformers-named tensors (Qwen3_5ForCausalLM or the ConditionalGeneration wrapper); MTP and vision
    tensors are skipped, a tied lm_head.weight is skipped; every missing / unexpected / mis-shaped tensor listed."""
    own = model.state_dict()
    mapped, unexpected = {}, []
    for name, t in tensors.items():
        key = hf_name(name)
        if key is None or (key == "lm_head.weight" and model.lm_head is None):
            continue
        if key in own:
            mapped[key] = t
        else:
            unexpected.append(name)
    missing = sorted(set(own) - set(mapped))
    misshaped = [(k, tuple(own[k].shape), tuple(t.shape)) for k, t in mapped.items() if t.shape != own[k].shape]
    if missing or unexpected or misshaped:
        raise TensorSetError(where, missing, sorted(unexpected), misshaped)
    model.load_state_dict({k: t.to(own[k].dtype) for k, t in mapped.items()}, strict=True)


def load_target(folder: str | Path, tap_ids: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                config: Qwen35Config | None = None) -> Qwen35Target:
    """A Qwen3.5 checkpoint folder (either architecture; safetensors, sharded or not) -> the reference, eval mode.
    The family's entry point (dflash2.families.qwen3_5.QWEN3_5.reference)."""
    from dflash2 import checkpoint as ckpt

    from dflash2.families.qwen3_5 import tensor_shapes

    c = config or load_qwen3_5_config(folder)
    model = Qwen35Target(c, tap_ids)
    names = set(ckpt.read_headers(folder)) & set(tensor_shapes(c))  # the text target's: no vision tower / MTP read
    load_hf_state_dict(model, ckpt.load_tensors(folder, names), where=str(folder))
    return model.to(dtype).eval()
