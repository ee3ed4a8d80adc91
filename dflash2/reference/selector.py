"""The DFlash2 candidate selector as a torch custom op with the real fp32 reference body.

`torch.ops.dflash2.select_path` follows `dflash2.ops.contract` exactly (inputs, outputs,
attributes). `select_candidates` adds what precedes the op in the drafter: top-K of the
LM-head logits (ties: lowest token id) and the context gate.
"""

from __future__ import annotations

import torch

from dflash2.ops import contract as C

_QUALNAME = f"{C.TORCH_NAMESPACE}::{C.TORCH_OP_NAME}"


@torch.library.custom_op(_QUALNAME, mutates_args=())
def select_path(
    cand_logits: torch.Tensor,  # [B, S, K] float
    cand_ids: torch.Tensor,  # [B, S, K] int32
    gate: torch.Tensor,  # [B, S, R] float
    anchor: torch.Tensor,  # [B] int32
    pred_codebook: torch.Tensor,  # [V, R] float
    succ_codebook: torch.Tensor,  # [V, R] float
    uniforms: torch.Tensor,  # [B, S] fp32: one uniform per walked row (mode sample)
    temperature: torch.Tensor,  # [B] fp32: <= 0 walks greedily
    top_k: int,
    rank: int,
    output_multiplier: float = 1.0,
    logit_softcap: float = 0.0,
    mode: str = "greedy",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms, temperature,
                 top_k=top_k, rank=rank, output_multiplier=output_multiplier,
                 logit_softcap=logit_softcap, mode=mode)
    scores, ids = lattice(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, output_multiplier,
                          logit_softcap)
    T = temperature.float() if mode == "sample" else torch.zeros(cand_ids.shape[0])  # [B]
    return walk(scores, ids, uniforms, T)


