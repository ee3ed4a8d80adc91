"""The Qwen3.5-MoE family (transformers `qwen3_5_moe`: Qwen3_5MoeForCausalLM and the
Qwen3_5MoeForConditionalGeneration wrapper, e.g. Qwen3.5-35B-A3B). Torch-free.

The Qwen3.5 hybrid (dflash2.families.qwen3_5: Gated DeltaNet + gated full attention, the same state kinds) with
every layer's MLP a sparse mixture of experts: the router's softmax top-k, always renormalised (transformers'
Qwen3_5MoeTopKRouter has no norm_topk_prob switch), plus a shared expert (SwiGLU of width
`shared_expert_intermediate_size`) scaled by sigmoid(x @ shared_expert_gate^T). There is no dense MLP.

Expert tensors come in two layouts, both read:
- per expert, `mlp.experts.{e}.gate_proj|up_proj|down_proj.weight` (what transformers 5's save_pretrained writes);
- fused, `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows then up rows) and `mlp.experts.down_proj` [E, H, I], no
  `.weight` suffix: what the published checkpoints hold (Qwen3.5-35B-A3B's index).
The reader looks at the folder's safetensors headers (no tensor read) to tell which; a folder without weights yet
(a tiny checkpoint being written) is taken as per expert. docs/families/qwen3_moe.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from dflash2.config import _Fields
from dflash2.families.base import TargetFamily, TinyShape
from dflash2.families.qwen3_5 import Qwen35Config, read_qwen3_5_config
from dflash2.families.qwen3_5 import tensor_shapes as dense_shapes
from dflash2.families.qwen3_5 import tiny_config as dense_tiny
from dflash2.families.qwen3_moe import expert_shapes, read_moe_fields

ARCHS = {"Qwen3_5MoeForCausalLM": False, "Qwen3_5MoeForConditionalGeneration": True}  # -> text in text_config
DENSE_ARCH = {"Qwen3_5MoeForCausalLM": "Qwen3_5ForCausalLM",
              "Qwen3_5MoeForConditionalGeneration": "Qwen3_5ForConditionalGeneration"}
IGNORED = ("mtp.", "model.visual.")


@dataclass(frozen=True)
class Qwen35MoeConfig(Qwen35Config):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    fused_experts: bool = False  # the checkpoint's expert layout (module docstring)

    family = "qwen3_5_moe"
    norm_topk_prob = True  # transformers' Qwen3_5MoeTopKRouter always renormalises


def fused_experts(folder: Path) -> bool:
    """Whether the folder's checkpoint stores each layer's experts fused (module docstring); False without weights."""
    if not any(folder.glob("*.safetensors")):
        return False
    from dflash2.checkpoint import read_headers  # numpy: imported only when a folder is read

    return any(n.endswith("mlp.experts.gate_up_proj") for n in read_headers(folder))


def read_qwen3_5_moe_config(raw: dict, path: str | Path = "config.json") -> Qwen35MoeConfig:
    path = Path(path)
    base = read_qwen3_5_config(raw, path, ARCHS)
    text, prefix = (raw["text_config"], "text_config.") if ARCHS[base.arch] else (raw, "")
    moe = read_moe_fields(path, text, prefix)
    shared = _Fields(path, text, prefix).int("shared_expert_intermediate_size", minimum=1)
    return Qwen35MoeConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **moe,
                           shared_expert_intermediate_size=shared, fused_experts=fused_experts(path.parent))


def tensor_shapes(c: Qwen35MoeConfig) -> dict[str, tuple[int, ...]]:
    """qwen3_5's tensors with each layer's dense MLP replaced by the router, the experts (either layout) and the
    shared expert with its gate."""
    shapes = dense_shapes(dataclasses.replace(c, arch=DENSE_ARCH[c.arch]))
    model = "model.language_model." if ARCHS[c.arch] else "model."
    H, I, S, E = c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size, c.num_experts
    for i in range(c.num_layers):
        p = f"{model}layers.{i}.mlp."
        for m in ("gate_proj", "up_proj", "down_proj"):
            del shapes[f"{p}{m}.weight"]
        if c.fused_experts:
            shapes.update({p + "gate.weight": (E, H), p + "experts.gate_up_proj": (E, 2 * I, H),
                           p + "experts.down_proj": (E, H, I)})
        else:
            shapes.update(expert_shapes(p, c, E, I))
        shapes.update({p + "shared_expert.gate_proj.weight": (S, H), p + "shared_expert.up_proj.weight": (S, H),
                       p + "shared_expert.down_proj.weight": (H, S), p + "shared_expert_gate.weight": (1, H)})
    return shapes


def tiny_config(s: TinyShape) -> dict:
    """A Qwen3_5MoeForCausalLM config.json (model_type qwen3_5_moe_text) as transformers writes it: qwen3_5's tiny
    hybrid layout, 4 experts, top-2, a shared expert (`extra` overrides any field)."""
    out = {k: v for k, v in dense_tiny(TinyShape(**{**s.__dict__, "extra": {}})).items() if k != "intermediate_size"}
    return {**out, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": max(1, s.intermediate_size // 4),
            "shared_expert_intermediate_size": max(1, s.intermediate_size // 2), "router_aux_loss_coef": 0.001,
            **s.extra}


def _layer_states(c: Qwen35MoeConfig) -> tuple[tuple[str, ...], ...]:
    return tuple(("kv",) if t == "full_attention" else ("conv", "recurrent") for t in c.layer_types)


QWEN3_5_MOE = TargetFamily(
    name="qwen3_5_moe", archs=tuple(ARCHS), description="hybrid Gated DeltaNet, mixture of experts",
    read_config=lambda path, raw, arch: read_qwen3_5_moe_config(raw, path), layer_states=_layer_states,
    tensor_shapes=tensor_shapes, tiny_config=tiny_config, hf_class="Qwen3_5MoeForCausalLM", ignored=IGNORED,
    reference="dflash2.reference.qwen3_5_moe:load_target",
    # the hybrid's builders, their MLP the experts' block (dflash2.export.moe) on every layer
    templates={"plain": "dflash2.export.qwen3_5:build", "fused": "dflash2.export.qwen3_5:build_fused"},
    fused_kv="gqa-shared", dtypes=("float32", "float16", "bfloat16"))
