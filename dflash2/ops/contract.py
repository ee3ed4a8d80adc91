"""The DFlash2 candidate-selector op contract: the ONE place that defines it.

The torch custom op (`dflash2.reference.selector`), the ONNX schema and node
(`dflash2.export.selector_onnx`), the TensorRT plugin's YAML and C++ field list
(`plugins/dflash2Selector/`) are all tested against this file.  Plain Python: the
runtime imports it on edge boards, so no torch here.

Math (see docs/algorithm.md section 4), all in fp32 whatever the input dtypes:
    u[b,s,c]      = softcap(output_multiplier * cand_logits[b,s,c])
    pred[b,0,:]   = anchor[b];  pred[b,s,:] = cand_ids[b,s-1,:]
    score[b,s,p,c] = u[b,s,c] + sum_r P[pred[b,s,p],r] * gate[b,s,r] * Q[cand_ids[b,s,c],r]
    NaN -> -inf;  row_s = score[b,s,idx_{s-1},:]  (idx_{-1} = 0: every row-0 predecessor is the anchor)
    idx_s, q_s = walk_row(row_s, T_b, u[b,s])  (see `walk_row`: the one definition of both modes)
      greedy (mode "greedy", or mode "sample" with T_b <= 0): idx_s = first argmax, q_s one-hot
      sample (T_b > 0): idx_s drawn from q_s = softmax(row_s / T_b) by inverse CDF with u[b,s]
    draft_ids[b,s] = cand_ids[b,s,idx_s]; path_index[b,s] = idx_s; path_scores[b,s,:] = row_s
    confidence[b,s] = softmax(row_s)[idx_s] at temperature 1  (`path_confidence`)
    draft_probs[b,s,:] = q_s  (the draft distribution of lossless speculative sampling)
Ids outside [0, V) are invalid input: the torch op and the CPU twin raise; the CUDA kernel never
reads out of bounds and scores such a candidate -inf.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

CONTRACT_VERSION = 3  # 2: + the confidence output; 3: + mode "sample" (uniforms, temperature, draft_probs)
OP_NAME = "DFlash2Selector"  # ONNX op_type == TensorRT plugin name; no ONNX op has this name
ONNX_DOMAIN = "dflash2"
ONNX_OPSET = 1
PLUGIN_VERSION = "3"  # version 1: 6 inputs / 3 outputs, 2: 6 / 4, 3: 8 / 5
PLUGIN_NAMESPACE = ""
TORCH_NAMESPACE = "dflash2"
TORCH_OP_NAME = "select_path"  # torch.ops.dflash2.select_path

FLOAT_TYPES = ("float32", "float16", "bfloat16")
MAX_TOP_K = 64
MAX_RANK = 1024
MODES = ("greedy", "sample")  # same inputs and outputs in both; greedy ignores uniforms and temperature


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[str, ...]
    dtypes: tuple[str, ...]
    type_var: str  # inputs sharing a type_var must share a dtype
    doc: str


@dataclass(frozen=True)
class AttributeSpec:
    name: str
    kind: str  # "int" | "float" | "string"
    default: object | None  # None: required
    doc: str
    allowed: tuple = field(default=())


INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("cand_logits", ("B", "S", "K"), FLOAT_TYPES, "TL",
               "raw LM-head logits of the K candidates per draft position"),
    TensorSpec("cand_ids", ("B", "S", "K"), ("int32",), "TI",
               "vocabulary ids of the candidates (top-K, descending, ties lowest id)"),
    TensorSpec("gate", ("B", "S", "R"), FLOAT_TYPES, "TC",
               "context gate hidden_projection(h_s) of each draft position"),
    TensorSpec("anchor", ("B",), ("int32",), "TI",
               "last committed token: the predecessor of position 0"),
    TensorSpec("pred_codebook", ("V", "R"), FLOAT_TYPES, "TC", "predecessor codebook P"),
    TensorSpec("succ_codebook", ("V", "R"), FLOAT_TYPES, "TC", "successor codebook Q"),
    TensorSpec("uniforms", ("B", "S"), ("float32",), "TF",
               "one uniform number in [0, 1) per walked row (mode sample; read by no greedy walk)"),
    TensorSpec("temperature", ("B",), ("float32",), "TF",
               "sampling temperature of each batch row; <= 0 (or NaN) walks greedily (mode sample)"),
)

OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("draft_ids", ("B", "S"), ("int32",), "TI", "the walked draft tokens"),
    TensorSpec("path_index", ("B", "S"), ("int32",), "TI", "index of the walked candidate in K"),
    TensorSpec("path_scores", ("B", "S", "K"), ("float32",), "TF",
               "fp32 score row the walk chose from at each position (NaN already -inf)"),
    TensorSpec("confidence", ("B", "S"), ("float32",), "TF",
               "probability of the walked candidate under the softmax of its score row (path_confidence)"),
    TensorSpec("draft_probs", ("B", "S", "K"), ("float32",), "TF",
               "q: the distribution the walked candidate was drawn from (walk_row); one-hot when greedy"),
)

ATTRIBUTES: tuple[AttributeSpec, ...] = (
    AttributeSpec("top_k", "int", None, f"K, 1..{MAX_TOP_K}; must equal the K of the inputs"),
    AttributeSpec("rank", "int", None, f"R, 1..{MAX_RANK}; must equal the R of the inputs"),
    AttributeSpec("output_multiplier", "float", 1.0, "scale on the unary logits, > 0"),
    AttributeSpec("logit_softcap", "float", 0.0, "tanh(v/cap)*cap on the unary logits; 0 = off"),
    AttributeSpec("mode", "string", "greedy", "path rule", allowed=MODES),
)


def path_confidence(row: list[float], index: int) -> float:
    """confidence of one position: softmax(row)[index] at temperature 1, m = max(row):
        m == -inf (nothing scored)  -> 0.0
        m == +inf                   -> 1 / (number of +inf entries) if row[index] == +inf else 0.0
        else                        -> exp(row[index] - m) / sum_c exp(row[c] - m), exp(-inf) = 0
    (greedy: index is the first argmax, so the numerator is 1.)
    Plain Python (float64 here; the implementations sum in fp32 and agree to ~1e-6 relative).
    Every implementation (torch op, ONNX function, CPU twin, CUDA kernel) is tested against this."""
    m = max(row)
    if m == -math.inf:
        return 0.0
    if m == math.inf:
        return 1.0 / sum(1 for v in row if v == math.inf) if row[index] == math.inf else 0.0
    return math.exp(row[index] - m) / sum(math.exp(v - m) for v in row)


def first_argmax(row: list[float]) -> int:
    """The greedy rule: first index of the maximum (NaN already -inf; all -inf -> 0)."""
    best = 0
    for c, v in enumerate(row):
        if v > row[best]:
            best = c
    return best


def walk_row(row: list[float], temperature: float, u: float, mode: str = "sample") -> tuple[int, list[float]]:
    """(index, q) of one walked row: the ONE definition of both modes (NaN in row already -inf).

    Greedy (mode "greedy", or temperature <= 0 or NaN): index = first_argmax(row), q one-hot at it.
    Sample, with m = max(row), in fp32 (emulated here with float64 rounded through fp32 steps):
        e_c = 0 where row_c == -inf;  m == +inf: e_c = 1 where row_c == +inf, else 0;
        otherwise e_c = exp((row_c - m) / T)
        cdf_c = e_0 + ... + e_c (summed in order, c = 0..K-1);  total = cdf_{K-1}
        m == -inf (all -inf): index 0, q one-hot at 0
        count = #{c : cdf_c <= u * total};  index = clamp(count, first c with e_c > 0, last c with e_c > 0)
        q_c = e_c / total
    The clamp keeps any u (even outside [0, 1), or u * total rounding up to total) on a candidate
    with q > 0; for u in [0, 1) it is inverse-CDF sampling: P(index = c) = q_c."""
    K = len(row)
    if mode == "greedy" or not temperature > 0:
        i = first_argmax(row)
        return i, [1.0 if c == i else 0.0 for c in range(K)]
    m = max(row)
    if m == -math.inf:
        return 0, [1.0] + [0.0] * (K - 1)
    f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]  # noqa: E731
    T = f32(temperature)
    if m == math.inf:
        e = [1.0 if v == math.inf else 0.0 for v in row]
    else:
        e = [0.0 if v == -math.inf else f32(math.exp(f32(f32(v - m) / T))) for v in row]
    cdf, acc = [], 0.0
    for v in e:
        acc = f32(acc + v)
        cdf.append(acc)
    total = cdf[-1]
    thr = f32(f32(u) * total)
    count = sum(1 for v in cdf if v <= thr)
    pos = [c for c in range(K) if e[c] > 0]
    index = min(max(count, pos[0]), pos[-1])
    return index, [f32(v / total) for v in e]


def input_names() -> list[str]:
    return [t.name for t in INPUTS]


def output_names() -> list[str]:
    return [t.name for t in OUTPUTS]


def check_attributes(attrs: dict) -> dict:
    """Fill defaults and validate values; raise ValueError naming the attribute."""
    out = {}
    known = {a.name for a in ATTRIBUTES}
    unknown = sorted(set(attrs) - known)
    if unknown:
        raise ValueError(f"{OP_NAME}: unknown attribute(s) {unknown}; expected a subset of {sorted(known)}")
    for a in ATTRIBUTES:
        if a.name not in attrs:
            if a.default is None:
                raise ValueError(f"{OP_NAME}: required attribute {a.name!r} is missing")
            out[a.name] = a.default
            continue
        v = attrs[a.name]
        if a.kind == "int" and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{OP_NAME}: attribute {a.name!r} expected int, found {v!r}")
        if a.kind == "float" and not isinstance(v, (int, float)):
            raise ValueError(f"{OP_NAME}: attribute {a.name!r} expected float, found {v!r}")
        if a.kind == "string" and not isinstance(v, str):
            raise ValueError(f"{OP_NAME}: attribute {a.name!r} expected string, found {v!r}")
        out[a.name] = float(v) if a.kind == "float" else v
    if not 1 <= out["top_k"] <= MAX_TOP_K:
        raise ValueError(f"{OP_NAME}: top_k expected 1..{MAX_TOP_K}, found {out['top_k']}")
    if not 1 <= out["rank"] <= MAX_RANK:
        raise ValueError(f"{OP_NAME}: rank expected 1..{MAX_RANK}, found {out['rank']}")
    if not out["output_multiplier"] > 0:
        raise ValueError(f"{OP_NAME}: output_multiplier expected > 0, found {out['output_multiplier']}")
    if not out["logit_softcap"] >= 0:
        raise ValueError(f"{OP_NAME}: logit_softcap expected >= 0, found {out['logit_softcap']}")
    if out["mode"] not in MODES:
        raise ValueError(f"{OP_NAME}: mode expected one of {MODES}, found {out['mode']!r}")
    return out


def check_io(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str], attrs: dict,
             id_ranges: dict[str, tuple[int, int]] | None = None) -> dict[str, int]:
    """The op's input rules on plain shapes / dtype names (torch op and CPU twin both call this).

    Returns the dims {B, S, K, R, V}; ValueError names the tensor, what was expected and found.
    id_ranges: optional (min, max) of cand_ids / anchor, checked against [0, V)."""
    a = check_attributes(attrs)
    for spec in INPUTS:
        if dtypes[spec.name] not in spec.dtypes:
            raise ValueError(f"{OP_NAME}: input {spec.name} dtype expected one of {spec.dtypes}, "
                             f"found {dtypes[spec.name]}")
        if len(shapes[spec.name]) != len(spec.dims):
            raise ValueError(f"{OP_NAME}: input {spec.name} expected rank {len(spec.dims)} {list(spec.dims)}, "
                             f"found shape {list(shapes[spec.name])}")
    for var in {t.type_var for t in INPUTS}:
        group = {t.name: dtypes[t.name] for t in INPUTS if t.type_var == var}
        if len(set(group.values())) > 1:
            raise ValueError(f"{OP_NAME}: {', '.join(group)} must share a dtype, found {', '.join(group.values())}")
    dims: dict[str, int] = {}
    for spec in INPUTS:
        for d, n in zip(spec.dims, shapes[spec.name]):
            if dims.setdefault(d, n) != n:
                raise ValueError(f"{OP_NAME}: dim {d} of input {spec.name} expected {dims[d]}, found {n}")
    if dims["K"] != a["top_k"]:
        raise ValueError(f"{OP_NAME}: K of the inputs expected top_k={a['top_k']}, found {dims['K']}")
    if dims["R"] != a["rank"]:
        raise ValueError(f"{OP_NAME}: R of the inputs expected rank={a['rank']}, found {dims['R']}")
    if dims["S"] < 1:
        raise ValueError(f"{OP_NAME}: S expected >= 1, found {dims['S']}")
    for name, (lo, hi) in (id_ranges or {}).items():
        if lo < 0 or hi >= dims["V"]:
            raise ValueError(f"{OP_NAME}: {name} expected ids in [0, {dims['V']}), found [{lo}, {hi}]")
    return dims


def as_dict() -> dict:
    """The contract as plain data (compared with plugins/*/..._PluginConfig.yaml)."""
    return {
        "name": OP_NAME,
        "contract_version": CONTRACT_VERSION,
        "onnx_domain": ONNX_DOMAIN,
        "plugin_version": PLUGIN_VERSION,
        "plugin_namespace": PLUGIN_NAMESPACE,
        "inputs": [{"name": t.name, "dims": list(t.dims), "dtypes": list(t.dtypes),
                    "type_var": t.type_var} for t in INPUTS],
        "outputs": [{"name": t.name, "dims": list(t.dims), "dtypes": list(t.dtypes)} for t in OUTPUTS],
        "attributes": [{"name": a.name, "kind": a.kind, "default": a.default,
                        "allowed": list(a.allowed)} for a in ATTRIBUTES],
        "limits": {"max_top_k": MAX_TOP_K, "max_rank": MAX_RANK},
    }
