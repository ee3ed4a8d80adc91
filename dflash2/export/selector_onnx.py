"""The selector op in ONNX: schema, the single custom node, and its portable function body.

Two flavours of every graph that holds the node:
- "tensorrt": the bare node, no local function, so TensorRT's parser falls through to the
  plugin registry (it dispatches on op_type only; a local function of the same name wins);
- "portable": the same node plus a model-local FunctionProto of standard ops that ONNX Runtime
  inlines, so a stock onnxruntime runs it anywhere.
Both are built from `dflash2.ops.contract`.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from dflash2.ops import contract as C

FLAVOURS = ("portable", "tensorrt")
ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
               "bfloat16": TensorProto.BFLOAT16, "int32": TensorProto.INT32}
_ATTR_KIND = {"int": onnx.defs.OpSchema.AttrType.INT, "float": onnx.defs.OpSchema.AttrType.FLOAT,
              "string": onnx.defs.OpSchema.AttrType.STRING}


def op_schema() -> onnx.defs.OpSchema:
    S = onnx.defs.OpSchema
    float_types = [f"tensor({'float' if t == 'float32' else t})" for t in C.FLOAT_TYPES]
    type_map = {"TL": float_types, "TC": float_types, "TI": ["tensor(int32)"], "TF": ["tensor(float)"]}

    def param(t: C.TensorSpec) -> S.FormalParameter:
        return S.FormalParameter(t.name, t.type_var, t.doc)

    attrs = [S.Attribute(a.name, _ATTR_KIND[a.kind], a.doc, required=a.default is None)
             if a.default is None else
             S.Attribute(a.name, _attr_default(a), a.doc) for a in C.ATTRIBUTES]
    attrs += [S.Attribute("plugin_version", helper.make_attribute("plugin_version", C.PLUGIN_VERSION),
                          "TensorRT plugin creator version"),
              S.Attribute("plugin_namespace", helper.make_attribute("plugin_namespace", C.PLUGIN_NAMESPACE),
                          "TensorRT plugin creator namespace")]
    used = {t.type_var for t in C.INPUTS + C.OUTPUTS}
    return S(C.OP_NAME, C.ONNX_DOMAIN, C.ONNX_OPSET, doc=__doc__ or "",
             inputs=[param(t) for t in C.INPUTS], outputs=[param(t) for t in C.OUTPUTS],
             type_constraints=[(v, type_map[v], f"{v} types") for v in sorted(used)],
             attributes=attrs)


def _attr_default(a: C.AttributeSpec) -> onnx.AttributeProto:
    value = float(a.default) if a.kind == "float" else a.default
    return helper.make_attribute(a.name, value)


def register_schema() -> None:
    """Register the schema once so onnx.checker / shape inference know the node."""
    try:
        onnx.defs.get_schema(C.OP_NAME, C.ONNX_OPSET, C.ONNX_DOMAIN)
    except onnx.defs.SchemaError:
        onnx.defs.register_schema(op_schema())


def selector_node(inputs: list[str], outputs: list[str], attrs: dict, name: str = "selector") -> onnx.NodeProto:
    a = C.check_attributes(attrs)
    if len(inputs) != len(C.INPUTS) or len(outputs) != len(C.OUTPUTS):
        raise ValueError(f"{C.OP_NAME} node expects {len(C.INPUTS)} inputs / {len(C.OUTPUTS)} outputs, "
                         f"got {len(inputs)} / {len(outputs)}")
    return helper.make_node(C.OP_NAME, inputs, outputs, name=name, domain=C.ONNX_DOMAIN,
                            plugin_version=C.PLUGIN_VERSION, plugin_namespace=C.PLUGIN_NAMESPACE, **a)


def selector_function(S: int, opset: int = 18, mode: str = "greedy") -> onnx.FunctionProto:
    """Standard-op body of the op, unrolled over the S draft positions of this model.
    `opset` must equal the default-domain opset of the model that holds the function; `mode` is the
    node's (a function body cannot branch on a string attribute, so each mode has its own body)."""
    if mode not in C.MODES:
        raise ValueError(f"{C.OP_NAME}: mode expected one of {C.MODES}, found {mode!r}")
    nodes: list[onnx.NodeProto] = []

    def n(op: str, ins: list[str], out: str, **kw) -> str:
        nodes.append(helper.make_node(op, ins, [out], **kw))
        return out

    def const(name: str, value) -> str:
        return n("Constant", [], name, value=helper.make_tensor(name, *_np_to_tensor_args(np.asarray(value))))

    def ref_const(name: str, attr: str, kind: int) -> str:
        a = onnx.AttributeProto(name="value_float", ref_attr_name=attr, type=kind)
        nodes.append(onnx.NodeProto(op_type="Constant", output=[name], attribute=[a]))
        return name

    cand_logits, cand_ids, gate, anchor, pcb, scb, uniforms, temperature = C.input_names()
    mult = ref_const("mult", "output_multiplier", onnx.AttributeProto.FLOAT)
    cap = ref_const("cap", "logit_softcap", onnx.AttributeProto.FLOAT)
    zero = const("zero_f", np.float32(0.0))
    one_f = const("one_f", np.float32(1.0))
    ninf = const("ninf", np.float32(-np.inf))
    pinf = const("pinf", np.float32(np.inf))
    # unary: softcap(mult * logits) in fp32                                    # [B, S, K]
    u0 = n("Mul", [n("Cast", [cand_logits], "lg32", to=TensorProto.FLOAT), mult], "u0")
    capped = n("Mul", [n("Tanh", [n("Div", [u0, cap], "u_div")], "u_tanh"), cap], "u_cap")
    unary = n("Where", [n("Greater", [cap, zero], "has_cap"), capped, u0], "unary")
    ids = n("Cast", [cand_ids], "ids64", to=TensorProto.INT64)  # [B, S, K]
    shape = n("Shape", [ids], "ids_shape")
    one = const("one_i", np.array([1], np.int64))
    k_dim = n("Slice", [shape, const("s2", np.array([2], np.int64)), const("s3", np.array([3], np.int64))], "k_dim")
    b_1_k = n("Concat", [n("Slice", [shape, const("s0", np.array([0], np.int64)), one], "b_dim"), one, k_dim],
              "b1k", axis=0)
    anc = n("Expand", [n("Unsqueeze", [n("Cast", [anchor], "anc64", to=TensorProto.INT64),
                                       const("ax12", np.array([1, 2], np.int64))], "anc_u"), b_1_k], "anc_e")
    prev_ids = n("Slice", [ids, const("st0", np.array([0], np.int64)), const("en_1", np.array([-1], np.int64)),
                           one], "prev_ids")
    pred = n("Concat", [anc, prev_ids], "pred_ids", axis=1)  # [B, S, K]
    # gather the candidates' rows, then cast them: a Cast of the whole [V, R] codebook made ONNX Runtime fold a
    # second fp32 copy of both codebooks at session start (and copy them every call where folding is off)
    P = n("Cast", [n("Gather", [pcb, pred], "P_raw")], "P_rows", to=TensorProto.FLOAT)  # [B, S, K, R]
    Q = n("Cast", [n("Gather", [scb, ids], "Q_raw")], "Q_rows", to=TensorProto.FLOAT)  # [B, S, K, R]
    g = n("Unsqueeze", [n("Cast", [gate], "g32", to=TensorProto.FLOAT), const("ax2", np.array([2], np.int64))],
          "g_u")  # [B, S, 1, R]
    pair = n("MatMul", [n("Mul", [P, g], "Pg"), n("Transpose", [Q], "QT", perm=[0, 1, 3, 2])], "pair")
    raw = n("Add", [n("Unsqueeze", [unary, const("ax2b", np.array([2], np.int64))], "u_u"), pair], "raw")
    scores = n("Where", [n("IsNaN", [raw], "isnan"), ninf, raw], "scores")  # [B, S, K, K]
    # the walk, unrolled: row_s = scores[:, s, idx_{s-1}, :]; idx_s, q_s = contract.walk_row(row_s, T, u_s)
    T3 = n("Unsqueeze", [temperature, const("ax12t", np.array([1, 2], np.int64))], "T3")  # [B, 1, 1]
    safe_T = n("Where", [n("Greater", [T3, zero], "T_pos"), T3, one_f], "T_safe")  # greedy rows ignore it
    ar_K = n("Range", [const("r0", np.int64(0)), n("Squeeze", [k_dim], "k_sc"), const("r1", np.int64(1))], "ar_K")
    prev = n("ConstantOfShape", [b_1_k], "prev0", value=helper.make_tensor("z", TensorProto.INT64, [1], [0]))
    shared = dict(scores=scores, ids=ids, b_1_k=b_1_k, ar_K=ar_K, prev=prev, T3=T3, safe_T=safe_T, zero=zero,
                  ninf=ninf, pinf=pinf, uniforms=uniforms)
    if mode == "greedy":
        nodes += _walk(S, "greedy", shared, "", C.output_names())
    else:  # every row greedy (the default, temperature 0): the greedy walk, ~4x fewer nodes than the sampled one
        def branch(m: str) -> onnx.GraphProto:
            outs = [f"{m}.{o}" for o in C.output_names()]
            return helper.make_graph(_walk(S, m, shared, f"{m}.", outs), f"walk_{m}", [],
                                     [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, _OUT_TYPES)])
        any_T = n("ReduceMax", [n("Cast", [n("Greater", [temperature, zero], "T_gt0")], "T_gt0_f",
                                    to=TensorProto.FLOAT)], "any_sampled_f", keepdims=0)  # NaN rows: greedy
        cond = n("Greater", [any_T, const("half", np.float32(0.5))], "any_sampled")
        nodes.append(helper.make_node("If", [cond], C.output_names(), then_branch=branch("sample"),
                                      else_branch=branch("greedy")))
    attrs = [a.name for a in C.ATTRIBUTES] + ["plugin_version", "plugin_namespace"]
    return helper.make_function(C.ONNX_DOMAIN, C.OP_NAME, C.input_names(), C.output_names(), nodes,
                                opset_imports=[helper.make_opsetid("", opset)], attributes=attrs)


