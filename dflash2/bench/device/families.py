"""The device check's torch-ref piece: the PyTorch references of every target family (llama, qwen3:
reference/target.py; qwen3_5 hybrid: reference/qwen3_5.py) on the GPU against the CPU, prefill + a verify
step. Why this lives in the bench stage: it imports dflash2.reference (measurement over the reference
models; tests/test_stages.py). torch is imported inside the functions, so the runner and the refusal
never load it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash2.bench.device.runner import FAIL, PASS


def rel_diff(a, b) -> float:
    """max |a - b| / max(1, max |b|) (the references' own parity measure)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max()))) if a.size else 0.0


def argmax_flips(a, b, margin: float = 1e-3) -> int:
    """Rows whose argmax differs although b's top-2 gap exceeds `margin` (a near-tie may flip)."""
    a, b = np.asarray(a), np.asarray(b)
    top2 = np.sort(b, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > margin
    return int(((a.argmax(-1) != b.argmax(-1)) & clear).sum())


TORCH_TOL = 1e-4  # fp32 logits, GPU vs CPU (TF32 off): only the matmul blocking and reduction order differ


def _dense_model(family: str, work: Path):
    import torch

    from dflash2 import tiny
    from dflash2.config import load_target_config
    from dflash2.reference.target import Target
    folder = work / f"ref-{family}"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny.target_config(family, 211, 64, 3, 4, 2, 128, False, 1, "float32", family == "qwen3")
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(3)
    m = Target(load_target_config(folder)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape))
    return m


def _hybrid_model():
    import torch

    from dflash2.reference.qwen3_5 import Qwen35Target, read_qwen3_5_config
    raw = {"architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 211, "hidden_size": 48, "intermediate_size": 96,
           "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    torch.manual_seed(4)
    m = Qwen35Target(read_qwen3_5_config(raw, "<device-check>/config.json")).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape))
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return m


def _run_family(family: str, model, device: str, prompt, verify):
    """prefill `prompt`, then a verify step of `verify` rows on the committed state -> (logits, logits)."""
    import torch
    model = model.to(device)
    with torch.no_grad(), torch.device(device):
        p, v = prompt.to(device), verify.to(device)
        if family == "qwen3_5":
            from dflash2.reference.qwen3_5 import commit
            state = model.empty_state()
            l1, _, step = model(p, state)
            state = commit(state, step, p.shape[0])
            l2, _, _ = model(v, state)
        else:
            c = model.config
            past = torch.zeros(0, c.num_layers, 2, c.num_kv_heads, c.head_dim)
            l1, _, kv = model(p, past)
            l2, _, _ = model(v, kv)
    return l1.float().cpu().numpy(), l2.float().cpu().numpy()


def piece_torch_ref(ctx: dict, device: str = "cuda", families=("llama", "qwen3", "qwen3_5")) -> dict:
    import copy

    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(5)
    prompt, verify = torch.randint(0, 211, (24,), generator=g), torch.randint(0, 211, (8,), generator=g)
    per, bad = {}, []
    for fam in families:
        m = _hybrid_model() if fam == "qwen3_5" else _dense_model(fam, Path(ctx["work"]))
        cpu = _run_family(fam, copy.deepcopy(m), "cpu", prompt, verify)
        dev = _run_family(fam, m, device, prompt, verify)
        d = [rel_diff(x, y) for x, y in zip(dev, cpu)]
        flips = sum(argmax_flips(x, y) for x, y in zip(dev, cpu))
        per[fam] = {"prefill_rel": d[0], "verify_rel": d[1], "argmax_flips": flips}
        if max(d) > TORCH_TOL or flips:
            bad.append(f"{fam}: rel {max(d):.2e} (tol {TORCH_TOL:g}), {flips} argmax flips")
    detail = "; ".join(f"{f} {max(v['prefill_rel'], v['verify_rel']):.1e}" for f, v in per.items())
    return {"result": FAIL if bad else PASS, "cases": 2 * len(families), "data": {"families": per, "tol": TORCH_TOL},
            "detail": (f"{bad[0]}; " if bad else f"{device} == cpu within {TORCH_TOL:g} (prefill + verify): ")
            + detail}


