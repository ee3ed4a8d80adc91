"""The plugin's CPU twin (C ABI, ctypes) against the contract's plain-Python walk
(`contract.walk_row` / `path_confidence`: the primary reference) and torch.ops.dflash2.select_path.

Ids and path indices must match exactly; scores to fp32 rounding (the summation order differs
from torch's einsum), exactly where every value is a small dyadic number; q (draft_probs) to ~1e-6.
The sample-mode known answers (`SAMPLE_CASES`, `run_rows`) are shared with test_plugin_gpu.py, which
runs the same table on the kernel. Needs `bash plugins/build.sh`; skips with that hint when the
library is missing, unless DFLASH2_REQUIRE_PLUGINS=1 (CI), where a missing library fails.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
import sys

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2.native import bench, library, selector
import dflash2.reference.selector  # noqa: F401  registers torch.ops.dflash2.select_path
from dflash2.ops import contract as C

# id, B, S, K, R, V, logits dtype, codebook dtype, output_multiplier, logit_softcap
CASES = [
    ("production", 1, 7, 16, 256, 2000, "float32", "float32", 1.0, 0.0),
    ("production-bf16", 1, 7, 16, 256, 2000, "bfloat16", "bfloat16", 1.0, 0.0),
    ("batch8-fp16", 8, 7, 16, 256, 2000, "float16", "float16", 1.0, 0.0),
    ("softcap-mult", 3, 7, 16, 256, 2000, "float32", "bfloat16", 1.7, 30.0),
    ("S1", 2, 1, 16, 256, 500, "float32", "float32", 1.0, 0.0),
    ("K1", 2, 5, 1, 64, 100, "float16", "float32", 1.0, 0.0),
    ("K64", 2, 5, 64, 128, 500, "float32", "float16", 1.0, 0.0),
    ("R1024", 2, 3, 16, 1024, 300, "bfloat16", "float32", 0.5, 0.0),
    ("R1", 2, 4, 8, 1, 50, "float32", "float32", 1.0, 0.0),
    ("R33", 3, 4, 8, 33, 50, "float32", "bfloat16", 1.0, 5.0),
    ("S40", 2, 40, 4, 32, 64, "float32", "float32", 1.0, 0.0),
]
SAMPLE_T = 0.7  # temperature of the random sample-mode cases: low enough to differ from uniform


def require(loader):
    """The loaded library, or skip (fail when DFLASH2_REQUIRE_PLUGINS=1) with the build hint."""
    try:
        return loader()
    except library.PluginLibraryError as e:
        if os.environ.get("DFLASH2_REQUIRE_PLUGINS") == "1":
            pytest.fail(f"DFLASH2_REQUIRE_PLUGINS=1 but {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="module", autouse=True)
def twin():
    return require(selector.load_cpu_twin)


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def reference(x: dict, **attrs) -> list[np.ndarray]:
    op = torch.ops.dflash2.select_path
    out = op(**{k: to_torch(v) for k, v in x.items()}, **attrs)
    return [o.numpy() for o in out]


def assert_matches(got, want, exact_scores: bool = False) -> None:
    assert len(got) == len(want) == len(C.OUTPUTS)
    np.testing.assert_array_equal(got[0], want[0], err_msg="draft_ids")
    np.testing.assert_array_equal(got[1], want[1], err_msg="path_index")
    for i in (2, 3, 4):
        assert got[i].dtype == np.float32 and got[i].shape == want[i].shape, C.OUTPUTS[i].name
    if exact_scores:
        np.testing.assert_array_equal(got[2], want[2], err_msg="path_scores")
    else:
        np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-5, err_msg="path_scores")
    # exp and the summation order differ between implementations: a few ulp, never exact
    np.testing.assert_allclose(got[3], want[3], rtol=1e-5, atol=1e-7, err_msg="confidence")
    np.testing.assert_allclose(got[4], want[4], rtol=1e-5, atol=1e-7, err_msg="draft_probs")


def contract_check(x: dict, attrs: dict, got) -> int:
    """The plain-Python reference (a naive float64 loop) on the implementation's own walk: every row
    recomputed in float64 from the inputs with the predecessor the walk actually chose, then walked
    with contract.walk_row (index exact, q to 1e-6) and path_confidence. Returns how many rows walked
    a non-argmax candidate."""
    a = C.check_attributes(attrs)
    lg, gate, P, Q = (np.asarray(x[k]).astype(np.float64) for k in ("cand_logits", "gate", "pred_codebook",
                                                                     "succ_codebook"))
    ids, (B, S, _) = x["cand_ids"], x["cand_ids"].shape
    off_argmax = 0
    with np.errstate(invalid="ignore"):  # inf - inf in a row is NaN, then -inf by the contract
        for b in range(B):
            pred = int(x["anchor"][b])
            for s in range(S):
                u = lg[b, s] * a["output_multiplier"]
                if a["logit_softcap"] > 0:
                    u = np.tanh(u / a["logit_softcap"]) * a["logit_softcap"]
                want_row = u + (P[pred] * gate[b, s]) @ Q[ids[b, s]].T
                want_row[np.isnan(want_row)] = -np.inf
                row = got[2][b, s]
                np.testing.assert_allclose(row, want_row, rtol=1e-5, atol=1e-5, err_msg=f"row b={b} s={s}")
                i, q = C.walk_row(row.tolist(), float(x["temperature"][b]), float(x["uniforms"][b, s]), a["mode"])
                assert (got[1][b, s], got[0][b, s]) == (i, ids[b, s, i]), f"walk at b={b} s={s}"
                np.testing.assert_allclose(got[4][b, s], q, rtol=1e-6, atol=0, err_msg=f"q at b={b} s={s}")
                conf = C.path_confidence(row.tolist(), i)
                np.testing.assert_allclose(got[3][b, s], conf, rtol=1e-5, atol=1e-7, err_msg=f"conf b={b} s={s}")
                off_argmax += i != C.first_argmax(row.tolist())
                pred = int(ids[b, s, i])  # the walk continues from the candidate actually chosen
    return off_argmax


def case_inputs(case, temperature: float = SAMPLE_T) -> tuple[dict, dict]:
    _, B, S, K, R, V, tl, tc, mult, cap = case
    x = bench.random_inputs(B, S, K, R, V, codebook_dtype=tc, logits_dtype=tl, seed=B * 1000 + S * 100 + K,
                            temperature=temperature)
    return x, {"top_k": K, "rank": R, "output_multiplier": mult, "logit_softcap": cap}


def special_inputs() -> tuple[dict, dict, dict]:
    """Zero codebooks (pair = 0) so each row's scores are its logits: NaN, +-inf and ties, known answers."""
    nan, inf = np.nan, np.inf
    logits = np.array([[[1, 3, 3, 2],              # tie: lowest index 1
                        [nan, -inf, -inf, nan],    # all -inf after the NaN rule: index 0
                        [1, inf, 5, inf],          # first +inf wins: 1
                        [-inf, nan, -5, -5]]],     # NaN is -inf; tie at -5: index 2
                      np.float32)
    ids = np.array([[[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 42, 43]]], np.int32)
    x = {"cand_logits": logits, "cand_ids": ids, "gate": np.ones((1, 4, 3), np.float32),
         "anchor": np.array([5], np.int32), "pred_codebook": np.zeros((50, 3), np.float32),
         "succ_codebook": np.zeros((50, 3), np.float32), "uniforms": np.full((1, 4), 0.5, np.float32),
         "temperature": np.zeros(1, np.float32)}
    want = {"draft_ids": [[11, 20, 31, 42]], "path_index": [[1, 0, 1, 2]],
            "path_scores": np.where(np.isnan(logits), -inf, logits),
            "confidence": [[1 / (2 + np.exp(-1) + np.exp(-2)), 0.0, 0.5, 0.5]],  # tie; none scored; 2 x +inf; tie
            "draft_probs": np.eye(4, dtype=np.float32)[[1, 0, 1, 2]][None]}
    return x, {"top_k": 4, "rank": 3}, want


