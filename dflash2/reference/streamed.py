"""The target reference with bounded memory: each layer's weights read from safetensors as it runs.

`StreamedTarget` computes exactly `Target.forward` (the same function, the same layer module), but holds
only the final norm and ONE layer: before layer i runs, its weights are read from the checkpoint
(dflash2.checkpoint.Weights, pread in pieces) into a copy of a meta `TargetLayer`; the embedding and the LM head
are `StreamedRows` (dflash2.reference.vocab: the rows looked up, the head a vocabulary slice at a time).
A forward pass then reads the checkpoint once (1.2 GB of bf16 for Qwen3-0.6B: about a second from the
page cache), and the export's reference never holds the model: validation and the deviation measurement
of a 36-layer target cost what a 1-layer one does. `StreamedDrafter` is the drafter the same way: its
layers read as they run, the target's embedding / head shared as StreamedRows, the rest (fc, norms, the
selector's codebooks) resident.

`truncated(tc, dc, k)`: the configs of the same pair cut to the first k target layers (taps spread over
them), for the end-to-end check of a truncated build with the real embedding and head.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager

import torch
from torch import nn

from dflash2.config import DrafterConfig, TargetConfig
from dflash2.drafter_formats import ALIASES
from dflash2.families import DENSE
from dflash2.reference.layers import Fp32Rope, RMSNorm, rope_inv_freq
from dflash2.reference.drafter import Drafter
from dflash2.reference.target import Target, TargetLayer
from dflash2.reference.qwen3_5 import Qwen35Layer, Qwen35Target, ZeroCentredRMSNorm, mrope_inv_freq
from dflash2.reference.moe import SparseMoE, UnfusedExperts
from dflash2.reference.vocab import StreamedRows


class StreamedTarget(Fp32Rope):
    """Target's interface (forward, embed, project, head_weight, kv_row_shape, config, tap_ids), one layer resident."""

    forward = Target.forward
    layer_masks = Target.layer_masks
    kv_row_shape = Target.kv_row_shape

    def __init__(self, c: TargetConfig, tap_ids: tuple[int, ...], weights, like: StreamedTarget | None = None,
                 dtype: torch.dtype = torch.float32):
        """like: a StreamedTarget of the same checkpoint whose final norm and vocabulary matrices are reused
        (a truncated reference beside the whole one); dtype: of every weight as it runs (Target.to(dtype))."""
        super().__init__()
        self.config, self.tap_ids, self.src = c, tuple(tap_ids), weights
        self.dtype = like.dtype if like is not None else dtype
        if like is not None:
            self.embed_rows, self.head_rows, self.norm = like.embed_rows, like.head_rows, like.norm
        else:
            self.embed_rows = StreamedRows(weights, "embed_tokens.weight", dtype)
            self.head_rows = self.embed_rows if c.tie_word_embeddings else StreamedRows(weights, "lm_head.weight", dtype)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.norm.weight = nn.Parameter(_tensor(weights, "norm.weight").to(dtype), requires_grad=False)
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim), persistent=False)
        with torch.device("meta"):  # the template of every layer: shapes only, never given tensors (one per layer
            # where the layers differ: a MoE target's dense and sparse MLPs, dflash2.reference.moe)
            sparse = getattr(c, "is_sparse", None)
            one = TargetLayer(c).requires_grad_(False) if sparse is None else None
            self._layers = [one if one is not None else TargetLayer(c, i).requires_grad_(False)
                            for i in range(c.num_layers)]

    @property
    def head_weight(self) -> StreamedRows:
        return self.head_rows

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, H]
        return self.embed_rows.rows(ids)

    def project(self, h: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]
        return self.head_rows.project(h)

    def iter_layers(self):
        return _stream(self._layers, self.src, self.dtype)


