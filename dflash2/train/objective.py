"""What a drafter is trained on and scored by: its blocks at random anchors of a target-answered sequence, the
depth-decayed draft cross-entropy plus the selector's K-way cross-entropy (docs/algorithm.md section 4), the
target's soft labels, and acceptance offline (what the speculative loop would accept at those anchors)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from dflash2.errors import Dflash2Error
from dflash2.reference.drafter import Drafter
from dflash2.reference.layers import rope_cos_sin
from dflash2.speculative import Stats
from dflash2.train.pool import anchor_range, sample_anchors


class Teacher:
    """The target's layers after the last tap, run over a record's last-tap rows: its final hidden
    states, hence its next-token distribution (soft labels), for 2 of SmolLM2's 30 layers. Corpus
    taps are fp16, so these logits are close to, not bit-equal with, the target's.

    A hybrid target (Qwen3.5: `Qwen35Target`, layers of kind "linear_attention" / "full_attention") runs its
    remaining layers per kind over the record's rows from an empty state, as its own prefill does: the Gated
    DeltaNet layers from a zero conv and recurrent state (chunk-parallel: only the outputs are needed), the gated
    full-attention layers with no past K/V under the M-RoPE angles of text (the token index on all three axes:
    mrope_cos_sin of plain positions). The rows are a whole sequence from position 0, so nothing is approximated
    (the tapped layer's output is all a later layer reads). It runs in fp32 with autocast off (the GDN recurrence
    solves triangular systems that bf16 autocast would cast down)."""

    def __init__(self, target, tap_ids: tuple[int, ...]):
        last = max(tap_ids)
        self.column = list(tap_ids).index(last)  # which H-wide slice of the taps is the last tap
        self.layers = target.layers[last + 1:]
        self.norm, self.head, self.inv_freq = target.norm, target.head_weight, target.inv_freq
        c = target.config
        self.hybrid = hasattr(target, "empty_state")  # Qwen35Target: per-kind layers, M-RoPE, recurrent state
        if self.hybrid:
            kinds = sorted({layer.kind for layer in self.layers} - {"linear_attention", "full_attention"})
            if kinds:
                raise Dflash2Error(f"--kd-weight: expected layers of kind 'linear_attention' / 'full_attention' after "
                                   f"tap {last}, found {kinds}")
            self.section = tuple(c.mrope_section)
            self.kv_shape = (0, 2, c.num_kv_heads, c.head_dim)  # GatedAttention's past_kv [P, 2, kv, hd]
            self.conv_shape = (c.conv_dim, c.linear_conv_kernel_dim - 1)
            self.rec_shape = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        else:
            self.kv_shape = (0, c.num_kv_heads, c.head_dim)

    def to(self, device, head: torch.Tensor | None = None) -> "Teacher":
        """Its layers, final norm, LM head and RoPE frequencies on `device` (the rows come there with the record);
        `head`: the same LM head already there (the drafter's buffer), shared instead of copied."""
        for layer in self.layers:
            layer.to(device)
        self.norm.to(device)
        self.head = self.head.to(device) if head is None else head
        self.inv_freq = self.inv_freq.to(device)
        return self

    @torch.no_grad()
    def logits(self, rec: dict, positions: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """positions [nb, S] (rows whose next token is a label) -> logits [nb, S, U or V] (fp32)."""
        H = self.norm.weight.shape[0]
        h = rec["taps"][:, self.column * H:(self.column + 1) * H].float()  # [T, H]
        pos = torch.arange(h.shape[0], device=h.device)
        visible = pos[None, :] <= pos[:, None]  # [T, T] causal
        if self.hybrid:
            with torch.autocast(h.device.type, enabled=False):
                h = self._hybrid_layers(h, pos, visible)
        else:
            cos, sin = rope_cos_sin(pos, self.inv_freq)
            empty = h.new_zeros(self.kv_shape)
            for layer in self.layers:
                h, _ = layer(h, empty, empty, cos, sin, visible)
        head = self.head if vocab is None else self.head[vocab]
        return self.norm(h)[positions.clamp(max=h.shape[0] - 1)] @ head.T

    def _hybrid_layers(self, h: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Qwen35Target.forward's layer loop over rows 0..T-1 from an empty state (no taps, no state kept)."""
        from dflash2.reference.qwen3_5 import mrope_cos_sin

        cos, sin = mrope_cos_sin(pos.expand(3, -1), self.inv_freq, self.section)  # text: T = H = W = the index
        empty_kv = h.new_zeros(self.kv_shape)
        conv0, rec0 = h.new_zeros(self.conv_shape), h.new_zeros(self.rec_shape)
        for layer in self.layers:
            u = layer.input_layernorm(h)
            if layer.kind == "full_attention":
                y, _ = layer.self_attn(u, empty_kv, cos, sin, visible)
            else:
                y, _, _ = layer.linear_attn(u, conv0, rec0, 64)  # chunk-parallel: the final state only
            h = h + y
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h


def block_forward(d: Drafter, rec: dict, anchors: list[int]):
    """-> hidden [nb, S, H] (final-normed rows 1..S), labels [nb, S] (-100 beyond the sequence)."""
    S = d.config.block_size - 1
    ids, taps = rec["ids"], rec["taps"]
    T = taps.shape[0]  # taps exist for positions 0..T-1
    c = d.context(taps.float())  # [T, H]
    ctx_kv = d.append_context(c, 0)  # [T, Ld, 2, kv, hd]
    a = torch.tensor(anchors)
    h = d.block_embeddings(ids[a], nb=len(anchors))  # [nb, B, H]
    hidden = d.run_blocks(h, ctx_kv, torch.arange(T), a, a)[:, 1:]  # [nb, S, H]
    idx = a[:, None] + torch.arange(1, S + 1)[None, :]  # [nb, S]
    labels = torch.where(idx < len(ids), ids[idx.clamp(max=len(ids) - 1)], torch.full_like(idx, -100))
    return hidden, labels, ids[a]


def losses(d: Drafter, hidden, labels, anchor_ids, gamma: float, K: int, vocab: torch.Tensor | None = None,
           multiplier: torch.Tensor | float | None = None, teacher: torch.Tensor | None = None, kd_weight: float = 0.0):
    """vocab: ids the softmax runs over ([U], sorted), or None for all; labels outside it are ignored.
    multiplier: the selector's unary scale (a learnable scalar while training), default the config's.
    teacher: the target's logits for the same rows and vocabulary [nb, S, U] (with kd_weight > 0)."""
    S = hidden.shape[1]
    prev = torch.cat([anchor_ids[:, None], labels[:, :-1].clamp(min=0)], 1)  # [nb, S] token ids before each row
    if vocab is None:
        logits = d.logits(hidden)  # [nb, S, V]
        to_vocab = None
    else:
        logits = hidden @ d.head_weight[vocab].T  # [nb, S, U]
        to_vocab = vocab
        col = torch.searchsorted(vocab, labels.clamp(min=0)).clamp(max=len(vocab) - 1)  # [nb, S]
        labels = torch.where((labels >= 0) & (vocab[col] == labels), col, -100)  # token ids -> columns of vocab
    w = torch.exp(-torch.arange(S, dtype=torch.float32, device=hidden.device) / gamma)  # position k+1 -> exp(-k/gamma)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none").view_as(labels)
    valid = labels >= 0
    if teacher is not None and kd_weight > 0:  # soft labels: the target's whole next-token distribution
        kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(teacher, -1), log_target=True,
                      reduction="none").sum(-1)  # [nb, S]
        ce = ce + kd_weight * kl
    draft_loss = (ce * w * valid).sum() / (w * valid).sum().clamp(min=1)
    # selector: K-way CE over the drafter's own top-K, predecessor = the TRUE previous token
    sel = d.candidate_selector
    with torch.no_grad():
        unary, cand = logits.detach().float().topk(K, dim=-1)  # [nb, S, K] (shortlist positions)
    with torch.autocast(hidden.device.type, enabled=False):  # the selector's math stays fp32 under bf16
        sel_loss = _selector_loss(sel, hidden.detach().float(), unary, cand, labels, valid, prev, to_vocab,
                                  d.config.output_multiplier if multiplier is None else multiplier)
    return draft_loss, sel_loss


def _selector_loss(sel, hidden, unary, cand, labels, valid, prev, to_vocab, m):
    """prev [nb, S]: the true previous token ids (a label outside `to_vocab` is still a predecessor)."""
    gate = hidden @ sel.hidden_projection.weight.T  # [nb, S, R]
    cand_vocab = cand if to_vocab is None else to_vocab[cand]
    pair = torch.einsum("nsr,nskr->nsk", sel.predecessor_codebook[prev] * gate, sel.successor_codebook[cand_vocab])
    hit = cand == labels[..., None]  # [nb, S, K]
    present = hit.any(-1) & valid
    target = hit.float().argmax(-1)
    sel_ce = F.cross_entropy((unary * m + pair).flatten(0, 1), target.flatten(),
                             reduction="none").view_as(labels)
    return (sel_ce * present).sum() / present.sum().clamp(min=1)


@torch.no_grad()
def accepted_lengths(d: Drafter, rec: dict, anchors: list[int]) -> dict[str, list[int]]:
    """Drafts accepted per block (leading matches with the target's greedy tokens) for the selector
    path, the top-1 path and the top-K oracle: what the speculative loop would accept at these anchors."""
    hidden, labels, anchor_ids = block_forward(d, rec, anchors)
    out = d.propose_batch(hidden, anchor_ids)
    return {"selector": _accepted(out["draft_ids"].long() == labels).tolist(),
            "top1": _accepted(out["cand_ids"][..., 0].long() == labels).tolist(),
            "oracle": _accepted((out["cand_ids"].long() == labels[..., None]).any(-1)).tolist()}


@torch.no_grad()
def offline_acceptance(d: Drafter, records: list[dict], anchors_per_seq: int = 16, seed: int = 1) -> dict:
    """tau for the selector path, the top-1 path and the top-K oracle on held-out blocks at random
    anchors (every position weighs the same; the loop's own anchors sit more often where drafts fail)."""
    rng = random.Random(seed)
    taus = {"selector": [], "top1": [], "oracle": []}
    S = d.config.num_drafts
    for rec in records:
        anchors = sample_anchors(rec, anchors_per_seq, rng)
        if anchors:
            for name, acc in accepted_lengths(d, rec, anchors).items():
                taus[name] += acc
    return _summary(taus, S) | {"blocks": len(taus["top1"])}


@torch.no_grad()
def loop_accepted(d: Drafter, rec: dict, chunk: int = 96) -> dict[str, list[int]]:
    """Drafts accepted per round at the anchors the speculative loop itself visits (greedy, all drafts verified):
    the first generated token, then after each round the token the target appended, a_{i+1} = a_i + accepted_i + 1.
    These sit where the last draft failed, unlike offline_acceptance's uniform anchors. Every answer position is
    scored once (in chunks of blocks), then each path's own chain is walked: the selector's, top-1's, oracle's."""
    lo, hi = anchor_range(rec)
    every = list(range(lo, hi + 1))
    at = {"selector": [], "top1": [], "oracle": []}
    for i in range(0, len(every), chunk):
        for k, v in accepted_lengths(d, rec, every[i:i + chunk]).items():
            at[k] += v
    chains = {}
    for k, acc in at.items():
        chains[k], a = [], lo
        while a <= hi:
            chains[k].append(acc[a - lo])
            a += acc[a - lo] + 1
    return chains


@torch.no_grad()
def after_misses(d: Drafter, rec: dict, anchors: list[int]) -> list[int]:
    """Where the speculative loop drafts next from each of `anchors` with this drafter (selector path, all drafts
    verified): a + accepted + 1, right after the first draft it gets wrong; those past the answer's last anchor are
    dropped, duplicates merged. One step of the loop's chain from uniform anchors: training blocks drawn where the
    loop's own blocks are (loop_accepted), for the price of a forward without gradients over `anchors`."""
    hi = anchor_range(rec)[1]
    return sorted({a + n + 1 for a, n in zip(anchors, accepted_lengths(d, rec, anchors)["selector"]) if a + n + 1 <= hi})


def loop_acceptance(d: Drafter, records: list[dict]) -> dict:
    """tau per path at the loop's own anchors (loop_accepted) over `records`; blocks: rounds per path."""
    taus = {"selector": [], "top1": [], "oracle": []}
    for rec in records:
        for k, v in loop_accepted(d, rec).items():
            taus[k] += v
    return _summary(taus, d.config.num_drafts) | {"blocks": {k: len(v) for k, v in taus.items()}}


def _summary(taus: dict[str, list[int]], S: int) -> dict:
    """Acceptance length and per-position acceptance per path ({"blocks": 0} for no block)."""
    if not taus["top1"]:
        return {"blocks": 0}
    stats = {k: Stats(S + 1, accepted=v) for k, v in taus.items()}
    return {k: s.acceptance_length for k, s in stats.items()} | {
        "position_acceptance": {k: s.position_acceptance() for k, s in stats.items()}}


def _accepted(ok: torch.Tensor) -> torch.Tensor:  # [nb, S] bool -> leading True count [nb]
    return ok.int().cumprod(-1).sum(-1)
