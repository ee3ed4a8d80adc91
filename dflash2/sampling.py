"""Sampling at T > 0: the processed target distribution p, seeded uniforms, and lossless verification.

No torch: the edge runtime and the PyTorch reference share this module, so the same seed gives the
same ids on every backend (up to logits differences at a uniform's boundary).

    p = softmax(top_p(top_k(logits / T)))        # HF's warper order and rules (tested against them)
    u(seed, position, purpose)                   # counter-based: a rollback never shifts the stream
    draft x ~ q  ->  accept if u_accept * q(x) < p(x)   (probability min(1, p(x) / q(x)))
    first rejection: token ~ norm(max(p - q, 0)) on supp(p) U supp(q), q sparse over K candidates
    every draft accepted: bonus ~ p of the last verified row
Target-only sampling draws the token at position i from p with u(seed, i, TOKEN): the baseline.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash2.errors import Dflash2Error

# purposes of the uniforms: one stream per use, so no number is ever used twice
DRAFT, ACCEPT, RESIDUAL, TOKEN = 1, 2, 3, 4
_MASK = (1 << 64) - 1


class SamplingError(Dflash2Error, ValueError):
    pass


@dataclass(frozen=True)
class Sampling:
    """Generation options. temperature 0 = greedy (top_k / top_p then play no part)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0

    def __post_init__(self):
        checks = [("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature >= 0,
                   "a finite number >= 0"),
                  ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0"),
                  ("top_p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1]"),
                  ("seed", self.seed, isinstance(self.seed, int) and 0 <= self.seed < 2**63, "an integer in [0, 2^63)")]
        for name, value, ok, want in checks:
            if not ok:
                raise SamplingError(f"{name} expected {want}, found {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        return f"T={self.temperature:g} top_k={self.top_k or 'off'} top_p={self.top_p:g} seed={self.seed}"


def defaults_from(model_dir: str | Path | None) -> dict:
    """temperature / top_k / top_p of a `generation_config.json` that asks for sampling (do_sample
    true), else {} (greedy). Unreadable or malformed files are an error naming the file and field."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SamplingError(f"{path}: expected a JSON object, found unreadable content ({e})") from None
    if not isinstance(cfg, dict):
        raise SamplingError(f"{path}: expected a JSON object, found {type(cfg).__name__}")
    if not cfg.get("do_sample", False):
        return {}
    out = {}
    for key, kind in (("temperature", (int, float)), ("top_k", int), ("top_p", (int, float))):
        if key in cfg and cfg[key] is not None:
            if isinstance(cfg[key], bool) or not isinstance(cfg[key], kind):
                raise SamplingError(f"{path}: field {key} expected a number, found {cfg[key]!r}")
            out[key] = cfg[key]
    try:  # ranges too, here, where the file can be named (a flag given instead is checked as the flag)
        Sampling(**out)
    except SamplingError as e:
        raise SamplingError(f"{path}: field {e}") from None
    return out


def uniform(seed: int, position: int, purpose: int) -> float:
    """U[0, 1) from (seed, absolute position, purpose) by SplitMix64 (24-bit mantissa, exact in fp32).

    Counter-based: the number for a position never depends on how many were drawn before, so a
    rollback, a skipped draft or another backend cannot shift the stream."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + purpose * 0x8CB92BA72F3D8DD7) & _MASK
    for _ in range(2):
        x = (x + 0x9E3779B97F4A7C15) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
    return (x >> 40) / float(1 << 24)


def uniforms(seed: int, first_position: int, n: int, purpose: int) -> np.ndarray:
    """[n] fp32: uniform(seed, first_position + i, purpose), all n in one vectorised SplitMix64 (uint64 numpy
    arithmetic wraps mod 2^64 exactly as the scalar's masks do: the same bits)."""
    if n <= 0:
        return np.zeros(0, np.float32)
    base = (seed * 0x9E3779B97F4A7C15 + first_position * 0xD1B54A32D192ED03 + purpose * 0x8CB92BA72F3D8DD7) & _MASK
    with np.errstate(over="ignore"):
        x = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)  # [n]
        for _ in range(2):
            x = x + np.uint64(0x9E3779B97F4A7C15)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
    return ((x >> np.uint64(40)).astype(np.float64) / float(1 << 24)).astype(np.float32)


