"""The Qwen3-MoE family (transformers `qwen3_moe`, Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B). Torch-free.

Qwen3's layers (attention with per-head q/k RMSNorm, one KV state kind) whose MLP is, on the sparse layers, a
mixture of experts: a router (`mlp.gate`, [E, H], no bias) scores every expert, softmax in fp32, the top
`num_experts_per_tok` kept (renormalised to sum 1 when `norm_topk_prob`), each kept expert a SwiGLU MLP of width
`moe_intermediate_size`, the output their weighted sum. No shared expert. Layer i is sparse when i is not in
`mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0 (transformers' Qwen3MoeDecoderLayer); the others keep
the dense MLP of width `intermediate_size`.

Tensor names: the experts one by one (`mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`), as the published
checkpoints on the Hub hold them and as transformers 5 writes them (save_pretrained converts its fused
`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] parameters back to these names).

The config is a TargetConfig (the dense reader's fields) plus the MoE fields, so the dense reference
(dflash2.reference.target) and the dense graph builders run it with the MLP chosen per layer
(dflash2.reference.moe, dflash2.export.moe). docs/families/qwen3_moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash2.config import TargetConfig, _Fields, _is_int, read_dense_target
from dflash2.errors import CheckpointError
from dflash2.families.base import TargetFamily, TinyShape

ARCH = "Qwen3MoeForCausalLM"
# the dense builders, their MLP the experts' block on the sparse layers (dflash2.export.moe)
TEMPLATES = {"fused": "dflash2.export.gqa:build", "plain": "dflash2.export.plain:build"}


@dataclass(frozen=True)
class MoeTargetConfig(TargetConfig):
    num_experts: int  # E
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the kept probabilities to sum 1
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def is_sparse(self, i: int) -> bool:
        """Layer i's MLP is the mixture of experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sparse(i))


def read_moe_fields(path: Path, raw: dict, prefix: str = "") -> dict:
    """The MoE fields shared by qwen3_moe and qwen3_5_moe, each refusal naming file, field, expected and found."""
    f = _Fields(path, raw, prefix)
    # transformers 5 writes `num_local_experts` (its attribute_map), the Hub's checkpoints `num_experts`
    named = {k: raw[k] for k in ("num_experts", "num_local_experts") if k in raw}
    if len(set(map(repr, named.values()))) > 1:
        raise CheckpointError(path, prefix + "num_local_experts", f"the same as num_experts={raw['num_experts']!r}",
                              repr(raw["num_local_experts"]))
    key = next(iter(named), "num_experts")
    experts = f.int(key, minimum=1)
    top_k = f.int("num_experts_per_tok", minimum=1)
    if top_k > experts:
        raise CheckpointError(path, prefix + "num_experts_per_tok", f"<= {key}={experts}", top_k)
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=f.int("moe_intermediate_size", minimum=1))


def read_qwen3_moe(path: Path, raw: dict, arch: str) -> MoeTargetConfig:
    base = read_dense_target(path, raw, arch, "qwen3_moe", qk_norm=True)
    f = _Fields(path, raw)
    moe = read_moe_fields(path, raw)
    step = f.int("decoder_sparse_step", 1, minimum=1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(_is_int(i) and 0 <= i < base.num_layers for i in only):
        raise CheckpointError(path, "mlp_only_layers", f"a list of layer indices in [0, {base.num_layers - 1}]",
                              repr(only)[:120])
    return MoeTargetConfig(**{k: getattr(base, k) for k in base.__dataclass_fields__}, **moe,
                           norm_topk_prob=f.bool("norm_topk_prob", False), decoder_sparse_step=step,
                           mlp_only_layers=tuple(sorted(set(only))))


def expert_shapes(p: str, c, experts: int, width: int) -> dict[str, tuple[int, ...]]:
    """Router + per-expert SwiGLU tensors under prefix p (`model.layers.{i}.mlp.`)."""
    H = c.hidden_size
    out = {p + "gate.weight": (experts, H)}
    for e in range(experts):
        out.update({f"{p}experts.{e}.gate_proj.weight": (width, H), f"{p}experts.{e}.up_proj.weight": (width, H),
                    f"{p}experts.{e}.down_proj.weight": (H, width)})
    return out


def tensor_shapes(c: MoeTargetConfig) -> dict[str, tuple[int, ...]]:
    from dflash2.checkpoint import target_tensor_shapes  # checkpoint imports config: read lazily

    shapes = target_tensor_shapes(c)  # the dense layout; the sparse layers' MLP tensors replaced below
    for i in c.sparse_layers:
        p = f"model.layers.{i}.mlp."
        for m in ("gate_proj", "up_proj", "down_proj"):
            del shapes[f"{p}{m}.weight"]
        shapes.update(expert_shapes(p, c, c.num_experts, c.moe_intermediate_size))
    return shapes


def tiny_config(s: TinyShape) -> dict:
    """A Qwen3MoeForCausalLM config.json as transformers 5 writes it: 4 experts, top-2, every layer sparse (the
    `extra` fields override: num_local_experts, num_experts_per_tok, norm_topk_prob, mlp_only_layers, ...)."""
    return {
        "architectures": [ARCH], "model_type": "qwen3_moe", "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size, "moe_intermediate_size": max(1, s.intermediate_size // 4),
        "num_local_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_hidden_layers": s.num_layers, "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim or s.hidden_size // s.num_heads,
        "vocab_size": s.vocab, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 8192, "tie_word_embeddings": s.tie_word_embeddings,
        "attention_bias": s.attention_bias, "hidden_act": "silu", "bos_token_id": None, "eos_token_id": s.eos,
        "pad_token_id": 0, "router_aux_loss_coef": 0.001, "use_sliding_window": False, "torch_dtype": s.dtype,
        **s.extra,
    }


def _layer_states(c: MoeTargetConfig) -> tuple[tuple[str, ...], ...]:
    return (("kv",),) * c.num_layers


QWEN3_MOE = TargetFamily(
    name="qwen3_moe", archs=(ARCH,), description="mixture of experts", read_config=read_qwen3_moe,
    layer_states=_layer_states, tensor_shapes=tensor_shapes, tiny_config=tiny_config, hf_class=ARCH,
    reference="dflash2.reference.load:load_target", templates=TEMPLATES, fused_kv="gqa-shared",
    dtypes=("float32", "float16", "bfloat16"))
