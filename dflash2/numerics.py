"""The one comparison rule of a backend's outputs against the PyTorch reference, used by the
validation right after export and by dflash2-compare (docs/export.md, "How outputs are compared"):

    float outputs: every element within |got - want| <= atol * scale + rtol * |want|, where
                   scale = max(1, rms(want)) is the output's own magnitude (numpy.isclose; equal
                   infinities match), tolerances by the export dtype
    id outputs:    at most id_share of the entries differ (fp16/bf16 logits may swap near-equal
                   candidates; fp32 allows none)

Tolerances come from the dtype table (dflash2.dtypes). Why the scale: rounding noise grows with the
magnitude of what is summed. Logits of std 32 over a 151,936-wide vocabulary (a Qwen3-shaped target)
differ from an fp64 evaluation by 1.8e-4 in PyTorch fp32 itself, so a fixed atol of 1e-4 failed exports
on noise; outputs of rms <= 1 (probabilities, most KV rows) keep the table's atol unchanged, larger ones
(logits, a context of large activations) get it scaled by their rms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash2.dtypes import BY_NAME, GRAPH_DTYPES

TOLERANCES = {n: (BY_NAME[n].atol, BY_NAME[n].rtol) for n in GRAPH_DTYPES}  # (atol, rtol)
ID_MISMATCH_SHARE = {n: BY_NAME[n].id_share for n in GRAPH_DTYPES}  # share of id entries allowed to differ


@dataclass
class Difference:
    """One float output vs its reference: the largest differences and the verdict."""

    max_abs: float
    max_rel: float
    ok: bool
    scale: float = 1.0  # the atol multiplier applied: max(1, rms(want))


def compare_floats(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> Difference:
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if a.size == 0:
        return Difference(0.0, 0.0, True)
    scale = magnitude(b)
    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities are judged by isclose itself
        diff = np.abs(a - b)
        diff = np.where(a == b, 0.0, diff)
    return Difference(float(diff.max()), float((diff / np.maximum(np.abs(b), 1e-6)).max()),
                      bool(np.isclose(a, b, rtol=rtol, atol=atol * scale).all()), scale)


def magnitude(want: np.ndarray) -> float:
    """max(1, rms of the finite entries of the reference): the atol multiplier (module docstring)."""
    finite = want[np.isfinite(want)]
    return max(1.0, float(np.sqrt(np.mean(np.square(finite))))) if finite.size else 1.0


def argmax_agreement(got: np.ndarray, want: np.ndarray) -> float:
    """Share of rows whose argmax over the last axis agrees (logits: the token greedy decoding picks)."""
    g, w = np.asarray(got).reshape(-1, got.shape[-1]), np.asarray(want).reshape(-1, want.shape[-1])
    return float((g.argmax(-1) == w.argmax(-1)).mean()) if len(w) else 1.0


def ids_within(differing: int, total: int, share: float) -> bool:
    """The id rule: at most `share` of `total` entries differ."""
    return differing <= share * total
