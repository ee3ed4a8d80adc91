"""A toy hybrid target pair as ONNX graphs (onnx.helper) that honours the whole target contract, with a recurrent
state whose meaning is checkable: the conv state is the last K-1 token ids, the recurrent state their running sum,
and next_ids a function of both. Its state io is the Qwen3.5 export's, per layer (signature.state_names): LG layers,
each conv_state.{j} / rec_state.{j} in and conv_states.{j} / rec_states.{j} out; every layer holds the same two values
under its own pattern, and the graph reads the window from layer 0 and the running sum from the last layer.
`reference` computes the same in Python (tests/test_state_binding.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as oh

from dflash2 import dtypes
from dflash2 import manifest as mf
from dflash2.export import signature as sg

# the toy pair: vocab, block size (= window), context width, KV row [L, 2, kv, hd], state rows
V, B, CW, KV_ROW = 50, 4, 3, [1, 2, 1, 2]
LG, C, K1, HV, DK, DV = 2, 3, 3, 2, 2, 3  # K1 = K - 1: the conv window
ROWS = [[C, K1], [HV, DK, DV]] * LG  # each state tensor's row, in state_names' order (conv, rec per layer)
PAST, PRESENT = sg.state_names(LG)


def state_sig(window: int = B, **change) -> mf.StateSignature:
    s = mf.StateSignature("rows", list(PAST), list(PRESENT), [list(r) for r in ROWS], ["float32"] * len(ROWS),
                          window)
    return dataclasses.replace(s, **change)


# --- the toy target: conv state = the last K1 token ids, recurrent state = their running sum -------------------

def reference(state: tuple[tuple, float], ids: list[int]) -> tuple[list[int], list[tuple[tuple, float]]]:
    """What the toy target computes: per row its next id and the state after it."""
    (window, total), nxt, after = state, [], []
    for x in ids:
        window, total = (*window[1:], float(x)), total + x
        nxt.append(int(total * 5 + 7 * window[0] + window[-2]) % V)
        after.append((window, total))
    return nxt, after


ZERO = ((0.0,) * K1, 0.0)
# per-element offsets inside a state row (element 0 is 0: what the graph reads back), so a row holds more than one value
# (and it differs per layer)
CONV_PAT = [np.arange(C * K1, dtype=np.float32).reshape(C, K1) // K1 * 100 * (j + 1) for j in range(LG)]
REC_PAT = [np.arange(HV * DK * DV, dtype=np.float32).reshape(HV, DK, DV) * 1000 * (j + 1) for j in range(LG)]


def state_rows(state) -> list[np.ndarray]:
    """A reference state as the rows the graph writes, per layer [C, K1], [HV, DK, DV] (PAST's order)."""
    window, total = state
    return [r for j in range(LG) for r in (np.asarray(window, np.float32) + CONV_PAT[j], total + REC_PAT[j])]


def _const(name: str, value) -> onnx.NodeProto:
    return oh.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(value), name))