def test_hand_built_known_path():
    # P[anchor 0] . Q[3] = 3 beats Q[1] -> index 1 (token 3); P[3] = 0 and equal logits: tie -> index 0
    # (token 2); P[2] . Q = (1, 3) plus logits (2.5, 0) -> index 0 (token 1).
    P = np.array([[1, 0], [0, 1], [1, 1], [0, 0]], np.float32)
    Q = np.array([[1, 0], [0, 1], [0, 2], [3, 0]], np.float32)
    x = {"cand_logits": np.array([[[0, 0], [0, 0], [2.5, 0]]], np.float32),
         "cand_ids": np.array([[[1, 3], [2, 0], [1, 3]]], np.int32), "gate": np.ones((1, 3, 2), np.float32),
         "anchor": np.array([0], np.int32), "pred_codebook": P, "succ_codebook": Q,
         "uniforms": np.zeros((1, 3), np.float32), "temperature": np.ones(1, np.float32)}
    got = selector.select_path_cpu(**x, top_k=2, rank=2)
    np.testing.assert_array_equal(got[0], [[3, 2, 1]])
    np.testing.assert_array_equal(got[1], [[1, 0, 0]])
    np.testing.assert_array_equal(got[2], [[[0, 3], [0, 0], [3.5, 3]]])
    np.testing.assert_allclose(got[3], [[1 / (1 + np.exp(-3)), 0.5, 1 / (1 + np.exp(-0.5))]], rtol=1e-6)
    np.testing.assert_array_equal(got[4], [[[0, 1], [1, 0], [1, 0]]])
    contract_check(x, {"top_k": 2, "rank": 2}, got)
    assert_matches(got, reference(x, top_k=2, rank=2), exact_scores=True)


