"""The graph I/O contract, written once: the tensor name of every role, per graph and KV binding kind.

Roles are what the runtime binds (`ids`, `next_ids`, `draft_ids`, ...); names are what the graphs call them.
The graph builders (graphs.py, gqa.py, qdq.py) name their tensors from here, the export records each
graph's `Signature` in the manifest, and every later stage (the session, the engine build and profiles,
dflash2-compare, the manifest checks) reads roles from the manifest: nothing after the export knows a
tensor name. No torch: the names are plain strings.
"""

from __future__ import annotations

from dflash2 import manifest as mf

# target graph
INPUT_IDS, NEXT_IDS, CONTEXT, LOGITS = "input_ids", "next_ids", "context", "logits"
PAST_KV, NEW_KV, KV_CACHE, PAST_LEN = "past_kv", "new_kv", "kv_cache", "past_len"
# drafter graph (CONTEXT in, PAST_LEN for its fixed flavour)
ANCHOR, UNIFORMS, TEMPERATURE = "anchor", "uniforms", "temperature"
DRAFT_IDS, CAND_IDS, CONFIDENCE, DRAFT_PROBS = "draft_ids", "cand_ids", "confidence", "draft_probs"
PAST_CTX_KV, NEW_CTX_KV, CTX_KV_CACHE = "past_ctx_kv", "new_ctx_kv", "ctx_kv_cache"
# the standalone selector graph: the op contract's own names (dflash2.ops.contract)
# a hybrid target's recurrent state (Gated DeltaNet layers; manifest.StateSignature, runtime.state.RowStates):
# conv_state [1, Lg, C, K-1] and rec_state [1, Lg, Hv, dk, dv] in (the state before the step), conv_states /
# rec_states [W', *row] out (the state after each of the step's last W' = min(n, W) rows)
CONV_STATE, REC_STATE, CONV_STATES, REC_STATES = "conv_state", "rec_state", "conv_states", "rec_states"
STATE = ([CONV_STATE, REC_STATE], [CONV_STATES, REC_STATES])

ROLES = {  # graph -> (input role -> name, output role -> name); a graph has a subset
    "target": ({"ids": INPUT_IDS}, {"next_ids": NEXT_IDS, "context": CONTEXT, "logits": LOGITS}),
    "drafter": ({"context": CONTEXT, "anchor": ANCHOR, "uniforms": UNIFORMS, "temperature": TEMPERATURE},
                {"draft_ids": DRAFT_IDS, "cand_ids": CAND_IDS, "confidence": CONFIDENCE, "draft_probs": DRAFT_PROBS}),
}
REQUIRED = mf.REQUIRED_ROLES
KV = {  # (graph, kind) -> KV binding (gqa-shared: per layer, made by gqa_kv_names)
    ("target", "prefix"): mf.KvSignature("prefix", [PAST_KV], [NEW_KV]),
    ("target", "fixed"): mf.KvSignature("fixed", [KV_CACHE], [NEW_KV], PAST_LEN),
    ("drafter", "prefix"): mf.KvSignature("prefix", [PAST_CTX_KV], [NEW_CTX_KV]),
    ("drafter", "fixed"): mf.KvSignature("fixed", [CTX_KV_CACHE], [NEW_CTX_KV], PAST_LEN),
}
# the fixed-shape (TensorRT) flavour replaces the prefix view of each graph by these
FIXED = {"target": (PAST_KV, KV_CACHE), "drafter": (PAST_CTX_KV, CTX_KV_CACHE)}


GQA_BINDING = ("gqa-shared: per layer past_key_values.{i}.key|value [1, kv, max_seq_len, hd] + past_len [1]; "
               "present.{i}.key|value are bound to the same memory and ONNX Runtime's GroupQueryAttention writes "
               "the step's rows at [past_len, past_len + n) in place; rollback lowers past_len.")


