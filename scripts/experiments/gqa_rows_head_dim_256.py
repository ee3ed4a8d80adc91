"""Is ONNX Runtime's CPU GroupQueryAttention row-invariant at head_dim 256 (Qwen3.5's full-attention layers)?

    python scripts/experiments/gqa_rows_head_dim_256.py --threads 1 --tokens 100 --min-keys 0
    python scripts/experiments/gqa_rows_head_dim_256.py --threads 1 --tokens 100 --min-keys 65
    python scripts/experiments/gqa_rows_head_dim_256.py --threads 1 --tokens 300 --min-keys 65 --json OUT.json

One GroupQueryAttention node (8 query / 2 KV heads, head_dim 256, no rotary inside: Qwen3.5's partial rotary and
QK norm stay outside it), the per-layer in-place KV of dflash2's gqa graph (dflash2/export/gqa.py): each call
appends its rows at past_len and attends causally. The reference is one 1-row call per token; then the same tokens
as k-row calls (k = 2, 3, 4, 8, 16) and every row's output compared bitwise with the 1-row call's. Every call carries
the gqa graph's extra row (a copy of its last, dflash2/export/gqa.py); --min-keys M pads each call with more such
rows until past_len + rows >= M, so that the kernel's score GEMM always has more than 64 columns.

Why 64: MLAS's SGEMM (MlasSgemmOperation) picks its K stride from N: for K = 256 and N <= 64 it sums the 256
products in one pass, for N > 64 in two 128-wide passes added together. GQA's score GEMM has N = the call's keys, so a
verify that ends past 64 keys and the 1-row decode of one of its rows that ended at or before 64 round differently
(the same cause as the plain graph's 128-wide score chunks, docs/families/qwen3_5.md). Padded to at least 65 keys
every call takes the two-pass path; the rows added are causal (no real row sees them) and their K|V lands past the
valid rows, where the next call writes.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

NH, KV, HD = 8, 2, 256


def session(cap: int, threads: int):
    f = TensorProto.FLOAT
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total"], ["o", "ok", "ov"],
                            domain="com.microsoft", num_heads=NH, kv_num_heads=KV, scale=HD ** -0.5)
    io = [helper.make_tensor_value_info("q", f, [1, "s", NH * HD]), helper.make_tensor_value_info("k", f, [1, "s", KV * HD]),
          helper.make_tensor_value_info("v", f, [1, "s", KV * HD]), helper.make_tensor_value_info("pk", f, [1, KV, cap, HD]),
          helper.make_tensor_value_info("pv", f, [1, KV, cap, HD]),
          helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
          helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("o", "ok", "ov")]
    model = helper.make_model(helper.make_graph([node], "gqa", io, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--min-keys", type=int, default=0, help="pad every call to at least this many keys (0: none)")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args()
    cap = a.tokens + max(a.min_keys, 2) + 16
    s = session(cap, a.threads)
    rng = np.random.default_rng(0)
    Q = rng.standard_normal((a.tokens, NH * HD), dtype=np.float32) * 3
    K = rng.standard_normal((a.tokens, KV * HD), dtype=np.float32) * 3
    V = rng.standard_normal((a.tokens, KV * HD), dtype=np.float32)

    def call(pk, pv, past: int, rows: list[int]):
        idx = rows + [rows[-1]] * max(1, a.min_keys - past - len(rows))  # the extra row(s): copies of the last
        n = len(idx)
        o, pk, pv = s.run(None, {"q": Q[idx][None], "k": K[idx][None], "v": V[idx][None], "pk": pk, "pv": pv,
                                 "seqlens_k": np.array([past + n - 1], np.int32), "total": np.array(past + n, np.int32)})
        return o[0, :len(rows)], pk, pv

    zero = np.zeros((1, KV, cap, HD), np.float32)
    pk, pv, want = zero, zero.copy(), []
    for t in range(a.tokens - 1):
        o, pk, pv = call(pk, pv, t, [t])
        want.append(o[0])
    per_k, differing = {}, []
    for k in (2, 3, 4, 8, 16):
        pk, pv, t, bad, n = zero.copy(), zero.copy(), 0, 0, 0
        while t + k <= a.tokens - 1:
            o, pk, pv = call(pk, pv, t, list(range(t, t + k)))
            for r in range(k):
                n += 1
                if o[r].tobytes() != want[t + r].tobytes():
                    bad += 1
                    differing.append({"k": k, "row": t + r, "max_abs": float(np.abs(o[r] - want[t + r]).max())})
            t += k
        per_k[k] = {"rows": n, "differing": bad}
    out = {"threads": a.threads, "tokens": a.tokens, "min_keys": a.min_keys, "head_dim": HD, "per_k": per_k,
           "rows": sum(v["rows"] for v in per_k.values()), "differing": sum(v["differing"] for v in per_k.values()),
           "first_differing": differing[:10], "onnxruntime": ort.__version__}
    print(json.dumps({k: v for k, v in out.items() if k != "first_differing"}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
