"""Resumable training state: one safetensors file, written atomically, never pickle.

It holds the fp32 master weights, AdamW's moments, the step, the config, the evaluation history and
both random generators (Python's for sequences / anchors, torch's for the negative shortlist), so a
run killed at any point resumes from its last save and continues exactly as if never stopped.
One file replaced by `os.replace` means a kill mid-write leaves the previous state intact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash2.errors import Dflash2Error

STATE = "train_state"  # resumable state lives in a subfolder: the checkpoint folder holds only the model
FILE = "resume.safetensors"


def path(folder: Path) -> Path:
    return Path(folder) / STATE / FILE


def save(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, config: dict,
         history: list, py_rng_state) -> None:
    tensors = {f"param/{k}": v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()
               if v is not None and v.is_floating_point() and not k.endswith(("embed_weight", "untied_head"))}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    tensors[f"{key}/{names[id(p)]}"] = st[key].detach().cpu().contiguous()
    tensors["rng/torch"] = torch.get_rng_state()
    meta = {"step": step, "config": config, "log": history,
            "py_rng": [py_rng_state[0], list(py_rng_state[1]), py_rng_state[2]]}
    out = path(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{FILE}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"resume": json.dumps(meta)})
    os.replace(tmp, out)


def step_of(folder: Path) -> int | None:
    """The step a folder's saved state is at, or None when it has none."""
    p = path(folder)
    if not p.is_file():
        return None
    with safe_open(str(p), framework="pt") as f:
        return json.loads(f.metadata()["resume"])["step"]


def load(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, list, tuple]:
    """Restores weights, moments and the torch generator; returns (step, history, python rng state)."""
    p = path(folder)
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = json.loads(f.metadata()["resume"])
        t = load_file(str(p))
    except (OSError, KeyError, ValueError, json.JSONDecodeError) as e:
        raise Dflash2Error(f"{p}: not a readable dflash2 training state ({e}); move it away to start over") from None
    own = model.state_dict()
    state = {k[6:]: v for k, v in t.items() if k.startswith("param/")}
    wrong = sorted(set(state) ^ {k for k, v in own.items() if v is not None and v.is_floating_point()
                                 and not k.endswith(("embed_weight", "untied_head"))})
    bad_shape = [k for k in state if k in own and own[k] is not None and own[k].shape != state[k].shape]
    if wrong or bad_shape:
        raise Dflash2Error(f"{p}: training state does not match the model (differing tensors {wrong[:6]}, "
                           f"other shapes {bad_shape[:6]}); train into another folder or match the settings")
    model.load_state_dict(state, strict=False)
    dev = next(model.parameters()).device
    for n, prm in model.named_parameters():
        if f"exp_avg/{n}" in t:
            opt.state[prm] = {"step": torch.tensor(float(meta["step"])), "exp_avg": t[f"exp_avg/{n}"].to(dev),
                              "exp_avg_sq": t[f"exp_avg_sq/{n}"].to(dev)}
    torch.set_rng_state(t["rng/torch"])
    v, internal, gauss = meta["py_rng"]
    return meta["step"], meta["log"], (v, tuple(internal), gauss)
