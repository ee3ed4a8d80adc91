"""Resumable training state: one safetensors file, written atomically, never pickle.

It holds the fp32 master weights, AdamW's moments, the step, the config, the evaluation history and
both random generators (Python's for sequences / anchors, torch's for the negative shortlist), so a
run killed at any point resumes from its last save and continues exactly as if never stopped.
One file replaced by `os.replace` means a kill mid-write, or a full disk (a DiskFullError naming the file and
the bytes it needed, dflash2.disk), leaves the previous state intact and no half file beside it.

That file (~6x the fp16 drafter: fp32 weights and two moments) stays on the machine. What travels in the
repository is the compact state beside the drafter: its fp16 `model.safetensors` and `progress.json` (the
step, the config, the history, the corpus stream's position, counters and the sha256 of the weights it goes
with). A fresh machine resumes from those with AdamW's moments rebuilt during a short warm-up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from dflash2.errors import Dflash2Error
from dflash2.disk import safetensors_bytes, writing

STATE = "train_state"  # resumable state lives in a subfolder: the checkpoint folder holds only the model
FILE = "resume.safetensors"


def path(folder: Path) -> Path:
    return Path(folder) / STATE / FILE


PROGRESS = "progress.json"  # the compact state, beside the fp16 drafter (committed; train_state/ is not)
PROGRESS_KIND = "dflash2-train-progress"


def save(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, config: dict,
         history: list, py_rng_state, extra: dict | None = None) -> None:
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
            "py_rng": [py_rng_state[0], list(py_rng_state[1]), py_rng_state[2]], "extra": extra or {}}
    out, metadata = path(folder), {"resume": json.dumps(meta)}
    tmp = out.with_name(f"{FILE}.tmp-{os.getpid()}")
    with writing(out, f"the training state of step {step}", safetensors_bytes(tensors, metadata)):
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            save_file(tensors, str(tmp), metadata=metadata)
            os.replace(tmp, out)
        finally:  # a full disk or a kill mid-write: the previous state stays, no half file beside it
            tmp.unlink(missing_ok=True)


# the settings that make a drafter what it is: a state saved under others is another drafter
IDENTITY = ("block_size", "layers", "top_k", "rank", "tap_ids")


def has_state(folder: Path) -> bool:
    """Whether OUT holds a full training state; `train_state` a file (or anything not a folder) is named."""
    folder_ = Path(folder) / STATE
    if (folder_.exists() or folder_.is_symlink()) and not folder_.is_dir():
        raise Dflash2Error(f"{folder_}: expected the training state folder, found a file (or something else); "
                           f"move it away to start over")
    p = path(folder)
    return p.exists() or p.is_symlink()


def read_meta(folder: Path) -> dict:
    """The one reader of resume.safetensors' header and metadata, checked like a manifest before anything is
    loaded: a regular file, a whole safetensors header (truncated, 8-byte or random files named), and its
    `resume` metadata with every field typed."""
    from dflash2.checkpoint import read_header
    from dflash2.errors import CheckpointError
    from dflash2.inputs import check_regular_file

    p = path(folder)
    hint = "move train_state/ away to start over"
    try:
        check_regular_file(p)
        read_header(p)
    except CheckpointError as e:
        raise Dflash2Error(f"{e}; {hint}") from None
    try:
        with safe_open(str(p), framework="pt") as f:
            raw = (f.metadata() or {}).get("resume")
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise Dflash2Error(f"{p}: header: expected a readable safetensors file, found {e}; {hint}") from None
    if raw is None:
        raise Dflash2Error(f"{p}: metadata.resume: expected dflash2's training state, found none; {hint}")
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        raise Dflash2Error(f"{p}: metadata.resume: expected JSON, found unreadable text; {hint}") from None
    if not isinstance(meta, dict):
        raise Dflash2Error(f"{p}: metadata.resume: expected a JSON object, found {type(meta).__name__}; {hint}")
    for key, typ in (("step", int), ("config", dict), ("log", list), ("py_rng", list), ("extra", dict)):
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            raise Dflash2Error(f"{p}: metadata.resume.{key}: expected {typ.__name__}, found "
                               f"{meta.get(key)!r:.60}; {hint}")
    if meta["step"] < 0 or len(meta["py_rng"]) != 3 or not isinstance(meta["py_rng"][1], list):
        raise Dflash2Error(f"{p}: metadata.resume: expected step >= 0 and a Python random state, found step "
                           f"{meta['step']}; {hint}")
    return meta


def check_same_drafter(where: Path, saved: dict, config: dict) -> None:
    """A resumed state continues the drafter it was saved from: another --block-size, --layers, ... is refused
    (it relabelled the drafter), naming the field and both values."""
    for key in IDENTITY:
        if key in saved and key in config and _plain(saved[key]) != _plain(config[key]):
            raise Dflash2Error(f"{where}: config.{key}: expected {_plain(config[key])} (this run's), found "
                               f"{_plain(saved[key])} (the saved state's); resume with the settings it was saved "
                               f"with, or train into another --out")


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def step_of(folder: Path) -> int | None:
    """The step a folder's saved state is at, or None when it has none."""
    if not has_state(folder):
        return None
    return read_meta(folder)["step"]