class StreamedDrafter(Drafter):
    """Drafter's interface with its layers read from the checkpoint as they run (module docstring)."""

    def __init__(self, c: DrafterConfig, target: StreamedTarget, weights, names: list[str]):
        """names: the checkpoint's tensor names (dflash2.checkpoint.drafter_tensor_shapes); every weight runs in
        the target's dtype (the embedding / LM head rows are the target's)."""
        with torch.device("meta"):  # the layers' parameters: shapes only, never allocated
            super().__init__(c, target.embed_rows, target.head_rows, target.config.hidden_size)
        self.dtype = target.dtype
        self.requires_grad_(False)
        self.src = weights
        self.inv_freq = rope_inv_freq(c.rope, c.head_dim)  # (made on meta above)
        own = {v: k for k, v in ALIASES.get(c.format, {}).items()}  # a format's names (Meta's encoder.*) -> ours
        resident = {own.get(n, n): _tensor(weights, n).to(self.dtype) for n in names if not n.startswith("layers.")}
        missing, unexpected = self.load_state_dict(resident, strict=False, assign=True)
        left = [k for k in missing if not k.startswith("layers.")]
        if left or unexpected:
            raise KeyError(f"{weights.folder}: the drafter's tensors do not match its module: missing {left}, "
                           f"unexpected {unexpected}")
        self.eval()

    def iter_layers(self):
        return _stream(self.layers, self.src, self.dtype)  # the meta layers: the templates, never given tensors


class StreamedQwen35Target(Qwen35Target):
    """Qwen35Target's interface (forward, empty_state, kv_row_shape, head_weight, ...) with StreamedTarget's memory:
    the embedding and LM head StreamedRows, one layer resident (a meta template per layer kind), the final norm
    loaded. The same forward: it reads its weights through embed / iter_layers / project."""

    def __init__(self, c, tap_ids: tuple[int, ...], weights, like: "StreamedQwen35Target | None" = None,
                 dtype: torch.dtype = torch.float32):
        nn.Module.__init__(self)
        self.config, self.tap_ids, self.src = c, tuple(tap_ids), weights
        self._dtype = like.dtype if like is not None else dtype
        if like is not None:
            self.embed_rows, self.head_rows, self.norm = like.embed_rows, like.head_rows, like.norm
        else:
            self.embed_rows = StreamedRows(weights, "embed_tokens.weight", self._dtype)
            self.head_rows = self.embed_rows if c.tie_word_embeddings else StreamedRows(weights, "lm_head.weight",
                                                                                         self._dtype)
            self.norm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
            self.norm.weight = nn.Parameter(_tensor(weights, "norm.weight").to(self._dtype), requires_grad=False)
        self.lm_head = None
        self.register_buffer("inv_freq", mrope_inv_freq(c), persistent=False)
        with torch.device("meta"):  # one template per layer kind: shapes only
            kinds = {k: Qwen35Layer(c, k).requires_grad_(False) for k in set(c.layer_types)}
        self._templates = [kinds[k] for k in c.layer_types]

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def head_weight(self) -> StreamedRows:
        return self.head_rows

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_rows.rows(ids)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.head_rows.project(h)

    def iter_layers(self):
        return _stream(self._templates, self.src, self._dtype)


class StreamedQwen35MoeTarget(StreamedQwen35Target):
    """StreamedQwen35Target of a Qwen3.5-MoE target: the layer templates' MLP the experts' block
    (dflash2.reference.moe.SparseMoE), the experts read per expert whichever layout the checkpoint holds."""

    def __init__(self, c, tap_ids: tuple[int, ...], weights, like=None, dtype: torch.dtype = torch.float32):
        super().__init__(dataclasses.replace(c, intermediate_size=1), tap_ids, UnfusedExperts(weights), like, dtype)
        self.config = c
        with torch.device("meta"):
            for template in set(self._templates):
                template.mlp = SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                                         c.norm_topk_prob, c.shared_expert_intermediate_size).requires_grad_(False)