def target_graph() -> onnx.ModelProto:
    f = TP.FLOAT
    n = [
        _const("flat", np.array([-1], np.int64)), _const("k1", np.array([K1], np.int64)),
        _const("z1", np.array([0], np.int64)), _const("one", np.array([1], np.int64)),
        _const("big", np.array([1 << 30], np.int64)), _const("negw", np.array([-B], np.int64)),
        _const("m1", np.arange(1, K1 + 1, dtype=np.int64)), _const("zero", np.array(0, np.int64)),
        _const("c5", np.array(5, np.float32)), _const("c7", np.array(7, np.float32)),
        _const("cv", np.array(V, np.float32)), _const("col0", np.array(0, np.int64)),
        _const("colm", np.array(K1 - 2, np.int64)),
        _const("r5", np.array([-1, 1, 1, 1, 1], np.int64)), _const("r4", np.array([-1, 1, 1, 1], np.int64)),
        _const("ctx_ones", np.ones((1, CW), np.float32)), _const("kv_ones", np.ones([1, *KV_ROW], np.float32)),
        _const("vocab", np.arange(V, dtype=np.float32)[None, :]),
        oh.make_node("Cast", ["input_ids"], ["x"], to=f),
        # the state before the step: element 0 of each row (conv: its first K1 values from layer 0, rec: the
        # running sum from the last layer)
        oh.make_node("Reshape", [PAST[0], "flat"], ["conv_flat"]),
        oh.make_node("Slice", ["conv_flat", "z1", "k1"], ["w0"]),
        oh.make_node("Reshape", [PAST[-1], "flat"], ["rec_flat"]),
        oh.make_node("Slice", ["rec_flat", "z1", "one"], ["s0"]),
        oh.make_node("Concat", ["w0", "x"], ["seq"], axis=0),  # [K1 + n]
        oh.make_node("Shape", ["input_ids"], ["n"]),
        oh.make_node("Squeeze", ["n"], ["n0"]),
        oh.make_node("Range", ["zero", "n0", "one_s"], ["t"]),
        oh.make_node("Squeeze", ["one"], ["one_s"]),
        oh.make_node("Unsqueeze", ["t", "one"], ["t2"]),
        oh.make_node("Unsqueeze", ["m1", "z1"], ["m2"]),
        oh.make_node("Add", ["t2", "m2"], ["idx"]),  # [n, K1]: row t's window is seq[t + 1: t + K1 + 1]
        oh.make_node("Gather", ["seq", "idx"], ["win"], axis=0),
        oh.make_node("CumSum", ["x", "zero"], ["cs"]),
        oh.make_node("Add", ["cs", "s0"], ["st"]),  # [n] running sums
        oh.make_node("Gather", ["win", "col0"], ["wa"], axis=1),
        oh.make_node("Gather", ["win", "colm"], ["wb"], axis=1),
        oh.make_node("Mul", ["st", "c5"], ["a1"]), oh.make_node("Mul", ["wa", "c7"], ["a2"]),
        oh.make_node("Add", ["a1", "a2"], ["a3"]), oh.make_node("Add", ["a3", "wb"], ["a4"]),
        oh.make_node("Mod", ["a4", "cv"], ["nf"], fmod=1),
        oh.make_node("Cast", ["nf"], ["next_ids"], to=TP.INT32),
        # the state after each of the last min(n, B) rows, per layer
        oh.make_node("Slice", ["win", "negw", "big", "z1"], ["win_w"]),
        oh.make_node("Slice", ["st", "negw", "big", "z1"], ["st_w"]),
        oh.make_node("Unsqueeze", ["win_w", "one"], ["ww1"]),  # [w, 1, K1]
        oh.make_node("Reshape", ["st_w", "r4"], ["st4"]),  # [w, 1, 1, 1]
        # the dense target's io: context and KV rows from the ids, logits peaked at next_ids (+ 0 * the past KV)
        oh.make_node("Unsqueeze", ["x", "one"], ["xc"]),
        oh.make_node("Mul", ["xc", "ctx_ones"], ["context"]),
        oh.make_node("Reshape", ["x", "r5"], ["xk"]),
        oh.make_node("Mul", ["xk", "kv_ones"], ["new_kv"]),
        oh.make_node("ReduceSum", ["past_kv"], ["kv_sum"], keepdims=0),
        oh.make_node("Mul", ["kv_sum", "zero_f"], ["kv_zero"]), _const("zero_f", np.array(0, np.float32)),
        oh.make_node("Slice", ["nf", "negw", "big", "z1"], ["nf_w"]),
        oh.make_node("Unsqueeze", ["nf_w", "one"], ["nf2"]),
        oh.make_node("Sub", ["nf2", "vocab"], ["d"]), oh.make_node("Abs", ["d"], ["ad"]),
        oh.make_node("Neg", ["ad"], ["l0"]), oh.make_node("Add", ["l0", "kv_zero"], ["logits"]),
    ]
    for j in range(LG):
        n += [_const(f"conv_pat{j}", CONV_PAT[j]), _const(f"rec_pat{j}", REC_PAT[j]),
              oh.make_node("Add", ["ww1", f"conv_pat{j}"], [PRESENT[2 * j]]),
              oh.make_node("Add", ["st4", f"rec_pat{j}"], [PRESENT[2 * j + 1]])]
    ins = [oh.make_tensor_value_info("input_ids", TP.INT32, ["n"]),
           oh.make_tensor_value_info("past_kv", f, ["past", *KV_ROW]),
           *[oh.make_tensor_value_info(nm, f, [1, *r]) for nm, r in zip(PAST, ROWS)]]
    outs = [oh.make_tensor_value_info("next_ids", TP.INT32, ["n"]), oh.make_tensor_value_info("context", f, ["n", CW]),
            oh.make_tensor_value_info("logits", f, ["w", V]), oh.make_tensor_value_info("new_kv", f, ["n", *KV_ROW]),
            *[oh.make_tensor_value_info(nm, f, ["w", *r]) for nm, r in zip(PRESENT, ROWS)]]
    g = oh.make_graph(_toposort(n), "toy_hybrid_target", ins, outs)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])


