"""The selector op against a plain Python-loop implementation, hand-built cases and edge rules."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dflash2.reference.selector as sel
from dflash2.ops import contract as C

op = torch.ops.dflash2.select_path


def naive(cand_logits, cand_ids, gate, anchor, P, Q, uniforms=None, temperature=None, mult=1.0, cap=0.0,
          mode="greedy"):
    """Scalar loops, straight from docs/algorithm.md section 4 (the row rule of mode sample:
    contract.walk_row, the one definition)."""
    B, S, K = cand_ids.shape
    R = gate.shape[-1]
    draft, index, rows, conf, probs = [], [], [], [], []
    for b in range(B):
        prev_id, prev_idx = int(anchor[b]), 0
        d, ix, rr, cc, qq = [], [], [], [], []
        for s in range(S):
            row = []
            pred = prev_id if s == 0 else int(cand_ids[b, s - 1, prev_idx])
            for c in range(K):
                u = float(cand_logits[b, s, c]) * mult
                if cap > 0:
                    u = math.tanh(u / cap) * cap
                cid = int(cand_ids[b, s, c])
                pair = sum(float(P[pred, r]) * float(gate[b, s, r]) * float(Q[cid, r]) for r in range(R))
                v = u + pair
                row.append(-math.inf if math.isnan(v) else v)
            best = 0
            for c in range(1, K):
                if row[c] > row[best]:
                    best = c
            q = [1.0 if c == best else 0.0 for c in range(K)]
            if mode == "sample" and temperature is not None:
                best, q = C.walk_row(row, float(temperature[b]), float(uniforms[b, s]), mode)
            d.append(int(cand_ids[b, s, best]))
            ix.append(best)
            rr.append(row)
            cc.append(C.path_confidence(row, best))
            qq.append(q)
            prev_idx = best  # the next predecessor is the candidate chosen
            prev_id = d[-1]
        draft.append(d), index.append(ix), rows.append(rr), conf.append(cc), probs.append(qq)
    return np.array(draft), np.array(index), np.array(rows), np.array(conf), np.array(probs)


def random_case(B, S, K, R, V, seed=0, dtype=torch.float32, temperature=0.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(S)]) for _ in range(B)])
    return (torch.randn(B, S, K, generator=g) * 3, ids.int(), torch.randn(B, S, R, generator=g).to(dtype),
            torch.randint(0, V, (B,), generator=g).int(), (torch.randn(V, R, generator=g) / R ** 0.25).to(dtype),
            (torch.randn(V, R, generator=g) / R ** 0.25).to(dtype), torch.rand(B, S, generator=g),
            torch.full((B,), float(temperature)))


def run(case, **attrs):
    B, S, K = case[1].shape
    return [t.numpy() for t in op(*case, top_k=K, rank=case[2].shape[-1], **attrs)]


def floats(case):
    return [t.float() if t.is_floating_point() else t for t in case]


@pytest.mark.parametrize("B,S,K,R,V", [(1, 7, 16, 256, 300), (3, 7, 16, 256, 300), (2, 1, 1, 1, 5),
                                       (1, 15, 5, 3, 40), (2, 4, 64, 8, 100)])
def test_matches_naive_loops(B, S, K, R, V):
    case = random_case(B, S, K, R, V, seed=B * 100 + S)
    d, i, r, c, q = run(case, output_multiplier=0.7, logit_softcap=4.0)
    nd, ni, nr, nc, nq = naive(*floats(case), mult=0.7, cap=4.0)
    np.testing.assert_array_equal(q, nq)  # one-hot at the walked index
    np.testing.assert_array_equal(d, nd)
    np.testing.assert_array_equal(i, ni)
    np.testing.assert_allclose(r, nr, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(c, nc, rtol=1e-4, atol=1e-6)
    assert c.dtype == np.float32 and ((0 < c) & (c <= 1)).all()


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), S=st.integers(1, 8), K=st.integers(1, 12), R=st.integers(1, 9), seed=st.integers(0, 999))
def test_property_matches_naive(B, S, K, R, seed):
    case = random_case(B, S, K, R, V=K + 7, seed=seed)
    d, i, _, c, _ = run(case)
    nd, ni, _, nc, _ = naive(*case)
    np.testing.assert_array_equal(d, nd)
    np.testing.assert_array_equal(i, ni)
    np.testing.assert_allclose(c, nc, rtol=1e-4, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), S=st.integers(1, 8), K=st.integers(1, 12), R=st.integers(1, 9), seed=st.integers(0, 999),
       T=st.sampled_from([0.0, 0.3, 0.5, 1.0, 2.0]))
def test_sample_mode_matches_naive_walk_row(B, S, K, R, seed, T):
    """Mode sample: index, q, rows and confidence of the torch op equal the plain loops over walk_row."""
    case = random_case(B, S, K, R, V=K + 7, seed=seed, temperature=T)
    d, i, r, c, q = run(case, mode="sample")
    nd, ni, nr, nc, nq = naive(*case, mode="sample")
    np.testing.assert_array_equal(i, ni)
    np.testing.assert_array_equal(d, nd)
    np.testing.assert_allclose(q, nq, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(c, nc, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)


def test_sample_mode_at_temperature_zero_is_the_greedy_walk():
    case = random_case(3, 7, 16, 32, 200, seed=4)
    for a, b in zip(run(case), run(case, mode="sample")):
        np.testing.assert_array_equal(a, b)  # bit-identical


def test_sampled_walk_follows_its_predecessor_and_draws_q():
    """Hand-built: row 0 sampled away from its argmax moves row 1's predecessor (and its scores);
    over many uniforms the indices of row 0 follow q."""
    ids = torch.tensor([[[3, 4], [5, 2]]], dtype=torch.int32)  # [1, S=2, K=2]
    logits = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    P, Q = torch.zeros(6, 1), torch.zeros(6, 1)
    P[4], Q[2] = torch.tensor([1.0]), torch.tensor([5.0])  # after 4, candidate 2 scores +5
    base = (logits, ids, torch.ones(1, 2, 1), torch.tensor([1], dtype=torch.int32), P, Q)
    q0 = [1 / (1 + math.exp(-2)), 1 - 1 / (1 + math.exp(-2))]  # softmax([1, 0] / 0.5)
    for u0, want in ((0.1, [0, 0]), (0.95, [1, 1])):  # u0 past q0[0] = 0.88: candidate 4, then 2 wins
        d, i, r, c, q = run((*base, torch.tensor([[u0, 0.1]]), torch.tensor([0.5])), mode="sample")
        assert i.tolist() == [want]
        np.testing.assert_allclose(q[0, 0], q0, rtol=1e-6)
    assert r[0, 1].tolist() == [1.0, 5.0]  # the last run's row 1 was scored from predecessor 4
    n = 4000
    u = torch.rand(n, 2, generator=torch.Generator().manual_seed(0))
    batch = [t.expand(n, *t.shape[1:]) if t.dim() == 3 or t.dim() == 1 and t.shape[0] == 1 and k == 3 else t
             for k, t in enumerate(base)]
    out = op(*batch, u, torch.full((n,), 0.5), top_k=2, rank=1, mode="sample")
    share = (out[1][:, 0] == 0).float().mean().item()
    assert abs(share - q0[0]) < 5 * math.sqrt(q0[0] * q0[1] / n)


def test_hand_built_path_is_known():
    """V=6, R=2. Unary favours candidate 0 everywhere; the codebooks make (anchor 1 -> 4 -> 2) win."""
    ids = torch.tensor([[[3, 4], [5, 2]]], dtype=torch.int32)  # [1, S=2, K=2]
    logits = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    gate = torch.ones(1, 2, 2)
    P = torch.zeros(6, 2)
    Q = torch.zeros(6, 2)
    P[1] = torch.tensor([1.0, 0.0])  # anchor 1 likes successors with Q[:,0]
    Q[4] = torch.tensor([2.0, 0.0])  # 4 after 1: pair 2.0 -> score 2.0 > 1.0
    P[4] = torch.tensor([0.0, 1.0])
    Q[2] = torch.tensor([0.0, 3.0])  # 2 after 4: 3.0 > 1.0
    d, i, r, c, _ = run((logits, ids, gate, torch.tensor([1], dtype=torch.int32), P, Q, torch.zeros(1, 2),
                         torch.zeros(1)))
    assert d.tolist() == [[4, 2]] and i.tolist() == [[1, 1]]
    np.testing.assert_allclose(r, [[[1.0, 2.0], [1.0, 3.0]]])
    # softmax of the walked candidate: e^2 / (e^1 + e^2), e^3 / (e^1 + e^3)
    np.testing.assert_allclose(c, [[1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-2))]], rtol=1e-6)
    # top-1 path (what DFlash v1 drafts) differs: the selector changed the path
    assert ids[0, :, 0].tolist() == [3, 5]


def test_nan_inf_and_ties():
    V, R = 10, 2
    ids = torch.tensor([[[1, 2, 3, 4]] * 4], dtype=torch.int32)
    zero = torch.zeros(V, R)
    logits = torch.tensor([[[0.5, float("nan"), 0.5, 0.1],  # NaN is -inf; tie 0.5/0.5 -> lowest index 0
                            [1.0, float("inf"), 2.0, float("inf")],  # first +inf wins
                            [-float("inf")] * 4,  # all -inf -> index 0
                            [float("nan")] * 4]])  # all NaN -> all -inf -> index 0
    d, i, r, c, _ = run((logits, ids, torch.zeros(1, 4, R), torch.tensor([0], dtype=torch.int32), zero, zero,
                         torch.zeros(1, 4), torch.zeros(1)))
    assert i.tolist() == [[0, 1, 0, 0]]
    assert np.isneginf(r[0, 0, 1]) and np.isneginf(r[0, 3]).all() and not np.isnan(r).any()
    # tie of two at 0.5 (NaN entry counts 0): e^.5 / (2 e^.5 + e^.1); two +inf -> 1/2; nothing scored -> 0
    np.testing.assert_allclose(c[0], [1 / (2 + math.exp(-0.4)), 0.5, 0.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("row,index,want", [([0.0], 0, 1.0), ([1.0, 1.0, 1.0, 1.0], 0, 0.25),
                                            ([3.0, -math.inf], 0, 1.0), ([-math.inf, -math.inf], 0, 0.0),
                                            ([math.inf, 2.0, math.inf], 0, 0.5),
                                            ([0.0, math.log(3.0)], 1, 0.75)])
def test_contract_confidence_rule(row, index, want):
    assert C.path_confidence(row, index) == pytest.approx(want, rel=1e-12)
    got = sel.path_confidence(torch.tensor([row], dtype=torch.float32))
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_softcap_and_multiplier_change_unary():
    case = random_case(1, 3, 4, 2, 20, seed=3)
    _, _, r1, _, _ = run(case, output_multiplier=1.0)
    _, _, r2, _, _ = run(case, output_multiplier=2.0, logit_softcap=1.0)
    assert np.abs(r2).max() <= 1.0 + np.abs(r1 - case[0].numpy()).max() + 1e-4  # unary capped at 1
    assert not np.allclose(r1, r2)


def test_low_precision_codebooks_computed_in_fp32():
    case = random_case(2, 7, 16, 64, 200, seed=5, dtype=torch.bfloat16)
    d, i, _, c, _ = run(case)
    nd, ni, _, nc, _ = naive(*floats(case))
    np.testing.assert_array_equal(d, nd)
    np.testing.assert_allclose(c, nc, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mutate,match", [
    (lambda c: (c[0], c[1].long(), *c[2:]), "cand_ids dtype"),
    (lambda c: (c[0][:, :, :3], *c[1:]), "dim K"),
    (lambda c: (*c[:2], c[2][:, :, :1], *c[3:]), "dim R"),
    (lambda c: (*c[:4], c[4].half(), *c[5:]), "share a dtype"),
    (lambda c: (*c[:3], c[3][None], *c[4:]), "anchor expected rank 1"),
    (lambda c: (c[0], c[1] + 20, *c[2:]), r"cand_ids expected ids in \[0, 20\)"),
])
def test_bad_inputs_are_rejected(mutate, match):
    case = random_case(1, 3, 4, 2, 20)
    with pytest.raises(ValueError, match=match):
        op(*mutate(case), top_k=4, rank=2)


@pytest.mark.parametrize("attrs,match", [({"top_k": 65, "rank": 2}, "top_k expected 1..64"),
                                         ({"top_k": 4, "rank": 0}, "rank expected"),
                                         ({"top_k": 4, "rank": 2, "output_multiplier": -1.0}, "output_multiplier"),
                                         ({"top_k": 4, "rank": 2, "mode": "viterbi"}, "mode expected")])
def test_bad_attributes_are_rejected(attrs, match):
    with pytest.raises(ValueError, match=match):
        C.check_attributes(attrs)


def test_topk_ties_keep_lower_token_id():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    v, i = sel.topk_lowest_index(x, 3)
    assert i.tolist() == [[1, 2, 4]]


@pytest.mark.parametrize("levels", [3, 8, 1000, None])  # few distinct values: ties everywhere; None: continuous
@pytest.mark.parametrize("k", [1, 5, 8, 63, 64])
def test_topk_lowest_index_equals_the_stable_sort(levels, k):
    """The topk path (picks reordered, rows whose ties cross the k-th place re-sorted) against sorting every row."""
    g = torch.Generator().manual_seed(k * 7 + (levels or 0))
    shape = (3, 5, 64)
    x = torch.rand(shape, generator=g) if levels is None else torch.randint(0, levels, shape, generator=g).float()
    x[0, 0, 5] = float("-inf")
    x[1, 1] = 0.0  # a whole row tied
    if levels is None:
        x[2, 2, 3] = float("nan")
    want_v, want_i = torch.sort(x, dim=-1, descending=True, stable=True)
    v, i = sel.topk_lowest_index(x, k)
    assert i.tolist() == want_i[..., :k].tolist()
    torch.testing.assert_close(v, want_v[..., :k], equal_nan=True)
    assert sel.topk_lowest_index(x, 64)[1].tolist() == want_i.tolist()  # k = the whole axis: the sort itself
    assert sel.topk_lowest_index(x[:0], k)[0].shape == (0, 5, min(k, 64))
