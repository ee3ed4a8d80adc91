import numpy as np, onnxruntime as ort
from onnx import helper, TensorProto, numpy_helper
nh, kv, hd = 4, 2, 16
rng = np.random.default_rng(0)
def sess(W=-1, sink=False, window_cache=0, causal=1):
    ins = ["q", "k", "v", "pk", "pv", "seqlens_k", "total"]
    if sink: ins += ["", "", "", "", "sink"]
    attrs = dict(num_heads=nh, kv_num_heads=kv, local_window_size=W)
    if window_cache: attrs["sliding_window_cache"] = 1
    if causal != 1: attrs["causal"] = causal
    node = helper.make_node("GroupQueryAttention", ins, ["o", "ok", "ov"], domain="com.microsoft", **attrs)
    T = TensorProto.FLOAT
    vi = lambda n, s, t=T: helper.make_tensor_value_info(n, t, s)
    g = helper.make_graph([node], "g", [vi("q", [1, None, nh * hd]), vi("k", [1, None, kv * hd]), vi("v", [1, None, kv * hd]),
                           vi("pk", [1, kv, None, hd]), vi("pv", [1, kv, None, hd]), vi("seqlens_k", [1], TensorProto.INT32),
                           vi("total", [], TensorProto.INT32)] + ([vi("sink", [nh])] if sink else []),
                          [vi("o", [1, None, nh * hd]), vi("ok", [1, kv, None, hd]), vi("ov", [1, kv, None, hd])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]); m.ir_version = 10
    so = ort.SessionOptions(); so.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
def ref(q, K, V, qpos, kpos, W=None, sink=None, incl=False):
    # q [n, nh, hd], K/V [T, kv, hd]; visible: k <= q and (q - k < W) [or <= W if incl]
    g = nh // kv; Kh = np.repeat(K, g, 1); Vh = np.repeat(V, g, 1)
    s = np.einsum("qhd,khd->hqk", q, Kh) / np.sqrt(hd)
    d = qpos[:, None] - kpos[None, :]; ok = d >= 0
    if W is not None: ok &= (d <= W) if incl else (d < W)
    s = np.where(ok[None], s, -np.inf)
    mx = s.max(-1, keepdims=True)
    if sink is not None: mx = np.maximum(mx, sink[:, None, None])
    e = np.exp(s - mx); den = e.sum(-1, keepdims=True)
    if sink is not None: den = den + np.exp(sink[:, None, None] - mx)
    return np.einsum("hqk,khd->qhd", e / den, Vh).reshape(len(qpos), nh * hd)
T_total, W, cap = 40, 5, 48
Q = rng.standard_normal((T_total, nh, hd)).astype(np.float32); K = rng.standard_normal((T_total, kv, hd)).astype(np.float32); V = rng.standard_normal((T_total, kv, hd)).astype(np.float32)
sink = rng.standard_normal(nh).astype(np.float32)
def step(s, P, n, buf_k, buf_v, extra=None):
    feed = {"q": Q[P:P + n].reshape(1, n, -1), "k": K[P:P + n].reshape(1, n, -1), "v": V[P:P + n].reshape(1, n, -1),
            "pk": buf_k, "pv": buf_v, "seqlens_k": np.array([P + n - 1], np.int32), "total": np.array(P + n, np.int32)}
    if extra is not None: feed["sink"] = extra
    return s.run(None, feed)
# 1) local_window_size semantics, shared full-length buffer
for label, sk in (("no sink", None), ("head_sink", sink)):
    s = sess(W=W, sink=sk is not None)
    bk = np.zeros((1, kv, cap, hd), np.float32); bv = np.zeros_like(bk)
    bk[0, :, :12] = K[:12].transpose(1, 0, 2); bv[0, :, :12] = V[:12].transpose(1, 0, 2)
    o = step(s, 12, 4, bk, bv, sk)[0][0]
    qpos = np.arange(12, 16); kpos = np.arange(16)
    for incl in (False, True):
        r = ref(Q[12:16], K[:16], V[:16], qpos, kpos, W, sk, incl)
        print(f"{label}: local_window_size={W} vs visible q-k {'<=' if incl else '<'} {W}: max diff {np.abs(o - r).max():.2e}")
# 2) windowed cache (sliding_window_cache=1, capacity C >= W): steps, and rollback by a smaller seqlens_k
C = 8
s = sess(W=W, window_cache=1)
bk = np.zeros((1, kv, C, hd), np.float32); bv = np.zeros_like(bk)
P, errs = 0, []
for n in (6, 1, 3, 1, 4, 2, 1):   # the physical layout is L(T) rows at [0, L), compaction by G = C - W + 1
    o, bk, bv = step(s, P, n, bk, bv)
    r = ref(Q[P:P + n], K[:P + n], V[:P + n], np.arange(P, P + n), np.arange(P + n), W)
    errs.append(np.abs(o[0] - r).max()); P += n
print("windowed cache C=%d W=%d: per-step max diff" % (C, W), ["%.1e" % e for e in errs], "T =", P)
def L(T, C=C, W=W):
    G = C - W + 1
    return T if T <= C else T - G * -(-(T - C) // G)
print("L(T) for T=1..24:", [L(t) for t in range(1, 25)])
# rollback: a verify of 4 rows at T=P, then accept a rows, re-run from P + a with the same buffer
base_k, base_v, P0 = bk.copy(), bv.copy(), P
for a in range(1, 5):
    o, k1, v1 = step(s, P0, 4, base_k.copy(), base_v.copy())   # the verify
    T_after = P0 + a
    exact = L(T_after) == L(P0 + 4) - (4 - a)
    o2, _, _ = step(s, T_after, 1, k1, v1)                    # next decode step from the rolled-back length
    r = ref(Q[T_after:T_after + 1], K[:T_after + 1], V[:T_after + 1], np.arange(T_after, T_after + 1), np.arange(T_after + 1), W)
    print(f"verify 4 at T={P0}, accept {a}: L(T-k)==L(T)-k: {exact}; next step max diff {np.abs(o2[0] - r).max():.2e}")
# a longer run: verify 4 then accept a (random), decode from there, over many rounds; what breaks and when
rng2 = np.random.default_rng(1); bk = np.zeros((1, kv, C, hd), np.float32); bv = np.zeros_like(bk)
o, bk, bv = step(s, 0, 3, bk, bv); P = 3; bad = []
while P + 5 <= T_total:
    a = int(rng2.integers(1, 5)); o, k1, v1 = step(s, P, 4, bk.copy(), bv.copy())
    exact = L(P + a) == L(P + 4) - (4 - a)
    bk, bv = k1, v1; P += a
    o2, bk2, bv2 = step(s, P, 1, bk.copy(), bv.copy())
    r = ref(Q[P:P + 1], K[:P + 1], V[:P + 1], np.arange(P, P + 1), np.arange(P + 1), W)
    bad.append((P, a, exact, float(np.abs(o2[0] - r).max()) < 1e-5))
print("(T after commit, accepted, L-rule exact, next step correct):", bad)
