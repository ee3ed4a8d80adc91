"""A Qwen3_5ForCausalLM folder (the scale check's random Qwen3.5-0.8B-shaped target) rewritten as the
Qwen3_5ForConditionalGeneration wrapper, which is what onnxruntime-genai 0.18's builder takes: the text config under
text_config, the tensors under model.language_model. (no vision tower: the builder builds the text model). A
Qwen3_5MoeForCausalLM folder becomes Qwen3_5MoeForConditionalGeneration the same way (experts as they are).

    python scripts/experiments/qwen3_5_wrapper.py ~/.cache/dflash2/scale/qwen3.5-0.8b/target /tmp/q35-wrapper
    python -m onnxruntime_genai.models.builder -i /tmp/q35-wrapper -o /tmp/q35-genai -p int4 -e cpu

Result: docs/results/qwen3_5/ (docs/results/README.md, 2026-12-06)."""
import json, shutil, sys
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
text = json.loads((src / "config.json").read_text())
tie = text.pop("tie_word_embeddings", False)
text.pop("architectures", None)
moe = "num_experts" in text or "num_local_experts" in text  # Qwen3_5MoeForCausalLM -> ...MoeForConditionalGeneration
kind = "qwen3_5_moe" if moe else "qwen3_5"
text["model_type"] = kind + "_text"
cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
       "model_type": kind, "text_config": text, "tie_word_embeddings": tie,
       "torch_dtype": text.get("torch_dtype", "bfloat16")}
(dst / "config.json").write_text(json.dumps(cfg, indent=2))
for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    if (src / f).exists():
        shutil.copy(src / f, dst / f)
out = {}
for f in sorted(src.glob("*.safetensors")):
    with safe_open(str(f), "pt") as fh:
        for k in fh.keys():
            out[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = fh.get_tensor(k)
save_file(out, str(dst / "model.safetensors"))
print(len(out), "tensors")
