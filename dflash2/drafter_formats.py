"""Drafter checkpoint formats other than z-lab's: Meta's DFlash assistant (transformers `muse_glimmer_assistant`,
MuseGlimmerAssistantModel). Torch-free.

Meta's assistant is a DFlash v1 drafter (dflash2.reference.drafter.Drafter, version 1) written differently:
- config: `block_size`, `mask_token_id` and `target_layer_ids` at the top level (no `dflash_config`); no
  `num_target_layers` and no `vocab_size` (both the target's: `for_target` fills them, checked, once the target is
  known); rope theta 500000 when absent (the class's default_theta); no output multiplier, no softcap
  (transformers drafts from the raw LM head);
- attention: bidirectional, and on sliding layers a key is visible when |q - k| <= sliding_window
  (transformers' sliding_window_bidirectional_overlay: INCLUSIVE). dflash2's drafter rule is z-lab's
  `|q - k| < window`, so the window is recorded as sliding_window + 1, every layer non-causal (the layer type
  "sliding_attention" does not mean causal here, unlike vLLM's rule for z-lab's configs);
- tensors: `encoder.fc.weight` / `encoder.output_norm_enc.weight` for dflash2's `fc.weight` / `hidden_norm.weight`
  (ALIASES; the rest are dflash2's v1 names).
The export reads both (Weights finds a format's names behind dflash2's; the drafter graph takes the per-layer
(causal, window) pairs); `dflash2-train --init-weights` reads z-lab's only (`require_zlab`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dflash2.errors import CheckpointError

META_ARCH = "MuseGlimmerAssistantModel"
META = "meta-assistant"
META_THETA = 500000.0  # MuseGlimmerAssistantConfig.default_theta
# format -> {dflash2's drafter tensor name: the checkpoint's}
ALIASES = {META: {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}}


def read_meta_assistant(path: Path, raw: dict, arch: str, block_size: int | None = None):
    """A MuseGlimmerAssistantModel config.json -> DrafterConfig (format "meta-assistant"); every refusal one line
    naming the field."""
    from dflash2.config import (DrafterConfig, _attention_shape, _Fields, _is_int, _object, check_draft_block)

    if raw.get("dflash_config") is not None:
        raise CheckpointError(path, "dflash_config", f"absent: read as {arch} (Meta's format keeps block_size, "
                              "mask_token_id and target_layer_ids at the top level)",
                              f"a JSON {type(raw['dflash_config']).__name__}",
                              "a z-lab drafter names DFlashDraftModel or DFlash2DraftModel in `architectures`")
    f = _Fields(path, raw)
    rope = {**_object(path, raw, "rope_scaling"), **_object(path, raw, "rope_parameters")}
    if "rope_theta" not in rope and "rope_theta" not in raw:
        raw = {**raw, "rope_theta": META_THETA}
    raw = {"rms_norm_eps": 1e-5, **raw}  # the class's default (dflash2's dense default is 1e-6)
    shape = _attention_shape(path, _Fields(path, {"vocab_size": 2, **raw}))  # no vocab_size: the target's
    shape["vocab_size"] = None
    for name in ("block_size", "mask_token_id", "target_layer_ids"):
        if name not in raw:  # no class-default fallback: a drafter is trained for its own block, mask and taps
            raise CheckpointError(path, name, "a top-level field (MuseGlimmerAssistantModel's format)",
                                  "the field missing")
    trained = f.int("block_size", minimum=2)
    if block_size is not None:
        check_draft_block(block_size, trained, path)
    taps = raw["target_layer_ids"]
    if not isinstance(taps, list) or not taps or not all(_is_int(t) and t >= 0 for t in taps):
        raise CheckpointError(path, "target_layer_ids", "a non-empty list of layer ids >= 0", repr(taps))
    L = shape["num_layers"]
    types = raw.get("layer_types") or ["sliding_attention"] * L
    if not isinstance(types, list) or len(types) != L or \
            any(t not in ("full_attention", "sliding_attention") for t in types):
        raise CheckpointError(path, "layer_types", f"{L} entries of 'full_attention' / 'sliding_attention'",
                              repr(types)[:200])
    window = raw.get("sliding_window", 2048)
    if "sliding_attention" in types and (not _is_int(window) or window < 1):
        raise CheckpointError(path, "sliding_window", "a positive integer (sliding_attention layers)", repr(window))
    if raw.get("is_causal") not in (None, False):  # transformers' assistant attention is always bidirectional
        raise CheckpointError(path, "is_causal", f"false or absent ({arch} attends bidirectionally)",
                              repr(raw["is_causal"]))
    if shape["attention_bias"]:
        raise CheckpointError(path, "attention_bias", f"false or absent ({arch} has no biases)", True)
    return DrafterConfig(
        arch=arch, version=1, **shape, block_size=trained if block_size is None else block_size,
        num_target_layers=None, target_layer_ids=tuple(taps), mask_token_id=f.int("mask_token_id", minimum=0),
        layer_causal=(False,) * L,
        layer_window=tuple(window + 1 if t == "sliding_attention" else None for t in types),  # |q-k| <= window
        trained_block_size=trained, format=META)


def for_target(dc, tc, drafter_dir: str | Path = "drafter"):
    """The drafter config completed from its target where its format leaves fields to the target (Meta's: the
    target's layer count and vocabulary), its taps and mask id checked against them; z-lab's returned as it is."""
    if dc.num_target_layers is not None and dc.vocab_size is not None:
        return dc
    path, L, V = Path(drafter_dir) / "config.json", tc.num_layers, tc.vocab_size
    bad = [t for t in dc.target_layer_ids if t >= L]
    if bad:
        raise CheckpointError(path, "target_layer_ids", f"layer ids in [0, {L - 1}] (the target's "
                              f"num_hidden_layers={L})", bad)
    if dc.mask_token_id >= V:
        raise CheckpointError(path, "mask_token_id", f"< the target's vocab_size={V}", dc.mask_token_id)
    return dataclasses.replace(dc, num_target_layers=L, vocab_size=V)


def require_zlab(dc, drafter_dir: str | Path, what: str) -> None:
    """Export and training read z-lab's drafter format only (yet): refused in one line naming the architecture."""
    if dc.format != "zlab":
        raise CheckpointError(Path(drafter_dir) / "config.json", "architectures",
                              "DFlashDraftModel or DFlash2DraftModel", repr(dc.arch),
                              f"{dc.arch} drafters: reference and parity only; {what} not yet supported")
