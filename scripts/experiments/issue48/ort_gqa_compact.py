import numpy as np, onnxruntime as ort
from onnx import helper, TensorProto
nh, kv, hd, W, C, B = 4, 2, 16, 5, 12, 4          # C >= 2(W-1) + B: the moved rows never overlap their target
rng = np.random.default_rng(0); N = 80
Q = rng.standard_normal((N, nh, hd)).astype(np.float32); K = rng.standard_normal((N, kv, hd)).astype(np.float32); V = rng.standard_normal((N, kv, hd)).astype(np.float32)
sink = rng.standard_normal(nh).astype(np.float32)
inv = 1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd)); ang = np.arange(4096)[:, None] * inv[None]
cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
def rope(x, pos):
    c, s = cos[pos][:, None], sin[pos][:, None]; a, b = x[..., :hd // 2], x[..., hd // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], -1)
T = TensorProto.FLOAT; vi = lambda n, s, t=T: helper.make_tensor_value_info(n, t, s)
node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total", "cos", "sin", "position_ids", "", "sink"],
                        ["o", "ok", "ov"], domain="com.microsoft", num_heads=nh, kv_num_heads=kv, local_window_size=W, do_rotary=1)
from onnx import numpy_helper
g = helper.make_graph([node], "g", [vi("q", [1, None, nh * hd]), vi("k", [1, None, kv * hd]), vi("v", [1, None, kv * hd]),
                       vi("pk", [1, kv, C, hd]), vi("pv", [1, kv, C, hd]), vi("seqlens_k", [1], TensorProto.INT32), vi("total", [], TensorProto.INT32),
                       vi("position_ids", [1, None], TensorProto.INT64)],
                      [vi("o", [1, None, nh * hd]), vi("ok", [1, kv, C, hd]), vi("ov", [1, kv, C, hd])],
                      [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin"), numpy_helper.from_array(sink, "sink")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]); m.ir_version = 10
so = ort.SessionOptions(); so.intra_op_num_threads = 1
s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
def ref(P, n):   # real positions, causal window q - k < W, sink
    qp, kp = np.arange(P, P + n), np.arange(P + n)
    q, k = rope(Q[P:P + n], qp), np.repeat(rope(K[:P + n], kp), nh // kv, 1); v = np.repeat(V[:P + n], nh // kv, 1)
    sc = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd); d = qp[:, None] - kp[None]
    sc = np.where(((d >= 0) & (d < W))[None], sc, -np.inf); mx = np.maximum(sc.max(-1, keepdims=True), sink[:, None, None])
    e = np.exp(sc - mx); pr = e / (e.sum(-1, keepdims=True) + np.exp(sink[:, None, None] - mx))
    return np.einsum("hqk,khd->qhd", pr, v).reshape(n, -1)
buf_k = np.zeros((1, kv, C, hd), np.float32); buf_v = np.zeros_like(buf_k)   # ONE buffer, bound as past and present
P, Tv, log, worst, compactions = 0, 0, [], 0.0, 0
def run(P, Tv, n):
    feed = {"q": Q[P:P + n].reshape(1, n, -1), "k": K[P:P + n].reshape(1, n, -1), "v": V[P:P + n].reshape(1, n, -1), "pk": buf_k, "pv": buf_v,
            "seqlens_k": np.array([Tv + n - 1], np.int32), "total": np.array(Tv + n, np.int32), "position_ids": np.arange(P, P + n)[None]}
    o, ok, ov = s.run(None, feed); buf_k[...] = ok; buf_v[...] = ov    # in place, as the gqa-shared binding does
    return o[0]
rng2 = np.random.default_rng(3)
o = run(0, 0, 3); P = Tv = 3; worst = np.abs(o - ref(0, 3)).max()
while P + B + 1 < N:
    if Tv + B > C:   # the runtime's compaction, only at a commit point: the last W-1 rows to the front
        buf_k[:, :, :W - 1] = buf_k[:, :, Tv - W + 1:Tv].copy(); buf_v[:, :, :W - 1] = buf_v[:, :, Tv - W + 1:Tv].copy(); Tv = W - 1; compactions += 1
    o = run(P, Tv, B)                          # a verify of B rows
    worst = max(worst, np.abs(o - ref(P, B)).max())
    a = int(rng2.integers(1, B + 1)); P += a; Tv += a   # commit a rows: rollback = a smaller length
print(f"virtual-length GQA (C={C}, W={W}, B={B}, sinks): {P} tokens, {compactions} runtime compactions, max |diff| vs reference {worst:.2e}")