def load(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, list, tuple, dict]:
    """Restores weights, moments and the torch generator; returns (step, history, python rng state, extra)."""
    p = path(folder)
    meta = read_meta(folder)
    try:
        t = load_file(str(p))
    except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as e:
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
    return meta["step"], meta["log"], (v, tuple(internal), gauss), meta.get("extra") or {}


def save_progress(folder: Path, step: int, config: dict, history: list, extra: dict, weights: Path) -> None:
    """The compact state, written after the fp16 weights it names (by sha256), atomically."""
    import hashlib

    h = hashlib.sha256(weights.read_bytes()).hexdigest()
    body = {"kind": PROGRESS_KIND, "step": step, "config": config, "history": history, "extra": extra,
            "weights": {"file": weights.name, "sha256": h}}
    out = Path(folder) / PROGRESS
    tmp = out.with_name(f"{PROGRESS}.tmp-{os.getpid()}")
    data = (json.dumps(body, indent=1) + "\n").encode()
    with writing(out, f"the training progress of step {step}", len(data)):
        try:
            tmp.write_bytes(data)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)


def progress_step(folder: Path) -> int | None:
    """The step of a folder's compact state (None: it has none or it is unreadable: load_progress says why)."""
    try:
        return load_progress(folder)["step"]
    except Dflash2Error:
        return None


def load_progress(folder: Path) -> dict:
    """progress.json, checked field by field and against the weights file it names."""
    import hashlib

    p = Path(folder) / PROGRESS
    try:
        body = json.loads(p.read_text())
    except FileNotFoundError:
        raise Dflash2Error(f"{p}: no compact training state there") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Dflash2Error(f"{p}: not a readable training progress file ({e}); move it away to start over") from None
    if not isinstance(body, dict) or body.get("kind") != PROGRESS_KIND:
        raise Dflash2Error(f"{p}: field kind expected {PROGRESS_KIND!r}, found "
                           f"{body.get('kind') if isinstance(body, dict) else type(body).__name__!r}")
    for key, typ in (("step", int), ("config", dict), ("history", list), ("extra", dict), ("weights", dict)):
        if not isinstance(body.get(key), typ) or isinstance(body.get(key), bool):
            raise Dflash2Error(f"{p}: field {key} expected {typ.__name__}, found {body.get(key)!r:.80}")
    w = Path(folder) / str(body["weights"].get("file"))
    if not w.is_file():
        raise Dflash2Error(f"{p}: weights.file expected {w} beside it, found nothing there")
    found = hashlib.sha256(w.read_bytes()).hexdigest()
    if found != body["weights"].get("sha256"):
        raise Dflash2Error(f"{w}: sha256 expected {body['weights'].get('sha256')} ({p}), found {found}: the weights "
                           "are not the ones this progress was saved with (restore both from git)")
    return body
