"""The one comparison rule of a backend's outputs against the PyTorch reference, used by the
validation right after export and by dflash2-compare (docs/export.md, "How outputs are compared"):

    float outputs: every element within |got - want| <= atol + rtol * |want|   (numpy.isclose;
                   equal infinities match), tolerances by the export dtype
    id outputs:    at most id_share of the entries differ (fp16/bf16 logits may swap near-equal
                   candidates; fp32 allows none)

Tolerances come from the dtype table (dflash2.dtypes).
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


def compare_floats(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> Difference:
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if a.size == 0:
        return Difference(0.0, 0.0, True)
    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities are judged by isclose itself
        diff = np.abs(a - b)
        diff = np.where(a == b, 0.0, diff)
    return Difference(float(diff.max()), float((diff / np.maximum(np.abs(b), 1e-6)).max()),
                      bool(np.isclose(a, b, rtol=rtol, atol=atol).all()))


def ids_within(differing: int, total: int, share: float) -> bool:
    """The id rule: at most `share` of `total` entries differ."""
    return differing <= share * total
