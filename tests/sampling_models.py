"""Sharp tiny model pairs and the exact target-only sampling distribution of the first tokens, by
enumeration: the statistical tests of lossless speculative sampling (tests/test_sampling.py) use them."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from dflash2 import tiny
from dflash2.export.api import export
from dflash2.sampling import Sampling, process

PROMPT = [5, 17, 42, 99]
CONTEXT = 0.25
DRAFT_SCALE = 2.0
SHARED = 30.0  # + this on embedding dim 0: the target's normed hidden states lean on one direction, and
# the drafter's final norm keeps only that dimension, so both rank the vocabulary alike and drafts are
# often accepted (a random pair's drafts never are: the accept path would go untested)


def sharp_export(root: Path, version: int, family: str = "qwen3", extra: dict | None = None, quantize=None) -> Path:
    """A tiny target (Qwen3, the Qwen3.5 hybrid or its MoE variant, gpt-oss) whose next-token distribution leans on
    one shared direction (a few dozen 3-token sequences hold most of the mass at T = 1) + a DFlash / DFlash2 drafter
    that leans on the same direction (block 4: one round drafts tokens 2..4), exported for ONNX Runtime. extra: the
    tiny config's overrides (tiny.make_target); quantize: export()'s (a QuantFlags), named in the folder."""
    tag = family if extra is None else f"{family}-{zlib.crc32(json.dumps(extra, sort_keys=True).encode()):08x}"
    out = root / f"export-{tag}-v{version}" if quantize is None else root / f"export-{tag}-v{version}-{quantize.method}"
    if (out / "manifest.json").is_file():
        return out
    target = root / f"target-{tag}"
    if not (target / "config.json").is_file():
        tiny.make_target(target, family=family, extra=extra)
        w = load_file(str(target / "model.safetensors"))
        w["model.embed_tokens.weight"][:, 0] += SHARED
        if family.startswith("qwen3_5"):  # zero-centred: the norm multiplies by 1 + w
            w["model.norm.weight"][1:] = (1 + w["model.norm.weight"][1:]) * CONTEXT - 1
        else:
            w["model.norm.weight"][1:] *= CONTEXT  # the context still moves p, less than the shared direction
        save_file(w, str(target / "model.safetensors"), metadata={"format": "pt"})
    drafter = root / f"drafter-{tag}-v{version}"
    if not (drafter / "config.json").is_file():  # (a quantized export of the same pair reuses it as it is)
        tiny.make_drafter(drafter, target, version=version, block_size=4, top_k=6)
        w = load_file(str(drafter / "model.safetensors"))
        w["norm.weight"][1:] = 0.0
        w["norm.weight"][0] *= DRAFT_SCALE
        for name in w:
            if name.endswith("codebook"):  # small pair scores: the walk follows the unary logits
                w[name] = (w[name] * 0.2).astype(np.float32)
        save_file(w, str(drafter / "model.safetensors"), metadata={"format": "pt"})
    export(drafter, target, out, max_seq_len=64, quiet=True, quantize=quantize)
    return out


def exact_distribution(session, s: Sampling, n: int = 3, min_mass: float = 1e-3) -> dict[tuple, float]:
    """Target-only sampling distribution of the first n tokens after PROMPT, by enumeration: the
    probability of a sequence is the product of the processed p of each step. Sequences of mass
    >= min_mass are bins of their own; the rest is one bin, None, of exactly the remaining mass."""
    def p_next(prefix: list[int]) -> np.ndarray:
        return process(session.prefill(PROMPT + prefix).logits()[-1], s)

    bins: dict[tuple, float] = {}
    frontier = [((), 1.0)]
    for depth in range(n):
        nxt = []
        for prefix, mass in frontier:
            p = p_next(list(prefix))
            for x in np.flatnonzero(p * mass >= min_mass * 1e-2):  # deeper steps can only shrink a mass
                nxt.append((prefix + (int(x),), mass * float(p[x])))
        frontier = nxt
    for seq, mass in frontier:
        if mass >= min_mass:
            bins[seq] = mass
    bins[None] = max(0.0, 1.0 - sum(bins.values()))
    return bins


def tv_bound(bins: int, samples: int, delta: float = 1e-6) -> float:
    """TV distance an empirical distribution over `bins` categories from `samples` draws exceeds with
    probability <= delta (Bretagnolle-Huber-Carol: P(||p_hat - p||_1 >= 2 eps) <= 2^M exp(-2 N eps^2))."""
    return math.sqrt((bins * math.log(2) + math.log(1 / delta)) / (2 * samples))


def tv(counts: dict, exact: dict[tuple, float], samples: int) -> float:
    """TV distance between the empirical bins (sequences outside `exact` count as the None bin) and exact."""
    emp: dict = {}
    for seq, c in counts.items():
        key = seq if seq in exact else None
        emp[key] = emp.get(key, 0) + c
    return 0.5 * sum(abs(emp.get(k, 0) / samples - exact.get(k, 0.0)) for k in set(exact) | set(emp))
