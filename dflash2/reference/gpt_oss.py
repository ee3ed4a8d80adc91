"""The gpt-oss target (transformers `gpt_oss`, GptOssForCausalLM) as a pure function of (ids, past KV), for export.

The dense reference (dflash2.reference.target.Target) by composition: its forward (one KV tensor
[P, L, 2, kv, hd], rollback = keep fewer rows, taps = layer outputs, plain embedding and LM head), with gpt-oss's
parts, each checked against transformers 5.25's modeling_gpt_oss.py:
- the RMSNorms as GptOssRMSNorm: (w * x) in fp32, then cast (Llama's casts first; the same in fp32);
- `layer_masks`: causal, and on sliding layers q - k < sliding_window. Every layer's K/V stays in the cache: the
  window is a mask, so memory is not bounded by it (the ring buffer is later);
- attention with q/k/v/o biases, a per-head sink logit (layers.attend's `sinks`), YaRN rotary: rope_inv_freq's
  "yarn" with cos and sin both times the rope's attention factor;
- GptOssMoE: router logits with a bias, top-k of the logits, softmax over the k kept (in their dtype); each expert
  gate|up = x @ gate_up_proj[e] + bias (columns interleaved: gate even, up odd), the clamped SwiGLU
  (up + 1) * gate * sigmoid(alpha * gate), then @ down_proj[e] + bias; the experts visited in ascending order and
  accumulated with index_add_, as transformers' loop.
MXFP4 checkpoints (families.gpt_oss: `_blocks` / `_scales`) are decoded exactly (a 16-entry table times a power of
two: every value representable in fp32 and bf16) to the reference's dtype when loaded; decode_mxfp4 is that
decode, quantize_mxfp4 its nearest-value inverse (tiny checkpoints, tests), mxfp4_to_int8 the block-exact int8 form
a later export writes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash2.families.gpt_oss import MXFP4_BLOCK, GptOssConfig, tensor_dtypes, tensor_shapes
from dflash2.reference.layers import Fp32Rope, Projections, RMSNorm, attend, rope_inv_freq
from dflash2.reference.selector import topk_lowest_index
from dflash2.reference.target import Target

# E2M1 values by 4-bit code (the sign the high bit)
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32] -> fp32 [E, in, out] (transformers' parameter
    orientation): value = FP4[code] * 2^(scale - 127), the low nibble the even element; exact (ldexp)."""
    E, n_out, nb, _ = blocks.shape
    b = blocks.long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(E, n_out, nb, MXFP4_BLOCK)  # [E, out, in/32, 32]
    w = torch.ldexp(FP4[codes], (scales.long() - 127)[..., None].to(torch.int32))
    return w.reshape(E, n_out, nb * MXFP4_BLOCK).transpose(1, 2).contiguous()