def test_sampled_predecessor_changes_the_next_row():
    # Row 0 (anchor 0, P[0] = 0): scores (0, ln 3), q = (1/4, 3/4) at T = 1; u = 0.2 walks index 0
    # (token 1), not the argmax (token 2). Row 1 is scored from P[1] = (0, 1): candidate token 3
    # (Q (0, 5)) scores 5, token 4 (Q (4, 0)) 0. The greedy walk follows token 2 (P (1, 0)): 0 and 4.
    P = np.array([[0, 0], [0, 1], [1, 0], [0, 0], [0, 0]], np.float32)
    Q = np.array([[0, 0], [0, 0], [0, 0], [0, 5], [4, 0]], np.float32)
    x = {"cand_logits": np.array([[[0, np.log(3)], [0, 0]]], np.float32),
         "cand_ids": np.array([[[1, 2], [3, 4]]], np.int32), "gate": np.ones((1, 2, 2), np.float32),
         "anchor": np.array([0], np.int32), "pred_codebook": P, "succ_codebook": Q,
         "uniforms": np.array([[0.2, 0.9]], np.float32), "temperature": np.ones(1, np.float32)}
    attrs = {"top_k": 2, "rank": 2}
    got = selector.select_path_cpu(**x, **attrs, mode="sample")
    np.testing.assert_array_equal(got[1], [[0, 0]])
    np.testing.assert_array_equal(got[0], [[1, 3]])
    np.testing.assert_array_equal(got[2], [[[0, np.float32(np.log(3))], [5, 0]]])
    np.testing.assert_allclose(got[4], [[[0.25, 0.75], [1 / (1 + np.exp(-5)), np.exp(-5) / (1 + np.exp(-5))]]],
                               rtol=1e-6)
    np.testing.assert_allclose(got[3], [[0.25, 1 / (1 + np.exp(-5))]], rtol=1e-6)  # softmax of the sampled one
    assert contract_check(x, {**attrs, "mode": "sample"}, got) == 1
    greedy = selector.select_path_cpu(**x, **attrs, mode="greedy")
    np.testing.assert_array_equal(greedy[0], [[2, 4]])
    np.testing.assert_array_equal(greedy[2][0, 1], [0, 4])
    assert_matches(got, reference(x, **attrs, mode="sample"), exact_scores=True)


