"""DFlash (v1) and DFlash2 (v2) block drafters, written for export and reused by training.

One round: context rows c = hidden_norm(fc(taps)) get their per-layer K/V appended to the
drafter's context cache ([T, Ld, 2, kv, hd], same sequence-major layout as the target's);
the block [anchor, MASK x S] attends over cached context + itself, non-causal inside the block
unless the layer's rule says causal. Rows 1..S of norm(h) go through the TARGET's LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.config import DrafterConfig
from dflash2.numerics import magnitude
from dflash2.reference.layers import (MLP, Fp32Rope, Projections, RMSNorm, attend, rope_cos_sin, rope_inv_freq,
                                     visibility)
from dflash2.reference.selector import select_candidates, topk_lowest_index
from dflash2.reference.vocab import project, take


class GroupedDynamicConv(nn.Module):
    """DFlash2's in-block convolution: per-row coefficients = base + projection(u), shared per group."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        self.taps, self.group = taps, group
        base = torch.zeros(2, taps, hidden)
        base[:, 0] = 1.0  # identity init: tap 0 = 1, projection 0 -> exactly DFlash v1
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group), bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def coefficients(self, u: torch.Tensor) -> torch.Tensor:  # [nb, B, H] -> [nb, B, 2, taps, G]
        return self.kernel_projection(u).unflatten(-1, (2, self.taps, -1))

    def convolve(self, z: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """z [nb, B, H]; taps never cross a block boundary (the anchor row has no predecessor)."""
        out = torch.zeros_like(z)
        for k in range(self.taps):
            shifted = z if k == 0 else F.pad(z[:, :-k], (0, 0, k, 0))  # [nb, B, H], row t holds z[t-k]
            out = out + self.base_kernel[side, k].to(z.dtype) * shifted
            dyn = delta[:, :, side, k].repeat_interleave(self.group, dim=-1)  # [nb, B, H]
            out = out + dyn * shifted
        return out


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig, index: int):
        super().__init__()
        self.causal, self.window = c.layer_causal[index], c.layer_window[index]
        self.self_attn = Projections(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                     c.attention_bias, True, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        conv = (c.hidden_size, c.conv_kernel_size, c.conv_group_size)
        self.attention_conv = GroupedDynamicConv(*conv) if c.version == 2 else None
        self.mlp_conv = GroupedDynamicConv(*conv) if c.version == 2 else None

    def context_kv(self, c: torch.Tensor, cos, sin) -> torch.Tensor:  # [n, H] -> [n, 2, kv, hd]
        k, v = self.self_attn.key_value(c, cos, sin)
        return torch.stack([k, v], dim=1)

    def forward(self, h, ctx_k, ctx_v, cos, sin, visible):
        """h [nb, B, H] blocks; ctx_k/v [T, kv, hd]; visible [nb*B, T + nb*B]."""
        nb, B, H = h.shape
        u = self.input_layernorm(h)
        a = self._sublayer(u, self.attention_conv, lambda x: self._attention(x, ctx_k, ctx_v, cos, sin, visible))
        h = h + a
        u = self.post_attention_layernorm(h)
        return h + self._sublayer(u, self.mlp_conv, self.mlp)

    @staticmethod
    def _sublayer(u, conv, fn):
        if conv is None:
            return fn(u)
        delta = conv.coefficients(u)  # both sides' coefficients come from the sublayer input u
        return conv.convolve(fn(conv.convolve(u, delta, 0)), delta, 1)

    def _attention(self, x, ctx_k, ctx_v, cos, sin, visible):
        nb, B, H = x.shape
        flat = x.reshape(nb * B, H)
        q = self.self_attn.query(flat, cos, sin)  # [nb*B, nh, hd]
        k, v = self.self_attn.key_value(flat, cos, sin)  # [nb*B, kv, hd]
        a = attend(q, torch.cat([ctx_k, k]), torch.cat([ctx_v, v]), visible)
        return self.self_attn.o_proj(a).view(nb, B, H)


class Drafter(Fp32Rope):
    """The drafter plus the target's embedding / LM head (buffers, not part of its checkpoint)."""

    def __init__(self, c: DrafterConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 target_hidden: int | None = None):
        super().__init__()
        self.config = c
        taps_width = len(c.target_layer_ids) * (target_hidden or c.hidden_size)
        self.fc = nn.Linear(taps_width, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.version == 2:
            self.candidate_selector = CandidateSelector(c)
        # a tied target shares one tensor: register it once so no graph stores it twice
        self.tied = head_weight is embed_weight or (isinstance(head_weight, torch.Tensor) and isinstance(
            embed_weight, torch.Tensor) and head_weight.data_ptr() == embed_weight.data_ptr())
        if isinstance(embed_weight, torch.Tensor):
            self.register_buffer("embed_weight", embed_weight, persistent=False)
            self.register_buffer("untied_head", None if self.tied else head_weight, persistent=False)
        else:  # dflash2.reference.vocab.StreamedRows: read from the target's checkpoint as needed
            self.embed_weight, self.untied_head = embed_weight, None if self.tied else head_weight
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim), persistent=False)
        # optional draft vocabulary (dflash2.draft_vocab): ids [N] and their LM-head rows [N, H]
        self.register_buffer("draft_ids", None, persistent=False)
        self.register_buffer("draft_head", None, persistent=False)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_weight if self.tied else self.untied_head

    def kv_row_shape(self) -> tuple[int, int, int, int]:
        c = self.config
        return (c.num_layers, 2, c.num_kv_heads, c.head_dim)

    def iter_layers(self):
        """The layers in order (dflash2.reference.streamed reads each one from disk as it is reached)."""
        return iter(self.layers)

    def context(self, taps: torch.Tensor) -> torch.Tensor:  # [n, n_taps*Ht] -> [n, H]
        return self.hidden_norm(self.fc(taps))

    def append_context(self, c: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
        """Per-layer K/V of context rows at positions start.. -> [n, Ld, 2, kv, hd]."""
        cos, sin = rope_cos_sin(torch.arange(c.shape[0]) + start, self.inv_freq)
        return torch.stack([layer.context_kv(c, cos, sin) for layer in self.iter_layers()], dim=1)

    def block_embeddings(self, anchor: torch.Tensor, nb: int = 1) -> torch.Tensor:
        """[nb, B, H]: slot 0 = the anchor's embedding, slots 1.. = MASK (the pitfall: never MASK in 0)."""
        c = self.config
        ids = torch.full((nb, c.block_size), c.mask_token_id, dtype=torch.long)
        ids[:, 0] = anchor.reshape(nb).long()
        return take(self.embed_weight, ids) * c.input_embedding_scale

    def run_blocks(self, h: torch.Tensor, ctx_kv: torch.Tensor, ctx_pos: torch.Tensor,
                   starts: torch.Tensor, ctx_limit: torch.Tensor) -> torch.Tensor:
        """h [nb, B, H] blocks at positions starts[b]..; ctx_kv [T, Ld, 2, kv, hd] at ctx_pos [T];
        block b sees context rows with position < ctx_limit[b]. Returns norm(h) [nb, B, H]."""
        nb, B, _ = h.shape
        q_pos = (starts[:, None] + torch.arange(B)[None, :]).reshape(-1)  # [nb*B]
        cos, sin = rope_cos_sin(q_pos, self.inv_freq)
        blk = torch.arange(nb).repeat_interleave(B)
        same_block = blk[:, None] == blk[None, :]  # [nb*B, nb*B]
        ctx_ok = ctx_pos[None, :] < ctx_limit[blk][:, None]  # [nb*B, T]
        for i, layer in enumerate(self.iter_layers()):
            vis = torch.cat([ctx_ok & visibility(q_pos, ctx_pos, layer.causal, layer.window),
                             same_block & visibility(q_pos, q_pos, layer.causal, layer.window)], dim=1)
            h = layer(h, ctx_kv[:, i, 0], ctx_kv[:, i, 1], cos, sin, vis)
        return self.norm(h)

    def forward(self, context: torch.Tensor, past_ctx_kv: torch.Tensor, anchor: torch.Tensor):
        """context [n, H] new rows, past_ctx_kv [P, Ld, 2, kv, hd], anchor [1]
        -> hidden [S, H] (final-normed rows 1..S), new_ctx_kv [n, Ld, 2, kv, hd]."""
        P, n = past_ctx_kv.shape[0], context.shape[0]
        new_kv = self.append_context(context, P)
        start = torch.zeros(1, dtype=torch.long) + (P + n)  # [1], symbolic under export
        ctx_pos = torch.arange(P + n)
        hidden = self.run_blocks(self.block_embeddings(anchor), torch.cat([past_ctx_kv, new_kv]), ctx_pos,
                                 start, start)
        return hidden[0, 1:], new_kv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [.., H] -> [.., V] raw LM-head logits
        return project(hidden, self.head_weight)

    def set_draft_vocab(self, ids: list[int] | None) -> None:
        """Restrict proposals to `ids` (ascending token ids) or lift the restriction (None)."""
        if ids is None:
            self.draft_ids = self.draft_head = None
            return
        self.draft_ids = torch.tensor(ids, dtype=torch.long)  # [N]
        self.draft_head = take(self.head_weight, self.draft_ids).clone()  # [N, H]: the graph stores only these rows

    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[.., H] -> logits over the draft vocabulary [.., N] and its ids [N] (or [.., V], None)."""
        if self.draft_ids is None:
            return self.logits(hidden), None
        return hidden @ self.draft_head.T, self.draft_ids

    def propose(self, hidden: torch.Tensor, anchor: torch.Tensor, uniforms: torch.Tensor | None = None,
                temperature: float = 0.0) -> dict[str, torch.Tensor]:
        """hidden [S, H] -> draft_ids [S] int32, confidence [S] fp32 (+ the selector's lattice for v2).
        v2 at temperature > 0: the selector samples its walk with uniforms [S] (draft_probs [S, K] = q);
        v1 always drafts its top-1 (q one-hot at the draft)."""
        if self.config.version == 1:
            logits, ids = self.draft_logits(hidden)  # [S, N]
            scaled = _scaled(logits.float(), self.config)  # [S, N]
            best = scaled.argmax(-1)  # [S]
            # confidence = top-1 probability; NaN-free softmax of finite logits (the v2 rule is the op's)
            conf = torch.softmax(scaled, dim=-1).amax(-1)  # [S] fp32
            return {"draft_ids": (best if ids is None else ids[best]).int(), "confidence": conf}
        u = None if uniforms is None else uniforms.reshape(1, -1)
        t = torch.tensor([float(temperature)]).reshape(1)
        return {k: v[0] for k, v in self.propose_batch(hidden[None], anchor.reshape(1), u, t).items()}

    def propose_batch(self, hidden: torch.Tensor, anchor: torch.Tensor, uniforms: torch.Tensor | None = None,
                      temperature: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """DFlash2: hidden [nb, S, H], anchor [nb] (, uniforms [nb, S], temperature [nb])
        -> selector outputs [nb, S(, K)]; the op runs in mode "sample" (temperature 0 walks greedily)."""
        c, sel = self.config, self.candidate_selector
        logits, ids = self.draft_logits(hidden)
        return select_candidates(logits.float(), hidden, anchor, sel.hidden_projection.weight,
                                 sel.predecessor_codebook, sel.successor_codebook, c.selector_top_k,
                                 c.output_multiplier, c.logit_softcap, id_map=ids, uniforms=uniforms,
                                 temperature=temperature, mode="sample")

    def candidates_from(self, hidden: torch.Tensor, cand_ids: torch.Tensor, atol: float, rtol: float
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Another top-K of these hidden states ([nb, S, H]; cand_ids [nb, S, K] token ids, a graph's) as
        (this reference's logits at those ids, the ids) when it is a top-K of this reference's logits up to
        rounding: every slot's logit within atol * max(1, rms(logits)) + rtol * |value| of this reference's own
        k-th value (near-equal candidates swap under fp16 rounding; any other difference returns None)."""
        logits, ids = self.draft_logits(hidden)
        logits = logits.float()  # [nb, S, N]
        own, _ = topk_lowest_index(logits, self.config.selector_top_k)  # [nb, S, K]
        g = cand_ids.long()
        if ids is None:
            known = (g >= 0) & (g < logits.shape[-1])
            cols = g.clamp(0, logits.shape[-1] - 1)
        else:  # token ids -> columns of the draft vocabulary (ascending ids)
            cols = torch.searchsorted(ids, g).clamp(max=len(ids) - 1)
            known = ids[cols] == g
        vals = logits.gather(-1, cols)  # [nb, S, K]
        scale = magnitude(logits.detach().numpy())  # the comparison rule's own atol scale
        close = (vals - own).abs() <= atol * scale + rtol * own.abs()
        distinct = all(len(set(r.tolist())) == len(r) for r in g.reshape(-1, g.shape[-1]))
        if not (bool(known.all()) and bool(close.all()) and distinct):
            return None
        return vals, cand_ids.int()


def _scaled(logits: torch.Tensor, c: DrafterConfig) -> torch.Tensor:
    logits = logits * c.output_multiplier
    if c.logit_softcap > 0:
        logits = torch.tanh(logits / c.logit_softcap) * c.logit_softcap
    return logits


class CandidateSelector(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(c.vocab_size, c.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(c.vocab_size, c.selector_rank))
