"""What each exported graph computes, as small torch modules around the reference models.

Declarative: a `GraphSpec` names the graph's inputs, outputs, dynamic dims and example feeds;
the exporter and the validator read only the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from dflash2.export import signature as N
from dflash2.ops import contract as C
from dflash2.reference.drafter import Drafter
from dflash2.reference.target import Target
from dflash2.reference.selector import lattice, walk, walk_tie


class TargetGraph(nn.Module):
    """ids [n] int32, past_kv [P, L, 2, kv, hd] -> next_ids [n] int32, context [n, C], new_kv [n, ...],
    logits [min(n, B), V] fp32. context = drafter fc + hidden_norm of the taps when fused.
    logits: the LAST B rows only (B = block size), what sampling reads: every verified row of a round
    (n <= B) and the last prompt row of a prefill; a slice of the tensor the argmax reads anyway, so
    the greedy path pays one copy of at most B rows, and no buffer grows with the prompt."""

    def __init__(self, target: Target, drafter: Drafter, fuse_context: bool = True):
        super().__init__()
        self.target, self.drafter, self.fuse = target, drafter, fuse_context
        self.block_size = drafter.config.block_size

    def forward(self, input_ids: torch.Tensor, past_kv: torch.Tensor, past_len: torch.Tensor | None = None):
        # past_len given (the TensorRT flavour): past_kv is the whole KV buffer, rows >= past_len masked
        logits, taps, new_kv = self.target(input_ids.long(), past_kv, past_len)
        logits = logits.float()  # argmax over fp32: one rule whatever the graph dtype
        context = self.drafter.context(taps) if self.fuse else taps
        return logits.argmax(-1).to(torch.int32), context, new_kv, logits[-self.block_size:]

    def target_logits(self, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        """[n, V] fp32 logits of every row of a validation feed (the deviation measurement reads them)."""
        return self.target(feed[N.INPUT_IDS].long(), feed[N.PAST_KV])[0].float()


class DrafterGraph(nn.Module):
    """context [n, C], past_ctx_kv [P, Ld, 2, kv, hd], anchor [1] int32 (, uniforms [S] fp32,
    temperature [1] fp32 for DFlash2) -> draft_ids [S] int32 (, cand_ids [S, K] int32 for DFlash2),
       confidence [S] fp32 (, draft_probs [S, K] fp32 for DFlash2), new_ctx_kv [n, Ld, 2, kv, hd].
    confidence: v2 the selector's (walked candidate's softmax probability in its score row), v1 the
    top-1 probability; the runtime's draft-length policy reads it. DFlash2's selector runs in mode
    "sample": temperature 0 is the greedy walk, > 0 samples each row with its uniform and returns q
    as draft_probs. v1 drafts its top-1 at every temperature (q one-hot, built by the runtime)."""

    def __init__(self, drafter: Drafter, fused_context: bool = True):
        super().__init__()
        self.drafter, self.fused = drafter, fused_context

    def forward(self, context: torch.Tensor, past_ctx_kv: torch.Tensor, anchor: torch.Tensor,
                past_len: torch.Tensor | None = None):
        hidden, new_kv = self._hidden(context, past_ctx_kv, anchor, past_len)
        out = self.drafter.propose(hidden, anchor)
        return out[N.DRAFT_IDS], out[N.CONFIDENCE], new_kv

    def _hidden(self, context, past_ctx_kv, anchor, past_len):
        c = context if self.fused else self.drafter.context(context)
        if past_len is None:
            return self.drafter(c, past_ctx_kv, anchor.long())
        return self._fixed(c, past_ctx_kv, anchor.long(), past_len.reshape(1).long())

    def _fixed(self, c, cache, anchor, start):
        """Drafter.forward over the whole context-KV buffer [cap, ...]: rows >= start are stale and get a
        position past every query, so the context mask (position < block start) hides them."""
        d, cap, n = self.drafter, cache.shape[0], c.shape[0]
        new_kv = d.append_context(c, start)  # positions start .. start+n-1
        rows = torch.arange(cap)
        ctx_pos = torch.cat([torch.where(rows < start, rows, rows + cap + n), start + torch.arange(n)])
        block = start + n  # the block sits after the new context rows, as in Drafter.forward
        hidden = d.run_blocks(d.block_embeddings(anchor), torch.cat([cache, new_kv]), ctx_pos, block, block)
        return hidden[0, 1:], new_kv


class SamplingDrafterGraph(DrafterGraph):
    """The DFlash2 drafter graph: + uniforms [S] fp32, temperature [1] fp32 in; + draft_probs [S, K] out."""

    def forward(self, context: torch.Tensor, past_ctx_kv: torch.Tensor, anchor: torch.Tensor,
                uniforms: torch.Tensor, temperature: torch.Tensor, past_len: torch.Tensor | None = None):
        hidden, new_kv = self._hidden(context, past_ctx_kv, anchor, past_len)
        out = self.drafter.propose_batch(hidden[None], anchor.reshape(1), uniforms.reshape(1, -1),
                                         temperature.reshape(1))
        return out[N.DRAFT_IDS][0], out[N.CAND_IDS][0], out[N.CONFIDENCE][0], out[N.DRAFT_PROBS][0], new_kv

    def on_candidates(self, got: dict, atol: float, rtol: float, context, past_ctx_kv, anchor, uniforms,
                      temperature, past_len=None):
        """forward's outputs judged on a graph's own choices where rounding alone explains them, or None.
        Its candidates [S, K] walked where they are a top-K of this reference's logits up to rounding
        (Drafter.candidates_from: fp16 swaps near-equal ones); where the graph's path leaves the walk at a row
        whose two picks tie up to rounding (selector.walk_tie), the reference takes the graph's pick there and
        walks on from it (every later row, confidence and q still the reference's: a later divergence must be a
        tie of its own). Returns (outputs, the rows where the graph's tied pick was taken)."""
        hidden, new_kv = self._hidden(context, past_ctx_kv, anchor, past_len)
        d, c = self.drafter, self.drafter.config
        cands = d.candidates_from(hidden[None], torch.from_numpy(got[N.CAND_IDS])[None], atol, rtol)
        if cands is None:
            return None
        vals, ids = cands  # [1, S, K]
        sel = d.candidate_selector
        gate = hidden[None].to(sel.hidden_projection.weight.dtype) @ sel.hidden_projection.weight.T  # [1, S, R]
        scores, ids_l = lattice(vals, ids, gate.to(sel.predecessor_codebook.dtype), anchor.reshape(1).int(),
                                sel.predecessor_codebook, sel.successor_codebook, float(c.output_multiplier),
                                float(c.logit_softcap))
        T, u = temperature.reshape(1).float(), uniforms.reshape(1, -1).float()
        g = torch.from_numpy(got[N.DRAFT_IDS]).long()
        picks = torch.full((1, g.shape[0]), -1, dtype=torch.long)
        while True:
            draft, index, rows, conf, probs = walk(scores, ids_l, u, T, picks)
            differ = (g != draft[0].long()).nonzero()
            if not len(differ):
                break
            s = int(differ[0])
            j = (ids_l[0, s] == g[s]).nonzero()
            if len(j) != 1 or picks[0, s] >= 0 or not walk_tie(rows[0, s], float(T[0]), float(u[0, s]), int(j[0]),
                                                               int(index[0, s]), atol, rtol):
                break  # not rounding: the plain comparison judges (and fails) it
            picks[0, s] = int(j[0])
        taken = int((picks >= 0).sum())
        return (draft[0], ids[0], conf[0], probs[0], new_kv), taken


class SelectorGraph(nn.Module):
    """The selector alone with the drafter's real codebooks: [B, S, K] candidates -> walked path."""

    def __init__(self, drafter: Drafter):
        super().__init__()
        c, sel = drafter.config, drafter.candidate_selector
        self.attrs = dict(top_k=c.selector_top_k, rank=c.selector_rank,
                          output_multiplier=c.output_multiplier, logit_softcap=c.logit_softcap)
        self.pred_codebook, self.succ_codebook = sel.predecessor_codebook, sel.successor_codebook

    def forward(self, cand_logits, cand_ids, gate, anchor, uniforms, temperature):
        return torch.ops.dflash2.select_path(cand_logits, cand_ids, gate, anchor, self.pred_codebook,
                                             self.succ_codebook, uniforms, temperature, **self.attrs,
                                             mode="sample")


@dataclass
class GraphSpec:
    name: str  # "target" | "drafter" | "selector"
    module: nn.Module
    inputs: list[str]
    outputs: list[str]
    dynamic: dict[str, dict[int, str]]  # input -> {axis: dim name}
    example: tuple  # tracing example
    feeds: Callable[[], list[dict[str, torch.Tensor]]]  # deterministic validation steps
    has_selector: bool = False
    tensorrt: GraphSpec | None = None  # a separate TensorRT flavour with fixed step shapes (fixed_shapes())
    # (output name, value, feed) -> the part compared: rows a graph leaves unspecified are cut (gqa's buffers)
    trim: Callable[[str, np.ndarray, dict], np.ndarray] | None = None
    # (the graph's outputs, atol, rtol, *inputs) -> (the reference's outputs walked on the graph's own choices, the
    # positions taken after a tie), or None where rounding does not explain them (SamplingDrafterGraph.on_candidates)
    on_candidates: Callable | None = None


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def graph_specs(target: Target, drafter: Drafter, fuse_context: bool = True) -> list[GraphSpec]:
    tc, dc = target.config, drafter.config
    dtype = target.norm.weight.dtype
    S, V = dc.num_drafts, tc.vocab_size
    ctx_width = dc.hidden_size if fuse_context else len(dc.target_layer_ids) * tc.hidden_size
    kv = lambda P: torch.zeros(P, *target.kv_row_shape(), dtype=dtype)  # noqa: E731
    ckv = lambda P: torch.zeros(P, *drafter.kv_row_shape(), dtype=dtype)  # noqa: E731

    def target_feeds():
        g = _gen(0)
        prompt = torch.randint(0, V, (11,), generator=g, dtype=torch.int32)
        verify = torch.randint(0, V, (S + 1,), generator=g, dtype=torch.int32)
        with torch.no_grad():
            _, _, past, *_ = TargetGraph(target, drafter)(prompt, kv(0))
        return [{N.INPUT_IDS: prompt, N.PAST_KV: kv(0)}, {N.INPUT_IDS: verify, N.PAST_KV: past}]

    v2 = dc.version == 2
    graph = (SamplingDrafterGraph if v2 else DrafterGraph)(drafter, fuse_context)
    # DFlash2's sampling inputs: step 0 greedy (temperature 0), step 1 sampling at 0.8
    sampling = [{N.UNIFORMS: torch.rand(S, generator=_gen(3)), N.TEMPERATURE: torch.tensor([t])} for t in (0.0, 0.8)]

    def drafter_feeds():
        g = _gen(1)
        c0 = torch.randn(9, ctx_width, generator=g).to(dtype)
        c1 = torch.randn(3, ctx_width, generator=g).to(dtype)
        anchor = torch.randint(0, V, (1,), generator=g, dtype=torch.int32)
        extra = sampling if v2 else [{}, {}]
        with torch.no_grad():
            past = graph(c0, ckv(0), anchor, *extra[0].values())[-1]
        return [{N.CONTEXT: c0, N.PAST_CTX_KV: ckv(0), N.ANCHOR: anchor, **extra[0]},
                {N.CONTEXT: c1, N.PAST_CTX_KV: past, N.ANCHOR: anchor + 1, **extra[1]}]

    t_out = [N.NEXT_IDS, N.CONTEXT, N.NEW_KV, N.LOGITS]
    d_in = [N.CONTEXT, N.PAST_CTX_KV, N.ANCHOR] + ([N.UNIFORMS, N.TEMPERATURE] if v2 else [])
    d_out = ([N.DRAFT_IDS, N.CONFIDENCE, N.NEW_CTX_KV] if not v2
             else [N.DRAFT_IDS, N.CAND_IDS, N.CONFIDENCE, N.DRAFT_PROBS, N.NEW_CTX_KV])
    d_example = (torch.zeros(5, ctx_width, dtype=dtype), ckv(3), torch.tensor([1], dtype=torch.int32))
    if v2:
        d_example += tuple(sampling[1].values())
    if hasattr(target, "empty_state"):  # a hybrid target (recurrent state besides the KV cache): its own spec
        from dflash2.export.qwen3_5_graph import target_spec
        t_spec = target_spec(target, drafter, fuse_context, _gen)
    else:
        t_spec = GraphSpec("target", TargetGraph(target, drafter, fuse_context), [N.INPUT_IDS, N.PAST_KV], t_out,
                           {N.INPUT_IDS: {0: "n"}, N.PAST_KV: {0: "past"}},
                           (torch.arange(5, dtype=torch.int32), kv(3)), target_feeds)
    specs = [
        t_spec,
        GraphSpec("drafter", graph, d_in, d_out,
                  {N.CONTEXT: {0: "n"}, N.PAST_CTX_KV: {0: "past"}, N.ANCHOR: {},
                   **({N.UNIFORMS: {}, N.TEMPERATURE: {}} if v2 else {})},
                  d_example, drafter_feeds, has_selector=v2, on_candidates=graph.on_candidates if v2 else None),
    ]
    for spec in specs:
        spec.tensorrt = fixed_shapes(spec)
    if dc.version == 2:
        K, R = dc.selector_top_k, dc.selector_rank

        def selector_feeds():
            g = _gen(2)
            out = []
            for B in (1, 3):
                ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).view(B, S, K)
                logits, _ = torch.sort(torch.randn(B, S, K, generator=g) * 3, dim=-1, descending=True)
                out.append({"cand_logits": logits, N.CAND_IDS: ids.int(),
                            "gate": torch.randn(B, S, R, generator=g).to(dtype),
                            N.ANCHOR: torch.randint(0, V, (B,), generator=g, dtype=torch.int32),
                            N.UNIFORMS: torch.rand(B, S, generator=g),
                            N.TEMPERATURE: torch.tensor([0.0, 0.7, 1.5][:B])})  # greedy and sampled rows
            return out

        ex = selector_feeds()[1]
        specs.append(GraphSpec("selector", SelectorGraph(drafter), list(ex),
                               C.output_names(),
                               {"cand_logits": {0: "batch"}, N.CAND_IDS: {0: "batch"}, "gate": {0: "batch"},
                                N.ANCHOR: {0: "batch"}, N.UNIFORMS: {0: "batch"}, N.TEMPERATURE: {0: "batch"}},
                               tuple(ex.values()), selector_feeds, has_selector=True))
    return specs