def streamed_target(tc, tap_ids, weights, like=None, dtype: torch.dtype = torch.float32):
    """The layer-streamed reference of any family's target config (dense: StreamedTarget)."""
    if tc.family == "muse_glimmer":
        from dflash2.reference.muse_glimmer import StreamedMuseGlimmerTarget

        return StreamedMuseGlimmerTarget(tc, tuple(tap_ids), weights, like=like, dtype=dtype)
    if tc.family == "gpt_oss":
        from dflash2.reference.gpt_oss import StreamedGptOssTarget

        return StreamedGptOssTarget(tc, tuple(tap_ids), weights, like=like, dtype=dtype)
    cls = StreamedTarget if tc.family in DENSE else \
        StreamedQwen35MoeTarget if tc.family == "qwen3_5_moe" else StreamedQwen35Target
    return cls(tc, tuple(tap_ids), weights, like=like, dtype=dtype)


def _stream(templates, weights, dtype: torch.dtype = torch.float32):
    """Layer i = a copy of meta template i holding the checkpoint's `layers.{i}.*` tensors (the fresh arrays
    themselves, no second copy), moved back to meta when the caller asks for the next (its loop variable
    still points at it): one layer resident while it runs, none after."""
    for i, template in enumerate(templates):
        layer = copy.deepcopy(template)  # shapes only: nothing allocated
        layer.load_state_dict({n: _tensor(weights, f"layers.{i}.{n}").to(dtype) for n, _ in template.named_parameters()},
                              strict=True, assign=True)
        yield layer
        layer.to("meta")


@contextmanager
def widened(module: nn.Module):
    """Inside, the reference (loaded or layer-streamed, any family) computes in fp32: its resident parameters and
    buffers cast to fp32, its streamed layers and vocabulary rows read as fp32; after, every tensor and dtype as
    before (the original tensors put back). The validation's judge of a low-precision graph against the function
    it rounds (dflash2.export.validate._against_fp32)."""
    mods = list(module.modules())
    params = [(t, t.data) for m in mods for t in m._parameters.values()
              if t is not None and t.is_floating_point() and not t.is_meta]
    buffers = [(m, n, t) for m in mods for n, t in m._buffers.items()
               if t is not None and t.is_floating_point() and not t.is_meta]
    holders = mods + [v for m in mods for v in vars(m).values() if isinstance(v, StreamedRows)]
    dtypes = [(h, a, vars(h)[a]) for h in holders for a in ("dtype", "_dtype")
              if isinstance(vars(h).get(a), torch.dtype)]
    for t, data in params:
        t.data = data.float()
    for m, n, t in buffers:
        m._buffers[n] = t.float()
    for h, a, _ in dtypes:
        setattr(h, a, torch.float32)
    try:
        yield module
    finally:
        for t, data in params:
            t.data = data
        for m, n, t in buffers:
            m._buffers[n] = t
        for h, a, d in dtypes:
            setattr(h, a, d)


def _tensor(weights, name: str) -> torch.Tensor:
    return torch.from_numpy(weights.get(name))  # fp32, checked finite (numpy widens bf16 ~5x faster here)


def truncated(tc: TargetConfig, dc: DrafterConfig, k: int) -> tuple[TargetConfig, DrafterConfig]:
    """The first k layers of the target; the drafter's taps moved into them, spread in order over layers
    0..k-1 (the first tap taken inside the layer loop, the last after it, the rest as distinct as k allows:
    so a tap order or concatenation bug shows; the context width stays). A hybrid keeps at least one layer of
    each kind (up to its first full-attention layer)."""
    if hasattr(tc, "layer_types"):
        k = max(k, 1 + max(tc.layer_types.index(t) for t in set(tc.layer_types)))
    k = min(k, tc.num_layers)
    unique = sorted(set(dc.target_layer_ids))
    spread = {t: (k - 1 if len(unique) == 1 else round(j * (k - 1) / (len(unique) - 1))) for j, t in enumerate(unique)}
    taps = tuple(spread[t] for t in dc.target_layer_ids)
    short = dataclasses.replace(tc, layer_types=tc.layer_types[:k]) if hasattr(tc, "layer_types") else \
        dataclasses.replace(tc, num_layers=k)
    return short, dataclasses.replace(dc, target_layer_ids=taps)