@pytest.mark.parametrize("mode", C.MODES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_contract(case, mode):
    x, attrs = case_inputs(case)
    off = contract_check(x, {**attrs, "mode": mode}, selector.select_path_cpu(**x, **attrs, mode=mode))
    assert off == 0 or mode == "sample"


def test_sampling_leaves_the_argmax():
    """The random sample-mode cases above really sample: many rows walk a non-argmax candidate."""
    rows = off = 0
    for case in CASES:
        x, attrs = case_inputs(case)
        got = selector.select_path_cpu(**x, **attrs, mode="sample")
        rows += got[1].size
        off += int((got[1] != got[2].argmax(-1)).sum())
    assert off >= 0.1 * rows, f"{off} of {rows} rows off the argmax at T={SAMPLE_T}"


@pytest.mark.parametrize("mode", C.MODES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, mode):
    x, attrs = case_inputs(case)
    assert_matches(selector.select_path_cpu(**x, **attrs, mode=mode), reference(x, **attrs, mode=mode))


@pytest.mark.parametrize("T", [0.0, -1.0, np.nan])
@pytest.mark.parametrize("case", CASES[:5], ids=[c[0] for c in CASES[:5]])
def test_sample_at_t_le_0_is_greedy_bit_for_bit(case, T):
    x, attrs = case_inputs(case, temperature=T)
    sample = selector.select_path_cpu(**x, **attrs, mode="sample")
    greedy = selector.select_path_cpu(**x, **attrs, mode="greedy")
    for name, g, s in zip(C.output_names(), greedy, sample):
        np.testing.assert_array_equal(s, g, err_msg=name)


def test_greedy_ignores_uniforms_and_temperature():
    x, attrs = case_inputs(CASES[2])
    base = selector.select_path_cpu(**x, **attrs)
    y = {**x, "uniforms": np.full_like(x["uniforms"], np.nan), "temperature": np.full_like(x["temperature"], 5.0)}
    for name, a, b in zip(C.output_names(), base, selector.select_path_cpu(**y, **attrs, mode="greedy")):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("mode", C.MODES)
def test_special_values_nan_inf_ties(mode):
    x, attrs, want = special_inputs()
    got = selector.select_path_cpu(**x, **attrs, mode=mode)  # T = 0: sample walks greedily too
    np.testing.assert_array_equal(got[0], want["draft_ids"])
    np.testing.assert_array_equal(got[1], want["path_index"])
    np.testing.assert_array_equal(got[2][0], want["path_scores"][0])
    np.testing.assert_allclose(got[3], want["confidence"], rtol=1e-6)
    np.testing.assert_array_equal(got[4], want["draft_probs"])
    assert_matches(got, reference(x, **attrs, mode=mode), exact_scores=True)


# ---- sample mode: hand-built rows with known answers ------------------------------------------------
L4 = [0.0, math.log(2), math.log(3), math.log(4)]  # q at T=1: (.1, .2, .3, .4); cdf/total: .1, .3, .6, 1
Q_T = {1.0: [.1, .2, .3, .4], 0.5: [1 / 30, 4 / 30, 9 / 30, 16 / 30],
       2.0: list(np.sqrt([1, 2, 3, 4]) / np.sqrt([1, 2, 3, 4]).sum()), math.inf: [.25] * 4}
P_T1 = [.1, .2, .3, .4]  # the confidence: softmax at temperature 1 whatever T sampled
NI, PI, NAN = -math.inf, math.inf, math.nan
MID = [NI, 0.0, NI, math.log(3), NI]  # -inf at the front, in the middle and at the end: q (0, .25, 0, .75, 0)
Q_MID = [0, .25, 0, .75, 0]
b_lo, b_hi = 1 - 1e-5, 1 + 1e-5  # well clear of fp32 rounding of the boundaries (exact ulps: test below)
# (name, row, T, u, index, q, confidence)
SAMPLE_CASES = [
    ("T1-u0", L4, 1.0, 0.0, 0, Q_T[1.0], .1),
    ("T1-below-.1", L4, 1.0, .1 * b_lo, 0, Q_T[1.0], .1), ("T1-above-.1", L4, 1.0, .1 * b_hi, 1, Q_T[1.0], .2),
    ("T1-below-.3", L4, 1.0, .3 * b_lo, 1, Q_T[1.0], .2), ("T1-above-.3", L4, 1.0, .3 * b_hi, 2, Q_T[1.0], .3),
    ("T1-below-.6", L4, 1.0, .6 * b_lo, 2, Q_T[1.0], .3), ("T1-above-.6", L4, 1.0, .6 * b_hi, 3, Q_T[1.0], .4),
    ("T1-u.999999", L4, 1.0, .999999, 3, Q_T[1.0], .4), ("T1-u.5", L4, 1.0, .5, 2, Q_T[1.0], .3),
    ("T.5-u.5", L4, 0.5, .5, 3, Q_T[0.5], .4), ("T.5-u.1", L4, 0.5, .1, 1, Q_T[0.5], .2),
    ("T.5-u.03", L4, 0.5, .03, 0, Q_T[0.5], .1),
    ("T2-u.5", L4, 2.0, .5, 2, Q_T[2.0], .3), ("T2-u.15", L4, 2.0, .15, 0, Q_T[2.0], .1),
    ("Tinf-u.5", L4, PI, .5, 2, Q_T[PI], .3),
    ("T0-greedy", L4, 0.0, .05, 3, [0, 0, 0, 1], .4), ("T-1-greedy", L4, -1.0, .05, 3, [0, 0, 0, 1], .4),
    ("Tnan-greedy", L4, NAN, .05, 3, [0, 0, 0, 1], .4),
    ("u-negative", L4, 1.0, -0.5, 0, Q_T[1.0], .1), ("u-1.0", L4, 1.0, 1.0, 3, Q_T[1.0], .4),
    ("u-1.5", L4, 1.0, 1.5, 3, Q_T[1.0], .4), ("u-nan", L4, 1.0, NAN, 0, Q_T[1.0], .1),
    ("u-+inf", L4, 1.0, PI, 3, Q_T[1.0], .4), ("u--inf", L4, 1.0, NI, 0, Q_T[1.0], .1),
    ("mid-u0", MID, 1.0, 0.0, 1, Q_MID, .25), ("mid-u.2", MID, 1.0, .2, 1, Q_MID, .25),
    ("mid-u.3", MID, 1.0, .3, 3, Q_MID, .75), ("mid-u.999999", MID, 1.0, .999999, 3, Q_MID, .75),
    ("mid-u1.5", MID, 1.0, 1.5, 3, Q_MID, .75), ("mid-u-1", MID, 1.0, -1.0, 1, Q_MID, .25),
    ("nan-as-inf", [NAN, 0.0, NAN, math.log(3), NAN], 1.0, .3, 3, Q_MID, .75),
    ("+inf-u0", [1, PI, 5, PI, NI], 1.0, 0.0, 1, [0, .5, 0, .5, 0], .5),
    ("+inf-u.49", [1, PI, 5, PI, NI], 0.5, .49, 1, [0, .5, 0, .5, 0], .5),
    ("+inf-u.5", [1, PI, 5, PI, NI], 2.0, .5, 3, [0, .5, 0, .5, 0], .5),
    ("+inf-u.999999", [1, PI, 5, PI, NI], 1.0, .999999, 3, [0, .5, 0, .5, 0], .5),
    ("all--inf", [NAN, NI, NAN, NI, NI], 1.0, .7, 0, [1, 0, 0, 0, 0], 0.0),
    ("one-finite", [NI, NI, NI, NI, 2.0], 1.0, 0.0, 4, [0, 0, 0, 0, 1], 1.0),
]


def run_rows(rows, T, u, mode: str = "sample", fn=None):
    """Each row as its own batch element (S = 1, zero codebooks: the scores are the logits)
    -> (index [N], q [N, K], confidence [N], path_scores [N, K]) of fn (default the CPU twin)."""
    N, K = len(rows), len(rows[0])
    x = {"cand_logits": np.array(rows, np.float32)[:, None, :],
         "cand_ids": np.tile(np.arange(K, dtype=np.int32), (N, 1, 1)), "gate": np.ones((N, 1, 1), np.float32),
         "anchor": np.zeros(N, np.int32), "pred_codebook": np.zeros((K, 1), np.float32),
         "succ_codebook": np.zeros((K, 1), np.float32), "uniforms": np.array(u, np.float32)[:, None],
         "temperature": np.array(T, np.float32)}
    out = (fn or selector.select_path_cpu)(**x, top_k=K, rank=1, mode=mode)
    return out[1][:, 0], out[4][:, 0], out[3][:, 0], out[2][:, 0]


def check_sample_cases(fn=None) -> None:
    for K in (4, 5):
        cases = [c for c in SAMPLE_CASES if len(c[1]) == K]
        index, q, conf, rows = run_rows([c[1] for c in cases], [c[2] for c in cases], [c[3] for c in cases], fn=fn)
        for i, (name, row, T, u, want_i, want_q, want_c) in enumerate(cases):
            assert index[i] == want_i, f"{name}: index {index[i]}, expected {want_i}"
            np.testing.assert_allclose(q[i], want_q, rtol=2e-6, atol=0, err_msg=name)
            assert conf[i] == pytest.approx(want_c, rel=2e-6), name
            ci, cq = C.walk_row(rows[i].tolist(), T, float(np.float32(u)), "sample")
            assert ci == index[i], f"{name}: contract.walk_row says {ci}, found {index[i]}"
            np.testing.assert_allclose(q[i], cq, rtol=1e-6, atol=0, err_msg=name)
            assert conf[i] == pytest.approx(C.path_confidence(rows[i].tolist(), ci), rel=1e-6), name


def test_sample_known_answers():
    check_sample_cases()


def fp32_boundaries(row, T) -> list[tuple[int, np.float32]]:
    """(c, the fp32 u = cdf_c / total) of every inner cdf boundary, in the contract's fp32 arithmetic."""
    r = np.array(row, np.float32)
    e = np.exp(((r - r.max()) / np.float32(T)).astype(np.float64)).astype(np.float32)
    cdf = np.cumsum(e, dtype=np.float32)  # sequential, like the contract
    return [(c, np.float32(cdf[c] / cdf[-1])) for c in range(len(row) - 1)]


def check_ulp_boundaries(T: float, fn=None) -> None:
    """u a few ulp either side of each boundary: the index equals contract.walk_row's exactly, and the
    window really straddles the boundary (both neighbours occur)."""
    rows, us, owners = [], [], []
    for c, b in fp32_boundaries(L4, T):
        for k in range(-3, 4):
            rows.append(L4)
            us.append(np.float32(b + k * np.spacing(b)))
            owners.append(c)
    index, _, _, scores = run_rows(rows, [T] * len(rows), us, fn=fn)
    for i, (u, c) in enumerate(zip(us, owners)):
        assert index[i] == C.walk_row(scores[i].tolist(), T, float(u), "sample")[0], f"T={T} u={u!r}"
    for c in set(owners):
        assert {c, c + 1} <= {int(index[i]) for i in range(len(us)) if owners[i] == c}, f"boundary {c} not crossed"


@pytest.mark.parametrize("T", [0.5, 1.0, 2.0])
def test_sample_one_ulp_around_cdf_boundaries(T):
    check_ulp_boundaries(T)


def test_sample_frequencies_match_q():
    """20,000 uniforms on one row: index frequencies within 5 sigma of q (and q is walk_row's)."""
    rng = np.random.default_rng(7)
    row = (rng.standard_normal(8) * 2).astype(np.float32).tolist()
    N, T = 20000, 2.0
    index, q, _, scores = run_rows([row] * N, [T] * N, rng.random(N, dtype=np.float32))
    want_q = C.walk_row(scores[0].tolist(), T, 0.5, "sample")[1]
    np.testing.assert_allclose(q, np.broadcast_to(want_q, q.shape), rtol=1e-6, atol=0)
    freq = np.bincount(index, minlength=8) / N
    sigma = np.sqrt(np.array(want_q) * (1 - np.array(want_q)) / N)
    assert np.all(np.abs(freq - want_q) <= 5 * sigma + 1e-12), (freq.tolist(), want_q)
    assert (np.array(want_q) > 0.05).sum() >= 3  # a row worth sampling: several likely candidates


def test_empty_batch():
    x, attrs = case_inputs(("empty", 1, 3, 4, 8, 10, "float32", "float32", 1.0, 0.0))
    x = {k: (v if k.endswith("codebook") else v[:0]) for k, v in x.items()}
    for mode in C.MODES:
        got = selector.select_path_cpu(**x, **attrs, mode=mode)
        assert [g.shape for g in got] == [(0, 3), (0, 3), (0, 3, 4), (0, 3), (0, 3, 4)]


_GRID = st.integers(-16, 16).map(lambda i: np.float32(i / 4))  # exact in bf16/fp16; sums stay exact in fp32
_SPECIAL = st.sampled_from([np.float32(np.nan), np.float32(np.inf), np.float32(-np.inf)])
_U = st.one_of(st.floats(0, 1, width=32, exclude_max=True), st.sampled_from([0.0, 0.999999, -1.0, 2.0, np.nan]))


@st.composite
def exact_inputs(draw):
    B, S, K = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 8))
    R, V = draw(st.integers(1, 40)), draw(st.integers(1, 12))
    tl, tc = draw(st.sampled_from(C.FLOAT_TYPES)), draw(st.sampled_from(C.FLOAT_TYPES))
    logit_el = st.one_of(_GRID, _GRID, _GRID, _SPECIAL)
    x = {"cand_logits": draw(hnp.arrays(np.float32, (B, S, K), elements=logit_el)),
         "cand_ids": draw(hnp.arrays(np.int32, (B, S, K), elements=st.integers(0, V - 1))),
         "gate": draw(hnp.arrays(np.float32, (B, S, R), elements=_GRID)),
         "anchor": draw(hnp.arrays(np.int32, (B,), elements=st.integers(0, V - 1))),
         "pred_codebook": draw(hnp.arrays(np.float32, (V, R), elements=_GRID)),
         "succ_codebook": draw(hnp.arrays(np.float32, (V, R), elements=_GRID)),
         "uniforms": draw(hnp.arrays(np.float32, (B, S), elements=_U)),
         "temperature": draw(hnp.arrays(np.float32, (B,), elements=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0,
                                                                                     -1.0, np.nan])))}
    x = {k: (v if k in ("cand_ids", "anchor", "uniforms", "temperature")
             else as_dtype(v, tl if k == "cand_logits" else tc)) for k, v in x.items()}
    return x, {"top_k": K, "rank": R, "output_multiplier": draw(st.sampled_from([0.5, 1.0, 2.0])),
               "mode": draw(st.sampled_from(C.MODES))}


