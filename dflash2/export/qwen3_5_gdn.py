"""The Qwen3.5 target's Gated DeltaNet layer template (dflash2.export.qwen3_5 builds the graph around it).

Per GDN layer j the layer reads its own state inputs and writes its own state outputs (signature.state_names):

    conv_state.{j}   [1, C, K-1]          the last K-1 conv inputs before the step
    rec_state.{j}    [1, Hv, dk, dv] fp32 the delta-rule state before the step
    conv_states.{j}  [W', C, K-1]         out: the conv state after each of the LAST W' = min(n, W) rows
    rec_states.{j}   [W', Hv, dk, dv]     out: the delta-rule state after each of those rows

One tensor per layer, not one stacked over layers: the stacked binding cost a Split of the input and a Concat of the
18 layers' per-row states into one output every step (9-11% of an int4 decode step at Qwen3.5-0.8B's shape).

The recurrence, per layer, is an If on n == 1:
  then (a 1-row decode): the one-row delta rule applied once, reading rec_state.{j} and writing rec_states.{j}
       directly: no Scan, no row Slices, no state copy (the Scan, its per-row Identity included, was 9% of the
       stacked graph's decode step, beside a zero-row LinearAttention per layer; docs/results, 2026-12-06);
  else: the rows before the window (a prefill past it) in one pass that keeps no per-row state, the last W' rows
       in a Scan whose body is the same one-row delta rule, keeping each row's state.
Both run the SAME one-row op on the same shapes (the fused LinearAttention over [1, 1, Hv*dk] rows, or the standard
ops over [Hv, dk] rows), so a k-row verify row stays bitwise the 1-row decode of that token: the row invariance that
makes speculative output lossless (the export's row check, runtime/invariance.py, verifies it).

In an fp16 / bf16 graph the projections, the conv (its state too) and the output projection run in it; q, k, v are cast
to fp32 after the conv, g and beta are fp32, the recurrence and its state are fp32 as in the fp32 graph, and the
output comes back to the graph dtype for the gated norm, as GatedDeltaNet does in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from dflash2.export import signature as N

F32 = TensorProto.FLOAT
STD_CONSTS = (("ax1", [1]), ("ax2", [2]), ("ax12", [1, 2]), ("axm2", [-2]))  # the standard-op row's axes
AXES = {nm for nm, _ in STD_CONSTS}


def _standard_row(x: Callable[[str], str], c: Callable[[str], str]) -> list[onnx.NodeProto]:
    """The reference's per-row operations (gated_delta_rows) on one row: (S [Hv, dk, dv]; q, k [Hv, dk], v [Hv, dv],
    g, beta [Hv]) -> S2, o [Hv, dv]. x(name): the tensor a body name stands for; c(name): an axes constant's name."""
    def node(op, ins, out, **kw):
        return helper.make_node(op, [c(i) if i in AXES else x(i) for i in ins], [x(out)], **kw)
    return [
        node("Exp", ["g"], "decay"),
        node("Unsqueeze", ["decay", "ax12"], "decay3"),  # exp(g) [Hv, 1, 1]
        node("Mul", ["S", "decay3"], "S1"),
        node("Unsqueeze", ["k", "ax2"], "k3"),  # [Hv, dk, 1]
        node("Mul", ["S1", "k3"], "Sk"),
        node("ReduceSum", ["Sk", "axm2"], "kv_mem", keepdims=0),  # S^T k [Hv, dv]
        node("Sub", ["v", "kv_mem"], "err"),
        node("Unsqueeze", ["beta", "ax1"], "beta2"),
        node("Mul", ["err", "beta2"], "delta"),  # [Hv, dv]
        node("Unsqueeze", ["delta", "ax1"], "delta3"),  # [Hv, 1, dv]
        node("Mul", ["k3", "delta3"], "outer"),
        node("Add", ["S1", "outer"], "S2"),
        node("Unsqueeze", ["q", "ax2"], "q3"),
        node("Mul", ["S2", "q3"], "Sq"),
        node("ReduceSum", ["Sq", "axm2"], "o", keepdims=0),  # [Hv, dv]
    ]


