"""The records a manifest is made of: files, graphs and their io, KV layout, selector, quantization, engines,
and each graph's typed `Signature` (its contract with the runtime). Plain dataclasses; `dflash2.manifest.schema`
assembles them into the two folder manifests and `dflash2.manifest.jsonio` reads them from JSON by their type
hints, so a record's field types are its schema (allowed types: dflash2/manifest/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash2.dtypes import BY_NAME as DTYPE_NAMES
from dflash2.manifest.window import WindowSignature  # a Signature field: jsonio resolves its type hint here

@dataclass
class FileEntry:
    sha256: str
    bytes: int


@dataclass
class IoSpec:
    name: str
    dtype: str
    shape: list[int | str]  # ints or symbolic dim names


@dataclass
class Context:
    fused: bool
    width: int  # columns of one context row
    why: str = ""


@dataclass
class KvRows:
    target: list[int]  # one sequence row: [L, 2, kv_heads, head_dim]
    drafter: list[int]


@dataclass
class Kv:
    layout: list[str]
    rows: KvRows
    dtype: str
    binding: str = ""
    target_attention: str = "plain"  # "gqa": the target graph is ONNX Runtime's fused-op one (per-layer KV)


@dataclass
class Selector:
    op: str
    domain: str
    plugin_version: str
    plugin_namespace: str
    top_k: int
    rank: int
    output_multiplier: float
    logit_softcap: float


@dataclass
class DraftVocab:
    size: int
    file: str
    sha256: str
    why: str = ""


@dataclass
class Tokenizer:
    files: list[str] = field(default_factory=list)


@dataclass
class Flavours:
    portable: str  # every ONNX runtime (the selector as a model-local function)
    tensorrt: str | None = None  # a bare DFlash2Selector node for the TensorRT plugin
    cpu_q4: str | None = None  # int4: MatMulNBits as ai.dflash2.Q4MatMul (dflash2.export.q4_flavour), where it runs


@dataclass
class GraphIo:
    inputs: list[IoSpec]
    outputs: list[IoSpec]


KV_KINDS = ("prefix", "fixed", "gqa-shared")
# The role vocabulary of the signatures (dflash2.export.signature names the tensors): what every graph of a kind
# must bind, and what each capability adds. The runtime reads these roles and nothing else.
REQUIRED_ROLES = {"target": ({"ids"}, {"next_ids", "context", "logits"}),
                  "drafter": ({"context", "anchor"}, {"draft_ids", "confidence"})}
CAPABILITY_ROLES = {"logits": (set(), {"logits"}), "confidence": (set(), {"confidence"}),
                    "lattice": (set(), {"cand_ids"}),
                    "sampled-walk": ({"uniforms", "temperature"}, {"draft_probs"})}


def capabilities_of(inputs: dict, outputs: dict) -> list[str]:
    """The capabilities a signature's roles give it (the manifest's list must be exactly these)."""
    return [c for c, (i, o) in CAPABILITY_ROLES.items() if i <= set(inputs) and o <= set(outputs)]


@dataclass
class KvSignature:
    """How a graph binds its KV cache (dflash2.runtime.binding has one class per kind):
    prefix      past = [rows [0, P) of the sequence buffer], present = [rows [P, P + n)]
    fixed       past = [the whole buffer], length = its valid rows, present = [n rows to a staging buffer]
    gqa-shared  past = per layer K, V buffers, present = the same buffers (written in place), length = valid rows
    """
    kind: str
    past: list[str]
    present: list[str]
    length: str | None = None


STATE_KINDS = ("rows",)


@dataclass
class StateSignature:
    """How a hybrid target (Gated DeltaNet layers) binds its recurrent state (dflash2.runtime.state.RowStates):
    rows  past = the state tensors, each [1, *row]: the state before the step;
          present = one per past tensor, in its order, each [W', *row], W' = min(n, window): the state after each
          of the step's last W' rows (so any accepted prefix of a verify of <= window rows has its state kept)
    Any number of state tensors (>= 1): the Qwen3.5 export binds two per GDN layer (conv_state.{j} [1, C, K-1],
    rec_state.{j} [1, Hv, dk, dv]: dflash2.export.signature.state_names); a manifest of the stacked binding (two
    tensors [1, Lg, ...]) reads the same way.
    rows: the per-row shape of each past tensor; dtypes: each element type;
    window: W, the most rows whose states one step keeps (the pair's block size)."""
    kind: str
    past: list[str]
    present: list[str]
    rows: list[list[int]]
    dtypes: list[str]
    window: int

    def problems(self, where: str, io: "GraphIo | None") -> list[str]:
        """The binding is well formed and, where the graph's io is given, agrees with its tensors' shapes and
        element types. (Fields that failed their type check are None here, already reported.)"""
        out, w = [], f"{where}.state"
        if self.kind is not None and self.kind not in STATE_KINDS:
            out.append(f"{w}.kind: expected one of {list(STATE_KINDS)}, found {self.kind!r}")
        if self.past is not None and not self.past:
            out.append(f"{w}.past: expected at least 1 state tensor, found none")
        for name in ("present", "rows", "dtypes"):  # one per past tensor, in its order
            value = getattr(self, name)
            if value is not None and self.past and len(value) != len(self.past):
                out.append(f"{w}.{name}: expected {len(self.past)} entries (one per state.past tensor), found "
                           f"{len(value)}")
        if self.window is not None and self.window < 1:
            out.append(f"{w}.window: expected >= 1, found {self.window}")
        for i, row in enumerate(self.rows or []):
            if row is not None and (not row or any(not isinstance(d, int) or d < 1 for d in row)):
                out.append(f"{w}.rows[{i}]: expected a shape of positive ints, found {row}")
        for i, dt in enumerate(self.dtypes or []):
            if dt is not None and dt not in DTYPE_NAMES:
                out.append(f"{w}.dtypes[{i}]: expected one of {list(DTYPE_NAMES)}, found {dt!r}")
        names = [n for n in (self.past or []) + (self.present or []) if n is not None]
        if len(set(names)) != len(names):
            out.append(f"{w}: expected distinct tensor names, found past {self.past}, present {self.present}")
        if out or io is None or None in (self.past, self.present, self.rows, self.dtypes) or \
                io.inputs is None or io.outputs is None:
            return out
        specs = [{s.name: s for s in io.inputs if s is not None}, {s.name: s for s in io.outputs if s is not None}]
        for side, names, lead in ((0, self.past, "1"), (1, self.present, "W'")):
            for name, row, dt in zip(names, self.rows, self.dtypes):
                spec = specs[side].get(name)
                if spec is None:
                    out.append(f"{w}: {name} is not an {('input', 'output')[side]} of the graph "
                               f"({sorted(specs[side])})")
                    continue
                shape = list(spec.shape or [])
                if shape[1:] != row or (side == 0 and shape[:1] != [1]):
                    out.append(f"{w}: {name} expected shape [{', '.join(map(str, [lead, *row]))}], found {shape}")
                if spec.dtype != dt:
                    out.append(f"{w}: {name} expected element type {dt}, found {spec.dtype}")
        return out


@dataclass
class Signature:
    """A graph's typed contract with the runtime: tensor name per role (`ids`, `next_ids`, `draft_ids`, ...),
    its KV binding, and what it can do. Written by the export (dflash2.export.signature); nothing after the
    export knows a tensor name."""
    inputs: dict[str, str]
    outputs: dict[str, str]
    kv: KvSignature | None = None  # None: a graph without a cache (the standalone selector)
    capabilities: list[str] = field(default_factory=list)  # "logits", "confidence", "lattice", "sampled-walk"
    state: StateSignature | None = None  # a hybrid target's recurrent state; None: a graph without one
    window: WindowSignature | None = None  # the sliding-window layers' bounded KV; None: every layer on `kv`

    def names(self) -> tuple[set[str], set[str]]:
        """(input names, output names) the signature binds."""
        kv = self.kv or KvSignature("", [], [])
        ins = set((self.inputs or {}).values()) | set(kv.past or []) | ({kv.length} if kv.length else set())
        outs = set((self.outputs or {}).values()) | set(kv.present or [])
        if self.state is not None:
            ins |= set(self.state.past or [])
            outs |= set(self.state.present or [])
        if self.window is not None:
            w = self.window
            ins |= set(w.past or []) | {n for n in (w.base, w.length) if n}
            outs |= set(w.present or [])
        return ins, outs

    def has(self, capability: str) -> bool:
        return capability in (self.capabilities or [])

    def problems(self, where: str, io: "GraphIo | None", graph: str = "") -> list[str]:
        """The signature agrees with the graph's own io: every name it binds exists, every graph input is bound,
        and its KV binding has the tensors its kind needs. (Fields that failed their type check are None here,
        already reported: each rule skips them.)"""
        out, kv = [], self.kv
        if kv is not None:
            if kv.kind not in KV_KINDS:
                out.append(f"{where}.kv.kind: expected one of {list(KV_KINDS)}, found {kv.kind!r}")
            past, present = kv.past or [], kv.present or []
            one = kv.kind in ("prefix", "fixed")
            if one and (len(past) != 1 or len(present) != 1):
                out.append(f"{where}.kv: a {kv.kind} binding expects one past and one present tensor, found "
                           f"{len(past)} and {len(present)}")
            if kv.kind == "gqa-shared" and len(past) != len(present):
                out.append(f"{where}.kv: a gqa-shared binding expects a present tensor per past one, found "
                           f"{len(past)} and {len(present)}")
            if kv.kind in ("fixed", "gqa-shared") and not kv.length:
                out.append(f"{where}.kv.length: expected the valid-length input of a {kv.kind} binding, found none")
            if len(set(past)) != len(past) or len(set(present)) != len(present):
                out.append(f"{where}.kv: expected distinct tensor names, found past {past}, present {present}")
        if self.inputs is not None and self.outputs is not None and graph in REQUIRED_ROLES:
            need_in, need_out = REQUIRED_ROLES[graph]
            for cap in self.capabilities or []:
                if isinstance(cap, str) and cap in CAPABILITY_ROLES:
                    need_in, need_out = need_in | CAPABILITY_ROLES[cap][0], need_out | CAPABILITY_ROLES[cap][1]
            missing = sorted(need_in - set(self.inputs)) + sorted(need_out - set(self.outputs))
            if missing:
                out.append(f"{where}: expected roles {missing} (a {graph} graph"
                           f"{' with ' + ', '.join(map(str, self.capabilities)) if self.capabilities else ''}), "
                           "found none")
            if kv is None:
                out.append(f"{where}.kv: expected the {graph} graph's KV binding, found none")
            caps = capabilities_of(self.inputs, self.outputs)
            if isinstance(self.capabilities, list) and sorted(map(str, self.capabilities)) != sorted(caps):
                out.append(f"{where}.capabilities: expected {caps} (what its roles give), found {self.capabilities}")
        if self.state is not None:
            if graph and graph != "target":
                out.append(f"{where}.state: expected none (only a target graph keeps a recurrent state), found "
                           f"a {self.state.kind!r} binding")
            out += self.state.problems(where, io)
        if self.window is not None:
            if graph == "drafter":  # every drafter layer slides: its context KV on the window buffer
                out += self.window.drafter_problems(where, kv)
            elif graph and graph != "target":
                out.append(f"{where}.window: expected none (only a target or drafter graph has sliding-window "
                           f"layers), found a {self.window.kind!r} binding")
            out += self.window.problems(where, io)
        if out or io is None or self.inputs is None or self.outputs is None or io.inputs is None or io.outputs is None:
            return out
        ins, outs = self.names()
        have_in = {s.name for s in io.inputs if s is not None}
        have_out = {s.name for s in io.outputs if s is not None}
        if not all(isinstance(n, str) for n in ins | outs | have_in | have_out):
            return out  # a name that is not a string: reported by the type check
        if ins != have_in:
            out.append(f"{where}: inputs expected {sorted(have_in)} (the graph's), found {sorted(ins)} in its signature")
        if not outs <= have_out:
            out.append(f"{where}: outputs {sorted(outs - have_out)} of its signature are not outputs of the graph "
                       f"({sorted(have_out)})")
        return out


@dataclass
class Graph:
    flavours: Flavours
    data: str  # the external data file(s) its flavours read, ", "-joined (a drafter reads the target's embedding)
    inputs: list[IoSpec]  # of the portable flavour
    outputs: list[IoSpec]
    seconds: float = 0.0
    # the TensorRT flavour's own inputs/outputs where it is a separate, fixed-shape graph (target, drafter:
    # whole KV buffer + valid length instead of the prefix view); None: the portable ones
    tensorrt_io: GraphIo | None = None
    signature: Signature | None = None  # of the portable flavour (required: checked)
    tensorrt_signature: Signature | None = None  # of the TensorRT flavour where it is a separate graph

    @property
    def tensorrt(self) -> GraphIo:
        """Inputs / outputs of the file TensorRT parses."""
        return self.tensorrt_io or GraphIo(self.inputs, self.outputs)


@dataclass
class Deviation:
    """A quantized graph vs the fp32 PyTorch reference: measured, not judged by fp32 tolerances."""

    judged: str  # what the graph was held to instead (e.g. "deviation from fp32 (int4 weights)")
    top1_agreement: float | None = None  # target: share of validation positions with the reference's argmax
    max_logit_error: float | None = None  # target: max |logit - reference logit|


@dataclass
class Validation:
    """ONNX Runtime vs PyTorch right after export, per graph."""

    ok: bool
    failures: list[str]
    steps: dict[str, Any] = field(default_factory=dict)  # "step0" -> output -> max abs/rel or id mismatches
    skipped: str | None = None  # why the graph was not run (e.g. bf16 with no provider for it)
    deviation: Deviation | None = None  # set for quantized graphs (then `steps` holds their deviation)


@dataclass
class QuantizedGraph:
    """What quantization did to one graph (dflash2.export.quantize)."""

    weight_matmuls: int  # MatMuls with a constant weight (after the Gemm / Transpose rewrite)
    quantized: int  # of them, now quantized
    lm_heads: list[str]  # node names of the LM head MatMuls
    kept_fp32: list[str]  # node names left in float
    weight_mb_before: float
    weight_mb_after: float
    gemm_rewritten: int = 0
    fused: dict[str, int] = field(default_factory=dict)  # rewrite -> count (dflash2.export.fuse)
    native: dict[str, int] = field(default_factory=dict)  # ggml block type -> MatMuls carrying those blocks as they are


@dataclass
class Quantization:
    """The export's weight quantization (dflash2-export --quantize); engines copy it from the export."""

    method: str  # "int4" | "int8" (ONNX Runtime MatMulNBits) | "int4_awq" | "fp8" | "int8_qdq" (modelopt Q/DQ)
    backend: str  # the runtime the quantized graphs are for: "onnxruntime" | "tensorrt"
    library: str  # the quantizer that wrote them
    bits: int
    format: str
    graphs: dict[str, QuantizedGraph]
    block_size: int | None = None
    accuracy_level: int | None = None
    symmetric: bool | None = None
    lm_head: bool = True  # LM heads quantized too
    drafter: bool = True  # drafter graph quantized too
    fuse: bool = False  # ONNX Runtime fusions applied before quantizing (dflash2.export.fuse)
    calibration: str | None = None  # what calibrated activation ranges (Q/DQ methods)
    native: str | None = None  # the GGUF whose quantized blocks the target carries unchanged (not requantized)
    drafter_method: str | None = None  # the drafter's own "int4" | "int8" | "int8-dynamic" (None: method)
    drafter_block_size: int | None = None  # the drafter's own block size (None: block_size)
    lossless_against: str = "the quantized target: speculative ids == its own greedy ids"


@dataclass
class Sources:
    drafter: str
    target: str


@dataclass
class Plugin:
    path: str
    sha256: str
    op: str
    plugin_version: str
    plugin_namespace: str
    contract_version: int
    abi_version: int


@dataclass
class BuildInfo:
    workspace_mb: int | None = None
    timing_cache: str | None = None


@dataclass
class ProfileRecord:
    name: str
    dims: dict[str, list[int]]  # symbolic dim -> [min, opt, max]
    shapes: dict[str, dict[str, list[int]]]  # input -> {"min", "opt", "max"} shapes


@dataclass
class EngineEntry:
    file: str
    onnx: str
    inputs: list[IoSpec]
    outputs: list[IoSpec]
    profiles: list[ProfileRecord]
    seconds: float | None = None
    signature: Signature | None = None  # the signature of the graph the engine was built from (required: checked)