def mxfp4_to_int8(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 -> blockwise int8, exactly (the form ONNX Runtime's CPU QMoE int8 runs, docs/families/gpt_oss.md):
    blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32] -> (codes int8 [E, out, in] in [-12, 12],
    scales fp32 [E, out, in/32]) with codes * scale == decode_mxfp4 per block of 32: every E2M1 value is a multiple
    of 0.5 up to 6, so code = 2 * value and scale = 2^(s - 128)."""
    E, n_out, nb, _ = blocks.shape
    b = blocks.long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(E, n_out, nb * MXFP4_BLOCK)
    return (2 * FP4[codes]).to(torch.int8), torch.ldexp(torch.ones(()), (scales.long() - 128).to(torch.int32))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, in, out] (transformers' orientation) -> (blocks, scales) as an MXFP4 checkpoint holds them: per 32
    inputs the scale 2^e with e = ceil(log2(amax / 6)) (so the largest fits E2M1's 6), each value the nearest code."""
    g = w.float().transpose(1, 2)  # [E, out, in]
    E, n_out, n_in = g.shape
    g = g.reshape(E, n_out, n_in // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = g.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax.clamp_min(1e-30) / 6.0)), torch.zeros_like(amax))
    codes = (torch.ldexp(g, -e.to(torch.int32))[..., None] - FP4).abs().argmin(-1)  # [E, out, in/32, 32]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (e[..., 0] + 127).to(torch.uint8)


class GptOssRMSNorm(RMSNorm):
    """transformers' GptOssRMSNorm: the weight times the fp32 normalized x, in fp32, then cast ((w * x).to(dtype), where
    Llama's casts first: w * x.to(dtype)); the same in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


class GptOssExperts(nn.Module):
    """transformers' GptOssExperts parameters: gate_up_proj [E, H, 2I], down_proj [E, I, H] ([in, out]), biases."""

    def __init__(self, c: GptOssConfig):
        super().__init__()
        E, H, I = c.num_experts, c.hidden_size, c.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.zeros(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
        self.alpha, self.limit = c.swiglu_alpha, c.swiglu_limit

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # [m, H] -> [m, H]
        gu = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # [m, 2I]
        gate = gu[..., ::2].clamp(max=self.limit)  # clamped from above only
        up = gu[..., 1::2].clamp(-self.limit, self.limit)
        return ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[e] + self.down_proj_bias[e]


class GptOssMoE(nn.Module):
    def __init__(self, c: GptOssConfig):
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.router = nn.Linear(c.hidden_size, c.num_experts, bias=True)
        self.experts = GptOssExperts(c)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, H] -> (weights [n, k], expert ids [n, k]): softmax over the top-k LOGITS."""
        top, idx = topk_lowest_index(self.router(x), self.top_k)  # ties: the lower expert first (ONNX TopK's rule)
        return torch.softmax(top, dim=-1, dtype=top.dtype), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        weights, idx = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():  # ascending, as transformers' expert_hit loop
            rows, slot = torch.where(idx == e)
            out.index_add_(0, rows, (self.experts.expert(e, x[rows]) * weights[rows, slot, None]).to(out.dtype))
        return out


class SinkAttention(Projections):
    """q/k/v/o with biases (transformers' names) and `sinks` [nh], one learnt logit per head."""

    def __init__(self, c: GptOssConfig):
        super().__init__(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, True, False, c.rms_norm_eps)
        self.sinks = nn.Parameter(torch.zeros(c.num_heads))


class GptOssLayer(nn.Module):
    def __init__(self, c: GptOssConfig):
        super().__init__()
        self.self_attn = SinkAttention(c)
        self.mlp = GptOssMoE(c)
        self.input_layernorm = GptOssRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rope_scale = c.rope.attention_factor  # YaRN's: multiplies cos and sin

    def forward(self, h, past_k, past_v, cos, sin, visible):
        """h [n, H], past_k / past_v [P, kv, hd], cos / sin [n, hd], visible [n, P+n] -> (h [n, H], [n, 2, kv, hd])."""
        cos, sin = cos * self.rope_scale, sin * self.rope_scale
        u = self.input_layernorm(h)
        q = self.self_attn.query(u, cos, sin)  # [n, nh, hd]
        k, v = self.self_attn.key_value(u, cos, sin)  # [n, kv, hd]
        a = attend(q, torch.cat([past_k, k]), torch.cat([past_v, v]), visible, self.self_attn.sinks)
        h = h + self.self_attn.o_proj(a)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, torch.stack([k, v], dim=1)


class GptOssTarget(Target):
    """forward(ids [n], past_kv [P, L, 2, kv, hd], past_len=None) -> logits [n, V], taps, new_kv: Target's."""

    def __init__(self, c: GptOssConfig, tap_ids: tuple[int, ...] = ()):
        Fp32Rope.__init__(self)  # Target's fields, gpt-oss's layers
        self.config, self.tap_ids = c, tuple(tap_ids)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(GptOssLayer(c) for _ in range(c.num_layers))
        self.norm = GptOssRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim), persistent=False)

    def layer_masks(self, pos: torch.Tensor, k_pos: torch.Tensor) -> list[torch.Tensor]:
        causal = k_pos[None, :] <= pos[:, None]  # [n, P+n]
        return [causal if w is None else causal & (pos[:, None] - k_pos[None, :] < w)
                for w in self.config.layer_windows]


def hf_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> GptOssTarget's (`model.` dropped); MXFP4 `<p>_blocks` + `<p>_scales` -> `<p>` decoded."""
    out = {}
    for name, t in tensors.items():
        key = name.removeprefix("model.")
        if key.endswith("_scales"):
            continue
        if key.endswith("_blocks"):
            base = name[:-len("_blocks")]
            out[key[:-len("_blocks")]] = decode_mxfp4(t, tensors[base + "_scales"])
        else:
            out[key] = t
    return out


def load_target(folder: str | Path, tap_ids: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                config: GptOssConfig | None = None) -> GptOssTarget:
    """A GptOssForCausalLM folder (float or MXFP4 experts; safetensors, sharded or not) -> the reference, eval
    mode. The family's entry point (dflash2.families.gpt_oss)."""
    from dflash2 import checkpoint as ckpt
    from dflash2 import families

    c = config or families.load(folder)[1]
    expected = tensor_shapes(c)
    ckpt.check_tensors(folder, expected, (), tensor_dtypes(c))
    model = GptOssTarget(c, tap_ids)
    state = hf_state_dict(ckpt.load_tensors(folder, set(expected)))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(dtype).eval()


class DecodedExperts:
    """A weight source (dflash2.checkpoint.Weights' interface) over an MXFP4 checkpoint answering the float expert
    names: `...mlp.experts.gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H] decoded from `<name>_blocks` /
    `<name>_scales` (decode_mxfp4, exact) for the rows asked only (rows = experts: one expert in memory when the
    export writes them one at a time). Every other name passes through; a float checkpoint's names as they are."""

    def __init__(self, src):
        self.src = src

    def __getattr__(self, name: str):  # the rest of the source's interface (folder, non_finite, ...) as it is
        if name == "src":
            raise AttributeError(name)
        return getattr(self.src, name)

    def _mxfp4(self, name: str) -> bool:
        return name not in self.src and f"{name}_blocks" in self.src

    def __contains__(self, name: str) -> bool:
        return name in self.src or self._mxfp4(name)

    def shape(self, name: str) -> tuple[int, ...]:
        if not self._mxfp4(name):
            return tuple(self.src.shape(name))
        E, n_out, nb, _ = self.src.shape(f"{name}_blocks")
        return (E, nb * MXFP4_BLOCK, n_out)

    def get(self, name: str, rows: slice | None = None):
        if not self._mxfp4(name):
            return self.src.get(name, rows)
        blocks, scales = (torch.from_numpy(self.src.raw(f"{name}_{part}", rows)) for part in ("blocks", "scales"))
        return decode_mxfp4(blocks, scales).numpy()  # [e, in, out] fp32


class StreamedGptOssTarget(GptOssTarget):
    """GptOssTarget's interface with dflash2.reference.streamed's memory: the embedding and LM head StreamedRows
    (read a slice at a time), one layer resident (read from the checkpoint when it runs, MXFP4 experts decoded as
    read: DecodedExperts), the final norm loaded. The same forward: it reads its weights through embed / iter_layers
    / project (Target's)."""

    def __init__(self, c: GptOssConfig, tap_ids: tuple[int, ...], weights, like=None,
                 dtype: torch.dtype = torch.float32):
        from dflash2.reference.streamed import _tensor
        from dflash2.reference.vocab import StreamedRows

        Fp32Rope.__init__(self)
        self.config, self.tap_ids, self.src = c, tuple(tap_ids), DecodedExperts(weights)
        self.dtype = like.dtype if like is not None else dtype
        if like is not None:
            self.embed_rows, self.head_rows, self.norm = like.embed_rows, like.head_rows, like.norm
        else:
            self.embed_rows = StreamedRows(weights, "embed_tokens.weight", self.dtype)
            self.head_rows = self.embed_rows if c.tie_word_embeddings else \
                StreamedRows(weights, "lm_head.weight", self.dtype)
            self.norm = GptOssRMSNorm(c.hidden_size, c.rms_norm_eps)
            self.norm.weight = nn.Parameter(_tensor(weights, "norm.weight").to(self.dtype), requires_grad=False)
        self.lm_head = None
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim), persistent=False)
        with torch.device("meta"):  # one template for every layer (the windows are masks): shapes only
            template = GptOssLayer(c).requires_grad_(False)
        self._layers = [template] * c.num_layers

    @property
    def head_weight(self):
        return self.head_rows

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_rows.rows(ids)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.head_rows.project(h)

    def iter_layers(self):
        from dflash2.reference.streamed import _stream

        return _stream(self._layers, self.src, self.dtype)