def _fused_row(Hv: int, dk: int, x: Callable[[str], str], c: Callable[[str], str], state4: str, state4_out: str) \
        -> list[onnx.NodeProto]:
    """ONNX Runtime's LinearAttention over one row (within 1.2e-7 of the standard ops, docs/families/qwen3_5.md; 2.1x
    faster at Hv 16, 128 x 128): q, k, v, g, beta rows as [1, 1, heads * dim], the state [1, Hv, dk, dv] ->
    o1 [1, 1, Hv * dv], state4_out [1, Hv, dk, dv]. q arrives l2-normed, unscaled: the kernel applies dk^-0.5 (its
    `scale`), one Mul node a layer fewer."""
    nodes = [helper.make_node("Reshape", [x(t), c("row")], [x(f"{t}1")]) for t in ("q", "k", "v", "g", "beta")]
    nodes.append(helper.make_node("LinearAttention", [x("q1"), x("k1"), x("v1"), state4, x("g1"), x("beta1")],
                                  [x("o1"), state4_out], domain="com.microsoft", q_num_heads=Hv, kv_num_heads=Hv,
                                  scale=dk ** -0.5, update_rule="gated_delta"))
    return nodes


def _delta_body(Hv: int, dk: int, dv: int, fused: bool) -> onnx.GraphProto:
    """The Scan body over the window's rows: (state [Hv, dk, dv]; q, k [Hv, dk], v [Hv, dv], g, beta [Hv])
    -> (state', o [Hv, dv], state' as the row's scan output)."""
    same = lambda t: t  # noqa: E731
    if fused:
        nodes = [helper.make_node("Unsqueeze", ["S", "ax0"], ["S4"]), *_fused_row(Hv, dk, same, same, "S4", "S4o"),
                 helper.make_node("Squeeze", ["S4o", "ax0"], ["S2"]),
                 helper.make_node("Reshape", ["o1", "heads"], ["o"])]
        consts = [("ax0", [0]), ("row", [1, 1, -1]), ("heads", [Hv, dv])]
    else:
        nodes, consts = _standard_row(same, same), list(STD_CONSTS)
    # a Scan body may not name one value as two outputs: the carried state and the row's kept copy
    nodes.append(helper.make_node("Identity", ["S2"], ["S_row"]))
    outs = [helper.make_tensor_value_info("S2", F32, [Hv, dk, dv]), helper.make_tensor_value_info("o", F32, [Hv, dv]),
            helper.make_tensor_value_info("S_row", F32, [Hv, dk, dv])]
    ins = [helper.make_tensor_value_info("S", F32, [Hv, dk, dv]), helper.make_tensor_value_info("q", F32, [Hv, dk]),
           helper.make_tensor_value_info("k", F32, [Hv, dk]), helper.make_tensor_value_info("v", F32, [Hv, dv]),
           helper.make_tensor_value_info("g", F32, [Hv]), helper.make_tensor_value_info("beta", F32, [Hv])]
    return helper.make_graph(nodes, "delta_row_state", ins, outs,
                             [helper.make_tensor(n, TensorProto.INT64, [len(v)], v) for n, v in consts])


@dataclass
class GdnShared:
    """The graph-wide names every GDN layer reads (made once by qwen3_5.build)."""
    n: str  # [1] int64 rows of the step
    split_at: str  # [1] n - W': rows before it keep no state
    has_head: str  # [] bool: a prefill longer than the window
    end: str  # [1] a Slice end past any row
    ax0: str  # [1] = 0


