"""The sparse mixture-of-experts MLP block of the MoE targets (Qwen3-MoE, Qwen3.5-MoE), one module for both.

transformers' Qwen3MoeSparseMoeBlock / Qwen3_5MoeSparseMoeBlock, with their parameter names (`gate.weight` the
router, `experts.{e}.gate_proj|up_proj|down_proj.weight`, Qwen3.5-MoE's `shared_expert.*` and
`shared_expert_gate.weight`) and their order of operations:
- router: logits = x @ gate^T in the weights' dtype; softmax in fp32; top-k of the probabilities, equal ones
  taken lower expert index first (ONNX TopK's rule; torch.topk leaves it open, and bf16 logits tie often: 3-5% of
  rows at 128-256 experts top-8 routed otherwise on random weights); with norm_topk_prob the k kept divided by
  their sum (Qwen3.5-MoE always); then cast to x's dtype;
- each expert that some row picked, in ascending expert order: SwiGLU of its rows, times the row's weight,
  accumulated into a zero output (transformers' index_add_ loop: the same summation order per row);
- Qwen3.5-MoE adds sigmoid(x @ shared_expert_gate^T) * shared_expert(x) after the routed sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.reference.layers import MLP
from dflash2.reference.selector import topk_lowest_index


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int, width: int, norm_topk_prob: bool,
                 shared_width: int = 0):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router, [E, H]
        self.experts = nn.ModuleList(MLP(hidden, width) for _ in range(experts))
        self.shared_expert = MLP(hidden, shared_width) if shared_width else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_width else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, H] -> (weights [n, k] in x's dtype, expert ids [n, k] int64)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [n, E] fp32
        top, idx = topk_lowest_index(probs, self.top_k)  # [n, k]
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), idx

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # [m, H] -> [m, H]
        """Expert e's SwiGLU with gate|up as ONE [2I, H] matmul, as transformers' fused gate_up_proj computes it
        (two matmuls round differently: ~1e-4 on a tiny hybrid's logits after the GDN layers)."""
        ex = self.experts[e]
        gate, up = F.linear(x, torch.cat([ex.gate_proj.weight, ex.up_proj.weight])).chunk(2, dim=-1)
        return ex.down_proj(F.silu(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        weights, idx = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():  # ascending, as transformers' expert_hit loop
            rows, slot = torch.where(idx == e)  # the rows that picked expert e, and in which of their k slots
            y = self.expert(e, x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def mlp_for(c, i: int) -> nn.Module:
    """Layer i's MLP for a dense-layout target config (TargetConfig; a MoeTargetConfig's sparse layers get the
    mixture of experts, dflash2.families.qwen3_moe)."""
    if getattr(c, "is_sparse", None) is not None and c.is_sparse(i):
        return SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                         c.norm_topk_prob)
    return MLP(c.hidden_size, c.intermediate_size, c.mlp_bias)


def unfuse_experts(tensors: dict) -> dict:
    """A checkpoint's fused expert tensors (`...mlp.experts.gate_up_proj` [E, 2I, H]: gate rows then up rows, as
    transformers' Concatenate(dim=1) makes them; `...mlp.experts.down_proj` [E, H, I]) -> the per-expert names
    SparseMoE loads (views, no copy); every other tensor as it is."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p, half = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"], out[f"{p}{e}.up_proj.weight"] = t[e, :half], t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            p = name[:-len("down_proj")]
            out.update({f"{p}{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


class UnfusedExperts:
    """A weight source (dflash2.checkpoint.Weights' interface: get / shape / in / row_chunks) over a checkpoint whose
    experts are fused, answering the per-expert names: `...experts.{e}.gate_proj.weight` is rows e of
    `...experts.gate_up_proj`'s first half, read alone (Weights.get's row slice: one expert in memory). Every other
    name passes through. The layer-streamed reference and the export's templates read either layout through it."""

    PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}

    def __init__(self, src):
        self.src = src

    def __getattr__(self, name: str):  # the rest of the source's interface (folder, non_finite, ...) as it is
        if name == "src":
            raise AttributeError(name)
        return getattr(self.src, name)

    def _fused(self, name: str):
        """(fused name, expert, half) for a per-expert name the source holds fused, else None."""
        head, sep, tail = name.rpartition(".experts.")
        parts = tail.split(".")
        if not sep or len(parts) != 3 or not parts[0].isdigit() or parts[1] not in self.PARTS or parts[2] != "weight":
            return None
        fused, half = self.PARTS[parts[1]]
        key = f"{head}.experts.{fused}"
        return (key, int(parts[0]), half) if key in self.src and name not in self.src else None

    def __contains__(self, name: str) -> bool:
        return name in self.src or self._fused(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        f = self._fused(name)
        if f is None:
            return tuple(self.src.shape(name))
        E, N, K = self.src.shape(f[0])
        return (N // 2, K) if f[2] is not None else (N, K)

    def get(self, name: str, rows: slice | None = None):
        f = self._fused(name)
        if f is None:
            return self.src.get(name, rows)
        key, e, half = f
        w = self.src.get(key, slice(e, e + 1))[0]  # [2I, H] or [H, I]: this expert only
        if half is not None:
            w = w[half * (w.shape[0] // 2):(half + 1) * (w.shape[0] // 2)]
        return w if rows is None else w[rows]

    def row_chunks(self, name: str, *args, **kwargs):
        if self._fused(name) is None:
            return self.src.row_chunks(name, *args, **kwargs)
        return iter([self.get(name)])
