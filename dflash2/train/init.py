"""The fresh drafter a training run starts from: its config.json from the target's (any family: a Qwen3.5 target's
drafter is dense, with the target's full-attention shapes) and its weights initialised from the target's layers
(attention and MLP copied, identity convs, small codebooks). Apart from the training loop (trainer.py), which calls
them once per run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash2.config import load_drafter_config, load_target_config
from dflash2.errors import Dflash2Error
from dflash2.folders import write_atomic
from dflash2.reference.drafter import Drafter
from dflash2.disk import writing


def drafter_config_dict(target_dir: str | Path, c) -> dict:  # c: trainer.TrainConfig
    """The drafter's config.json: dense attention layers with the target's attention shapes (a Qwen3.5 target's
    full-attention heads, head_dim and RoPE base: its drafter is dense, not hybrid) and `model_type` the family."""
    t = load_target_config(target_dir)
    theta = t.rope.theta if hasattr(t, "rope") else t.rope_theta  # TargetConfig.rope / Qwen35Config.rope_theta
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": t.family, "hidden_size": t.hidden_size,
        "intermediate_size": mlp_width(t), "num_hidden_layers": c.layers,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
        "vocab_size": t.vocab_size, "rms_norm_eps": t.rms_norm_eps, "rope_theta": theta,
        "attention_bias": False, "hidden_act": "silu", "num_target_layers": t.num_layers,
        "block_size": c.block_size, "is_causal": False, "tie_word_embeddings": False,
        "dflash_config": {"block_size": c.block_size, "target_layer_ids": list(c.tap_ids),
                          "mask_token_id": c.mask_token_id, "conv_kernel_size": 2, "conv_group_size": 16,
                          "selector_rank": c.rank, "selector_top_k": c.top_k},
    }


def mlp_width(t) -> int:
    """The drafter's dense MLP width: the target's `intermediate_size`; for Qwen3.5-MoE (no dense MLP: 0) its
    shared expert's width. The shared expert is the one dense SwiGLU every token runs, so the drafter's MLP starts
    as a copy of it (_mlp_source); `moe_intermediate_size` would give a drafter MLP as narrow as one routed expert
    (1/k of what a token's routed experts compute) with no one weight to copy. At Qwen3.5-35B-A3B's shape both
    are 512 wide."""
    return t.intermediate_size or t.shared_expert_intermediate_size


def init_drafter(target, cfg_dict: dict, init_from: str = "last") -> Drafter:
    """Fresh drafter: attention/MLP copied from the target's first (or last) layers, identity convs,
    small codebooks. The block's input is a token embedding, which the first layers expect. Its config is read
    through the one loader (checked like any drafter's) from a private copy: the run's folder is written only
    once every check of the run passed (`train`)."""
    import tempfile

    if init_from not in ("first", "last"):
        raise Dflash2Error(f"init_from: expected 'first' or 'last', found {init_from!r}")
    with writing(tempfile.gettempdir(), "a scratch copy of the drafter's config (checked before --out is written)",
                 after="nothing was written into --out: free some space there and run the same command again"):
        with tempfile.TemporaryDirectory(prefix="dflash2-drafter-") as folder:
            write_atomic(Path(folder) / "config.json", json.dumps(cfg_dict, indent=2))
            dc = load_drafter_config(folder)
    d = Drafter(dc, target.embed_tokens.weight.detach(), target.head_weight.detach(), target.config.hidden_size)
    src = target.layers[:dc.num_layers] if init_from == "first" else target.layers[-dc.num_layers:]
    for mine, theirs in zip(d.layers, src):
        attn = _attention_source(target, theirs)
        if attn is not None:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(mine.self_attn, name).weight.data.copy_(_attention_weight(attn, name))
        mlp = _mlp_source(target, theirs, mine.mlp.gate_proj.weight.shape)
        if mlp is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(mine.mlp, name).weight.data.copy_(getattr(mlp, name).weight)
        mine.input_layernorm.weight.data.copy_(_norm_weight(theirs.input_layernorm))
        mine.post_attention_layernorm.weight.data.copy_(_norm_weight(theirs.post_attention_layernorm))
    d.norm.weight.data.copy_(_norm_weight(target.norm))
    g = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(d.fc.weight, std=d.fc.in_features ** -0.5, generator=g)
    sel = d.candidate_selector
    torch.nn.init.normal_(sel.hidden_projection.weight, std=0.02, generator=g)
    torch.nn.init.normal_(sel.predecessor_codebook, std=0.02, generator=g)
    torch.nn.init.normal_(sel.successor_codebook, std=0.02, generator=g)
    return d


def _attention_source(target, layer):
    """The attention a drafter layer starts from: the layer's own (dense targets; a Qwen3.5 full-attention layer);
    for a Qwen3.5 Gated DeltaNet layer (no attention of its kind) the nearest full-attention layer's, None when the
    target has none (the drafter's attention then keeps its fresh init)."""
    if not hasattr(layer, "kind"):
        return layer.self_attn
    full = [i for i, x in enumerate(target.layers) if x.kind == "full_attention"]
    if not full:
        return None
    at = next(i for i, x in enumerate(target.layers) if x is layer)
    return target.layers[min(full, key=lambda i: (abs(i - at), -i))].self_attn


def _mlp_source(target, layer, shape):
    """The dense MLP a drafter layer starts from: the layer's own; for a MoE target's sparse layer (no dense MLP
    there: dflash2.reference.moe.SparseMoE) the nearest layer's dense MLP of the drafter's width (mlp_only_layers /
    decoder_sparse_step), None when there is none (the drafter's MLP then keeps its fresh init). A Qwen3.5-MoE
    block's shared expert counts as its layer's dense MLP (mlp_width)."""
    dense = [i for i, x in enumerate(target.layers)
             if _dense_mlp(x) is not None and _dense_mlp(x).gate_proj.weight.shape == shape]
    if not dense:
        return None
    at = next(i for i, x in enumerate(target.layers) if x is layer)
    return _dense_mlp(target.layers[min(dense, key=lambda i: (abs(i - at), -i))])


def _dense_mlp(layer):
    """A target layer's dense SwiGLU (gate_proj, up_proj, down_proj): its MLP, or its experts' block's shared
    expert (Qwen3.5-MoE); None for a block without one (Qwen3-MoE's sparse layers)."""
    return layer.mlp if hasattr(layer.mlp, "gate_proj") else getattr(layer.mlp, "shared_expert", None)


def _attention_weight(attn, name: str) -> torch.Tensor:
    """A target attention projection as the drafter's dense attention holds it: Qwen3.5's gated q_proj emits
    [query ; gate] per head (2 * head_dim rows each): the query rows only (the drafter has no output gate)."""
    from dflash2.reference.qwen3_5 import GatedAttention

    w = getattr(attn, name).weight
    if name == "q_proj" and isinstance(attn, GatedAttention):
        return w.view(attn.heads, 2, attn.head_dim, -1)[:, 0].reshape(attn.heads * attn.head_dim, -1)
    return w


def _norm_weight(norm) -> torch.Tensor:
    """An RMSNorm's effective scale: Qwen3.5's norms are zero-centred (x_hat * (1 + w)), the drafter's plain."""
    from dflash2.reference.qwen3_5 import ZeroCentredRMSNorm

    return norm.weight + 1.0 if isinstance(norm, ZeroCentredRMSNorm) else norm.weight
