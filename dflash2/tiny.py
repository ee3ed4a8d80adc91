"""Deterministic tiny checkpoints in the exact Hugging Face / DFlash formats, for tests and demos.

make_target(): a folder of any registered target family (dflash2.families: Llama, Qwen3, Qwen3.5): config.json,
safetensors, optionally sharded, a byte-level BPE tokenizer with a ChatML template. make_drafter(): a DFlash v1
or DFlash2 drafter for it.
A full disk (or quota) while a file is written is a DiskFullError naming that file (dflash2.disk), and the
half-written file is removed: dflash2-make-tiny fills temporary folders and renames them only when complete.
Weights are scaled so logits are well separated (random models with near-ties would make
token-for-token comparisons depend on float summation order).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash2 import families
from dflash2.checkpoint import INDEX, drafter_tensor_shapes
from dflash2.disk import safetensors_bytes, write_text, writing

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_WORDS = ("the a of to and in is it that for on with as was be by this are from at or an have not "
          "model token draft target block speculative decode verify accept reject bonus cache layer "
          "attention hidden state engine plugin graph export runtime tensor kernel path select greedy "
          "python function class return value list dict string number error file folder config write "
          "read time speed fast small large first last next prompt answer question because when where").split()


def _corpus(seed: int = 0, lines: int = 3000) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(_WORDS), (lines, 12), generator=g)
    return [" ".join(_WORDS[i] for i in row) + ("." if k % 3 else "?") for k, row in enumerate(idx.tolist())]


def make_tokenizer(folder: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on a built-in corpus; returns its real vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    write_text(folder / "tokenizer.json", tok.to_str(pretty=True), "the tokenizer")  # tok.save's bytes
    write_text(folder / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, indent=2), "the tokenizer's config")
    return tok.get_vocab_size()


def _save(tensors: dict[str, torch.Tensor], path: Path, what: str) -> None:
    """One safetensors file; a full disk -> DiskFullError naming it, and no half file left under its name."""
    meta = {"format": "pt"}
    with writing(path, what, safetensors_bytes(tensors, meta)):
        try:
            save_file(tensors, str(path), metadata=meta)
        except BaseException:
            path.unlink(missing_ok=True)
            raise


def _init(shapes: dict[str, tuple[int, ...]], seed: int, embed_std: float = 1.0,
          head_std: float = 3.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.05 * torch.randn(shape, generator=g)
        elif "embed_tokens" in name:
            t = embed_std * torch.randn(shape, generator=g)
        elif name == "lm_head.weight":
            t = head_std / shape[1] ** 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("codebook"):
            t = torch.randn(shape, generator=g) / shape[1] ** 0.25
        elif name.endswith("base_kernel"):
            t = 0.2 * torch.randn(shape, generator=g)
            t[:, 0] += 1.0
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        out[name] = t.contiguous()
    return out


def _mxfp4_bytes(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Random MXFP4 blocks (any two E2M1 codes a byte) and scales near 2^-2 (values up to about 1.5)."""
    g = torch.Generator().manual_seed(seed + 7)
    out = {}
    for name, shape in sorted(shapes.items()):
        low, high = (0, 256) if name.endswith("_blocks") else (123, 127)
        out[name] = torch.randint(low, high, shape, generator=g).to(torch.uint8)
    return out


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    if shards <= 1:
        _save(tensors, folder / "model.safetensors", "the weights")
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        _save({k: tensors[k] for k in part}, folder / fname, f"weight shard {i + 1} of {shards}")
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_text(folder / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2),
                "the weights' index")


def target_config(family: str, vocab: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                  intermediate_size: int, tie_word_embeddings: bool, eos: int, dtype: str = "float32",
                  attention_bias: bool = False, head_dim: int | None = None, **extra) -> dict:
    """A config.json of `family` as transformers writes it (the family's tiny_config: the fields dflash2 reads,
    and the usual rest)."""
    return families.by_name(family).tiny_config(families.TinyShape(
        vocab, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, tie_word_embeddings, eos, dtype,
        attention_bias, head_dim, extra))


