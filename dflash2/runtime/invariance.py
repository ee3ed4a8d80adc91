"""Row invariance: does a k-row verify give, bit for bit, the logits that k 1-row decode steps give?

Greedy speculative decoding is lossless only if it does: the loop accepts a draft where the verify's argmax
equals it and takes the verify's argmax as the bonus token, so every verify row stands in for the decode step
target-only generation would have run at that position. Exact arithmetic guarantees it; a kernel that computes
a 1-row call and a k-row call differently (another summation order, another activation quantization path)
does not, and then a near tie can go either way. Measured on ONNX Runtime 1.32's CPU provider (AVX-512 VNNI,
SmolLM2-135M): fp32 (plain and fused-op graphs), int4 block 32 and int8 give bitwise-equal logits; int4
blocks 64 and 128 differ on every row (up to 2.2 in the logits) and their speculative output differed from
their own autoregressive output (docs/quantization.md).

The check runs the session exactly as generation does (the same binding, buffers, threads and in-place KV):
a greedy 1-row continuation of a fixed prompt, then the same tokens again as k-row verifies committed in full
for every k in 2..B (so KV rows written by one verify are read by the next), comparing every row's logits with
the 1-row pass bitwise. Kernels are chosen per CPU (MLAS dispatches on the instruction set), so the export
checks the machine it runs on; `dflash2-run --check-rows` checks the machine that deploys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dflash2 import manifest as mf

PROMPT_TOKENS, CONTINUATION = 24, 40


@dataclass
class RowCheck:
    rows: int = 0  # verify rows compared
    differing: int = 0  # of them, not bitwise equal to the 1-row decode's logits
    argmax_flips: int = 0  # of them, another argmax (a speculative output that would differ)
    max_abs: float = 0.0
    per_k: dict[int, dict] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.rows > 0 and self.differing == 0

    def failures(self, what: str) -> list[str]:
        if self.ok:
            return []
        bad = ", ".join(f"k={k}: {v['differing']}/{v['rows']}" for k, v in self.per_k.items() if v["differing"])
        return [f"{what}: a k-row verify is not bitwise equal to k 1-row decode steps ({self.differing} of "
                f"{self.rows} rows differ: {bad}; max |logit difference| {self.max_abs:.3g}; {self.argmax_flips} "
                f"rows take another argmax): this graph's kernels on this CPU are not row-count invariant, so "
                f"speculative output would not always equal target-only output (not lossless). On ONNX Runtime's "
                f"CPU provider int4 blocks 64 / 128 fail this and block 32, int8 and fp32 pass "
                f"(docs/quantization.md)"]


def _prompt(vocab: int, n: int) -> list[int]:
    # fixed ids spread over the vocabulary (no tokenizer needed); the continuation is the target's own argmax
    return [(7919 * i + 104_729) % min(vocab, 32_000) + 1 for i in range(n)]


def sizes(max_seq_len: int, block_size: int) -> tuple[int, int]:
    """(prompt tokens, continuation) that fit the session: PROMPT_TOKENS + CONTINUATION where they do, else
    shorter (the last verify reaches continuation + the kernel's spare row; a tiny export still checks k = 2)."""
    room = max_seq_len - 2  # the gqa kernel's spare row, and the last verify's bonus row
    prompt = max(1, min(PROMPT_TOKENS, room // 3))
    return prompt, max(0, min(CONTINUATION, room - prompt))


def check_rows(session, continuation: int = CONTINUATION) -> RowCheck:
    """Compare every k-row verify (k = 2..B) row with the 1-row decode at the same position, bitwise."""
    n_prompt, fits = sizes(session.max_seq_len, session.block_size)
    continuation = min(continuation, fits)
    prompt = _prompt(session.vocab_size, n_prompt)
    first = session.prefill(prompt)
    tokens, want = [int(first.ids[-1])], []
    for _ in range(continuation):  # the reference: one row per call, as target-only generation runs
        v = session.decode(tokens[-1])
        want.append(np.array(v.logits()[0], copy=True))
        tokens.append(int(v.ids[0]))
    out = RowCheck()
    for k in range(2, min(session.block_size, continuation) + 1):
        session.prefill(prompt)
        n = d = flips = 0
        for p in range(0, continuation - k + 1, k):  # rows p..p+k-1 predict tokens p+1..p+k, as in a verify
            logits = session.verify(tokens[p:p + k]).logits()[:k]
            for r in range(k):
                diff = np.abs(logits[r].astype(np.float64) - want[p + r])
                n, bad = n + 1, bool(diff.max() > 0 or np.any(np.isnan(logits[r]) != np.isnan(want[p + r])))
                d += bad
                flips += int(np.argmax(logits[r]) != np.argmax(want[p + r]))
                out.max_abs = max(out.max_abs, float(np.nan_to_num(diff, nan=np.inf).max()))
            session.commit(k)
        out.per_k[k] = {"rows": n, "differing": d}
        out.rows, out.differing, out.argmax_flips = out.rows + n, out.differing + d, out.argmax_flips + flips
    session.reset()
    return out


def validation(session, what: str = "target") -> mf.Validation:
    """The check as an export validation record (manifest.validation["target.rows"])."""
    r = check_rows(session)
    if r.rows == 0:
        return mf.Validation(ok=False, failures=[], skipped=f"max_seq_len {session.max_seq_len} leaves no room for "
                                                            "a 2-row verify after a prompt")
    steps = {"rows": r.rows, "differing": r.differing, "argmax_flips": r.argmax_flips, "max_abs": r.max_abs,
             "per_k": {str(k): v for k, v in r.per_k.items()}, "rule": "bitwise equal logits"}
    return mf.Validation(ok=r.ok, failures=r.failures(what), steps=steps)
