"""The Muse-Glimmer family (transformers `muse_glimmer`, MuseGlimmerForConditionalGeneration), text path. Torch-free.

A wrapper config (`text_config` holds the language model; the vision tower, adapter and projection are not the
text target and are skipped by name). Dense attention layers, each with one KV state, differing from Llama in:
- `layer_types`: sliding-window layers (`sliding_window`, 2048 on the 30B; dflash2's `q - k < window` rule, the
  same as transformers' causal sliding mask) and full layers, 3 : 1 by default, the last layer full;
- `layer_rope_theta`: 0 on a layer means no rotary there (NoPE: the full layers by default); transformers tests
  only whether an entry is non-zero and uses ONE global rotary, so a non-zero entry other than the global
  `rope_theta` would be silently ignored by it: refused here;
- sigmoid-gated attention output (`self_attn.gate_proj` [nh*hd, H], no bias);
- scaleless per-head RMSNorm on q and k, q times `qk_scale_factor`;
- Gemma-style zero-centred (1 + w) sandwich norms: input / pre-feedforward at `rms_norm_eps`, post-attention /
  post-feedforward at `post_norm_eps`; the final norm is a plain w RMSNorm;
- the embedding rows RMS-normed without a weight (the raw matrix is what a DFlash drafter embeds its block with);
- logits = T * tanh(lm_head(y) * output_multiplier / T), T = `final_logit_softcapping`;
- image / video placeholder ids embedded as id 0 (transformers' text path does so on every step).
The reference is dflash2.reference.muse_glimmer; the export templates dflash2.export.muse_glimmer (fp32 standard ops;
`fused`: int4 / int8 weights). docs/families/muse_glimmer.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from dflash2.config import RopeConfig, _Fields, _is_int, _json_type, _rope
from dflash2.errors import CheckpointError
from dflash2.families.base import TargetFamily, TinyShape

ARCH = "MuseGlimmerForConditionalGeneration"
IGNORED = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")
LAYER_TYPES = ("sliding_attention", "full_attention")
TEXT = "model.language_model."


@dataclass(frozen=True)
class MuseGlimmerConfig:
    arch: str
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    layer_rope: tuple[bool, ...]  # False: a NoPE layer (layer_rope_theta 0)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    sliding_window: int | None  # None: no sliding layer
    qk_scale_factor: float
    output_multiplier: float
    final_logit_softcapping: float
    rms_norm_eps: float
    post_norm_eps: float
    attention_bias: bool
    vocab_size: int
    tie_word_embeddings: bool  # the TOP-LEVEL flag (transformers ignores text_config's)
    image_token_id: int | None
    video_token_id: int | None
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    family = "muse_glimmer"  # TargetConfig.family's counterpart (a class attribute: not a config field)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, its window in dflash2's convention (a key is visible while q - k < window), None: full."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def remapped_ids(self) -> tuple[int, ...]:
        """The ids the text path embeds as id 0 (image / video placeholders)."""
        return tuple(i for i in (self.image_token_id, self.video_token_id) if i is not None)

    def to_dict(self) -> dict:
        return asdict(self)


def read_muse_glimmer_config(path: Path, raw: dict, arch: str = ARCH) -> MuseGlimmerConfig:
    """A MuseGlimmerForConditionalGeneration config.json -> MuseGlimmerConfig, with transformers 5.25's defaults
    for absent fields; every refusal names the file, the field, what was expected and what was found."""
    path = Path(path)
    if not isinstance(raw.get("text_config"), dict):
        raise CheckpointError(path, "text_config", "an object {...} (the text model's config)",
                              "the field missing" if "text_config" not in raw else
                              f"a JSON {_json_type(raw['text_config'])}")
    text, prefix = raw["text_config"], "text_config."
    f = _Fields(path, text, prefix)

    def bad(name, expected, found, hint=""):
        return CheckpointError(path, prefix + name, expected, found, hint)

    hidden = f.int("hidden_size", 6656, minimum=1)
    heads = f.int("num_attention_heads", 32, minimum=1)
    kv = f.int("num_key_value_heads", 2, minimum=1)
    if heads % kv:
        raise bad("num_key_value_heads", f"a divisor of num_attention_heads={heads}", kv)
    head_dim = f.int("head_dim", 128, minimum=2)
    if head_dim % 2:
        raise bad("head_dim", "an even number (RoPE)", head_dim)
    layers = f.int("num_hidden_layers", 52, minimum=1)
    if text.get("hidden_activation", "silu") != "silu":
        raise bad("hidden_activation", "'silu'", repr(text.get("hidden_activation")))
    types = text.get("layer_types")
    if types is None:  # transformers' default: the last layer full, every 4th back from it
        types = ["full_attention" if (layers - 1 - i) % 4 == 0 else "sliding_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise bad("layer_types", f"{layers} entries (num_hidden_layers) of {LAYER_TYPES}", repr(types)[:200])
    try:
        rope = _rope(path, text)
    except CheckpointError as e:  # the same refusal, named where the field is (under text_config)
        raise CheckpointError(path, prefix + e.field, e.expected, e.found) from None
    thetas = text.get("layer_rope_theta")
    if thetas is None:  # transformers' default: NoPE exactly on the full layers
        thetas = [0 if t == "full_attention" else rope.theta for t in types]
    if not isinstance(thetas, list) or len(thetas) != layers:
        raise bad("layer_rope_theta", f"{layers} numbers (num_hidden_layers)", repr(thetas)[:200])
    for i, t in enumerate(thetas):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t not in (0, rope.theta):
            raise bad(f"layer_rope_theta[{i}]", f"0 (no rotary) or rope_theta={rope.theta} (transformers uses one "
                      f"global rotary: another theta would be ignored)", repr(t))
    window = text.get("sliding_window", 2048)
    if "sliding_attention" in types:
        if not _is_int(window) or window < 1:
            raise bad("sliding_window", "a positive integer (sliding_attention layers)", repr(window))
    else:
        window = None
    cap = text.get("final_logit_softcapping", 20.0)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise bad("final_logit_softcapping", "a number > 0 (transformers always applies the cap)", repr(cap))
    mult = f.float("output_multiplier", 0.19611613513818404)
    if not mult > 0:
        raise bad("output_multiplier", "> 0", mult)
    vocab = f.int("vocab_size", 202048, minimum=2)
    eos = text.get("eos_token_id", 200001)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(_is_int(e) and 0 <= e < vocab for e in eos_ids):
        raise bad("eos_token_id", f"an id or a list of ids < vocab_size={vocab}", repr(eos))
    bos = text.get("bos_token_id", 200000)
    if bos is not None and not _is_int(bos):
        raise bad("bos_token_id", "an integer or null", repr(bos))
    media = {}
    for name, default in (("image_token_id", 200092), ("video_token_id", 200091)):
        v = raw.get(name, default)
        if v is not None and (not _is_int(v) or v < 0):
            raise CheckpointError(path, name, "a non-negative integer or null", repr(v))
        media[name] = v if v is not None and v < vocab else None  # an id past the vocabulary is never embedded
    return MuseGlimmerConfig(
        arch=arch, hidden_size=hidden, intermediate_size=f.int("intermediate_size", 19968, minimum=1),
        layer_types=tuple(types), layer_rope=tuple(t != 0 for t in thetas), num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, rope=rope, sliding_window=window, qk_scale_factor=f.float("qk_scale_factor", 3.87),
        output_multiplier=mult, final_logit_softcapping=float(cap), rms_norm_eps=f.float("rms_norm_eps", 1e-5),
        post_norm_eps=f.float("post_norm_eps", 1e-8), attention_bias=f.bool("attention_bias", False),
        vocab_size=vocab, tie_word_embeddings=_Fields(path, raw).bool("tie_word_embeddings", False), **media,
        max_position_embeddings=f.int("max_position_embeddings", 131072, minimum=1), eos_token_ids=eos_ids,
        bos_token_id=bos)


def _layer_states(c: MuseGlimmerConfig) -> tuple[tuple[str, ...], ...]:
    # every layer keeps K/V rows; a sliding layer reads only its last `window` of them (bounding its memory to the
    # window is the ring buffer of docs/families/plan_muse_glimmer_gpt_oss.md section 3.2, not built yet)
    return (("kv",),) * c.num_layers


def tensor_shapes(c: MuseGlimmerConfig) -> dict[str, tuple[int, ...]]:
    """The text target's tensors as transformers names them (the vision tower's: IGNORED, skipped by name)."""
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * hd, c.num_kv_heads * hd
    shapes = {TEXT + "embed_tokens.weight": (c.vocab_size, H), TEXT + "norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_layers):
        p = f"{TEXT}layers.{i}."
        a = p + "self_attn."
        shapes.update({a + "q_proj.weight": (q, H), a + "k_proj.weight": (kv, H), a + "v_proj.weight": (kv, H),
                       a + "o_proj.weight": (H, q), a + "gate_proj.weight": (q, H),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
        if c.attention_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                           a + "o_proj.bias": (H,)})
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            shapes[f"{p}{n}.weight"] = (H,)
    return shapes


def vision_tensor_shapes(raw: dict) -> dict[str, tuple[int, ...]]:
    """The vision tower / adapter / projection tensors of a config.json (transformers 5.25's names): not read by
    dflash2, written by the tiny maker so that transformers loads its checkpoint without a missing tensor."""
    v, H = raw["vision_config"], raw["text_config"]["hidden_size"]
    D, I, proj = v["hidden_size"], v["intermediate_size"], raw["projector_hidden_size"]
    patch, positions = v["patch_temporal"] * 3 * v["patch_size"] ** 2, v["pos_emb_height"] * v["pos_emb_width"]
    out = {"model.vision_projection.weight": (H, proj),
           "model.vision_adapter.fc1.weight": (proj, raw["out_hidden_size"]),
           "model.vision_adapter.fc2.weight": (proj, proj),
           "model.vision_tower.patch_embedder.patch_embedding.weight": (D, patch),
           "model.vision_tower.patch_embedder.position_embedding_table.weight": (positions, D)}
    for n in ("ln_pre", "ln_post"):
        out.update({f"model.vision_tower.{n}.weight": (D,), f"model.vision_tower.{n}.bias": (D,)})
    for i in range(v["num_hidden_layers"]):
        p = f"model.vision_tower.layers.{i}."
        for n, shape in (("attn.q_proj", (D, D)), ("attn.k_proj", (D, D)), ("attn.v_proj", (D, D)),
                         ("attn.proj", (D, D)), ("mlp.fc1", (I, D)), ("mlp.fc2", (D, I)), ("norm1", (D,)),
                         ("norm2", (D,))):
            out.update({p + n + ".weight": shape, p + n + ".bias": shape[:1]})
    return out


def tiny_config(s: TinyShape) -> dict:
    """A MuseGlimmerForConditionalGeneration config.json as transformers 5.25 saves it (every field written): the
    default 3 : 1 layout with NoPE full layers, a window of 8 (`extra`'s text fields override: `sliding_window`,
    ...), the image / video ids the last two of the vocabulary (so the remap is exercised), a one-layer vision
    tower of 32 channels."""
    text = {
        "model_type": "muse_glimmer_text", "vocab_size": s.vocab, "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim or s.hidden_size // s.num_heads, "hidden_activation": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "eos_token_id": s.eos, "bos_token_id": None,
        "pad_token_id": 0, "tie_word_embeddings": False, "attention_bias": s.attention_bias, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "sliding_window": 8,
        "final_logit_softcapping": 20.0, "qk_scale_factor": 3.87, "output_multiplier": 0.19611613513818404,
        "post_norm_eps": 1e-8, "initializer_range": 0.02, "use_cache": True,
        **{k: v for k, v in s.extra.items() if k != "vision_config"},
    }
    L = text["num_hidden_layers"]
    text.setdefault("layer_types", ["full_attention" if (L - 1 - i) % 4 == 0 else "sliding_attention"
                                    for i in range(L)])
    text.setdefault("layer_rope_theta", [0 if t == "full_attention" else 10000.0 for t in text["layer_types"]])
    vision = {"model_type": "muse_glimmer_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "patch_size": 14, "patch_temporal": 2, "pos_emb_height": 4,
              "pos_emb_width": 4, "merge_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
              "layer_types": ["full_attention"], "max_position_embeddings": 1024,
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}, **s.extra.get("vision_config", {})}
    return {"architectures": [ARCH], "model_type": "muse_glimmer", "text_config": text, "vision_config": vision,
            "out_hidden_size": vision["hidden_size"] * vision["merge_size"] ** 2, "projector_hidden_size": 64,
            "projector_hidden_act": "gelu", "image_token_id": s.vocab - 2, "video_token_id": s.vocab - 1,
            "tie_word_embeddings": s.tie_word_embeddings, "dtype": s.dtype}


MUSE_GLIMMER = TargetFamily(
    name="muse_glimmer", archs=(ARCH,), description="sliding-window / NoPE gated attention",
    read_config=read_muse_glimmer_config, layer_states=_layer_states, tensor_shapes=tensor_shapes,
    tiny_config=tiny_config, hf_class=ARCH, reference="dflash2.reference.muse_glimmer:load_target", ignored=IGNORED,
    extra_tensors=vision_tensor_shapes, templates={"plain": "dflash2.export.muse_glimmer:build",
               "fused": "dflash2.export.muse_glimmer:build_fused"},
    trainable=False,  # the corpus, teacher and fresh-drafter paths are not checked for it yet
    dtypes=("float32", "float16", "bfloat16"))
