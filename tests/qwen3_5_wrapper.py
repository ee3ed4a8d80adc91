"""A tiny Qwen3_5ForConditionalGeneration checkpoint as users download them (the text model under
`model.language_model.*`, a vision tower, an MTP tensor transformers does not build), made from a tiny
Qwen3_5ForCausalLM folder's text config: the export and the trainer tests read it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def make_wrapper(text_target: Path, out: Path, seed: int = 3):
    """(transformers' wrapper model, its folder) with text_target's text config and tokenizer, random weights."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = json.loads((text_target / "config.json").read_text())
    for k in ("architectures", "torch_dtype", "tie_word_embeddings"):
        text.pop(k, None)
    cfg = Qwen3_5Config(text_config=text, tie_word_embeddings=False,
                        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                           out_hidden_size=64, patch_size=4, num_position_embeddings=16))
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    model.save_pretrained(out)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.startswith("model.visual.") for k in sd) and "model.language_model.embed_tokens.weight" in sd
    sd["mtp.fc.weight"] = torch.zeros(4, 4)  # real checkpoints carry one; transformers does not build it
    for f in out.glob("*.safetensors"):
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(sd, str(out / "model.safetensors"))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (text_target / f).is_file():
            shutil.copy(text_target / f, out / f)
    return model, out