def process_sparse(logits: np.ndarray, s: Sampling) -> tuple[np.ndarray | None, np.ndarray]:
    """logits [V] -> (ids, p): the processed distribution on the ids it can give mass to, ascending (None: all V,
    p dense). / T, top-k (ties at the k-th value kept), top-p (the smallest top set whose mass reaches top_p:
    a token stays while the mass ranked above it is < top_p; at least one), renormalised.
    transformers' Temperature / TopK / TopP warpers are the reference.

    fp32 throughout (float64 exp is ~15x slower per element on this CPU; fp32's relative error, ~1e-7, is
    far below what the statistical tests can see and both sides of a comparison use this same function);
    only top-p's prefix sums run in float64, on its few candidates. With top-k on, only the top-k candidates
    are ever exponentiated; with top-p alone, one compare pass finds its candidates (no V-wide partition)."""
    V = logits.shape[0]
    ids = None
    if 0 < s.top_k < V:  # the order of logits / T is the order of the logits (T > 0): pick on the row as given
        top = np.argpartition(logits, V - s.top_k)[V - s.top_k:]
        kth = logits[top].min()
        if np.isnan(kth) or np.isnan(logits[top]).any():
            raise SamplingError("target logits: expected a finite maximum, found nan (NaN or inf in the logits)")
        ids = np.flatnonzero(logits >= kth)  # [n >= k] ascending: ties at the k-th value kept
        x = np.divide(logits[ids], np.float32(s.temperature), dtype=np.float32)
    else:
        x = np.divide(logits, np.float32(s.temperature), dtype=np.float32)  # [V] a new buffer, worked in place
    m = x.max()
    if not np.isfinite(m):
        raise SamplingError(f"target logits: expected a finite maximum, found {m} (NaN or inf in the logits)")
    x -= m
    np.exp(x, out=x)
    x /= x.sum()
    if s.top_p < 1:  # positions are in ascending id order: its ties-by-lower-id rule holds
        keep, x = _top_p(x, s.top_p)
        ids = keep if ids is None else ids[keep]
    return ids, x