_OUT_TYPES = (TensorProto.INT32, TensorProto.INT32, TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.FLOAT)


def _walk(S: int, mode: str, x: dict, prefix: str, outputs: list[str]) -> list[onnx.NodeProto]:
    """The walk's nodes (mode greedy or sample) from the shared values `x`, writing `outputs` (the op's five);
    every other name prefixed (the two If branches of mode sample hold one each)."""
    nodes: list[onnx.NodeProto] = []

    def n(op: str, ins: list[str], out: str, **kw) -> str:
        out = out if out in outputs else prefix + out
        nodes.append(helper.make_node(op, ins, [out], **kw))
        return out

    def const(name: str, value) -> str:
        return n("Constant", [], name, value=helper.make_tensor(prefix + name, *_np_to_tensor_args(np.asarray(value))))

    scores, ids, b_1_k, ar_K, prev = x["scores"], x["ids"], x["b_1_k"], x["ar_K"], x["prev"]
    zero, ninf, pinf = x["zero"], x["ninf"], x["pinf"]
    idxs, rows, probs = [], [], []
    # only the walk itself is sequential: a row, its pick, the next predecessor (3 nodes a position when
    # greedy); the draft ids and the greedy one-hot q are gathered for all positions at once after it. (Few nodes
    # was thought to be what makes a drafter cheap; measured on ONNX Runtime 1.32 a small node costs ~0.3 us
    # outside its profiler, which inflates it to several: the drafter's time is its weight MatMuls, docs/quantization.md)
    nodes.append(helper.make_node("Split", [scores, const("split1", np.ones(S, np.int64))],
                                  [prefix + f"sc{s}" for s in range(S)], axis=1))  # S x [B, 1, K, K]
    sq1 = const("ax1", np.array([1], np.int64))
    sq = const("ax2c", np.array([2], np.int64))
    greedy_walk = mode != "sample"
    if greedy_walk:  # the walk in 4-D ([B, 1, ., K] per position): no reshape between a position and the next
        prev = n("Unsqueeze", [prev, sq1], "prev0_4d")  # [B, 1, 1, K]
        b_1_1_k = n("Shape", [prev], "b11k")
    for s in range(S):
        if greedy_walk:
            row = n("GatherElements", [prefix + f"sc{s}", prev], f"row{s}", axis=2)  # [B, 1, 1, K]
            idx = n("ArgMax", [row], f"gidx{s}", axis=3, keepdims=1)  # [B, 1, 1, 1], first max (all -inf: 0)
            if s + 1 < S:
                prev = n("Expand", [idx, b_1_1_k], f"prev{s + 1}")  # the next predecessor: the candidate chosen
        else:
            sc = n("Squeeze", [prefix + f"sc{s}", sq1], f"scq{s}")  # [B, K, K]
            row = n("GatherElements", [sc, prev], f"row{s}", axis=1)  # [B, 1, K]
            greedy = n("ArgMax", [row], f"gidx{s}", axis=2, keepdims=1)  # [B, 1, 1], first max (all -inf: 0)
            idx, q = _sample_row(n, const, s, row, greedy, x["uniforms"], x["T3"], x["safe_T"], ar_K, zero, ninf,
                                 pinf)
            probs.append(q)
            if s + 1 < S:
                prev = n("Expand", [idx, b_1_k], f"prev{s + 1}")  # the next predecessor: the candidate chosen
        idxs.append(idx)
        rows.append(row)
    out_d, out_i, out_s, out_c, out_q = outputs
    i_cat = n("Concat", idxs, "i_cat4" if greedy_walk else "i_cat", axis=1)  # [B, S, 1] int64 ([B, S, 1, 1])
    if greedy_walk:
        i_cat = n("Squeeze", [i_cat, const("ax3", np.array([3], np.int64))], "i_cat")
    n("Cast", [n("Squeeze", [n("GatherElements", [ids, i_cat], "d_cat", axis=2), sq], "d_sq")], out_d,
      to=TensorProto.INT32)  # the walked candidates' ids [B, S]
    n("Cast", [n("Squeeze", [i_cat, sq], "i_sq")], out_i, to=TensorProto.INT32)
    if greedy_walk:
        n("Squeeze", [n("Concat", rows, "rows4", axis=1), sq], out_s)  # [B, S, K]
    else:
        n("Concat", rows, out_s, axis=1)  # [B, S, K]
    if mode == "sample":
        n("Concat", probs, out_q, axis=1)  # [B, S, K]
    else:  # one-hot at the walked index
        n("Cast", [n("Equal", [ar_K, i_cat], "oh")], out_q, to=TensorProto.FLOAT)  # [B, S, K]
    # confidence = softmax(row)[walked] at T = 1 = exp(row[idx] - max) / sum_c exp(row_c - max)
    m = n("ReduceMax", [out_s, sq], "row_max", keepdims=1)  # [B, S, 1]
    total = n("ReduceSum", [n("Exp", [n("Sub", [out_s, m], "row_sub")], "row_exp"), sq], "row_sum", keepdims=0)
    picked = n("Squeeze", [n("GatherElements", [out_s, i_cat], "picked_u", axis=2), sq], "picked")  # [B, S]
    m2 = n("Squeeze", [m, sq], "row_max_sq")  # [B, S]
    n_inf = n("ReduceSum", [n("Cast", [n("Equal", [out_s, pinf], "is_pinf")], "pinf_f", to=TensorProto.FLOAT), sq],
              "n_pinf", keepdims=0)  # [B, S]
    finite = n("Div", [n("Exp", [n("Sub", [picked, m2], "pick_sub")], "pick_exp"), total],
               "conf_finite")  # NaN when the max is infinite: replaced next
    on_inf = n("Div", [n("Cast", [n("Equal", [picked, pinf], "pick_inf")], "pick_inf_f", to=TensorProto.FLOAT),
                       n_inf], "conf_inf")
    top_inf = n("Where", [n("Equal", [m2, pinf], "max_pinf"), on_inf, finite], "conf_a")
    n("Where", [n("Equal", [m2, ninf], "max_ninf"), zero, top_inf], out_c)
    return nodes