def gqa_kv_names(num_layers: int) -> tuple[list[str], list[str]]:
    """(past inputs, present outputs) of a gqa-shared graph, layer-major, key before value (the names
    onnxruntime-genai's builder gives them)."""
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return past, [p.replace("past_key_values", "present") for p in past]


def kv_signature(graph: str, kind: str, num_layers: int | None = None) -> mf.KvSignature:
    if kind == "gqa-shared":
        past, present = gqa_kv_names(num_layers)
        return mf.KvSignature("gqa-shared", past, present, PAST_LEN)
    return KV[(graph, kind)]


def state_signature(window: int, io: dict) -> mf.StateSignature:
    """The rows state binding of a hybrid target graph: each state's row shape and element type read from its past
    input in `io` ({"inputs": [{"name", "dtype", "shape"}, ...], "outputs": [...]}, as trace.io_spec reads a file).
    window: W, the pair's block size. A past input that is not [1, *static row], or a present output whose row or
    element type differs from its past input's, is a builder bug: ValueError names them."""
    specs = {d["name"]: d for d in io["inputs"]}
    past, present = STATE
    rows = [list(specs[n]["shape"])[1:] for n in past]
    state = mf.StateSignature("rows", list(past), list(present), rows, [specs[n]["dtype"] for n in past], window)
    graph_io = mf.GraphIo([mf.IoSpec(d["name"], d["dtype"], list(d["shape"])) for d in io["inputs"]],
                          [mf.IoSpec(d["name"], d["dtype"], list(d["shape"])) for d in io["outputs"]])
    problems = state.problems("target signature", graph_io)
    if problems:
        raise ValueError("; ".join(problems))
    return state


def signature(graph: str, kind: str, inputs: list[str], outputs: list[str], num_layers: int | None = None,
              selector_io: tuple[list[str], list[str]] | None = None, state_window: int | None = None,
              io: dict | None = None) -> mf.Signature:
    """The signature of a built graph from its io names: every role whose tensor it has, its KV binding, its
    capabilities. A graph whose io does not match the contract (a required role missing, a tensor no role
    names) is a builder bug: ValueError names both lists.
    A hybrid target (its inputs hold CONV_STATE / REC_STATE) also gets its state binding: state_window is W (the
    pair's block size) and io the graph's io dict (state_signature reads the rows' shapes and types from it)."""
    if graph == "selector":  # the standalone selector: the op contract's io, no cache
        ins, outs = selector_io
        return mf.Signature({n: n for n in ins}, {n: n for n in outs}, None, ["lattice"])
    in_roles, out_roles = ROLES[graph]
    kv = kv_signature(graph, kind, num_layers)
    state = None
    named = [n for n in STATE[0] if n in inputs] + [n for n in STATE[1] if n in outputs]
    if graph == "target" and (named or state_window is not None):
        absent = [n for n in STATE[0] + STATE[1] if n not in named]
        if absent or state_window is None or io is None:
            raise ValueError(f"target graph ({kind}): a recurrent state needs inputs {STATE[0]}, outputs {STATE[1]}, "
                             f"state_window and the io dict; found state tensors {named}, state_window "
                             f"{state_window}, io {'given' if io is not None else 'none'}")
        state = state_signature(state_window, io)
    sig = mf.Signature({r: n for r, n in in_roles.items() if n in inputs},
                       {r: n for r, n in out_roles.items() if n in outputs}, kv, state=state)
    need_in, need_out = REQUIRED[graph]
    bound_in, bound_out = sig.names()
    missing = sorted((need_in - sig.inputs.keys()) | (need_out - sig.outputs.keys()))
    extra = sorted(set(inputs) - bound_in) + sorted(set(outputs) - bound_out)
    if missing or extra or not bound_in <= set(inputs) or not bound_out <= set(outputs):
        raise ValueError(f"{graph} graph ({kind}): roles {missing} missing, tensors {extra} unnamed by the contract; "
                         f"graph inputs {inputs}, outputs {outputs}")
    return mf.Signature(sig.inputs, sig.outputs, kv, mf.capabilities_of(sig.inputs, sig.outputs), state)
