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


# Elements per slice of a chunked comparison: the rule widens both sides to float64 and keeps a few temporaries of
# that size, 6 x 8 bytes per element at once; a Qwen3.5-0.8B target's per-row recurrent states (16 rows x 18 layers
# x 1 MB) would then hold 3.6 GB. Outputs up to this size are compared in one piece, exactly as always.
CHUNK = 1 << 22


def compare_floats(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> Difference:
    """The rule over one output, in slices of CHUNK elements where it is larger (the same maxima and verdict:
    each is a max / all over elements; the scale's mean of squares is then summed per slice, equal to the
    one-piece sum up to float64 rounding)."""
    got, want = np.asarray(got), np.asarray(want)
    if want.size == 0:
        return Difference(0.0, 0.0, True)
    if want.size <= CHUNK or got.shape != want.shape:
        return _compare(got, want, atol, rtol, magnitude(np.asarray(want, np.float64)))
    scale = magnitude(want)
    a, b = got.reshape(-1), want.reshape(-1)
    parts = [_compare(a[i:i + CHUNK], b[i:i + CHUNK], atol, rtol, scale) for i in range(0, b.size, CHUNK)]
    # np.max, not max(): a NaN in any slice is the result, as in one piece
    return Difference(float(np.max([d.max_abs for d in parts])), float(np.max([d.max_rel for d in parts])),
                      all(d.ok for d in parts), scale)


def _compare(got: np.ndarray, want: np.ndarray, atol: float, rtol: float, scale: float) -> Difference:
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities are judged by isclose itself
        diff = np.abs(a - b)
        diff = np.where(a == b, 0.0, diff)
    return Difference(float(diff.max()), float((diff / np.maximum(np.abs(b), 1e-6)).max()),
                      bool(np.isclose(a, b, rtol=rtol, atol=atol * scale).all()), scale)


def magnitude(want: np.ndarray) -> float:
    """max(1, rms of the finite entries of the reference): the atol multiplier (module docstring); in slices of
    CHUNK elements past that size (compare_floats)."""
    want = np.asarray(want)
    if want.size <= CHUNK:
        finite = want[np.isfinite(want)]
        return max(1.0, float(np.sqrt(np.mean(np.square(finite))))) if finite.size else 1.0
    flat, total, count = want.reshape(-1), 0.0, 0
    for i in range(0, flat.size, CHUNK):
        part = flat[i:i + CHUNK]
        finite = part[np.isfinite(part)]
        total, count = total + float(np.sum(np.square(finite, dtype=np.float64))), count + finite.size
    return max(1.0, float(np.sqrt(total / count))) if count else 1.0


def max_abs_difference(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| in float64, in slices of CHUNK elements (no float64 copy of a large output)."""
    a, b = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if not b.size:
        return 0.0
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, the result as in one piece (np.max propagates it)
        return float(np.max([np.abs(a[i:i + CHUNK].astype(np.float64) - b[i:i + CHUNK]).max()
                             for i in range(0, b.size, CHUNK)]))


def argmax_agreement(got: np.ndarray, want: np.ndarray) -> float:
    """Share of rows whose argmax over the last axis agrees (logits: the token greedy decoding picks)."""
    g, w = np.asarray(got).reshape(-1, got.shape[-1]), np.asarray(want).reshape(-1, want.shape[-1])
    return float((g.argmax(-1) == w.argmax(-1)).mean()) if len(w) else 1.0


def ids_within(differing: int, total: int, share: float) -> bool:
    """The id rule: at most `share` of `total` entries differ."""
    return differing <= share * total


# torch._dynamo.utils.same's multiplier for fp16 / bf16 results judged against an fp64 reference (TorchInductor's
# accuracy check): a result passes if its RMSE from the exact one is at most 3x the eager reference's + tol / 10
DTYPE_ERROR_MULTIPLIER = 3.0


def rmse(a: np.ndarray, b: np.ndarray) -> float:
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return float(np.sqrt(np.mean(d * d))) if d.size else 0.0


def _worst_row_rmse(a: np.ndarray, b: np.ndarray) -> float:
    """The largest RMSE of one row (the first axis: a step's token rows) of a - b."""
    d = (np.asarray(a, np.float64) - np.asarray(b, np.float64)).reshape(len(a), -1) if np.ndim(a) else None
    return float(np.sqrt((d * d).mean(axis=1)).max()) if d is not None and d.size else rmse(a, b)


def within_dtype_error(got: np.ndarray, own: np.ndarray, exact: np.ndarray, dtype: str) -> tuple[bool, dict]:
    """The low-precision rule of last resort (docs/export.md, "How outputs are compared"). It applies only where the
    framework's own run in this dtype (`own`) misses the exact function (`exact`: the fp32 reference) by the dtype's
    fixed rule itself (elsewhere the fixed rules judge: False); then no fixed tolerance can judge the graph (`got`),
    and it passes if it is no further from the exact function than the framework's own dtype is, up to
    DTYPE_ERROR_MULTIPLIER (torch._dynamo.utils.same's fp64_ref rule), on three measures each + atol / 10: the
    output's RMSE, its worst row's RMSE (an error confined to a few rows) and its max abs. Ids: no more differing
    from the exact ids than the framework's own plus the dtype's share. (ok, report)."""
    g, o, e = (np.asarray(x) for x in (got, own, exact))
    if g.shape != e.shape or o.shape != e.shape:
        return False, {"shapes": [list(g.shape), list(o.shape), list(e.shape)]}
    atol, rtol = TOLERANCES[dtype]
    share = ID_MISMATCH_SHARE[dtype]
    if np.issubdtype(e.dtype, np.integer):
        bad_g, bad_o = int((g != e).sum()), int((o != e).sum())
        report = {"graph_vs_fp32_ids": bad_g, "own_vs_fp32_ids": bad_o, "total": int(e.size)}
        return not ids_within(bad_o, e.size, share) and bad_g <= bad_o + share * e.size, report
    if compare_floats(o, e, atol, rtol).ok:
        return False, {"own_within_tolerance": True}
    m, slack = DTYPE_ERROR_MULTIPLIER, atol / 10
    pairs = {"rmse": (rmse(g, e), rmse(o, e)), "worst_row_rmse": (_worst_row_rmse(g, e), _worst_row_rmse(o, e)),
             "max_abs": (float(np.abs(g.astype(np.float64) - e).max()), float(np.abs(o.astype(np.float64) - e).max()))}
    report = {f"{k}_vs_fp32": {"graph": round(a, 6), "own": round(b, 6)} for k, (a, b) in pairs.items()}
    return all(a <= m * b + slack for a, b in pairs.values()), report