def drafter_graph() -> onnx.ModelProto:
    """Drafts anchor + 1..S (the test replaces them); context KV rows from the context."""
    f, S = TP.FLOAT, B - 1
    n = [_const("steps", np.arange(1, S + 1, dtype=np.int32)), _const("vi", np.array(V, np.int32)),
         _const("r5", np.array([-1, 1, 1, 1, 1], np.int64)), _const("one", np.array([1], np.int64)),
         _const("kv_ones", np.ones([1, *KV_ROW], np.float32)),
         oh.make_node("Add", ["anchor", "steps"], ["d0"]), oh.make_node("Mod", ["d0", "vi"], ["draft_ids"]),
         oh.make_node("Cast", ["draft_ids"], ["df"], to=f), oh.make_node("Sign", ["df"], ["ds"]),
         oh.make_node("Abs", ["ds"], ["confidence"]),
         oh.make_node("ReduceSum", ["context", "one"], ["cs"], keepdims=0),
         oh.make_node("Reshape", ["cs", "r5"], ["c5"]), oh.make_node("Mul", ["c5", "kv_ones"], ["new_ctx_kv"])]
    ins = [oh.make_tensor_value_info("context", f, ["m", CW]), oh.make_tensor_value_info("anchor", TP.INT32, [1]),
           oh.make_tensor_value_info("past_ctx_kv", f, ["past", *KV_ROW])]
    outs = [oh.make_tensor_value_info("draft_ids", TP.INT32, [S]), oh.make_tensor_value_info("confidence", f, [S]),
            oh.make_tensor_value_info("new_ctx_kv", f, ["m", *KV_ROW])]
    return oh.make_model(oh.make_graph(n, "toy_drafter", ins, outs), opset_imports=[oh.make_opsetid("", 17)])


def _toposort(nodes: list) -> list:
    """Nodes in an order where each input is made first (the list above reads in the order of the math)."""
    made, out, rest = {"input_ids", "past_kv", *PAST}, [], list(nodes)
    while rest:
        ready = [nd for nd in rest if all(i in made for i in nd.input if i)]
        assert ready, [nd.output for nd in rest]
        for nd in ready:
            out.append(nd)
            made |= set(nd.output)
            rest.remove(nd)
    return out


def io_of(model: onnx.ModelProto) -> dict:
    def one(v):
        t = v.type.tensor_type
        return {"name": v.name, "dtype": dtypes.from_onnx(t.elem_type).name,
                "shape": [d.dim_param or d.dim_value for d in t.shape.dim]}
    return {"inputs": [one(v) for v in model.graph.input], "outputs": [one(v) for v in model.graph.output]}


def names(io: dict) -> tuple[list[str], list[str]]:
    return [d["name"] for d in io["inputs"]], [d["name"] for d in io["outputs"]]


def facts(max_seq_len: int = 64) -> mf.ModelFacts:
    return mf.ModelFacts(dtype="float32", max_seq_len=max_seq_len, block_size=B, num_drafts=B - 1, drafter_version=1,
                         tap_ids=[0], mask_token_id=0, vocab_size=V, eos_token_ids=[], context=mf.Context(False, CW),
                         kv=mf.Kv(["seq", "layer", "kv", "head", "dim"], mf.KvRows(KV_ROW, KV_ROW), "float32"),
                         selector=None)


def graph_io(model) -> mf.GraphIo:
    io = io_of(model)
    return mf.GraphIo(*[[mf.IoSpec(d["name"], d["dtype"], d["shape"]) for d in io[k]] for k in ("inputs", "outputs")])