def lattice(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, output_multiplier: float = 1.0,
            logit_softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk's score lattice [B, S, K(pred), K(cand)] (unary + low-rank pair scores) and the ids [B, S, K]."""
    B, S, K = cand_ids.shape
    unary = cand_logits.float() * output_multiplier  # [B, S, K]
    if logit_softcap > 0:
        unary = torch.tanh(unary / logit_softcap) * logit_softcap
    ids = cand_ids.long()
    pred_ids = torch.cat([anchor.long()[:, None, None].expand(B, 1, K), ids[:, :-1]], dim=1)  # [B, S, K]
    P = pred_codebook[pred_ids].float()  # [B, S, K, R]: gather first, then widen only the rows used
    Q = succ_codebook[ids].float()  # [B, S, K, R]
    pair = torch.einsum("bspr,bsr,bscr->bspc", P, gate.float(), Q)  # [B, S, K(pred), K(cand)]
    scores = unary[:, :, None, :] + pair  # [B, S, K, K]
    return torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")), ids


def walk(scores: torch.Tensor, ids: torch.Tensor, uniforms: torch.Tensor, T: torch.Tensor,
         picks: torch.Tensor | None = None):
    """The walk over a lattice (select_path's loop). picks [B, S] (-1: walk): rows whose candidate is given (a
    graph's own choice at a tie, judged by the validation); the walk continues from whatever was chosen."""
    B, S, K = ids.shape
    draft = torch.empty(B, S, dtype=torch.int32)
    index = torch.empty(B, S, dtype=torch.int32)
    rows = torch.empty(B, S, K, dtype=torch.float32)
    probs = torch.empty(B, S, K, dtype=torch.float32)
    prev = torch.zeros(B, dtype=torch.long)  # row 0: every predecessor is the anchor
    for s in range(S):
        row = scores[torch.arange(B), s, prev]  # [B, K]
        idx, q = walk_rows(row, T, uniforms[:, s].float())  # [B], [B, K]
        if picks is not None:
            forced = picks[:, s] >= 0
            idx = torch.where(forced, picks[:, s].long(), idx)
            q = torch.where(forced[:, None] & (T[:, None] <= 0), torch.nn.functional.one_hot(idx, K).float(), q)
        rows[:, s], probs[:, s] = row, q
        index[:, s] = idx.int()
        draft[:, s] = ids[torch.arange(B), s, idx].int()
        prev = idx  # the next row's predecessor is the candidate actually chosen
    return draft, index, rows, path_confidence(rows, index.long()), probs


@select_path.register_fake
def _(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms, temperature, top_k, rank,
      output_multiplier=1.0, logit_softcap=0.0, mode="greedy"):
    B, S, K = cand_ids.shape
    f32 = torch.float32
    return (cand_ids.new_empty(B, S), cand_ids.new_empty(B, S), cand_logits.new_empty(B, S, K, dtype=f32),
            cand_logits.new_empty(B, S, dtype=f32), cand_logits.new_empty(B, S, K, dtype=f32))


def walk_rows(row: torch.Tensor, T: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """contract.walk_row on a batch: row [B, K] fp32, T [B] (<= 0 or NaN: greedy), u [B] -> index [B], q [B, K]."""
    K, inf = row.shape[-1], float("inf")
    greedy = first_argmax(row)  # [B]
    m = row.max(dim=-1, keepdim=True).values  # [B, 1]
    safe_T = torch.where(T > 0, T, torch.ones_like(T))[:, None]  # [B, 1]; greedy rows ignore it
    e = torch.where(m == inf, (row == inf).float(), torch.exp((row - m) / safe_T))
    e = torch.where(row == -inf, torch.zeros_like(e), e)  # [B, K]
    cdf = torch.cumsum(e, dim=-1)  # [B, K], summed in order
    total = cdf[:, -1]  # [B]
    count = (cdf <= (u * total)[:, None]).sum(dim=-1)  # [B]
    pos = (e > 0).float()
    first, last = first_argmax(pos), K - 1 - first_argmax(pos.flip(-1))
    sampled = torch.minimum(torch.maximum(count, first), last)
    sample = (T > 0) & (m[:, 0] > -inf)  # all -inf rows: index 0 either way
    idx = torch.where(sample, sampled, torch.where(m[:, 0] > -inf, greedy, torch.zeros_like(greedy)))
    one_hot = torch.nn.functional.one_hot(idx, K).float()
    return idx, torch.where(sample[:, None], e / total[:, None], one_hot)


def walk_tie(row: torch.Tensor, T: float, u: float, a: int, b: int, atol: float, rtol: float) -> bool:
    """Whether one walked row [K] could pick index a or b under rounding of its scores: greedy (T <= 0), both
    within atol * max(1, rms(row)) + rtol * |max| of the row's maximum; sampled, the uniform u within atol of
    every cumulative-probability boundary between them (walk_rows' order)."""
    finite = row[torch.isfinite(row)]
    if T <= 0:
        if not finite.numel():
            return False
        m = float(finite.max())
        tol = atol * max(1.0, float(finite.square().mean().sqrt())) + rtol * abs(m)
        return bool(row[a] >= m - tol and row[b] >= m - tol)
    _, q = walk_rows(row[None].float(), torch.tensor([T]), torch.tensor([u]))
    cdf = torch.cumsum(q[0], dim=-1)  # [K]
    lo, hi = min(a, b), max(a, b)
    return bool(((cdf[lo:hi] - u).abs() <= atol).all())


def path_confidence(rows: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """[..., K] fp32 walked score rows, [...] walked index (None: the first argmax) -> [...]
    softmax(row)[index] at temperature 1 (contract.path_confidence: -inf max -> 0, +inf max ->
    1 / number of +inf where the walked entry is +inf, else 0)."""
    inf = float("inf")
    m = rows.max(dim=-1, keepdim=True).values  # [..., 1]
    picked = m[..., 0] if index is None else rows.gather(-1, index[..., None])[..., 0]  # [...]
    finite = torch.exp(picked - m[..., 0]) / torch.exp(rows - m).sum(dim=-1)  # NaN where m is infinite
    n_inf = (rows == inf).sum(dim=-1).clamp(min=1).float()
    m = m[..., 0]
    return torch.where(m == -inf, torch.zeros_like(finite),
                       torch.where(m == inf, (picked == inf).float() / n_inf, finite))


def first_argmax(row: torch.Tensor) -> torch.Tensor:
    """argmax over the last axis, ties -> lowest index, explicit so no backend detail leaks in."""
    best = row.max(dim=-1, keepdim=True).values  # [..., 1]
    hit = row == best  # all -inf rows: every entry hits -> index 0
    ar = torch.arange(row.shape[-1], device=row.device)
    return torch.where(hit, ar, row.shape[-1]).min(dim=-1).values


def check_inputs(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms, temperature,
                 **attrs) -> None:
    """The contract's shape / dtype / id rules (dflash2.ops.contract.check_io) on torch tensors."""
    t = dict(zip(C.input_names(), (cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms,
                                   temperature)))
    ranges = None
    if not torch.compiler.is_exporting():  # data-dependent: eager only
        ranges = {n: (int(t[n].min()), int(t[n].max())) for n in ("cand_ids", "anchor") if t[n].numel()}
    C.check_io({n: tuple(v.shape) for n, v in t.items()},
               {n: str(v.dtype).replace("torch.", "") for n, v in t.items()}, attrs, ranges)


def select_candidates(
    logits: torch.Tensor,  # [B, S, V] (or [B, S, N] over a draft vocabulary) LM-head logits of rows 1..S
    hidden: torch.Tensor,  # [B, S, H] final-normed drafter hidden states of the same rows
    anchor: torch.Tensor,  # [B] int
    hidden_projection: torch.Tensor,  # [R, H]
    pred_codebook: torch.Tensor,
    succ_codebook: torch.Tensor,
    top_k: int,
    output_multiplier: float = 1.0,
    logit_softcap: float = 0.0,
    id_map: torch.Tensor | None = None,  # [N] ascending token ids of the logits' last axis, None = identity
    uniforms: torch.Tensor | None = None,  # [B, S] fp32; None: zeros
    temperature: torch.Tensor | None = None,  # [B] fp32; None: 0 (greedy)
    mode: str = "greedy",
) -> dict[str, torch.Tensor]:
    """Top-K (stable: equal logits keep the lower token id first, as ONNX TopK) + gate + op."""
    cand_logits, cand_ids = topk_lowest_index(logits.float(), top_k)  # [B, S, K]
    if id_map is not None:  # ascending ids: the lowest-index tie rule still means the lowest token id
        cand_ids = id_map[cand_ids]
    gate = hidden.to(hidden_projection.dtype) @ hidden_projection.T  # [B, S, R]
    B, S = cand_ids.shape[:2]
    uniforms = torch.zeros(B, S) if uniforms is None else uniforms.float()
    temperature = torch.zeros(B) if temperature is None else temperature.float()
    draft, index, rows, conf, probs = select_path(
        cand_logits, cand_ids.int(), gate.to(pred_codebook.dtype), anchor.int(), pred_codebook,
        succ_codebook, uniforms, temperature, top_k=top_k, rank=pred_codebook.shape[1],
        output_multiplier=float(output_multiplier), logit_softcap=float(logit_softcap), mode=mode)
    return {"draft_ids": draft, "path_index": index, "path_scores": rows, "confidence": conf,
            "draft_probs": probs, "cand_ids": cand_ids.int(), "cand_logits": cand_logits}


def topk_lowest_index(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last axis, descending, equal values ordered by lower index (ONNX TopK rule).

    Under export the ONNX TopK node guarantees the rule (a stable sort has no ONNX translation). Eager torch.topk
    leaves tie order unspecified, so eager takes torch.topk of k + 1, the first k reordered by (value descending, index
    ascending). A row whose (k+1)-th value equals its k-th (a tie across the k-th place: which of the tied
    values made the k is unspecified) or that picks a NaN takes the stable sort. The same answer as sorting
    every row (tests/test_selector.py); over a 49k vocabulary the sort was ~30 s of the trainer's ~55 s
    held-out evaluation."""
    if torch.compiler.is_exporting():
        return torch.topk(x, k, dim=-1, largest=True, sorted=True)
    if k >= x.shape[-1] or x.numel() == 0:
        values, order = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[..., :k], order[..., :k]
    top, order = torch.topk(x, k + 1, dim=-1, largest=True, sorted=True)  # [..., k+1]: ties picked arbitrarily
    # the (k+1)-th value equal to the k-th: tied values cross the k-th place, which of them made the k is open
    crossing = (top[..., k] == top[..., k - 1]) | top[..., :k].isnan().any(-1)  # [...]
    order, perm = order[..., :k].sort(dim=-1)  # index ascending, then a stable sort by value: the rule inside the k
    values, perm2 = top[..., :k].gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    order = order.gather(-1, perm2)
    if bool(crossing.any()):  # which of the tied values made the k is unspecified there: sort those rows
        v, o = torch.sort(x[crossing], dim=-1, descending=True, stable=True)
        values[crossing], order[crossing] = v[..., :k], o[..., :k]
    return values, order
