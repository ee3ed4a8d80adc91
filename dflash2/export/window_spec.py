"""The windowed graphs' validation specs: what the export checks the window-buffer graphs against (the target's
sliding layers: `windowed_spec`; a drafter whose every layer slides: `windowed_drafter_spec`, at the end).

A target whose config has sliding-window layers and at least one full-attention layer is exported with its
sliding layers' K|V in the bounded window buffer (export.plain.KvLayout, manifest.WindowSignature,
runtime.window.CompactingKv). Its graphs take `past_kv` of the full layers only, `past_window_kv` (the window
buffer's valid rows) and `window_base` (the real position of its row 0), and return `new_window_kv` beside
`new_kv`. The PyTorch reference (TargetGraph) knows one `past_kv` of every layer: `WindowedTargetGraph` puts the
window rows back at their real positions in an every-layer past (rows before `window_base` zero: no later query
can see them, q - k < W, and the reference's own mask says so) and splits the reference's new rows the graph's way.

The feeds go past the window and through a compaction, as generation does (plan section 3.2):
  0. a prompt of max(11, keep + 4) rows, nothing before it: the sliding mask inside one step;
  1. a block-wide verify after it, the window buffer holding every row (base 0: no compaction yet);
  2. the same verify after a compaction: the buffer holds the last `keep` rows only, base = P - keep.
The fixed (TensorRT) flavour's feeds are these with stale random rows after the valid ones of both buffers.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dflash2.export import signature as N
from dflash2.export.graphs import STALE_ROWS, GraphSpec, TargetGraph, _gen


class WindowedTargetGraph(nn.Module):
    """input_ids [n], past_kv [P, Lf, ...], past_window_kv [v, Lw, ...], window_base [1] int64 (or the fixed
    flavour's kv_cache + past_len, window_cache + window_len, window_base) -> next_ids, context, new_kv [n, Lf, ...],
    new_window_kv [n, Lw, ...], logits: TargetGraph over the every-layer past (module docstring)."""

    def __init__(self, graph: TargetGraph, layers: list[int], fixed: bool = False):
        super().__init__()
        self.graph, self.target, self.layers, self.fixed = graph, graph.target, list(layers), fixed
        self.L = graph.target.config.num_layers
        self.full = [i for i in range(self.L) if i not in self.layers]

    def whole_past(self, past_kv: torch.Tensor, window: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        P, v, b = past_kv.shape[0], window.shape[0], int(base.reshape(-1)[0])
        if b + v != P:  # the runtime keeps base + v = the full layers' rows (window.py): a feed that does not is a bug
            raise ValueError(f"windowed target feed: window_base {b} + window rows {v} expected = past_kv rows {P}")
        whole = torch.zeros(P, self.L, *past_kv.shape[2:], dtype=past_kv.dtype)
        whole[:, self.full] = past_kv
        whole[b:, self.layers] = window
        return whole

    def _views(self, args):
        if not self.fixed:
            return args
        ids, cache, past_len, wcache, wlen, base = args
        return ids, cache[:int(past_len[0])], wcache[:int(wlen[0])], base

    def forward(self, *args):
        ids, past_kv, window, base = self._views(args)
        next_ids, context, new_kv, logits = self.graph(ids, self.whole_past(past_kv, window, base))
        return next_ids, context, new_kv[:, self.full], new_kv[:, self.layers], logits

    def target_logits(self, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        """[n, V] fp32 logits of every row of a (portable) feed: the deviation measurement reads them."""
        whole = self.whole_past(feed[N.PAST_KV], feed[N.PAST_WINDOW_KV], feed[N.WINDOW_BASE])
        return self.target(feed[N.INPUT_IDS].long(), whole)[0].float()


def windowed_spec(spec: GraphSpec, layers: list[int], keep: int) -> GraphSpec:
    """The windowed target's spec (both flavours) from the export's every-layer target spec (graph_specs)."""
    graph: TargetGraph = spec.module
    module = WindowedTargetGraph(graph, layers)
    target = graph.target
    V, B = target.config.vocab_size, graph.block_size
    dtype = target.norm.weight.dtype
    full = module.full

    def split(whole: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(past_kv of the full layers, the window buffer's last `rows` rows) of an every-layer past."""
        return whole[:, full].contiguous(), whole[whole.shape[0] - rows:, layers].contiguous()

    def feeds():
        g = _gen(0)
        P = max(11, keep + 4)
        prompt = torch.randint(0, V, (P,), generator=g, dtype=torch.int32)
        verify = torch.randint(0, V, (B,), generator=g, dtype=torch.int32)
        empty = torch.zeros(0, *target.kv_row_shape(), dtype=dtype)
        with torch.no_grad():
            whole = graph(prompt, empty)[2]  # the prompt's rows of every layer
        out = []
        for ids, past, rows in ((prompt, empty, 0), (verify, whole, P), (verify, whole, keep)):
            kv, win = split(past, rows)
            out.append({N.INPUT_IDS: ids, N.PAST_KV: kv, N.PAST_WINDOW_KV: win,
                        N.WINDOW_BASE: torch.tensor([past.shape[0] - rows], dtype=torch.int64)})
        return out

    inputs = [N.INPUT_IDS, N.PAST_KV, N.PAST_WINDOW_KV, N.WINDOW_BASE]
    outputs = [N.NEXT_IDS, N.CONTEXT, N.NEW_KV, N.NEW_WINDOW_KV, N.LOGITS]
    dynamic = {N.INPUT_IDS: {0: "n"}, N.PAST_KV: {0: "past"}, N.PAST_WINDOW_KV: {0: "window_past"},
               N.WINDOW_BASE: {}}
    row = target.kv_row_shape()[1:]
    example = (torch.arange(5, dtype=torch.int32), torch.zeros(3, len(full), *row, dtype=dtype),
               torch.zeros(3, len(layers), *row, dtype=dtype), torch.tensor([0], dtype=torch.int64))
    portable = GraphSpec("target", module, inputs, outputs, dynamic, example, feeds)
    portable.tensorrt = _fixed(portable, layers)
    return portable


def _fixed(spec: GraphSpec, layers: list[int]) -> GraphSpec:
    """The fixed flavour: both buffers whole with STALE_ROWS random rows past their valid ones, and their valid
    rows (past_len, window_len) as inputs; the reference reads only the valid rows (the graph must hide the rest)."""
    inputs = [N.INPUT_IDS, N.KV_CACHE, N.PAST_LEN, N.WINDOW_CACHE, N.WINDOW_LEN, N.WINDOW_BASE]

    def stale(t: torch.Tensor, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.cat([t, torch.randn(STALE_ROWS, *t.shape[1:], generator=g).to(t.dtype)])

    def convert(feed: dict) -> dict:
        kv, win = feed[N.PAST_KV], feed[N.PAST_WINDOW_KV]
        return {N.INPUT_IDS: feed[N.INPUT_IDS], N.KV_CACHE: stale(kv, kv.shape[0]),
                N.PAST_LEN: torch.tensor([kv.shape[0]], dtype=torch.int32),
                N.WINDOW_CACHE: stale(win, 1000 + win.shape[0]),
                N.WINDOW_LEN: torch.tensor([win.shape[0]], dtype=torch.int32), N.WINDOW_BASE: feed[N.WINDOW_BASE]}

    module = WindowedTargetGraph(spec.module.graph, layers, fixed=True)
    dynamic = {N.INPUT_IDS: {0: "n"}, N.KV_CACHE: {0: "cap"}, N.PAST_LEN: {}, N.WINDOW_CACHE: {0: "window_cap"},
               N.WINDOW_LEN: {}, N.WINDOW_BASE: {}}
    ex = convert(dict(zip(spec.inputs, spec.example)))
    return dataclasses.replace(spec, module=module, inputs=inputs, dynamic=dynamic,
                               example=tuple(ex[n] for n in inputs), feeds=lambda: [convert(f) for f in spec.feeds()],
                               tensorrt=None)


class WindowedDrafterGraph(nn.Module):
    """The windowed drafter (every layer slides: fused_drafter.sliding): DrafterGraph's inputs + window_base [1]
    int64, past_ctx_kv the window buffer's valid rows at real positions window_base ..; the reference (DrafterGraph /
    SamplingDrafterGraph, whose every past row is at its index) reads them put back at their positions in an
    every-row past, rows before window_base zero (no block query can see them: q - k < W, its own mask says so)."""

    def __init__(self, graph: nn.Module):
        super().__init__()
        self.graph = graph

    @staticmethod
    def whole_past(window: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        b = int(base.reshape(-1)[0])
        whole = torch.zeros(b + window.shape[0], *window.shape[1:], dtype=window.dtype)
        whole[b:] = window
        return whole

    def forward(self, context, past_ctx_kv, anchor, *rest):
        *rest, base = rest
        return self.graph(context, self.whole_past(past_ctx_kv, base), anchor, *rest)

    def on_candidates(self, got, atol, rtol, context, past_ctx_kv, anchor, *rest):
        *rest, base = rest
        return self.graph.on_candidates(got, atol, rtol, context, self.whole_past(past_ctx_kv, base), anchor, *rest)


def windowed_drafter_spec(spec: GraphSpec, keep: int) -> GraphSpec:
    """The windowed drafter's portable spec from the export's drafter spec (graph_specs): feeds past the window and
    through a compaction, as generation does: 0. a context of max(9, keep + 4) rows, nothing before it; 1. 3 new rows
    after it, the buffer holding every row (base 0); 2. the same after a compaction: the buffer holds the last
    `keep` rows only, base = P - keep. Its TensorRT flavour stays the drafter's max_seq_len-row one (no window)."""
    graph = spec.module
    module = WindowedDrafterGraph(graph)
    ctx_row, kv_row = spec.example[0].shape[1:], spec.example[1].shape[1:]
    dtype = spec.example[0].dtype
    feeds0 = spec.feeds()  # the drafter's own: their anchors and sampling inputs (greedy, then sampled)

    def feeds():
        g = _gen(4)
        P = max(9, keep + 4)
        c0 = torch.randn(P, *ctx_row, generator=g).to(dtype)
        c1 = torch.randn(3, *ctx_row, generator=g).to(dtype)
        empty = torch.zeros(0, *kv_row, dtype=dtype)
        first = {**feeds0[0], N.CONTEXT: c0, N.PAST_CTX_KV: empty}
        with torch.no_grad():
            whole = graph(*[first[n] for n in spec.inputs])[-1]  # the context's rows [P, Ld, 2, kv, hd]
        out = []
        for ctx, past, rows, base in ((c0, empty, 0, 0), (c1, whole, P, 0), (c1, whole, keep, P - keep)):
            out.append({**feeds0[0 if rows == 0 else 1], N.CONTEXT: ctx, N.PAST_CTX_KV: past[past.shape[0] - rows:],
                        N.WINDOW_BASE: torch.tensor([base], dtype=torch.int64)})
        return out

    example = (*spec.example, torch.tensor([0], dtype=torch.int64))
    on_candidates = module.on_candidates if spec.on_candidates is not None else None
    return dataclasses.replace(spec, module=module, inputs=[*spec.inputs, N.WINDOW_BASE],
                               dynamic={**spec.dynamic, N.WINDOW_BASE: {}}, example=example, feeds=feeds,
                               on_candidates=on_candidates, tensorrt=spec.tensorrt)
