"""The dense families: Llama (LlamaForCausalLM) and Qwen3 (Qwen3ForCausalLM). Torch-free.

One layer kind (attention + SwiGLU MLP, pre-norm RMSNorm), one state kind (KV). They differ in data only:
Qwen3 puts a per-head RMSNorm on q and k before the rotary (`TargetConfig.qk_norm`), Llama may carry MLP biases.
Reference: dflash2.reference.target (Target, TargetLayer) loaded by dflash2.reference.load; templates:
dflash2.export.gqa (fused ONNX Runtime ops) and dflash2.export.plain (standard ops: portable + TensorRT flavour).
"""

from __future__ import annotations

from pathlib import Path

from dflash2.config import TargetConfig, read_dense_target
from dflash2.families.base import TargetFamily, TinyShape

TEMPLATES = {"fused": "dflash2.export.gqa:build", "plain": "dflash2.export.plain:build"}
REFERENCE = "dflash2.reference.load:load_target"


def _layer_states(c: TargetConfig) -> tuple[tuple[str, ...], ...]:
    return (("kv",),) * c.num_layers


def _tensor_shapes(c: TargetConfig) -> dict[str, tuple[int, ...]]:
    from dflash2.checkpoint import target_tensor_shapes  # checkpoint imports config: read lazily

    return target_tensor_shapes(c)


def _tiny_config(model_type: str, arch: str):
    def config(s: TinyShape) -> dict:
        """A Llama / Qwen3 config.json as transformers writes it (the fields dflash2 reads, and the usual rest)."""
        out = {
            "architectures": [arch], "model_type": model_type, "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_layers,
            "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
            "head_dim": s.head_dim or s.hidden_size // s.num_heads, "vocab_size": s.vocab, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 8192, "tie_word_embeddings": s.tie_word_embeddings,
            "attention_bias": s.attention_bias, "hidden_act": "silu", "bos_token_id": None, "eos_token_id": s.eos,
            "pad_token_id": 0, "torch_dtype": s.dtype, **s.extra,
        }
        if model_type == "llama":
            out["mlp_bias"] = False
        return out
    return config


def _family(name: str, arch: str, qk_norm: bool, hf_class: str) -> TargetFamily:
    def read(path: Path, raw: dict, a: str) -> TargetConfig:
        return read_dense_target(path, raw, a, name, qk_norm)

    return TargetFamily(name=name, archs=(arch,), description="dense", read_config=read,
                        layer_states=_layer_states, tensor_shapes=_tensor_shapes, tiny_config=_tiny_config(name, arch),
                        hf_class=hf_class, reference=REFERENCE, templates=TEMPLATES, fused_kv="gqa-shared",
                        dtypes=("float32", "float16", "bfloat16"))


LLAMA = _family("llama", "LlamaForCausalLM", qk_norm=False, hf_class="LlamaForCausalLM")
QWEN3 = _family("qwen3", "Qwen3ForCausalLM", qk_norm=True, hf_class="Qwen3ForCausalLM")
