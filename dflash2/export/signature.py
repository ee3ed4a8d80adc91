"""The graph I/O contract, written once: the tensor name of every role, per graph and KV binding kind.

Roles are what the runtime binds (`ids`, `next_ids`, `draft_ids`, ...); names are what the graphs call them.
The graph builders (graphs.py, gqa.py, qdq.py) name their tensors from here, the export records each
graph's `Signature` in the manifest, and every later stage (the session, the engine build and profiles,
dflash2-compare, the manifest checks) reads roles from the manifest: nothing after the export knows a
tensor name. No torch: the names are plain strings.
"""

from __future__ import annotations

import re

from dflash2 import manifest as mf

# target graph
INPUT_IDS, NEXT_IDS, CONTEXT, LOGITS = "input_ids", "next_ids", "context", "logits"
PAST_KV, NEW_KV, KV_CACHE, PAST_LEN = "past_kv", "new_kv", "kv_cache", "past_len"
# drafter graph (CONTEXT in, PAST_LEN for its fixed flavour)
ANCHOR, UNIFORMS, TEMPERATURE = "anchor", "uniforms", "temperature"
DRAFT_IDS, CAND_IDS, CONFIDENCE, DRAFT_PROBS = "draft_ids", "cand_ids", "confidence", "draft_probs"
PAST_CTX_KV, NEW_CTX_KV, CTX_KV_CACHE = "past_ctx_kv", "new_ctx_kv", "ctx_kv_cache"
# the standalone selector graph: the op contract's own names (dflash2.ops.contract)
# a hybrid target's recurrent state (Gated DeltaNet layers; manifest.StateSignature, runtime.state.RowStates), one
# pair of tensors per GDN layer j (0 .. Lg-1, in layer order; made by state_names): conv_state.{j} [1, C, K-1] and
# rec_state.{j} [1, Hv, dk, dv] in (the state before the step), conv_states.{j} / rec_states.{j} [W', *row] out (the
# state after each of the step's last W' = min(n, W) rows). Per layer, not stacked: a stacked input was Split and
# the stacked outputs Concat-ed every step (11% of an int4 decode step at Qwen3.5-0.8B's shape)
CONV_STATE, REC_STATE, CONV_STATES, REC_STATES = "conv_state", "rec_state", "conv_states", "rec_states"  # stems


# the sliding-window layers' bounded KV (manifest.WindowSignature, runtime.window.CompactingKv): the window layers'
# rows [v, Lw, 2, kv, hd] (portable) or the whole window buffer + its valid rows (fixed flavour), the real position
# of the buffer's row 0, and the step's new rows of those layers
PAST_WINDOW_KV, NEW_WINDOW_KV, WINDOW_CACHE = "past_window_kv", "new_window_kv", "window_cache"
WINDOW_BASE, WINDOW_LEN = "window_base", "window_len"


def window_signature(kind: str, layers: list[int], keep: int, graph: str = "target") -> mf.WindowSignature:
    """The window binding of a target graph of KV kind `kind` (prefix or fixed) whose sliding layers `layers` see
    `keep` past rows at most; of a drafter graph whose every layer slides: its own KV binding's tensors plus the base
    (manifest.WindowSignature: the window buffer replaces the drafter's context KV)."""
    if graph == "drafter":
        kv = KV[("drafter", kind)]
        return mf.WindowSignature("compacting", list(kv.past), list(kv.present), WINDOW_BASE, list(layers), keep,
                                  kv.length)
    if kind == "fixed":
        return mf.WindowSignature("compacting", [WINDOW_CACHE], [NEW_WINDOW_KV], WINDOW_BASE, list(layers), keep,
                                  WINDOW_LEN)
    return mf.WindowSignature("compacting", [PAST_WINDOW_KV], [NEW_WINDOW_KV], WINDOW_BASE, list(layers), keep)


