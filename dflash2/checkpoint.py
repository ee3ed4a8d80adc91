"""Safetensors checkpoints (single file or sharded index): headers, expected tensors, loading.

The expected tensor set of each architecture is derived from its config; every difference
(missing, unexpected, mis-shaped) is reported at once before a single weight loads.
Pickle (`*.bin`, `*.pt`) is refused: loading it can run code.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from dflash2.config import DrafterConfig, TargetConfig
from dflash2.errors import CheckpointError, TensorSetError

INDEX = "model.safetensors.index.json"


def shard_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(index, "weight_map", "a JSON object mapping tensor -> shard", "none") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(index, "weight_map", "shard files that exist", f"missing {missing}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = ("pickle weights are not loaded (they can run code); convert them to safetensors"
                if pickles else "")
        raise CheckpointError(folder, "weights", "*.safetensors or " + INDEX, pickles or "no weight files", hint)
    return files


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from a safetensors header, without reading the data."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(path, "header", "a safetensors file", "a truncated file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise CheckpointError(path, "header", "a safetensors header", f"a header length of {n} bytes")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(path, "header", "a JSON safetensors header", "unreadable bytes") from None
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


def read_headers(folder: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in shard_files(folder):
        out.update(read_header(f))
    return out


def target_tensor_shapes(c: TargetConfig) -> dict[str, tuple[int, ...]]:
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * hd, c.num_kv_heads * hd
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update(_block_shapes(p, H, I, q, kv, hd, c.qk_norm, c.attention_bias, c.mlp_bias))
    return shapes


def _block_shapes(p, H, I, q, kv, hd, qk_norm, attn_bias, mlp_bias) -> dict:
    s = {p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
         p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
         p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
         p + "mlp.down_proj.weight": (H, I),
         p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    if qk_norm:
        s.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    if attn_bias:
        s.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                  p + "self_attn.v_proj.bias": (kv,)})
    if mlp_bias:
        s.update({p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,), p + "mlp.down_proj.bias": (H,)})
    return s


def drafter_tensor_shapes(c: DrafterConfig, target_hidden: int) -> dict[str, tuple[int, ...]]:
    H, hd = c.hidden_size, c.head_dim
    shapes = {"fc.weight": (H, len(c.target_layer_ids) * target_hidden),
              "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes.update(_block_shapes(p, H, c.intermediate_size, c.num_heads * hd, c.num_kv_heads * hd, hd,
                                    True, c.attention_bias, False))
        if c.version == 2:
            G = H // c.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"{p}{conv}.base_kernel"] = (2, c.conv_kernel_size, H)
                shapes[f"{p}{conv}.kernel_projection.weight"] = (2 * c.conv_kernel_size * G, H)
    if c.version == 2:
        r, V = c.selector_rank, c.vocab_size
        shapes.update({"candidate_selector.hidden_projection.weight": (r, H),
                       "candidate_selector.predecessor_codebook": (V, r),
                       "candidate_selector.successor_codebook": (V, r)})
    return shapes


# HF checkpoints of tied models sometimes still carry lm_head.weight; it is ignored, not an error.
_TOLERATED = {"lm_head.weight"}


def check_tensors(folder: str | Path, expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, tuple]]:
    found = read_headers(folder)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(n for n in set(found) - set(expected) if n not in _TOLERATED)
    misshaped = [(n, expected[n], found[n][1]) for n in sorted(set(expected) & set(found))
                 if tuple(found[n][1]) != tuple(expected[n])]
    if missing or unexpected or misshaped:
        raise TensorSetError(str(folder), missing, unexpected, misshaped)
    return found


def load_tensors(folder: str | Path, names: set[str] | None = None) -> dict:
    """torch tensors by name (safetensors only). Imports torch lazily: callers are export/train."""
    from safetensors import safe_open

    out = {}
    for f in shard_files(folder):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if names is None or k in names:
                    out[k] = fh.get_tensor(k)
    return out
