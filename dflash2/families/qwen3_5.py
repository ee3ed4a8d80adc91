"""The Qwen3.5 family (transformers `qwen3_5`): Qwen3_5ForCausalLM and the Qwen3_5ForConditionalGeneration wrapper
(its text model under `text_config`), dense hybrid: Gated DeltaNet (linear attention) layers and gated full-attention
layers (`layer_types`; default every `full_attention_interval`-th layer full). Torch-free: the config reader, the
state kinds per layer, the tensor names and shapes, a tiny checkpoint's config.json.

The PyTorch reference is dflash2.reference.qwen3_5 (+ gated_deltanet.py); its layer templates (standard ONNX ops,
both flavours) dflash2.export.qwen3_5, bound by the runtime as KV rows + state rows. docs/families/qwen3_5.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from dflash2.config import _Fields, _is_int, _json_type, _object, read_config
from dflash2.errors import CheckpointError
from dflash2.families.base import TargetFamily, TinyShape

ARCHS = {"Qwen3_5ForCausalLM": False, "Qwen3_5ForConditionalGeneration": True}  # -> keeps the text in text_config
IGNORED = ("mtp.", "model.visual.")  # the in-checkpoint MTP head and the vision tower: not the text target
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35Config:
    arch: str
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # head_dim * partial_rotary_factor (even)
    rope_theta: float
    mrope_section: tuple[int, int, int]
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    family = "qwen3_5"  # TargetConfig.family's counterpart (a class attribute: not a config field)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def to_dict(self) -> dict:
        return asdict(self)


def read_qwen3_5_config(raw: dict, path: str | Path = "config.json", accepted: dict = ARCHS) -> Qwen35Config:
    """A Qwen3.5 config.json dict (Qwen3_5ForCausalLM, or Qwen3_5ForConditionalGeneration with the text model's
    fields under `text_config`) -> Qwen35Config. Every refusal names the file, the field, what was expected and
    what was found. accepted: the architectures read (-> wrapped in text_config); the MoE family
    (dflash2.families.qwen3_5_moe) passes its own, whose configs have no dense `intermediate_size`."""
    path = Path(path)
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise CheckpointError(path, "architectures", "a list with one architecture name", repr(archs))
    arch = archs[0]
    if arch not in accepted:
        hint = "the MoE variant: read by the qwen3_5_moe family" if "Moe" in arch and accepted is ARCHS else \
            "not a Qwen3.5 checkpoint of this family"
        raise CheckpointError(path, "architectures", f"one of {sorted(accepted)}", repr(arch), hint)
    text, prefix = raw, ""
    if accepted[arch]:
        if not isinstance(raw.get("text_config"), dict):
            raise CheckpointError(path, "text_config", "an object {...} (the text model's config)",
                                  "the field missing" if "text_config" not in raw else
                                  f"a JSON {_json_type(raw['text_config'])}")
        text, prefix = raw["text_config"], "text_config."
    f = _Fields(path, text, prefix)

    def bad(name, expected, found, hint=""):
        return CheckpointError(path, prefix + name, expected, found, hint)

    hidden = f.int("hidden_size", minimum=1)
    heads = f.int("num_attention_heads", minimum=1)
    kv = f.int("num_key_value_heads", heads, minimum=1)
    if heads % kv:
        raise bad("num_key_value_heads", f"a divisor of num_attention_heads={heads}", kv)
    head_dim = f.int("head_dim", 256, minimum=2)
    layers = f.int("num_hidden_layers", minimum=1)
    if text.get("hidden_act", "silu") != "silu":
        raise bad("hidden_act", "'silu'", repr(text.get("hidden_act")))
    if text.get("attn_output_gate", True) is not True:
        raise bad("attn_output_gate", "true (transformers' qwen3_5 always gates attention)",
                  repr(text.get("attn_output_gate")))
    types = text.get("layer_types")
    if types is None:
        every = f.int("full_attention_interval", 4, minimum=1)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise bad("layer_types", f"{layers} entries (num_hidden_layers) of {LAYER_TYPES}", repr(types)[:200])
    rope = {**_object(path, text, "rope_scaling"), **_object(path, text, "rope_parameters")}
    r = _Fields(path, rope, prefix + "rope_parameters.")
    theta = r.float("rope_theta", f.float("rope_theta", 10000.0))
    if not theta > 0:
        raise bad("rope_parameters.rope_theta", "> 0", theta)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise bad("rope_parameters.rope_type", "'default'", repr(kind), "scaled RoPE is not supported for qwen3_5")
    factor = r.float("partial_rotary_factor", f.float("partial_rotary_factor", 0.25))
    rotary = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary < 2 or rotary % 2:
        raise bad("rope_parameters.partial_rotary_factor", f"a factor in (0, 1] giving an even rotary width of "
                  f"head_dim={head_dim}", factor)
    section = rope.get("mrope_section", [11, 11, 10])
    if not isinstance(section, list) or len(section) != 3 or not all(_is_int(s) and s >= 0 for s in section):
        raise bad("rope_parameters.mrope_section", "a list of 3 non-negative integers", repr(section))
    k_heads = f.int("linear_num_key_heads", 16, minimum=1)
    v_heads = f.int("linear_num_value_heads", 32, minimum=1)
    if v_heads % k_heads:
        raise bad("linear_num_value_heads", f"a multiple of linear_num_key_heads={k_heads}", v_heads)
    vocab = f.int("vocab_size", minimum=2)
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(_is_int(e) and 0 <= e < vocab for e in eos_ids):
        raise bad("eos_token_id", f"an id or a list of ids < vocab_size={vocab}", repr(eos))
    bos = text.get("bos_token_id", raw.get("bos_token_id"))
    if bos is not None and not _is_int(bos):
        raise bad("bos_token_id", "an integer or null", repr(bos))
    # transformers ties by the TOP-LEVEL config's flag (the wrapper's, not text_config's)
    tie = _Fields(path, raw).bool("tie_word_embeddings", False)
    return Qwen35Config(
        arch=arch, hidden_size=hidden,
        intermediate_size=f.int("intermediate_size", minimum=1) if accepted is ARCHS else 0,  # MoE: experts only
        layer_types=tuple(types), num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rotary_dim=rotary,
        rope_theta=theta, mrope_section=tuple(section), vocab_size=vocab, rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        tie_word_embeddings=tie, attention_bias=f.bool("attention_bias", False),
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
        linear_key_head_dim=f.int("linear_key_head_dim", 128, minimum=1),
        linear_value_head_dim=f.int("linear_value_head_dim", 128, minimum=1),
        linear_conv_kernel_dim=f.int("linear_conv_kernel_dim", 4, minimum=1),
        max_position_embeddings=f.int("max_position_embeddings", 32768, minimum=1),
        eos_token_ids=eos_ids, bos_token_id=bos)


def load_qwen3_5_config(folder: str | Path) -> Qwen35Config:
    path, raw = read_config(folder)
    return read_qwen3_5_config(raw, path)


def _layer_states(c: Qwen35Config) -> tuple[tuple[str, ...], ...]:
    return tuple(("kv",) if t == "full_attention" else ("conv", "recurrent") for t in c.layer_types)


def tensor_shapes(c: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """The text target's tensors (transformers' names: `model.` for Qwen3_5ForCausalLM, `model.language_model.`
    for the ConditionalGeneration wrapper) for config c; the MTP head and the vision tower, which real checkpoints
    also hold, are not part of it (IGNORED: skipped by name, not refused)."""
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    model = "model.language_model." if ARCHS.get(c.arch) else "model."
    q, kv = c.num_heads * hd, c.num_kv_heads * hd
    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    hv = c.linear_num_value_heads
    shapes = {f"{model}embed_tokens.weight": (c.vocab_size, H), f"{model}norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i, kind in enumerate(c.layer_types):
        p = f"{model}layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
        if kind == "full_attention":
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (2 * q, H), a + "k_proj.weight": (kv, H), a + "v_proj.weight": (kv, H),
                           a + "o_proj.weight": (H, q), a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
            if c.attention_bias:
                shapes.update({a + "q_proj.bias": (2 * q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                               a + "o_proj.bias": (H,)})
        else:
            g = p + "linear_attn."
            shapes.update({g + "conv1d.weight": (c.conv_dim, 1, c.linear_conv_kernel_dim), g + "dt_bias": (hv,),
                           g + "A_log": (hv,), g + "norm.weight": (c.linear_value_head_dim,),
                           g + "out_proj.weight": (H, vd), g + "in_proj_qkv.weight": (2 * kd + vd, H),
                           g + "in_proj_z.weight": (vd, H), g + "in_proj_b.weight": (hv, H),
                           g + "in_proj_a.weight": (hv, H)})
    return shapes


def tiny_config(s: TinyShape) -> dict:
    """A Qwen3_5ForCausalLM config.json (model_type qwen3_5_text) as transformers writes it: the hybrid layout
    with one full-attention layer in every 2 (so a 4-layer tiny model has both kinds twice), small GDN heads."""
    hd = s.head_dim or 2 * s.hidden_size // s.num_heads
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_layers, "full_attention_interval": 2,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads, "head_dim": hd,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": s.vocab, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        "max_position_embeddings": 8192, "tie_word_embeddings": s.tie_word_embeddings,
        "attention_bias": s.attention_bias, "hidden_act": "silu", "bos_token_id": None, "eos_token_id": s.eos,
        "pad_token_id": 0, "torch_dtype": s.dtype, **s.extra,
    }


QWEN3_5 = TargetFamily(
    name="qwen3_5", archs=tuple(ARCHS), description="hybrid Gated DeltaNet",
    read_config=lambda path, raw, arch: read_qwen3_5_config(raw, path), layer_states=_layer_states,
    tensor_shapes=tensor_shapes, tiny_config=tiny_config, hf_class="Qwen3_5ForCausalLM", ignored=IGNORED,
    reference="dflash2.reference.qwen3_5:load_target", templates={"plain": "dflash2.export.qwen3_5:build",
                                                               "fused": "dflash2.export.qwen3_5:build_fused"},
    fused_kv="gqa-shared", dtypes=("float32", "float16", "bfloat16"))