def _sample_row(n, const, s, row, greedy, uniforms, T3, safe_T, ar_K, zero, ninf, pinf) -> tuple[str, str]:
    """contract.walk_row's sample rule on row [B, 1, K] -> (index [B, 1, 1] int64, q [B, 1, K])."""
    m = n("ReduceMax", [row, const(f"ax2m{s}", np.array([2], np.int64))], f"m{s}", keepdims=1)  # [B, 1, 1]
    ex = n("Exp", [n("Div", [n("Sub", [row, m], f"rs{s}"), safe_T], f"rt{s}")], f"ex{s}")
    e_inf = n("Cast", [n("Equal", [row, pinf], f"ri{s}")], f"ei{s}", to=TensorProto.FLOAT)
    e = n("Where", [n("Equal", [m, pinf], f"mi{s}"), e_inf, ex], f"e0{s}")
    e = n("Where", [n("Equal", [row, ninf], f"rn{s}"), zero, e], f"e{s}")  # [B, 1, K]
    cdf = n("CumSum", [e, const(f"ax2s{s}", np.int64(2))], f"cdf{s}")  # summed in order
    total = n("Slice", [cdf, const(f"tl{s}", np.array([-1], np.int64)),
                        const(f"th{s}", np.array([np.iinfo(np.int64).max], np.int64)),
                        const(f"ta{s}", np.array([2], np.int64))], f"tot{s}")  # [B, 1, 1]
    u = n("Unsqueeze", [n("Gather", [uniforms, const(f"us{s}", np.array([s], np.int64))], f"ug{s}", axis=1),
                        const(f"ua{s}", np.array([2], np.int64))], f"uni{s}")  # [B, 1, 1]
    below = n("Cast", [n("LessOrEqual", [cdf, n("Mul", [u, total], f"thr{s}")], f"le{s}")], f"lei{s}",
              to=TensorProto.INT64)
    count = n("ReduceSum", [below, const(f"ax2r{s}", np.array([2], np.int64))], f"cnt{s}", keepdims=1)
    pos = n("Cast", [n("Greater", [e, zero], f"ep{s}")], f"epf{s}", to=TensorProto.FLOAT)
    first = n("ArgMax", [pos], f"fp{s}", axis=2, keepdims=1)
    last = n("ArgMax", [pos], f"lp{s}", axis=2, keepdims=1, select_last_index=1)
    sampled = n("Min", [n("Max", [count, first], f"cmx{s}"), last], f"smp{s}")
    sample = n("And", [n("Greater", [T3, zero], f"tp{s}"), n("Greater", [m, ninf], f"mf{s}")], f"is_s{s}")
    idx = n("Where", [sample, sampled, greedy], f"idx{s}")  # [B, 1, 1]
    one_hot = n("Cast", [n("Equal", [ar_K, idx], f"oh{s}")], f"ohf{s}", to=TensorProto.FLOAT)
    q = n("Where", [sample, n("Div", [e, total], f"qs{s}"), one_hot], f"q{s}")  # [B, 1, K]
    return idx, q