class Gdn:
    """The Gated DeltaNet mixer template: gdn(u, p, j) -> (y [n, H], conv_states.{j}, rec_states.{j}).
    fns: the graph's shared helpers (norm, heads, l2norm, silu, repeat_heads: qwen3_5.build's closures).
    conv_rows: the conv state bound row-major, [K-1, C] per row (the gqa graph's; else [C, K-1]): the window's rows as
    they are, where the channel-major layout cost a Transpose of the state in and of the kept rows out per layer
    (36 strided copies a decode step at Qwen3.5-0.8B's 18 GDN layers)."""

    def __init__(self, b, src, c, fused: bool, sh: GdnShared, fns: dict, conv_rows: bool = False):
        self.b, self.src, self.c, self.fused, self.sh, self.f = b, src, c, fused, sh, fns
        self.conv_rows_major = conv_rows
        Hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        self.Hv, self.dk, self.dv = Hv, dk, dv
        self.body = _delta_body(Hv, dk, dv, fused)
        self.head_body = _delta_body(Hv, dk, dv, False)  # standard ops: a Scan over the rows before the window
        del self.head_body.output[2], self.head_body.node[-1]  # which keep no per-row state: no S_row
        self.decode = b.op("Squeeze", [b.op("Equal", [sh.n, b.const("gdn.n1", [1])], "gdn.is_decode")[0], sh.ax0],
                           "gdn.is_decode.scalar")[0]  # [] bool: a 1-row step
        self.batch = [b.const(f"gdn.batch.{nm}", [1, -1, w]) for nm, w in (("q", Hv * dk), ("k", Hv * dk),
                                                                           ("v", Hv * dv), ("g", Hv), ("beta", Hv))]
        kd = c.linear_num_key_heads * dk
        self.sizes_qkv = b.const("gdn.qkv_sizes", [kd, kd, Hv * dv])
        # shared by every layer, computed once per step: each conv tap's rows [t, n + t) of the window, and the
        # window rows of the conv state after each kept row r (split_at + 1 + r + [0, K-1)): [W', K-1]
        K = c.linear_conv_kernel_dim
        self.taps = [(b.const(f"gdn.tap{t}.from", [t]),
                      sh.n if t == 0 else b.op("Add", [sh.n, b.const(f"gdn.tap{t}.to", [t])], f"gdn.tap{t}.end")[0])
                     for t in range(K)]
        scalar = lambda x, nm: b.op("Squeeze", [x, sh.ax0], nm)[0]  # noqa: E731
        first = b.op("Add", [sh.split_at, b.const("gdn.one", [1])], "gdn.conv_state.first")[0]
        kept = b.op("Range", [scalar(first, "gdn.conv_state.first0"), scalar(self.taps[1][1], "gdn.conv_state.end0"),
                              b.const("gdn.step", 1)], "gdn.conv_state.kept")[0]  # [W'] split_at+1 .. n
        self.conv_rows = b.op("Add", [b.op("Unsqueeze", [kept, b.const("gdn.ax1", [1])], "gdn.conv_state.col")[0],
                                      b.const("gdn.conv_state.taps", [list(range(K - 1))])],
                              "gdn.conv_state.rows")[0]  # [W', K-1]
        # the one-row branch's constants, outer-scope initializers its If reads (the Scan body holds its own)
        self.row_consts = {nm: b.const(f"gdn.row.{nm}", v) for nm, v in
                           (STD_CONSTS if not fused else (("row", [1, 1, -1]), ("heads", [-1, Hv, dv])))}

    def _branch(self, nodes, name: str, outs: list[tuple[str, list]]) -> onnx.GraphProto:
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(o, F32, s) for o, s in outs])

    def _one_row(self, rows: list[str], state_in: str, p: str) -> onnx.GraphProto:
        """The If's then-branch (n == 1): the one-row delta rule on rec_state.{j} [1, Hv, dk, dv], as the Scan body
        computes a row: (o [1, Hv, dv], state [1, Hv, dk, dv])."""
        Hv, dk, dv, ax0 = self.Hv, self.dk, self.dv, self.sh.ax0
        x = {t: r for t, r in zip(("q", "k", "v", "g", "beta"), rows)}
        name = lambda t: x.get(t, f"{p}.row.{t}")  # noqa: E731
        c = self.row_consts.__getitem__
        if self.fused:  # LinearAttention reads the state input and writes the branch's output: no copy either way
            nodes = _fused_row(Hv, dk, name, c, state_in, f"{p}.row.S4o")
            nodes.append(helper.make_node("Reshape", [name("o1"), c("heads")], [f"{p}.row.o3"]))
            return self._branch(nodes, f"{p}.one_row", [(f"{p}.row.o3", [1, Hv, dv]),
                                                         (f"{p}.row.S4o", [1, Hv, dk, dv])])
        sq = [helper.make_node("Squeeze", [r, ax0], [f"{p}.row.{t}"]) for t, r in x.items()]  # [Hv, dk] ...
        sq.append(helper.make_node("Squeeze", [state_in, ax0], [f"{p}.row.S"]))  # [Hv, dk, dv]
        name = lambda t: f"{p}.row.{t}"  # noqa: E731
        nodes = sq + _standard_row(name, c) + [
            helper.make_node("Unsqueeze", [name("o"), ax0], [name("o3")]),
            helper.make_node("Unsqueeze", [name("S2"), ax0], [name("S4o")])]
        return self._branch(nodes, f"{p}.one_row", [(name("o3"), [1, Hv, dv]), (name("S4o"), [1, Hv, dk, dv])])

    def _rows(self, rows: list[str], state_in: str, p: str, rec_out: str) -> tuple[str, str]:
        """The recurrence over the step's n rows: (o [n, Hv, dv], rec_out [W', Hv, dk, dv]), an If on n == 1."""
        b, sh, Hv, dk, dv = self.b, self.sh, self.Hv, self.dk, self.dv
        at = len(b.nodes)  # the else-branch's nodes: emitted through the builder, then moved into the branch
        state = b.op("Squeeze", [state_in, sh.ax0], f"{p}.rec_past")[0]  # [Hv, dk, dv]
        head_rows, tail_rows = [], []
        for t in rows:
            head_rows.append(b.op("Slice", [t, b.const(f"{t}.h0", [0]), sh.split_at, sh.ax0], f"{t}.head")[0])
            tail_rows.append(b.op("Slice", [t, sh.split_at, sh.end, sh.ax0], f"{t}.tail")[0])
        # rows 0 .. n-W'-1 (a prefill past the window) keep no per-row state: _head() runs them
        state, o_head = self._head(state, head_rows, p)
        _, o_tail, rec_rows = b.op("Scan", [state, *tail_rows], f"{p}.delta_tail", outputs=3, body=self.body,
                                   num_scan_inputs=5)  # the last W' rows: [W', Hv, dk, dv]
        o = b.op("Concat", [o_head, o_tail], f"{p}.o_rows", axis=0)[0]  # [n, Hv, dv]
        rows_branch = self._branch(b.nodes[at:], f"{p}.rows", [(o, [None, Hv, dv]), (rec_rows, [None, Hv, dk, dv])])
        del b.nodes[at:]
        return tuple(b.op("If", [self.decode], f"{p}.delta", outputs=[f"{p}.o", rec_out],
                          then_branch=self._one_row(rows, state_in, p), else_branch=rows_branch))

    def _head(self, state: str, rows: list[str], p: str) -> tuple[str, str]:
        """The rows before the window, which keep no per-row state: (state after them, their outputs [m, Hv, dv]).
        fused: ONE LinearAttention over all of them (ONNX Runtime's chunked kernel: a long prompt is not a row loop;
        0 rows pass the state through). Standard ops: a Scan over them, inside an If, since ONNX Runtime's Scan
        refuses zero rows and every verify step has none. The If reads its inputs from the outer scope, which ONNX
        Runtime's quantizer's topological sort does not see: the plan refuses quantizing this graph after
        validation (the fused route writes int4 / int8 as it builds)."""
        b, sh, Hv, dk, dv = self.b, self.sh, self.Hv, self.dk, self.dv
        if self.fused:
            q_, k_, v_, g_, beta_ = (b.op("Reshape", [t, shape], f"{t}.batch")[0]
                                     for t, shape in zip(rows, self.batch))  # [1, m, heads * dim]
            s4 = b.op("Unsqueeze", [state, sh.ax0], f"{p}.head.state4")[0]
            o1, s1 = b.op("LinearAttention", [q_, k_, v_, s4, g_, beta_], f"{p}.delta_head", outputs=2,
                          domain="com.microsoft", q_num_heads=Hv, kv_num_heads=Hv, scale=dk ** -0.5,
                          update_rule="gated_delta")
            return (b.op("Squeeze", [s1, sh.ax0], f"{p}.head.state")[0],
                    b.op("Reshape", [o1, b.const(f"{p}.head.o_heads", [-1, Hv, dv])], f"{p}.head.o")[0])
        scan = helper.make_node("Scan", [state, *rows], [f"{p}.head.state", f"{p}.head.o"], body=self.head_body,
                                num_scan_inputs=5, name=f"{p}.delta_head")
        skip = [helper.make_node("Identity", [state], [f"{p}.skip.state"], name=f"{p}.skip.state"),
                helper.make_node("Identity", [rows[2]], [f"{p}.skip.o"], name=f"{p}.skip.o")]  # v[0:0]
        outs = lambda a, o: [(a, [Hv, dk, dv]), (o, [None, Hv, dv])]  # noqa: E731
        return tuple(b.op("If", [sh.has_head], f"{p}.delta_head.if", outputs=2,
                          then_branch=self._branch([scan], f"{p}.head", outs(f"{p}.head.state", f"{p}.head.o")),
                          else_branch=self._branch(skip, f"{p}.skip", outs(f"{p}.skip.state", f"{p}.skip.o"))))

    def __call__(self, u: str, p: str, j: int) -> tuple[str, str, str]:
        """One Gated DeltaNet mixer, GDN layer j: (y [n, H], conv_states.{j} [W', C, K-1], rec_states.{j})."""
        b, src, c, sh, f = self.b, self.src, self.c, self.sh, self.f
        C, K, Hk, Hv, dk, dv = c.conv_dim, c.linear_conv_kernel_dim, c.linear_num_key_heads, self.Hv, self.dk, self.dv
        vd = Hv * dv
        (conv_in, rec_in), (conv_out, rec_out) = (N.state_names(j + 1)[k][-2:] for k in (0, 1))
        a = f"{p}.linear_attn"
        proj = b.linear(u, f"{p}.gdn_in_proj", src, [f"{a}.in_proj_qkv", f"{a}.in_proj_z", f"{a}.in_proj_b",
                                                      f"{a}.in_proj_a"])  # [n, C + vd + 2 Hv]
        qkv, z, bb, aa = b.op("Split", [proj, b.const(f"{p}.gdn_sizes", [C, vd, Hv, Hv])], f"{p}.gdn_in", outputs=4,
                              axis=-1)
        # the causal conv over [conv_state ; the step's rows], row-major: window [K-1+n, C]
        past = b.op("Squeeze", [conv_in, sh.ax0], f"{p}.conv_past")[0]  # [K-1, C] or [C, K-1]
        if not self.conv_rows_major:
            past = b.op("Transpose", [past], f"{p}.conv_past_rows", perm=[1, 0])[0]  # [K-1, C]
        window = b.op("Concat", [past, qkv], f"{p}.window", axis=0)[0]
        wconv = np.asarray(src.get(f"{a}.conv1d.weight"), np.float32)[:, 0, :]  # [C, K]
        x = None
        for t in range(K):  # reference causal_conv: the taps summed in order
            rows = b.op("Slice", [window, *self.taps[t], sh.ax0], f"{p}.tap{t}.rows")[0]  # [n, C]
            m = b.op("Mul", [rows, b.fw(f"{p}.conv.w{t}", wconv[:, t])], f"{p}.tap{t}")[0]
            x = m if x is None else b.op("Add", [x, m], f"{p}.conv.sum{t}")[0]
        x = f["f32"](f["silu"](x, f"{p}.conv.silu"), f"{p}.conv.out")  # [n, C]: fp32 from here (reference qkv())
        # conv state after each of the last W' rows r: window rows r+1 .. r+K-1, as [C, K-1] (one Gather of the
        # shared row indices and a Transpose: the K-1 Slices, Unsqueezes and index Adds per layer they replace were
        # 13 of a decode step's ~60 nodes per GDN layer, each costing ONNX Runtime's per-node overhead)
        if self.conv_rows_major:  # the kept rows are the output: [W', K-1, C]
            b.op("Gather", [window, self.conv_rows], conv_out, outputs=[conv_out], axis=0)
        else:
            rows = b.op("Gather", [window, self.conv_rows], f"{p}.conv_state_rows", axis=0)[0]  # [W', K-1, C]
            b.op("Transpose", [rows], conv_out, outputs=[conv_out], perm=[0, 2, 1])  # [W', C, K-1]
        q, k, v = b.op("Split", [x, self.sizes_qkv], f"{p}.qkv", outputs=3, axis=-1)
        rep = f["repeat_heads"]
        q = f["l2norm"](rep(f["heads"](q, Hk, dk, f"{p}.q_heads"), f"{p}.q_rep"), f"{p}.q_l2")  # [n, Hv, dk]
        if not self.fused:  # the fused graph's LinearAttention applies dk^-0.5 itself (_fused_row)
            q = b.op("Mul", [q, b.const(f"{p}.q_scale", [dk ** -0.5], np.float32)], f"{p}.q")[0]
        k = f["l2norm"](rep(f["heads"](k, Hk, dk, f"{p}.k_heads"), f"{p}.k_rep"), f"{p}.k")
        v = f["heads"](v, Hv, dv, f"{p}.v")
        beta = f["f32"](b.op("Sigmoid", [bb], f"{p}.beta")[0], f"{p}.beta")  # [n, Hv], sigmoid in the graph dtype
        neg_a = -np.exp(b.held(src.get(f"{a}.A_log")))
        sp = b.op("Softplus", [b.op("Add", [f["f32"](aa, f"{p}.a"), b.weight(f"{p}.dt_bias", b.held(
            src.get(f"{a}.dt_bias")))], f"{p}.dt")[0]], f"{p}.softplus")[0]
        g = b.op("Mul", [sp, b.weight(f"{p}.neg_A", neg_a)], f"{p}.g")[0]  # [n, Hv] log decay, fp32
        o, _ = self._rows([q, k, v, g, beta], rec_in, p, rec_out)  # [n, Hv, dv] fp32
        o = f["back"](o, f"{p}.o")  # the reference's o.to(u.dtype) before its gated norm
        # gated RMSNorm per head: rmsnorm(o) * w (plain weight) * silu(z)
        if self.fused:  # the plain weight inside the norm's own product
            y = f["norm"](o, src.get(f"{a}.norm.weight"), f"{p}.o_norm")
        else:
            y = f["norm"](o, None, f"{p}.o_norm", dim=dv)
            y = b.op("Mul", [y, b.fw(f"{p}.o_norm.weight", src.get(f"{a}.norm.weight"))], f"{p}.o_norm.w")[0]
        z = f["f32"](f["heads"](z, Hv, dv, f"{p}.z"), f"{p}.z")  # silu(z) and the product in fp32 (GatedRMSNorm)
        z = b.op("Mul", [z, b.op("Sigmoid", [z], f"{p}.z.sigmoid")[0]], f"{p}.z.silu")[0]
        y = f["back"](b.op("Mul", [f["f32"](y, f"{p}.o_normed"), z], f"{p}.gated")[0], f"{p}.gated")
        y = b.op("Reshape", [y, b.const(f"{p}.o_flat", [-1, vd])], f"{p}.o_flat")[0]
        return b.linear(y, f"{p}.out_proj", src, [f"{a}.out_proj"]), conv_out, rec_out
