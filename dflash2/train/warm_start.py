"""Warm starts for `dflash2-train --init-weights`: an existing drafter's weights, grown where this run's drafter
is deeper or its selector wider, so that training starts from exactly what the smaller drafter drafted."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dflash2.checkpoint import load_tensors
from dflash2.config import load_drafter_config
from dflash2.drafter_formats import require_zlab
from dflash2.errors import Dflash2Error
from dflash2.reference.drafter import Drafter


def warm_start(d: Drafter, folder: Path, log_mult: torch.nn.Parameter) -> None:
    """Weights (and the learned unary scale) of an existing drafter with the same shapes, or with fewer layers or
    a lower selector rank: then the drafter grows (`_grow_layers`, `_grow_rank`), starting as exactly the smaller one."""
    src = load_drafter_config(folder)
    require_zlab(src, folder, "--init-weights from it")  # its encoder.* names are not the trainer's
    if src.version != d.config.version:  # a DFlash v1 drafter has no selector to start one from (or grow)
        raise Dflash2Error(f"{folder}: --init-weights expected a DFlash{d.config.version} drafter like this run's, "
                           f"found a DFlash{src.version} one (config.json architectures)")
    weights = load_tensors(folder)
    own = d.state_dict()
    if src.num_layers > d.config.num_layers:  # its first layers alone would draft something else entirely
        raise Dflash2Error(f"{folder}: --init-weights expected a drafter with at most this run's {d.config.num_layers} "
                           f"layers, found {src.num_layers} (config.json num_hidden_layers)")
    if src.num_layers < d.config.num_layers:
        weights = _grow_layers(weights, src.num_layers, d.config.num_layers)
    if src.selector_rank > d.config.selector_rank:  # dropping codebook columns would change every pair score
        raise Dflash2Error(f"{folder}: --init-weights expected a selector rank of at most this run's "
                           f"{d.config.selector_rank}, found {src.selector_rank} (config.json dflash_config.selector_rank)")
    if src.selector_rank < d.config.selector_rank:
        weights = _grow_rank(weights, src.selector_rank, d.config.selector_rank)
    bad = sorted(k for k in own if not k.startswith("train_") and (k not in weights or weights[k].shape != own[k].shape))
    if bad:
        raise Dflash2Error(f"{folder}: --init-weights expected a drafter with this run's shapes (or fewer layers, a "
                           f"lower selector rank); "
                           f"differing tensors {bad[:6]} (taps and widths must match; "
                           f"it has {src.num_layers} layers, this run {d.config.num_layers})")
    d.load_state_dict({k: weights[k].float() for k in own if not k.startswith("train_")}, strict=False)
    with torch.no_grad():
        log_mult.fill_(math.log(src.output_multiplier))


# a layer whose residual branches end in these writes nothing: zeroed, the layer is the identity
_BRANCH_OUTPUTS = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias")


def _grow_layers(weights: dict, have: int, want: int) -> dict:
    """Depth growth that keeps the function: layers have..want-1 are copies of the last layer (its attention
    already reads the context) with their residual branches' output projections zeroed, so the grown drafter
    drafts exactly what the smaller one did and training starts from there, not from noise (zero-initialised
    residual branches, as in ReZero / Fixup). Gradients reach the zeroed matrices at once: their inputs are not 0."""
    out = dict(weights)
    last = f"layers.{have - 1}."
    for i in range(have, want):
        for k, v in weights.items():
            if k.startswith(last):
                name = k[len(last):]
                out[f"layers.{i}.{name}"] = torch.zeros_like(v) if name in _BRANCH_OUTPUTS else v.clone()
    return out


_SEL = "candidate_selector."


def _grow_rank(weights: dict, have: int, want: int) -> dict:
    """Selector rank growth that keeps the function: the new gate rows and predecessor columns start small and
    random, as a fresh selector's do, the new successor columns at zero, so every new rank term of the pair score
    (P[pred, r] g[r] Q[cand, r]) is 0 and the grown drafter drafts exactly what the smaller one did. Q's new
    columns get gradient P g != 0 at once (zeroing both codebooks would leave every new term at a saddle)."""
    g = torch.Generator().manual_seed(have * 1000 + want)
    out = dict(weights)
    w, p, q = (weights[_SEL + n] for n in ("hidden_projection.weight", "predecessor_codebook", "successor_codebook"))
    extra = want - have
    out[_SEL + "hidden_projection.weight"] = torch.cat(  # [want, H]
        [w, (torch.randn(extra, w.shape[1], generator=g) * 0.02).to(w.dtype)])
    out[_SEL + "predecessor_codebook"] = torch.cat([p, (torch.randn(p.shape[0], extra, generator=g) * 0.02).to(p.dtype)], 1)
    out[_SEL + "successor_codebook"] = torch.cat([q, q.new_zeros(q.shape[0], extra)], 1)  # [V, want]
    return out
