import torch, numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto, numpy_helper
from safetensors.torch import load_file
torch.set_num_threads(1)
FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
sd = load_file("/tmp/i48/oss_mxfp4/model.safetensors"); p = "model.layers.0.mlp."
E, H, I, K = 4, 64, 64, 2
gb, gs = sd[p + "experts.gate_up_proj_blocks"].numpy(), sd[p + "experts.gate_up_proj_scales"].numpy()
db, ds = sd[p + "experts.down_proj_blocks"].numpy(), sd[p + "experts.down_proj_scales"].numpy()
gbias, dbias = sd[p + "experts.gate_up_proj_bias"].numpy(), sd[p + "experts.down_proj_bias"].numpy()
rw, rb = sd[p + "router.weight"].numpy(), sd[p + "router.bias"].numpy()
def deq(b, s):
    c = np.stack([b & 15, b >> 4], -1).reshape(*b.shape[:-1], 32)
    return (FP4[c] * np.exp2(s.astype(np.int32) - 127).astype(np.float32)[..., None]).reshape(b.shape[0], b.shape[1], -1).astype(np.float32)   # [E, out, in]
Wg, Wd = deq(gb, gs), deq(db, ds)
rng = np.random.default_rng(0); x = rng.standard_normal((5, H)).astype(np.float32)
def ref(x):
    logits = x @ rw.T + rb; out = np.zeros_like(x)
    for t in range(x.shape[0]):
        idx = np.argsort(-logits[t])[:K]; w = np.exp(logits[t, idx] - logits[t, idx].max()); w /= w.sum()
        for j, e in enumerate(idx):
            gu = Wg[e] @ x[t] + gbias[e]; g, u = np.minimum(gu[::2], 7.0), np.clip(gu[1::2], -7, 7)
            out[t] += w[j] * (Wd[e] @ (g / (1 + np.exp(-1.702 * g)) * (u + 1)) + dbias[e])
    return out
