"""Build the reference modules from validated Hugging Face folders (safetensors only)."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash2 import checkpoint as ckpt
from dflash2 import draft_vocab, families
from dflash2.families import DENSE
from dflash2.config import (DrafterConfig, TargetConfig, check_pair, load_drafter_config,
                            load_target_config)
from dflash2.drafter_formats import ALIASES, for_target
from dflash2.reference.drafter import Drafter
from dflash2.reference.streamed import StreamedDrafter, StreamedTarget, streamed_target
from dflash2.reference.target import Target


def load_target(folder: str | Path, tap_ids: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                config: TargetConfig | None = None) -> Target:
    c = config or families.load(folder)[1]  # any family: the reference of one not exportable (yet) too
    if c.family not in DENSE:  # another family's own reference (dflash2.families: its `reference` entry point)
        return families.resolve(families.by_name(c.family).reference)(folder, tuple(tap_ids), dtype, c)
    expected = ckpt.family_tensor_shapes(c)  # a MoE target's sparse layers hold experts (families.qwen3_moe)
    ckpt.check_tensors(folder, expected)
    tensors = ckpt.load_tensors(folder, set(expected))
    model = Target(c, tap_ids)
    state = {k.removeprefix("model."): v.to(dtype) for k, v in tensors.items()}
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def load_drafter(folder: str | Path, target: Target, dtype: torch.dtype = torch.float32,
                 config: DrafterConfig | None = None, use_draft_vocab: bool = True) -> Drafter:
    """With `use_draft_vocab`, the folder's draft_vocab.json (if any) restricts what it proposes."""
    c = for_target(config or load_drafter_config(folder), target.config, folder)  # Meta's: the target's V, L
    ckpt.check_tensors(folder, ckpt.drafter_tensor_shapes(c, target.config.hidden_size))
    return _drafter(folder, c, target.embed_tokens.weight.detach(), target.head_weight.detach(),
                    target.config.hidden_size, dtype, use_draft_vocab)


def _drafter(folder, c: DrafterConfig, embed: torch.Tensor, head: torch.Tensor, hidden: int, dtype: torch.dtype,
             use_draft_vocab: bool) -> Drafter:
    """The drafter loaded whole around the target's embedding / LM head tensors (its tensors already checked)."""
    ids = draft_vocab.read(folder, c.vocab_size, draft_vocab.min_size(c)) if use_draft_vocab else None
    tensors = ckpt.load_tensors(folder, set(ckpt.drafter_tensor_shapes(c, hidden)))
    names = {v: k for k, v in ALIASES.get(c.format, {}).items()}  # the format's names -> the module's
    tensors = {names.get(k, k): v for k, v in tensors.items()}
    model = Drafter(c, embed, head, hidden)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    model = model.to(dtype).eval()
    model.set_draft_vocab(ids)
    return model


def load_pair(drafter_dir: str | Path, target_dir: str | Path, dtype: torch.dtype = torch.float32,
              use_draft_vocab: bool = True, block_size: int | None = None) -> tuple[Target, Drafter]:
    """Validate both configs and their agreement before any weight loads (block_size: load_drafter_config's)."""
    dc, tc = load_drafter_config(drafter_dir, block_size), load_target_config(target_dir)
    check_pair(dc, tc, drafter_dir, target_dir)
    dc = for_target(dc, tc, drafter_dir)
    ckpt.check_target_tensors(target_dir, tc)
    ckpt.check_tensors(drafter_dir, ckpt.drafter_tensor_shapes(dc, tc.hidden_size))
    target = load_target(target_dir, dc.target_layer_ids, dtype, tc)
    return target, load_drafter(drafter_dir, target, dtype, dc, use_draft_vocab)


def load_streamed_pair(drafter_dir: str | Path, target_dir: str | Path, use_draft_vocab: bool = True,
                       dtype: torch.dtype = torch.float32, block_size: int | None = None
                       ) -> tuple[StreamedTarget, Drafter]:
    """load_pair at bounded memory (every weight in `dtype` as it runs): the target as a StreamedTarget and the drafter as a StreamedDrafter
    (one layer resident, each read from the checkpoint when it runs, checked finite as it is read; the
    embedding and LM head read a slice at a time, dflash2.reference.vocab); any family (streamed_target)."""
    dc, tc, expected = _checked_streamed(drafter_dir, target_dir, block_size)
    ids = draft_vocab.read(drafter_dir, dc.vocab_size, draft_vocab.min_size(dc)) if use_draft_vocab else None
    target = streamed_target(tc, dc.target_layer_ids, ckpt.Weights(target_dir), dtype=dtype)
    drafter = StreamedDrafter(dc, target, ckpt.Weights(drafter_dir), list(expected))
    drafter.set_draft_vocab(ids)
    return target, drafter


def _checked_streamed(drafter_dir, target_dir, block_size: int | None = None
                      ) -> tuple[DrafterConfig, TargetConfig, dict]:
    """The streamed loaders' checks before any reference is built: both configs and their agreement, every
    tensor's name and shape, and every NaN / inf weight of both checkpoints named at once (load_tensors does that
    for the loaded pair; a streamed reference would otherwise meet the first one minutes into the export).
    Returns (drafter config, target config, the drafter's tensor shapes)."""
    dc, tc = load_drafter_config(drafter_dir, block_size), load_target_config(target_dir)
    check_pair(dc, tc, drafter_dir, target_dir)
    dc = for_target(dc, tc, drafter_dir)
    target_shapes, expected = ckpt.family_tensor_shapes(tc), ckpt.drafter_tensor_shapes(dc, tc.hidden_size)
    ckpt.check_target_tensors(target_dir, tc)
    ckpt.check_tensors(drafter_dir, expected)
    ckpt.check_finite(target_dir, target_shapes)
    ckpt.check_finite(drafter_dir, expected)
    return dc, tc, expected