def _np_to_tensor_args(a: np.ndarray):
    return helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape), a.flatten().tolist()


def add_flavour(model: onnx.ModelProto, flavour: str, S: int) -> onnx.ModelProto:
    """Attach (portable) or strip (tensorrt) the local function of the selector node."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour expected one of {FLAVOURS}, found {flavour!r}")
    del model.functions[:]
    if flavour == "portable":
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
        model.functions.append(selector_function(S, opset, _node_mode(model)))
    if not any(o.domain == C.ONNX_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(C.ONNX_DOMAIN, C.ONNX_OPSET))
    return model


def _node_mode(model: onnx.ModelProto) -> str:
    """The mode attribute of the model's selector node (default greedy)."""
    for node in model.graph.node:
        if node.op_type == C.OP_NAME and node.domain == C.ONNX_DOMAIN:
            for a in node.attribute:
                if a.name == "mode":
                    return a.s.decode()
    return "greedy"


def selector_model(S: int, K: int, R: int, V: int, flavour: str, attrs: dict | None = None,
                   logits_dtype: str = "float32", codebook_dtype: str = "float32",
                   batch: str | int = "batch") -> onnx.ModelProto:
    """A one-node model of the op (codebooks as graph inputs): unit tests, Polygraphy, TensorRT."""
    attrs = {"top_k": K, "rank": R, **(attrs or {})}
    dims = {"B": batch, "S": S, "K": K, "R": R, "V": V}
    types = {"TL": logits_dtype, "TC": codebook_dtype, "TI": "int32", "TF": "float32"}

    def vi(t: C.TensorSpec):
        return helper.make_tensor_value_info(t.name, ONNX_DTYPES[types[t.type_var]], [dims[d] for d in t.dims])

    node = selector_node(C.input_names(), C.output_names(), attrs)
    graph = helper.make_graph([node], "dflash2_selector", [vi(t) for t in C.INPUTS], [vi(t) for t in C.OUTPUTS])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="dflash2")
    model.ir_version = 10
    return add_flavour(model, flavour, S)
