"""The gpt-oss family (transformers `gpt_oss`, GptOssForCausalLM: gpt-oss-20b / 120b). Torch-free.

Attention layers (one KV state each) alternating sliding-window (`sliding_window`, 128; layer 0 sliding by default)
and full, with biases on q/k/v/o, a learnt per-head sink logit in the softmax's denominator (`self_attn.sinks`),
YaRN rotary (cos and sin both scaled by its attention factor); every layer's MLP a mixture of experts: a router with
a bias, top-`num_experts_per_tok` of its LOGITS, softmax over the kept ones; each expert a clamped SwiGLU
(gate = min(g, limit), up = clamp(u, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate)) with biases, its
gate and up columns interleaved in one `gate_up_proj`.

Tensor names: transformers' fused expert parameters as it saves them (no conversion mapping for gpt_oss):
`mlp.experts.gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] in [in, out] orientation, their biases
[E, 2I] / [E, H]. The published checkpoints (`quantization_config.quant_method` "mxfp4") hold the expert weights
as MXFP4 instead: `<name>_blocks` uint8 [E, out, in/32, 16] (two E2M1 codes a byte, the low nibble first) and
`<name>_scales` uint8 [E, out, in/32] (a power of two, 2^(s - 127), per 32 values), in [out, in] orientation;
`tensor_dtypes` declares them so the checkpoint check accepts those integer tensors and no other.

The reference is dflash2.reference.gpt_oss; the standard-op templates (fp32) dflash2.export.gpt_oss
(`fused`: int4 / int8 weights, the experts on QMoE).
docs/families/gpt_oss.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash2.config import _Fields, _is_int, _object
from dflash2.errors import CheckpointError
from dflash2.families.base import TargetFamily, TinyShape

ARCH = "GptOssForCausalLM"
LAYER_TYPES = ("sliding_attention", "full_attention")
EXPERT_FORMATS = ("float", "mxfp4")
MXFP4_BLOCK = 32  # values per shared scale


@dataclass(frozen=True)
class YarnRope:
    """The rotary of a gpt-oss config: `type` "yarn" (the default) or "default" (plain RoPE, factor 1)."""
    theta: float
    type: str = "yarn"
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # transformers' default when the field is absent; gpt-oss writes false
    original_max_position_embeddings: int = 4096
    attention_factor: float = 1.0  # multiplies cos and sin (so q.k carries its square)


@dataclass(frozen=True)
class GptOssConfig:
    arch: str
    hidden_size: int
    intermediate_size: int  # each expert's SwiGLU width
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: YarnRope
    sliding_window: int | None
    num_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float
    swiglu_limit: float
    rms_norm_eps: float
    vocab_size: int
    tie_word_embeddings: bool
    expert_format: str  # "float" | "mxfp4" (quantization_config.quant_method)
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    family = "gpt_oss"  # TargetConfig.family's counterpart (a class attribute: not a config field)
    attention_bias = True  # gpt-oss always has q/k/v/o biases (a config without them is refused)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, its window in dflash2's convention (visible while q - k < window), None: full attention."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    def to_dict(self) -> dict:
        return asdict(self)


def _yarn(path: Path, raw: dict) -> YarnRope:
    """transformers' _compute_yarn_parameters' inputs, read with its defaults (factor 32 ... when absent)."""
    params = {**_object(path, raw, "rope_scaling"), **_object(path, raw, "rope_parameters")}
    if not params:
        params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096}
    r = _Fields(path, params, "rope_parameters.")
    theta = r.float("rope_theta", _Fields(path, raw).float("rope_theta", 150000.0))
    if not theta > 0:
        raise CheckpointError(path, "rope_parameters.rope_theta", "> 0", theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return YarnRope(theta=theta, type="default")
    if kind != "yarn":
        raise CheckpointError(path, "rope_parameters.rope_type", "'yarn' or 'default'", repr(kind))
    factor = r.float("factor")
    if not factor > 0:
        raise CheckpointError(path, "rope_parameters.factor", "> 0", factor)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(path, "rope_parameters.partial_rotary_factor", "1.0 (gpt-oss rotates every channel)",
                              repr(params["partial_rotary_factor"]))
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):  # transformers' yarn_get_mscale
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if attention is None:
        attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all \
            else get_mscale(factor)
    # transformers: `get("beta_fast") or 32`, so null (and 0) mean the default
    fast = r.float("beta_fast") if params.get("beta_fast") is not None else 0.0
    slow = r.float("beta_slow") if params.get("beta_slow") is not None else 0.0
    return YarnRope(theta=theta, factor=factor, beta_fast=fast or 32.0, beta_slow=slow or 1.0,
                    truncate=r.bool("truncate", True),
                    original_max_position_embeddings=r.int("original_max_position_embeddings", minimum=1),
                    attention_factor=float(attention))


def read_gpt_oss_config(path: Path, raw: dict, arch: str = ARCH) -> GptOssConfig:
    """A GptOssForCausalLM config.json -> GptOssConfig, transformers 5.25's defaults for absent fields; every
    refusal names the file, the field, what was expected and what was found."""
    path = Path(path)
    f = _Fields(path, raw)
    hidden = f.int("hidden_size", 2880, minimum=1)
    heads = f.int("num_attention_heads", 64, minimum=1)
    kv = f.int("num_key_value_heads", heads, minimum=1)
    if heads % kv:
        raise CheckpointError(path, "num_key_value_heads", f"a divisor of num_attention_heads={heads}", kv)
    head_dim = f.int("head_dim", 64, minimum=2)
    if head_dim % 2:
        raise CheckpointError(path, "head_dim", "an even number (RoPE)", head_dim)
    layers = f.int("num_hidden_layers", 36, minimum=1)
    types = raw.get("layer_types")
    if types is None:  # transformers' default: layer 0 sliding, then alternating
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(path, "layer_types", f"{layers} entries (num_hidden_layers) of {LAYER_TYPES}",
                              repr(types)[:200])
    window = raw.get("sliding_window", 128)
    if "sliding_attention" in types:
        if not _is_int(window) or window < 1:
            raise CheckpointError(path, "sliding_window", "a positive integer (sliding_attention layers)", repr(window))
    else:
        window = None
    if raw.get("attention_bias", True) is not True:
        raise CheckpointError(path, "attention_bias", "true (gpt-oss's attention has biases)",
                              repr(raw.get("attention_bias")))
    experts = f.int("num_local_experts", f.int("num_experts", 128, minimum=1), minimum=1)
    if "num_experts" in raw and raw["num_experts"] != experts:
        raise CheckpointError(path, "num_local_experts", f"the same as num_experts={raw['num_experts']!r}", experts)
    top_k = f.int("num_experts_per_tok", 4, minimum=1)
    if top_k > experts:
        raise CheckpointError(path, "num_experts_per_tok", f"<= num_local_experts={experts}", top_k)
    inter = f.int("intermediate_size", 2880, minimum=1)
    quant = _object(path, raw, "quantization_config")
    method = quant.get("quant_method") if quant else None
    if method not in (None, "mxfp4"):
        raise CheckpointError(path, "quantization_config.quant_method", "'mxfp4' or absent", repr(method))
    if method == "mxfp4":
        for name, v in (("hidden_size", hidden), ("intermediate_size", inter)):
            if v % MXFP4_BLOCK:
                raise CheckpointError(path, name, f"a multiple of {MXFP4_BLOCK} (MXFP4 expert blocks)", v)
    alpha, limit = f.float("swiglu_alpha", 1.702), f.float("swiglu_limit", 7.0)
    if not limit > 0:
        raise CheckpointError(path, "swiglu_limit", "> 0", limit)
    vocab = f.int("vocab_size", 201088, minimum=2)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(_is_int(e) and 0 <= e < vocab for e in eos_ids):
        raise CheckpointError(path, "eos_token_id", f"an id or a list of ids < vocab_size={vocab}", repr(eos))
    bos = raw.get("bos_token_id")
    if bos is not None and not _is_int(bos):
        raise CheckpointError(path, "bos_token_id", "an integer or null", repr(bos))
    return GptOssConfig(
        arch=arch, hidden_size=hidden, intermediate_size=inter, layer_types=tuple(types), num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, rope=_yarn(path, raw), sliding_window=window,
        num_experts=experts, num_experts_per_tok=top_k, swiglu_alpha=alpha, swiglu_limit=limit,
        rms_norm_eps=f.float("rms_norm_eps", 1e-5), vocab_size=vocab,
        tie_word_embeddings=f.bool("tie_word_embeddings", False), expert_format=method or "float",
        max_position_embeddings=f.int("max_position_embeddings", 131072, minimum=1), eos_token_ids=eos_ids,
        bos_token_id=bos)


def _layer_states(c: GptOssConfig) -> tuple[tuple[str, ...], ...]:
    # every layer keeps K/V rows; a sliding layer reads only its last `window` of them (the ring buffer that bounds
    # its memory is docs/families/plan_muse_glimmer_gpt_oss.md section 3.2, not built yet)
    return (("kv",),) * c.num_layers


def expert_tensor_shapes(p: str, c: GptOssConfig) -> dict[str, tuple[int, ...]]:
    """Layer prefix p's expert weights (`...mlp.experts.`) as the checkpoint holds them (float or MXFP4)."""
    E, H, I = c.num_experts, c.hidden_size, c.intermediate_size
    out = {p + "gate_up_proj_bias": (E, 2 * I), p + "down_proj_bias": (E, H)}
    if c.expert_format == "mxfp4":  # [out, in] orientation, in split in blocks of 32 (16 bytes)
        for name, n_out, n_in in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            out[f"{p}{name}_blocks"] = (E, n_out, n_in // MXFP4_BLOCK, MXFP4_BLOCK // 2)
            out[f"{p}{name}_scales"] = (E, n_out, n_in // MXFP4_BLOCK)
    else:  # transformers' parameters, [in, out]
        out.update({p + "gate_up_proj": (E, H, 2 * I), p + "down_proj": (E, I, H)})
    return out


def tensor_shapes(c: GptOssConfig) -> dict[str, tuple[int, ...]]:
    H, hd, E = c.hidden_size, c.head_dim, c.num_experts
    q, kv = c.num_heads * hd, c.num_kv_heads * hd
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for name, out, inp in (("q_proj", q, H), ("k_proj", kv, H), ("v_proj", kv, H), ("o_proj", H, q)):
            shapes.update({f"{a}{name}.weight": (out, inp), f"{a}{name}.bias": (out,)})
        shapes.update({a + "sinks": (c.num_heads,), p + "mlp.router.weight": (E, H), p + "mlp.router.bias": (E,),
                       p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
        shapes.update(expert_tensor_shapes(p + "mlp.experts.", c))
    return shapes


def tensor_dtypes(c: GptOssConfig) -> dict[str, str]:
    """The tensors that are not float (the checkpoint check refuses integer tensors elsewhere): MXFP4's bytes."""
    return {n: "U8" for n in tensor_shapes(c) if n.endswith(("_blocks", "_scales"))}


def tiny_config(s: TinyShape) -> dict:
    """A GptOssForCausalLM config.json as transformers 5.25 saves it: 4 experts, top-2, alternating sliding (window
    8) / full layers, YaRN as gpt-oss writes it (factor 32, truncate false, original_max = max_position / 32); the
    `extra` fields override (sliding_window, num_local_experts, quantization_config, ...)."""
    return {
        "architectures": [ARCH], "model_type": "gpt_oss", "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim or s.hidden_size // s.num_heads, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 8, "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(s.num_layers)],
        "vocab_size": s.vocab, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True, "attention_dropout": 0.0,
        "tie_word_embeddings": s.tie_word_embeddings, "hidden_act": "silu", "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "initializer_range": 0.02, "use_cache": True, "bos_token_id": None,
        "eos_token_id": s.eos, "pad_token_id": 0, "dtype": s.dtype, **s.extra,
    }


GPT_OSS = TargetFamily(
    name="gpt_oss", archs=(ARCH,), description="sliding-window mixture of experts with attention sinks",
    read_config=read_gpt_oss_config, layer_states=_layer_states, tensor_shapes=tensor_shapes,
    tiny_config=tiny_config, hf_class=ARCH, reference="dflash2.reference.gpt_oss:load_target",
    tensor_dtypes=tensor_dtypes,
    templates={"plain": "dflash2.export.gpt_oss:build", "fused": "dflash2.export.gpt_oss:build_fused"},
    trainable=False,  # the corpus, teacher and fresh-drafter paths are not checked for it yet
    dtypes=("float32", "float16", "bfloat16"))
