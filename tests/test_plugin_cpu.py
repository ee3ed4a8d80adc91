"""The plugin's CPU twin (C ABI, ctypes) against torch.ops.dflash2.select_path.

Ids and path indices must match exactly; scores to fp32 rounding (the summation order differs
from torch's einsum), exactly where every value is a small dyadic number. Needs
`bash plugins/build.sh`; skips with that hint when the library is missing, unless
DFLASH2_REQUIRE_PLUGINS=1 (CI), where a missing library fails.
"""

from __future__ import annotations

import ctypes
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
    out = torch.ops.dflash2.select_path(**{k: to_torch(v) for k, v in x.items()}, **attrs)
    return [o.numpy() for o in out]


def assert_matches(got, want, exact_scores: bool = False) -> None:
    np.testing.assert_array_equal(got[0], want[0], err_msg="draft_ids")
    np.testing.assert_array_equal(got[1], want[1], err_msg="path_index")
    assert got[2].dtype == np.float32 and got[2].shape == want[2].shape
    if exact_scores:
        np.testing.assert_array_equal(got[2], want[2], err_msg="path_scores")
    else:
        np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-5, err_msg="path_scores")
    assert len(got) == len(want) == len(C.OUTPUTS)
    assert got[3].dtype == np.float32 and got[3].shape == want[3].shape
    # expf and the summation order differ between implementations: a few ulp, never exact
    np.testing.assert_allclose(got[3], want[3], rtol=1e-5, atol=1e-7, err_msg="confidence")
    K = got[2].shape[-1]
    plain = [C.path_confidence(r.tolist(), int(i)) for r, i in zip(got[2].reshape(-1, K), got[1].ravel())]
    np.testing.assert_allclose(got[3].ravel(), plain, rtol=1e-5, atol=1e-7, err_msg="confidence vs contract")


def case_inputs(case) -> tuple[dict, dict]:
    _, B, S, K, R, V, tl, tc, mult, cap = case
    x = bench.random_inputs(B, S, K, R, V, codebook_dtype=tc, logits_dtype=tl, seed=B * 1000 + S * 100 + K)
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
         "succ_codebook": np.zeros((50, 3), np.float32)}
    want = {"draft_ids": [[11, 20, 31, 42]], "path_index": [[1, 0, 1, 2]],
            "path_scores": np.where(np.isnan(logits), -inf, logits),
            "confidence": [[1 / (2 + np.exp(-1) + np.exp(-2)), 0.0, 0.5, 0.5]]}  # tie; none scored; 2 x +inf; tie
    return x, {"top_k": 4, "rank": 3}, want


def test_hand_built_known_path():
    # P[anchor 0] . Q[3] = 3 beats Q[1] -> index 1 (token 3); P[3] = 0 and equal logits: tie -> index 0
    # (token 2); P[2] . Q = (1, 3) plus logits (2.5, 0) -> index 0 (token 1).
    P = np.array([[1, 0], [0, 1], [1, 1], [0, 0]], np.float32)
    Q = np.array([[1, 0], [0, 1], [0, 2], [3, 0]], np.float32)
    x = {"cand_logits": np.array([[[0, 0], [0, 0], [2.5, 0]]], np.float32),
         "cand_ids": np.array([[[1, 3], [2, 0], [1, 3]]], np.int32), "gate": np.ones((1, 3, 2), np.float32),
         "anchor": np.array([0], np.int32), "pred_codebook": P, "succ_codebook": Q}
    got = selector.select_path_cpu(**x, top_k=2, rank=2)
    np.testing.assert_array_equal(got[0], [[3, 2, 1]])
    np.testing.assert_array_equal(got[1], [[1, 0, 0]])
    np.testing.assert_array_equal(got[2], [[[0, 3], [0, 0], [3.5, 3]]])
    np.testing.assert_allclose(got[3], [[1 / (1 + np.exp(-3)), 0.5, 1 / (1 + np.exp(-0.5))]], rtol=1e-6)
    assert_matches(got, reference(x, top_k=2, rank=2), exact_scores=True)