def process(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """logits [V] -> p [V] float64 (process_sparse, dense)."""
    ids, p = process_sparse(logits, s)
    if ids is None:
        return p.astype(np.float64)
    out = np.zeros(logits.shape[0], np.float64)
    out[ids] = p
    return out


def _top_p(p: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(kept positions ascending, their renormalised p): the tokens whose exclusive prefix mass (descending,
    ties by lower position) is < top_p. Candidates are the tokens with p >= t (t = 1e-3, 1e-6 of the maximum,
    then 0) until they hold top_p of the mass, with a margin over summation-order rounding: a prefix of the
    descending order holding every tie at t, so every kept token is among them; only they are sorted."""
    pmax = float(p.max())
    for t in (pmax * 1e-3, pmax * 1e-6, 0.0):
        cand = np.flatnonzero(p >= t) if t > 0 else np.arange(p.shape[0])
        if t == 0 or float(p[cand].sum(dtype=np.float64)) >= top_p + 1e-6:
            break
    order = cand[np.argsort(-p[cand], kind="stable")]  # descending p, ties by ascending id (cand is ascending)
    w = p[order].astype(np.float64)
    before = np.cumsum(w) - w  # [m] mass ranked above each
    keep = np.sort(order[before < top_p])
    kept = p[keep]
    return keep, kept / kept.sum()


BLOCK = 512  # the inverse CDF in two levels: block sums, then one block's cumsum (V-wide cumsum is sequential)


def _index(p: np.ndarray, u: float) -> int:
    """Inverse CDF in index order: the first index whose cumulative mass exceeds u * total (zeros are never
    chosen; where rounding leaves u * total at or past the end, the last index with mass)."""
    n = p.shape[0]
    if n <= 4 * BLOCK:
        cdf = np.cumsum(p, dtype=np.float64)
        i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        return i if i < n and p[i] > 0 else int(np.flatnonzero(p)[-1])
    starts = np.arange(0, n, BLOCK)
    sums = np.cumsum(np.add.reduceat(p, starts), dtype=np.float64)  # [n / BLOCK]
    target = u * sums[-1]
    b = min(int(np.searchsorted(sums, target, side="right")), len(starts) - 1)
    a, e = starts[b], min(starts[b] + BLOCK, n)
    cdf = (sums[b - 1] if b else 0.0) + np.cumsum(p[a:e], dtype=np.float64)
    i = a + int(np.searchsorted(cdf, target, side="right"))
    if i < e and p[i] > 0:
        return i
    nz = np.flatnonzero(p[a:e])
    return a + int(nz[-1]) if nz.size else int(np.flatnonzero(p)[-1])


def _at(ids: np.ndarray | None, p: np.ndarray, x) -> np.ndarray:
    """p of the ids x (0 where x is outside the support) and their positions in p (-1 there)."""
    x = np.asarray(x)
    if ids is None:
        return p[x], x
    j = np.minimum(np.searchsorted(ids, x), len(ids) - 1)
    hit = ids[j] == x
    return np.where(hit, p[j], 0.0), np.where(hit, j, -1)


def sample(logits: np.ndarray, s: Sampling, u: float) -> int:
    """One token of target-only sampling from a logits row."""
    ids, p = process_sparse(logits, s)
    i = _index(p, u)
    return int(i if ids is None else ids[i])


def _residual(ids: np.ndarray | None, p: np.ndarray, q_ids: np.ndarray, q: np.ndarray, u: float) -> int:
    """After a rejection: a token ~ norm(max(p - q, 0)), q sparse (ids [K], probs [K]): only the K entries of q
    change p, and max(0 - q, 0) = 0 outside supp(p), so the residual lives on supp(p)."""
    r = p.copy()
    _, j = _at(ids, p, q_ids)
    keep = j >= 0
    r[j[keep]] = np.maximum(r[j[keep]] - q[keep], 0.0)
    if not r.sum() > 0:  # p == q up to rounding: a rejection has probability ~0; p is the limit
        r = p
    i = _index(r, u)
    return int(i if ids is None else ids[i])


def verify_round(rows: np.ndarray, drafts: list[int], q_ids: np.ndarray | None, q: np.ndarray | None,
                 start: int, s: Sampling) -> tuple[int, int]:
    """One round of lossless speculative sampling -> (accepted drafts, the token after them).

    rows [k+1, V]: target logits of [anchor, d_1..d_k]; drafts [k] (d_j sits at position start + j);
    q_ids / q [>= k, K]: each draft's candidates and draft distribution (None: q one-hot at the draft,
    the DFlash v1 drafter's deterministic top-1). Rows are processed only up to the first rejection."""
    for j, x in enumerate(drafts):
        ids, p = process_sparse(rows[j], s)  # the distribution of position start + 1 + j
        pos = start + 1 + j
        if q is None:
            qx, c_ids, probs = 1.0, np.array([x]), np.array([1.0])
        else:
            c_ids, probs = q_ids[j], q[j].astype(np.float64)
            hit = np.flatnonzero(c_ids == x)
            qx = float(probs[hit[0]]) if hit.size else 0.0
        px = float(_at(ids, p, [x])[0][0])
        if qx > 0 and uniform(s.seed, pos, ACCEPT) * qx < px:
            continue
        return j, _residual(ids, p, np.asarray(c_ids), probs, uniform(s.seed, pos, RESIDUAL))
    k = len(drafts)
    return k, sample(rows[k], s, uniform(s.seed, start + 1 + k, TOKEN))