STALE_ROWS = 3  # rows past the valid ones in the validation feeds: garbage the in-graph mask must hide


def fixed_shapes(spec: GraphSpec) -> GraphSpec:
    """The TensorRT flavour of the target / drafter: the whole KV buffer `kv_cache [cap, ...]` plus
    `past_len [1]` instead of the prefix view `past_kv [past, ...]`. A step of n rows then binds the
    same shapes and addresses wherever it is in the sequence, so a CUDA graph captured once per row
    count replays (the prefix view gives every step a new past length, hence a new graph). Outputs
    are unchanged (new_kv [n, ...] goes to a staging buffer the runtime copies into place).
    Feeds: the portable feeds with the past padded by STALE_ROWS random rows, same reference outputs."""
    past, cache = N.FIXED[spec.name]
    inputs = [cache if n == past else n for n in spec.inputs] + [N.PAST_LEN]
    dynamic = {(cache if k == past else k): ({0: "cap"} if k == past else v) for k, v in spec.dynamic.items()}
    dynamic[N.PAST_LEN] = {}

    def convert(feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        p = feed[past]
        g = torch.Generator().manual_seed(p.shape[0])
        stale = torch.randn(STALE_ROWS, *p.shape[1:], generator=g).to(p.dtype)
        out = {(cache if k == past else k): (torch.cat([p, stale]) if k == past else v) for k, v in feed.items()}
        out[N.PAST_LEN] = torch.tensor([p.shape[0]], dtype=torch.int32)
        return out

    ex = dict(zip(spec.inputs, spec.example))
    example = tuple(convert(ex)[n] for n in inputs)
    return GraphSpec(spec.name, spec.module, inputs, spec.outputs, dynamic, example,
                     lambda: [convert(f) for f in spec.feeds()], spec.has_selector,
                     on_candidates=spec.on_candidates)