def test_naive_float64_loop():
    x, attrs = case_inputs(("naive", 2, 5, 6, 40, 30, "float32", "float32", 1.3, 4.0))
    mult, cap = attrs["output_multiplier"], attrs["logit_softcap"]
    P, Q = x["pred_codebook"].astype(np.float64), x["succ_codebook"].astype(np.float64)
    got = selector.select_path_cpu(**x, **attrs)
    for b in range(2):
        prev_tok = x["anchor"][b]
        for s in range(5):
            u = np.tanh(x["cand_logits"][b, s] * mult / cap) * cap
            row = u + (P[prev_tok] * x["gate"][b, s]) @ Q[x["cand_ids"][b, s]].T
            idx = int(np.argmax(row))
            assert got[1][b, s] == idx and got[0][b, s] == x["cand_ids"][b, s, idx]
            np.testing.assert_allclose(got[2][b, s], row, rtol=1e-5, atol=1e-5)
            assert got[3][b, s] == pytest.approx(1 / np.exp(row - row.max()).sum(), rel=1e-5)
            prev_tok = x["cand_ids"][b, s, idx]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
    x, attrs = case_inputs(case)
    assert_matches(selector.select_path_cpu(**x, **attrs), reference(x, **attrs))


def test_special_values_nan_inf_ties():
    x, attrs, want = special_inputs()
    got = selector.select_path_cpu(**x, **attrs)
    np.testing.assert_array_equal(got[0], want["draft_ids"])
    np.testing.assert_array_equal(got[1], want["path_index"])
    np.testing.assert_array_equal(got[2][0], want["path_scores"][0])
    np.testing.assert_allclose(got[3], want["confidence"], rtol=1e-6)
    assert_matches(got, reference(x, **attrs), exact_scores=True)


def test_empty_batch():
    x, attrs = case_inputs(("empty", 1, 3, 4, 8, 10, "float32", "float32", 1.0, 0.0))
    x = {k: (v if k.endswith("codebook") else v[:0]) for k, v in x.items()}
    got = selector.select_path_cpu(**x, **attrs)
    assert [g.shape for g in got] == [(0, 3), (0, 3), (0, 3, 4), (0, 3)]


_GRID = st.integers(-16, 16).map(lambda i: np.float32(i / 4))  # exact in bf16/fp16; sums stay exact in fp32
_SPECIAL = st.sampled_from([np.float32(np.nan), np.float32(np.inf), np.float32(-np.inf)])


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
         "succ_codebook": draw(hnp.arrays(np.float32, (V, R), elements=_GRID))}
    x = {k: (v if v.dtype == np.int32 else as_dtype(v, tl if k == "cand_logits" else tc)) for k, v in x.items()}
    return x, {"top_k": K, "rank": R, "output_multiplier": draw(st.sampled_from([0.5, 1.0, 2.0]))}


def as_dtype(a: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        import ml_dtypes

        return a.astype(ml_dtypes.bfloat16)
    return a.astype(name)


@settings(max_examples=150, deadline=None, database=None)  # no .hypothesis/ folder in the repo
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
]


@pytest.mark.parametrize("bad", BAD, ids=[b[1] for b in BAD])
def test_rejects_like_reference(bad):
    change, needle = bad
    x, attrs = case_inputs(CASES[0])
    change(x, attrs)
    with pytest.raises(ValueError, match=needle) as ours:
        selector.select_path_cpu(**x, **attrs)
    with pytest.raises(ValueError, match=needle):
        reference(x, **attrs)
    assert C.OP_NAME in str(ours.value)


def test_rejects_out_of_range_ids():
    x, attrs = case_inputs(CASES[0])
    x["anchor"] = np.array([2000], np.int32)
    with pytest.raises(ValueError, match=r"anchor expected ids in \[0, 2000\)"):
        selector.select_path_cpu(**x, **attrs)


def test_c_abi_validates_arguments(twin):
    args = selector._Args(B=1, S=1, K=65, R=8, V=4, output_multiplier=1.0)
    err = ctypes.create_string_buffer(256)
    assert twin.dflash2_select_path_cpu(ctypes.byref(args), err, len(err)) == 1
    assert err.value.decode() == "DFlash2Selector: K (top_k) expected 1..64, found 65"
    args.K, args.logits_dtype = 4, 7
    assert twin.dflash2_check_select_args(ctypes.byref(args), err, len(err)) == 1
    assert "cand_logits dtype code expected 0..2, found 7" in err.value.decode()
    args.logits_dtype = 0
    assert twin.dflash2_check_select_args(ctypes.byref(args), err, len(err)) == 1
    assert "tensor cand_logits is NULL" in err.value.decode()


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