def state_names(num_layers: int) -> tuple[list[str], list[str]]:
    """(past inputs, present outputs) of a hybrid target with num_layers GDN layers: layer-major, conv before rec
    (as gqa_kv_names orders key before value)."""
    def of(stems):
        return [f"{s}.{j}" for j in range(num_layers) for s in stems]
    return of((CONV_STATE, REC_STATE)), of((CONV_STATES, REC_STATES))


def state_layers(inputs: list[str]) -> int:
    """How many GDN layers' states a graph's inputs hold (conv_state.{j}: 0 in a graph without a state)."""
    return sum(1 for n in inputs if re.fullmatch(rf"{CONV_STATE}\.\d+", n))


def is_state(name: str) -> bool:
    """A state tensor's name (any stem, any layer)."""
    return re.fullmatch(rf"({CONV_STATE}|{REC_STATE}|{CONV_STATES}|{REC_STATES})\.\d+", name) is not None


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
    past, present = state_names(state_layers(list(specs)))
    rows = [list(specs[n]["shape"])[1:] for n in past]
    state = mf.StateSignature("rows", past, present, rows, [specs[n]["dtype"] for n in past], window)
    graph_io = mf.GraphIo([mf.IoSpec(d["name"], d["dtype"], list(d["shape"])) for d in io["inputs"]],
                          [mf.IoSpec(d["name"], d["dtype"], list(d["shape"])) for d in io["outputs"]])
    problems = state.problems("target signature", graph_io)
    if problems:
        raise ValueError("; ".join(problems))
    return state


def signature(graph: str, kind: str, inputs: list[str], outputs: list[str], num_layers: int | None = None,
              selector_io: tuple[list[str], list[str]] | None = None, state_window: int | None = None,
              io: dict | None = None, window: tuple[list[int], int] | None = None) -> mf.Signature:
    """The signature of a built graph from its io names: every role whose tensor it has, its KV binding, its
    capabilities. A graph whose io does not match the contract (a required role missing, a tensor no role
    names) is a builder bug: ValueError names both lists.
    A hybrid target (its inputs hold state_names' tensors) also gets its state binding: state_window is W (the
    pair's block size) and io the graph's io dict (state_signature reads the rows' shapes and types from it)."""
    if graph == "selector":  # the standalone selector: the op contract's io, no cache
        ins, outs = selector_io
        return mf.Signature({n: n for n in ins}, {n: n for n in outs}, None, ["lattice"])
    in_roles, out_roles = ROLES[graph]
    kv = kv_signature(graph, kind, num_layers)
    state = None
    named = [n for n in inputs if is_state(n)] + [n for n in outputs if is_state(n)]
    if graph == "target" and (named or state_window is not None):
        past, present = state_names(state_layers(inputs))
        absent = [n for n in past + present if n not in named]
        if absent or not past or len(named) != len(past) + len(present) or state_window is None or io is None:
            raise ValueError(f"target graph ({kind}): a recurrent state needs inputs {past or state_names(1)[0]}, "
                             f"outputs {present or state_names(1)[1]}, "
                             f"state_window and the io dict; found state tensors {named}, state_window "
                             f"{state_window}, io {'given' if io is not None else 'none'}")
        state = state_signature(state_window, io)
    win = window_signature(kind, *window, graph=graph) if window is not None else None
    sig = mf.Signature({r: n for r, n in in_roles.items() if n in inputs},
                       {r: n for r, n in out_roles.items() if n in outputs}, kv, state=state, window=win)
    need_in, need_out = REQUIRED[graph]
    bound_in, bound_out = sig.names()
    missing = sorted((need_in - sig.inputs.keys()) | (need_out - sig.outputs.keys()))
    extra = sorted(set(inputs) - bound_in) + sorted(set(outputs) - bound_out)
    if missing or extra or not bound_in <= set(inputs) or not bound_out <= set(outputs):
        raise ValueError(f"{graph} graph ({kind}): roles {missing} missing, tensors {extra} unnamed by the contract; "
                         f"graph inputs {inputs}, outputs {outputs}")
    return mf.Signature(sig.inputs, sig.outputs, kv, mf.capabilities_of(sig.inputs, sig.outputs), state, win)