def make_target(folder: str | Path, family: str = "llama", vocab_size: int = 384, hidden_size: int = 64,
                num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                tie_word_embeddings: bool = False, shards: int = 1, seed: int = 0,
                dtype: torch.dtype = torch.float32, attention_bias: bool = False, head_dim: int | None = None,
                extra: dict | None = None) -> Path:
    """extra: config.json fields over the family's tiny config (a MoE target's mlp_only_layers, say)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(folder, vocab_size)
    eos = vocab and SPECIALS.index("<|im_end|>")
    config = target_config(family, vocab, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                           tie_word_embeddings, eos, str(dtype).replace("torch.", ""), attention_bias, head_dim,
                           **(extra or {}))
    write_text(folder / "config.json", json.dumps(config, indent=2), "the config")
    write_text(folder / "generation_config.json", json.dumps({"eos_token_id": eos, "do_sample": False}),
                "the generation config")
    fam, c = families.load(folder)
    shapes = {**(fam.extra_tensors(config) if fam.extra_tensors else {}), **fam.tensor_shapes(c)}
    declared = fam.tensor_dtypes(c) if fam.tensor_dtypes else {}  # integer tensors: gpt-oss's MXFP4 bytes
    tensors = {k: v.to(dtype) for k, v in _init({k: s for k, s in shapes.items() if k not in declared}, seed).items()}
    tensors.update(_mxfp4_bytes({k: shapes[k] for k in declared}, seed))
    write_safetensors(folder, tensors, shards)
    return folder


def drafter_config(t, version: int, num_layers: int, block_size: int, taps: list[int], mask_token_id: int,
                   top_k: int, rank: int, conv_group_size: int, conv_kernel_size: int, output_multiplier: float,
                   softcap: float | None, intermediate_size: int, **extra) -> dict:
    """A DFlash (v1) / DFlash2 drafter config.json for target config `t`, as z-lab's checkpoints write it."""
    dc = {"block_size": block_size, "target_layer_ids": taps, "mask_token_id": mask_token_id}
    if version == 2:
        dc.update(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size, selector_rank=rank,
                  selector_top_k=top_k, output_multiplier=output_multiplier, final_logit_softcapping=softcap)
    return {
        "architectures": ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": t.hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
        "vocab_size": t.vocab_size, "rms_norm_eps": 1e-6,
        "rope_theta": t.rope.theta if hasattr(t, "rope") else t.rope_theta, "attention_bias": False,
        "hidden_act": "silu", "num_target_layers": t.num_layers, "block_size": block_size,
        "is_causal": False, "dflash_config": dc, **extra,
    }


def make_drafter(folder: str | Path, target_dir: str | Path, version: int = 2, num_layers: int = 1,
                 block_size: int = 8, tap_ids: tuple[int, ...] | None = None, top_k: int = 8, rank: int = 16,
                 conv_group_size: int = 16, conv_kernel_size: int = 2, identity_conv: bool = False,
                 output_multiplier: float = 1.0, softcap: float | None = None, seed: int = 1,
                 dtype: torch.dtype = torch.float32, extra: dict | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _, t = families.load(target_dir)  # any registered family: a Qwen3.5 target's drafter is made the same way
    taps = list(tap_ids) if tap_ids is not None else sorted({1, t.num_layers - 2})
    config = drafter_config(t, version, num_layers, block_size, taps, SPECIALS.index("<|mask|>"), top_k, rank,
                            conv_group_size, conv_kernel_size, output_multiplier, softcap, 2 * t.hidden_size,
                            **(extra or {}))
    write_text(folder / "config.json", json.dumps(config, indent=2), "the config")
    from dflash2.config import load_drafter_config

    shapes = drafter_tensor_shapes(load_drafter_config(folder), t.hidden_size)
    tensors = _init(shapes, seed)
    if identity_conv:
        for name in tensors:
            if name.endswith("base_kernel"):
                tensors[name].zero_()
                tensors[name][:, 0] = 1.0
            elif "conv.kernel_projection" in name:
                tensors[name].zero_()
    write_safetensors(folder, {k: v.to(dtype) for k, v in tensors.items()})
    return folder


def make_pair(root: str | Path, family: str = "llama", version: int = 2, **drafter_kw) -> tuple[Path, Path]:
    root = Path(root)
    target = make_target(root / "target", family=family)
    return make_drafter(root / "drafter", target, version=version, **drafter_kw), target