attrs = dict(k=K, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0, normalize_routing_weights=1)
def run(node, inits):
    g = helper.make_graph([helper.make_node("MatMul", ["x", "rwT"], ["rl0"]), helper.make_node("Add", ["rl0", "rb"], ["router"]), node], "moe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, H])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, H])],
        [numpy_helper.from_array(rw.T.copy(), "rwT"), numpy_helper.from_array(rb, "rb")] + inits)
    mdl = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]); mdl.ir_version = 10
    so = ort.SessionOptions(); so.intra_op_num_threads = 1
    return ort.InferenceSession(mdl.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
r = ref(x)
# 1) MoE, fp32 weights (dequantized): the plain / fp32 route
moe = helper.make_node("MoE", ["x", "router", "w1", "b1", "w2", "b2"], ["y"], domain="com.microsoft", **attrs)
y = run(moe, [numpy_helper.from_array(Wg, "w1"), numpy_helper.from_array(gbias, "b1"), numpy_helper.from_array(Wd, "w2"), numpy_helper.from_array(dbias, "b2")])
print("MoE fp32  max|ort - ref|", np.abs(y - r).max(), "scale", np.abs(r).max())
# 2) QMoE quant_type fp4: the checkpoint's own MXFP4 bytes, reinterpreted (blocks -> [E, N, K/2], scales -> float8e8m0)
def e8m0(name, s):
    t = helper.make_tensor(name, TensorProto.FLOAT8E8M0, s.shape, s.tobytes(), raw=True); return t
try:
    q = helper.make_node("QMoE", ["x", "router", "w1", "s1", "b1", "w2", "s2", "b2", "", "", "", "", "", "", "", "g1", "g2"], ["y"],
                         domain="com.microsoft", quant_type="fp4", expert_weight_bits=4, block_size=32, **attrs)
    y = run(q, [numpy_helper.from_array(gb.reshape(E, 2 * I, H // 2), "w1"), e8m0("s1", gs), numpy_helper.from_array(gbias, "b1"),
                numpy_helper.from_array(db.reshape(E, H, I // 2), "w2"), e8m0("s2", ds), numpy_helper.from_array(dbias, "b2"),
                numpy_helper.from_array(np.ones(E, np.float32), "g1"), numpy_helper.from_array(np.ones(E, np.float32), "g2")])
    print("QMoE fp4  max|ort - ref|", np.abs(y - r).max())
except Exception as e:
    print("QMoE fp4 failed:", str(e)[:600])
# 3) QMoE int4 (block 32, symmetric zero point 8): the MXFP4 values are not int4 grid values -> requantized
def f32s(s): return (np.exp2(s.astype(np.int32) - 127)).astype(np.float32)
for label, mk_s, glob in (("fp4 float scales + global", lambda n, s: numpy_helper.from_array(f32s(s), n), True),
                          ("fp4 e8m0 scales, no global", e8m0, False)):
    try:
        ins = ["x", "router", "w1", "s1", "b1", "w2", "s2", "b2"] + (["", "", "", "", "", "", "", "g1", "g2"] if glob else [])
        q = helper.make_node("QMoE", ins, ["y"], domain="com.microsoft", quant_type="fp4", expert_weight_bits=4, block_size=32, **attrs)
        inits = [numpy_helper.from_array(gb.reshape(E, 2 * I, H // 2), "w1"), mk_s("s1", gs), numpy_helper.from_array(gbias, "b1"),
                 numpy_helper.from_array(db.reshape(E, H, I // 2), "w2"), mk_s("s2", ds), numpy_helper.from_array(dbias, "b2")]
        if glob: inits += [numpy_helper.from_array(np.ones(E, np.float32), "g1"), numpy_helper.from_array(np.ones(E, np.float32), "g2")]
        y = run(q, inits); print("QMoE", label, "max|ort - ref|", np.abs(y - r).max())
    except Exception as e:
        print("QMoE", label, "failed:", str(e).splitlines()[0][:300])
# int8 block-exact: E2M1 x 2^(e-127) == int8 code k * (0.5 * 2^(e-127)), k = 2*value in [-12, 12]; zero point 128 (default)
def to_int8(b, s):
    c = np.stack([b & 15, b >> 4], -1).reshape(*b.shape[:-1], 32)
    k = (2 * FP4[c]).astype(np.int32) + 128                                  # [E, N, K/32, 32] in [116, 140]
    return k.reshape(b.shape[0], b.shape[1], -1).astype(np.uint8), (0.5 * f32s(s)).astype(np.float32)
try:
    w1, s1 = to_int8(gb, gs); w2, s2 = to_int8(db, ds)
    q = helper.make_node("QMoE", ["x", "router", "w1", "s1", "b1", "w2", "s2", "b2"], ["y"], domain="com.microsoft", quant_type="int",
                         expert_weight_bits=8, block_size=32, **attrs)
    y = run(q, [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(s1, "s1"), numpy_helper.from_array(gbias, "b1"),
                numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(s2, "s2"), numpy_helper.from_array(dbias, "b2")])
    print("QMoE int8 block-exact  max|ort - ref|", np.abs(y - r).max())
except Exception as e:
    print("QMoE int8 failed:", str(e).splitlines()[0][:300])
# int4 (block 32, zero point 8) requantized from the dequantized weights: lossy
def to_int4(W):
    E_, N, Kd = W.shape; g = W.reshape(E_, N, Kd // 32, 32); sc = np.abs(g).max(-1) / 7.0; sc[sc == 0] = 1
    k = np.clip(np.round(g / sc[..., None]), -8, 7).astype(np.int32) + 8
    packed = (k[..., 0::2] | (k[..., 1::2] << 4)).astype(np.uint8).reshape(E_, N, Kd // 2)
    return packed, sc.astype(np.float32), (k - 8) * sc[..., None]
try:
    w1, s1, _ = to_int4(Wg); w2, s2, _ = to_int4(Wd)
    q = helper.make_node("QMoE", ["x", "router", "w1", "s1", "b1", "w2", "s2", "b2"], ["y"], domain="com.microsoft", quant_type="int",
                         expert_weight_bits=4, block_size=32, **attrs)
    y = run(q, [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(s1, "s1"), numpy_helper.from_array(gbias, "b1"),
                numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(s2, "s2"), numpy_helper.from_array(dbias, "b2")])
    print("QMoE int4 requantized  max|ort - ref|", np.abs(y - r).max())
except Exception as e:
    print("QMoE int4 failed:", str(e).splitlines()[0][:300])
# int4: compare with the reference over its own dequantized weights (lossless w.r.t. the quantized target)
w1, s1, Wg4 = to_int4(Wg); w2, s2, Wd4 = to_int4(Wd)
Wg_s, Wd_s = Wg, Wd
Wg, Wd = Wg4.reshape(Wg.shape).astype(np.float32), Wd4.reshape(Wd.shape).astype(np.float32); r4 = ref(x)
q = helper.make_node("QMoE", ["x", "router", "w1", "s1", "b1", "w2", "s2", "b2"], ["y"], domain="com.microsoft", quant_type="int",
                     expert_weight_bits=4, block_size=32, **attrs)
y = run(q, [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(s1, "s1"), numpy_helper.from_array(gbias, "b1"),
            numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(s2, "s2"), numpy_helper.from_array(dbias, "b2")])
print("QMoE int4 vs its own dequantized reference  max|ort - ref4|", np.abs(y - r4).max(), " (ref4 vs bf-exact ref:", np.abs(r4 - r).max(), ")")
# fp4 with float scales: is the nibble order swapped?
Wg, Wd = Wg_s, Wd_s
def deq_swapped(b, s):
    c = np.stack([b >> 4, b & 15], -1).reshape(*b.shape[:-1], 32)
    return (FP4[c] * f32s(s)[..., None]).reshape(b.shape[0], b.shape[1], -1).astype(np.float32)
Wg, Wd = deq_swapped(gb, gs), deq_swapped(db, ds); rs = ref(x); Wg, Wd = Wg_s, Wd_s
q = helper.make_node("QMoE", ["x", "router", "w1", "s1", "b1", "w2", "s2", "b2", "", "", "", "", "", "", "", "g1", "g2"], ["y"], domain="com.microsoft",
                     quant_type="fp4", expert_weight_bits=4, block_size=32, **attrs)
y = run(q, [numpy_helper.from_array(gb.reshape(E, 2 * I, H // 2), "w1"), numpy_helper.from_array(f32s(gs), "s1"), numpy_helper.from_array(gbias, "b1"),
            numpy_helper.from_array(db.reshape(E, H, I // 2), "w2"), numpy_helper.from_array(f32s(ds), "s2"), numpy_helper.from_array(dbias, "b2"),
            numpy_helper.from_array(np.ones(E, np.float32), "g1"), numpy_helper.from_array(np.ones(E, np.float32), "g2")])
print("QMoE fp4 float scales vs swapped-nibble ref", np.abs(y - rs).max())
def run_x(node, inits, xx):
    global x; old = x; x = xx
    try: return run(node, inits)
    finally: x = old
def inv(label, node, inits):
    full = run_x(node, inits, x)
    rows = np.concatenate([run_x(node, inits, x[i:i + 1]) for i in range(x.shape[0])])
    pair = np.concatenate([run_x(node, inits, x[i:i + 2]) for i in range(0, 4, 2)])
    print(f"row invariance {label}: 5-row vs 1-row bitwise equal: {np.array_equal(full, rows)} (max {np.abs(full-rows).max():.3g}); 2-row vs 1-row: {np.array_equal(pair, rows[:4])}")
moe = helper.make_node("MoE", ["x", "router", "w1", "b1", "w2", "b2"], ["y"], domain="com.microsoft", **attrs)
inv("MoE fp32", moe, [numpy_helper.from_array(Wg, "w1"), numpy_helper.from_array(gbias, "b1"), numpy_helper.from_array(Wd, "w2"), numpy_helper.from_array(dbias, "b2")])
for bits, (w1_, s1_), (w2_, s2_) in ((4, to_int4(Wg)[:2], to_int4(Wd)[:2]), (8, to_int8(gb, gs), to_int8(db, ds))):
    q = helper.make_node("QMoE", ["x", "router", "w1", "s1", "b1", "w2", "s2", "b2"], ["y"], domain="com.microsoft", quant_type="int",
                         expert_weight_bits=bits, block_size=32, **attrs)
    inv(f"QMoE int{bits}", q, [numpy_helper.from_array(w1_, "w1"), numpy_helper.from_array(s1_, "s1"), numpy_helper.from_array(gbias, "b1"),
                     numpy_helper.from_array(w2_, "w2"), numpy_helper.from_array(s2_, "s2"), numpy_helper.from_array(dbias, "b2")])
q = helper.make_node("QMoE", ["x", "router", "w1", "s1", "b1", "w2", "s2", "b2"], ["y"], domain="com.microsoft", quant_type="int",
                     expert_weight_bits=4, block_size=32, accuracy_level=4, **attrs)
w1_, s1_, _ = to_int4(Wg); w2_, s2_, _ = to_int4(Wd)
ins4 = [numpy_helper.from_array(w1_, "w1"), numpy_helper.from_array(s1_, "s1"), numpy_helper.from_array(gbias, "b1"),
        numpy_helper.from_array(w2_, "w2"), numpy_helper.from_array(s2_, "s2"), numpy_helper.from_array(dbias, "b2")]
inv("QMoE int4 accuracy_level 4", q, ins4)