def as_dtype(a: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        import ml_dtypes

        return a.astype(ml_dtypes.bfloat16)
    return a.astype(name)


@settings(max_examples=150, deadline=None, database=None)  # no .hypothesis/ folder in the repo
@given(exact_inputs())
def test_property_contract(case):
    """Dyadic values, specials, any u and T: the twin walks exactly as contract.walk_row says."""
    x, attrs = case
    contract_check(x, attrs, selector.select_path_cpu(**x, **attrs))


@settings(max_examples=150, deadline=None, database=None)
@given(exact_inputs())
def test_property_exact_equality(case):
    """Dyadic values: every backend computes the same exact sums, so ties and specials must agree bit for bit."""
    x, attrs = case
    assert_matches(selector.select_path_cpu(**x, **attrs), reference(x, **attrs), exact_scores=True)


BAD = [  # (change, substring both implementations must name)
    (lambda x, a: a.update(top_k=8), "top_k=8"),
    (lambda x, a: a.update(rank=64), "rank=64"),
    (lambda x, a: a.update(top_k=65), "top_k"),
    (lambda x, a: a.update(mode="beam"), "mode"),
    (lambda x, a: a.update(output_multiplier=0.0), "output_multiplier"),
    (lambda x, a: x.update(gate=x["gate"].astype(np.float16)), "share a dtype"),
    (lambda x, a: x.update(cand_ids=x["cand_ids"].astype(np.int64)), "cand_ids"),
    (lambda x, a: x.update(cand_logits=x["cand_logits"][0]), "cand_logits"),
    (lambda x, a: x.update(gate=x["gate"][:, :6]), "dim S of input gate expected 7, found 6"),
    (lambda x, a: x.update(uniforms=x["uniforms"][:, :6]), "dim S of input uniforms expected 7, found 6"),
    (lambda x, a: x.update(uniforms=x["uniforms"].astype(np.float64)), "uniforms dtype"),
    (lambda x, a: x.update(temperature=x["temperature"][:, None]), "temperature expected rank 1"),
    (lambda x, a: x.update(temperature=np.ones(2, np.float32)), "dim B of input temperature expected 1, found 2"),
]


@pytest.mark.parametrize("impl", ["cpu_twin", "torch_op"])
@pytest.mark.parametrize("bad", BAD, ids=[b[1] for b in BAD])
def test_rejects_bad_input_like_the_reference(bad, impl):
    """The CPU twin and the torch op refuse the same inputs with the same message."""
    change, needle = bad
    x, attrs = case_inputs(CASES[0])
    attrs["mode"] = "sample"
    change(x, attrs)
    run = selector.select_path_cpu if impl == "cpu_twin" else reference
    with pytest.raises(ValueError, match=needle) as ours:
        run(x, **attrs) if impl == "torch_op" else run(**x, **attrs)
    assert C.OP_NAME in str(ours.value)


def test_rejects_out_of_range_ids():
    x, attrs = case_inputs(CASES[0])
    x["anchor"] = np.array([2000], np.int32)
    with pytest.raises(ValueError, match=r"anchor expected ids in \[0, 2000\)"):
        selector.select_path_cpu(**x, **attrs)


def test_c_abi_validates_arguments(twin):
    assert twin.dflash2_selector_abi_version() == library.ABI_VERSION == 3
    args = selector._Args(B=1, S=1, K=65, R=8, V=4, output_multiplier=1.0)
    err = ctypes.create_string_buffer(256)
    assert twin.dflash2_select_path_cpu(ctypes.byref(args), err, len(err)) == 1
    assert err.value.decode() == "DFlash2Selector: K (top_k) expected 1..64, found 65"
    args.K, args.logits_dtype = 4, 7
    assert twin.dflash2_check_select_args(ctypes.byref(args), err, len(err)) == 1
    assert "cand_logits dtype code expected 0..2, found 7" in err.value.decode()
    args.logits_dtype, args.mode = 0, 2
    assert twin.dflash2_check_select_args(ctypes.byref(args), err, len(err)) == 1
    assert "mode code expected 0 (greedy) or 1 (sample), found 2" in err.value.decode()
    args.mode = 0
    assert twin.dflash2_check_select_args(ctypes.byref(args), err, len(err)) == 1
    assert "tensor cand_logits is NULL" in err.value.decode()
    # every tensor but uniforms / temperature set: greedy accepts, sample names the missing input
    buf = ctypes.create_string_buffer(1024)
    for name in C.input_names() + C.output_names():
        if name not in ("uniforms", "temperature"):
            setattr(args, name, ctypes.addressof(buf))
    assert twin.dflash2_check_select_args(ctypes.byref(args), err, len(err)) == 0, err.value
    args.mode = 1
    assert twin.dflash2_check_select_args(ctypes.byref(args), err, len(err)) == 1
    assert "tensor uniforms is NULL" in err.value.decode()


def test_struct_mirror_follows_the_contract():
    names = [f[0] for f in selector._Args._fields_]
    assert names[:len(C.INPUTS) + len(C.OUTPUTS)] == C.input_names() + C.output_names()
    assert names[-1] == "mode" and selector._MODE_CODES == {"greedy": 0, "sample": 1}


@pytest.mark.parametrize("name", [library.CPU_LIB, library.PLUGIN_LIB])
def test_library_loads_without_cuda_or_tensorrt(name):
    path = require(lambda: library.find_library(name))
    code = ("import ctypes, sys; ctypes.CDLL(sys.argv[1]); maps = open('/proc/self/maps').read(); "
            "print([n for n in ('libcudart', 'libcuda.so', 'libnvinfer') if n in maps])")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{name} pulled in {out.stdout.strip()}"


def test_module_does_not_import_torch():
    code = "import sys, dflash2.native.selector, dflash2.native.bench, dflash2.native.gpu_check; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_library_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.delenv(library.ENV_VAR, raising=False)
    monkeypatch.setattr(library, "search_dirs", lambda: [tmp_path])
    with pytest.raises(library.PluginLibraryError, match="bash plugins/build.sh"):
        library.find_library(library.CPU_LIB)


def test_env_var_wins(monkeypatch, tmp_path):
    real = require(lambda: library.find_library(library.PLUGIN_LIB))
    copy = tmp_path / library.PLUGIN_LIB
    shutil.copy(real, copy)
    monkeypatch.setenv(library.ENV_VAR, str(copy))
    assert library.find_library(library.PLUGIN_LIB) == copy
    monkeypatch.setenv(library.ENV_VAR, str(tmp_path))
    assert library.find_library(library.PLUGIN_LIB) == copy
