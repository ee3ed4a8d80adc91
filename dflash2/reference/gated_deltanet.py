"""Gated DeltaNet (Qwen3.5 / Qwen3-Next "linear_attention" layers) as plain per-row tensor code, for export.

One layer, per token row t (no batch axis; heads spelled out):

    qkv_t  = in_proj_qkv(u_t)                             [C = 2 * Hk * dk + Hv * dv]
    x_t    = silu(sum_j w[:, j] * window[:, t + j])         causal depthwise conv, kernel K, window =
                                                            [conv_state (K-1 columns) ; qkv_1 .. qkv_n]
    q, k, v = split(x_t)  -> q, k [Hk, dk] repeated to Hv heads (head h reads key head h // (Hv / Hk)), v [Hv, dv]
    q = l2norm(q) * dk^-0.5,  k = l2norm(k)                 (fp32 whatever the weights' dtype, eps 1e-6)
    beta_t = sigmoid(in_proj_b(u_t)),  g_t = -exp(A_log) * softplus(in_proj_a(u_t) + dt_bias)     [Hv], fp32
    S      = exp(g_t) * S                                   recurrent state S [Hv, dk, dv], fp32
    S      = S + k_t (x) beta_t * (v_t - S^T k_t)           the delta rule
    o_t    = S^T q_t                                        [Hv, dv]
    y_t    = out_proj(rmsnorm(o_t) * w_norm * silu(in_proj_z(u_t)))    (gated RMSNorm per head, plain weight)

Nothing is cut back after a verify: the state after row a is a different tensor for every a. So a step over n rows
returns the conv state and the recurrent state after EACH row (row_conv [n, C, K-1], row_state [n, Hv, dk, dv]); a
commit of a accepted rows picks row a-1 (a = 0: the state before the step). The conv state after row a is simply
the window's columns a .. a+K-2, so a runtime may keep the window [C, K-1+n] instead of n copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16 / bf16 / fp32 inputs (as transformers), fp64 for fp64 ones (exactness tests)."""
    return torch.promote_types(dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's / transformers' l2norm: x * rsqrt(sum(x^2) + eps) over the last axis."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """window [C, K-1+n], weight [C, K] -> [C, n] (no activation). An explicit sum over the K taps, in tap order:
    row t's value does not depend on n, so a k-row verify and k one-row steps give identical bits."""
    K = weight.shape[-1]
    n = window.shape[-1] - (K - 1)
    out = window[:, 0:n] * weight[:, 0:1]
    for j in range(1, K):
        out = out + window[:, j:j + n] * weight[:, j:j + 1]
    return out


def conv_rows(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """conv_state [C, K-1], x [n, C] -> (silu(conv) [n, C], window [C, K-1+n], row states [n, C, K-1])."""
    K = weight.shape[-1]
    window = torch.cat([conv_state, x.transpose(0, 1).to(conv_state.dtype)], dim=-1)
    y = F.silu(causal_conv(window, weight.to(window.dtype)))
    n = x.shape[0]
    rows = torch.stack([window[:, t + 1:t + K] for t in range(n)]) if n else window.new_zeros(0, *conv_state.shape)
    return y.transpose(0, 1).to(x.dtype), window, rows


def gated_delta_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule as a per-row loop, in the compute dtype (fp32; fp64 for fp64 inputs).

    q, k [n, Hv, dk] (already l2-normed, q already scaled), v [n, Hv, dv], g, beta [n, Hv], state [Hv, dk, dv]
    -> (out [n, Hv, dv], the state after each row [n, Hv, dk, dv]). Written as transformers'
    torch_recurrent_gated_delta_rule (same operations in the same order)."""
    outs, rows = [], []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        kv_mem = (state * k[t][:, :, None]).sum(dim=-2)  # S^T k  [Hv, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append((state * q[t][:, :, None]).sum(dim=-2))
        rows.append(state)
    if not rows:
        return v.new_zeros(0, *v.shape[1:]).to(state.dtype), state.new_zeros(0, *state.shape)
    return torch.stack(outs), torch.stack(rows)


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule, chunk-parallel (the WY / UT-transform form of transformers' torch_chunk_gated_delta_rule),
    for long prompts: returns (out [n, Hv, dv], the final state [Hv, dk, dv]) only; no per-row states."""
    n = q.shape[0]
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [Hv, N, d]
    beta, g = (F.pad(x.transpose(0, 1), (0, pad)) for x in (beta, g))  # [Hv, N]
    H, N = g.shape
    c = N // chunk
    kb, vb = k * beta[..., None], v * beta[..., None]
    q, k, kb, vb = (x.reshape(H, c, chunk, x.shape[-1]) for x in (q, k, kb, vb))
    cum = g.reshape(H, c, chunk).cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (kb @ k.transpose(-1, -2)) * decay  # read as I + its strictly lower triangle
    new_v = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    qd = q * cum.exp()[..., None]
    kd = k * (cum[..., -1:] - cum).exp()[..., None]
    step = cum[..., -1].exp()[..., None, None]  # [H, c, 1, 1]
    out = torch.zeros_like(new_v)
    for i in range(c):
        vn = new_v[:, i] - k_cum[:, i] @ state
        out[:, i] = qd[:, i] @ state + intra[:, i] @ vn
        state = state * step[:, i] + kd[:, i].transpose(-1, -2) @ vn
    return out.reshape(H, N, -1)[:, :n].transpose(0, 1), state


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3_5RMSNormGated: rmsnorm(x) * weight (a plain weight, NOT 1 + w) * silu(gate), fp32 inside."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype, cdt = x.dtype, compute_dtype(x.dtype)
        x = x.to(cdt)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(gate.to(cdt))).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention token mixer with transformers' parameter names (`linear_attn.*`).

    forward(u [n, H], conv_state [C, K-1], state [Hv, dk, dv] fp32 (fp64 for an fp64 model), chunk=None)
      -> (y [n, H], row_conv [n, C, K-1], row_state [n, Hv, dk, dv]);
    with `chunk` (prefill only) the recurrence runs chunk-parallel and row_state holds only the final state [1, ...]."""

    def __init__(self, hidden: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int, eps: float):
        super().__init__()
        if v_heads % k_heads:
            raise ValueError(f"linear_num_value_heads {v_heads} is not a multiple of linear_num_key_heads {k_heads}")
        self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.kernel = k_heads, v_heads, k_dim, v_dim, kernel
        self.key_dim, self.value_dim = k_heads * k_dim, v_heads * v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False,
                                padding=kernel - 1)  # only its weight [C, 1, K] is used (HF name and shape)
        self.dt_bias = nn.Parameter(torch.ones(v_heads))
        self.A_log = nn.Parameter(torch.zeros(v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, v_heads, bias=False)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return (self.conv_dim, self.kernel - 1), (self.v_heads, self.k_dim, self.v_dim)

    def gates(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [n, Hv] fp32 log-decay, beta [n, Hv])."""
        beta = self.in_proj_b(u).sigmoid()
        cdt = compute_dtype(u.dtype)
        g = -self.A_log.to(cdt).exp() * F.softplus(self.in_proj_a(u).to(cdt) + self.dt_bias)
        return g, beta

    def qkv(self, x: torch.Tensor):
        """Conv output x [n, C] -> q, k [n, Hv, dk] (l2-normed, q scaled), v [n, Hv, dv]; compute dtype."""
        n, rep, cdt = x.shape[0], self.v_heads // self.k_heads, compute_dtype(x.dtype)
        q, k, v = torch.split(x, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(n, self.k_heads, self.k_dim).repeat_interleave(rep, dim=1).to(cdt)
        k = k.reshape(n, self.k_heads, self.k_dim).repeat_interleave(rep, dim=1).to(cdt)
        v = v.reshape(n, self.v_heads, self.v_dim).to(cdt)
        q = l2norm(q) * self.k_dim ** -0.5
        return q, l2norm(k), v

    def forward(self, u: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, chunk: int | None = None):
        n = u.shape[0]
        x, _, row_conv = conv_rows(conv_state, self.in_proj_qkv(u), self.conv1d.weight[:, 0, :])
        q, k, v = self.qkv(x)
        g, beta = self.gates(u)
        beta, state = beta.to(q.dtype), state.to(q.dtype)
        if chunk is None:
            o, row_state = gated_delta_rows(q, k, v, g, beta, state)
        else:
            o, last = gated_delta_chunked(q, k, v, g, beta, state, chunk)
            row_conv, row_state = row_conv[-1:], last[None]
        z = self.in_proj_z(u).reshape(n, self.v_heads, self.v_dim)
        y = self.norm(o.to(u.dtype), z).reshape(n, self.value_dim)
        return self.out_proj(y), row_conv, row_state
