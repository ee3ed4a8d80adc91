"""The folder contracts: `ExportManifest` (dflash2-export) and `EngineManifest` (dflash2-build).

Every stage after export reads its input folder through ONE `load()`, which checks, and reports
all at once as (file, field, expected, found):
    the JSON is an object, `format` is one this reader asked for, `format_version` and
    `contract_version` are not newer than this dflash2's ("made by a newer dflash2 (version X > Y)"),
    `manifest_sha256` matches the canonical JSON of the rest (an edited field is detected),
    every field is present with its type, no unknown field, the semantic rules of `check()`,
    and (check_files=True) every listed file exists with its recorded size and sha256.
ONE writer, `write()`, fills `files` (sha256 + size of every file) and `manifest_sha256`.
Readers use attributes (`m.kv.rows.target`); nothing outside this module indexes a manifest by key.

Plain JSON, hashlib and dataclasses: no torch, no onnx (the runtime imports this on edge boards).

How to add a field (no redesign needed):
  - a field or an optional section: add it to the dataclass with a default (`None` for a section,
    e.g. `quantization: Quantization | None = None` with `@dataclass class Quantization: method: str;
    bits: int; block_size: int | None = None; graphs: list[str] = field(default_factory=list)`).
    Manifests written before it load with the default; an older dflash2 reading a newer file
    names the field it does not know. Types allowed: int, float, str, bool, Any, list[X],
    dict[str, X], X | None, and dataclasses of those.
  - a field the engine folder must carry too: put it in `ModelFacts` (both manifests have it; the
    engine manifest copies every ModelFacts field from its export).
  - a new graph output (e.g. a drafter `confidence` output): nothing to change here; graphs list
    their outputs as `IoSpec`s read from the ONNX file.
  - a change that makes an older reader misread a file (a field changes meaning, a required field):
    bump FORMAT_VERSION; older readers then refuse it as made by a newer dflash2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from dflash2 import verified
from dflash2.dtypes import GRAPH_DTYPES
from dflash2.errors import Dflash2Error
from dflash2.folders import write_atomic
from dflash2.ops import contract as C

EXPORT_FORMAT = "dflash2-export"
ENGINE_FORMAT = "dflash2-engines"
FORMAT_VERSION = 3  # 2: typed manifests sealed by manifest_sha256; 3: + typed graph signatures
MIN_CONTRACT_VERSION = 3  # older exports (no confidence / sampling i/o) are refused: re-export them
NAME = "manifest.json"


class ManifestError(Dflash2Error):
    """Every problem of one manifest: `problems` lists them, the message shows them all."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.path, self.problems = str(path), list(problems)
        head = f"{path}: " + (problems[0] if len(problems) == 1 else f"{len(problems)} problems:")
        super().__init__(head + ("" if len(problems) == 1 else "\n  " + "\n  ".join(problems)))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- records

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


@dataclass
class Signature:
    """A graph's typed contract with the runtime: tensor name per role (`ids`, `next_ids`, `draft_ids`, ...),
    its KV binding, and what it can do. Written by the export (dflash2.export.signature); nothing after the
    export knows a tensor name."""
    inputs: dict[str, str]
    outputs: dict[str, str]
    kv: KvSignature | None = None  # None: a graph without a cache (the standalone selector)
    capabilities: list[str] = field(default_factory=list)  # "logits", "confidence", "lattice", "sampled-walk"

    def names(self) -> tuple[set[str], set[str]]:
        """(input names, output names) the signature binds."""
        kv = self.kv or KvSignature("", [], [])
        ins = set((self.inputs or {}).values()) | set(kv.past or []) | ({kv.length} if kv.length else set())
        return ins, set((self.outputs or {}).values()) | set(kv.present or [])

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


# ------------------------------------------------------------------------------------------- manifests

@dataclass(kw_only=True)
class ModelFacts:
    """What the runtime needs about the model pair: in both manifests (engines copy it from the export)."""

    dtype: str
    max_seq_len: int
    block_size: int
    num_drafts: int
    drafter_version: int
    tap_ids: list[int]
    mask_token_id: int
    vocab_size: int
    eos_token_ids: list[int]
    context: Context
    kv: Kv
    selector: Selector | None
    draft_vocab: DraftVocab | None = None
    quantization: Quantization | None = None  # None: float weights of `dtype`

    def check(self) -> list[str]:
        """Rules beyond field types; problems as 'field: expected X, found Y'."""
        # A field that failed its type check is None here (already reported): each rule skips it.
        problems = []
        if self.dtype is not None and self.dtype not in GRAPH_DTYPES:
            problems.append(f"dtype: expected one of {list(GRAPH_DTYPES)}, found {self.dtype!r}")
        if self.drafter_version not in (1, 2, None):
            problems.append(f"drafter_version: expected 1 or 2, found {self.drafter_version}")
        elif self.drafter_version is not None and (self.selector is None) == (self.drafter_version == 2):
            problems.append(f"selector: expected {'a record' if self.drafter_version == 2 else 'null'} for "
                            f"drafter_version {self.drafter_version}, found {self.selector!r}")
        if self.block_size is not None and self.block_size < 2:
            problems.append(f"block_size: expected >= 2, found {self.block_size}")
        if None not in (self.max_seq_len, self.block_size) and self.max_seq_len < self.block_size:
            # the runtime sizes its buffers from it: -1 surfaced as numpy's "negative dimensions"
            problems.append(f"max_seq_len: expected >= block_size = {self.block_size}, found {self.max_seq_len}")
        V = self.vocab_size
        if V is not None and V < 1:
            problems.append(f"vocab_size: expected >= 1, found {V}")
        elif V is not None:  # ids the graphs are fed / compared against: outside [0, V) they never match or crash
            if self.mask_token_id is not None and not 0 <= self.mask_token_id < V:
                problems.append(f"mask_token_id: expected an id in [0, {V}) (vocab_size), found {self.mask_token_id}")
            bad = [e for e in self.eos_token_ids or [] if e is not None and not 0 <= e < V]
            if bad:
                problems.append(f"eos_token_ids: expected ids in [0, {V}) (vocab_size), found {bad}")
        if None not in (self.num_drafts, self.block_size) and self.num_drafts != self.block_size - 1:
            problems.append(f"num_drafts: expected block_size - 1 = {self.block_size - 1}, found {self.num_drafts}")
        return problems

    def io_problems(self, graphs: dict[str, tuple[list[IoSpec], list[IoSpec], Signature | None]],
                    where: str) -> list[str]:
        """The buffer facts the runtime allocates from must agree with the graphs' own io shapes, or the
        first step fails inside the engine: kv rows, context width, drafts per block. Tensors are found by
        their role in the graph's signature.
        graphs: name -> (inputs, outputs, signature) of the export's graphs or the engine folder's engines."""
        def dims(graph: str, io: int, role: str) -> list | None:
            specs, sig = (graphs.get(graph) or (None, None, None))[io] or [], (graphs.get(graph) or (None,) * 3)[2]
            if sig is None or sig.kv is None or sig.inputs is None or sig.outputs is None:
                return None
            name = sig.kv.past[0] if role == "kv" and sig.kv.past else (sig.inputs, sig.outputs)[io].get(role)
            return next((s.shape for s in specs if s is not None and s.name == name), None)

        def kind(graph: str) -> str | None:
            sig = (graphs.get(graph) or (None,) * 3)[2]
            return sig.kv.kind if sig is not None and sig.kv is not None else None

        rows = self.kv.rows if self.kv is not None else None
        gqa = kind("target") == "gqa-shared"
        rules = [("kv.rows.drafter", rows and rows.drafter, dims("drafter", 0, "kv"), slice(1, None)),
                 # a gqa target's per-layer buffers [1, kv, cap, hd]: kv heads and head_dim
                 ("kv.rows.target[2:]", rows and rows.target and rows.target[2:], dims("target", 0, "kv"),
                  slice(1, None, 2)) if gqa else
                 ("kv.rows.target", rows and rows.target, dims("target", 0, "kv"), slice(1, None)),
                 ("context.width", self.context and self.context.width, dims("target", 1, "context"), -1),
                 ("num_drafts", self.num_drafts, dims("drafter", 1, "draft_ids"), -1)]
        problems = []
        for name, fact, shape, part in rules:
            if fact is None or not shape:
                continue
            want = shape[part]
            if fact != want:
                problems.append(f"{name}: expected {want} (the {where} io shapes), found {fact}")
        return problems


@dataclass(kw_only=True)
class Sealed:
    format: str
    format_version: int = FORMAT_VERSION
    contract_version: int = C.CONTRACT_VERSION
    created: str
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    files: dict[str, FileEntry] = field(default_factory=dict)
    manifest_sha256: str = ""

    def to_dict(self) -> dict:
        return _plain(self)


@dataclass(kw_only=True)
class ExportManifest(ModelFacts, Sealed):
    format: str = EXPORT_FORMAT
    tools: dict[str, str]
    target_config: dict[str, Any]
    drafter_config: dict[str, Any]
    graphs: dict[str, Graph]
    validation: dict[str, Validation]
    sources: Sources | None = None

    def signature(self, graph: str, tensorrt: bool = False) -> Signature:
        """The signature of a graph's portable flavour (or of its TensorRT flavour: the same one where the
        graph has no separate TensorRT file)."""
        g = self.graphs[graph]
        return (g.tensorrt_signature or g.signature) if tensorrt else g.signature

    def check(self) -> list[str]:
        problems = super().check()
        want = ("target", "drafter") + (("selector",) if self.drafter_version == 2 else ())
        problems += [f"graphs.{g}: expected a graph, found none" for g in want if g not in (self.graphs or {})]
        for n, g in (self.graphs or {}).items():
            if g is None:
                continue
            if g.signature is None:
                problems.append(f"graphs.{n}.signature: expected the graph's signature, found none (made by an "
                                "older dflash2: re-export with dflash2-export)")
            else:
                problems += g.signature.problems(f"graphs.{n}.signature", GraphIo(g.inputs, g.outputs), n)
            if g.tensorrt_io is not None and g.tensorrt_signature is None:
                problems.append(f"graphs.{n}.tensorrt_signature: expected the TensorRT flavour's signature, found none")
            elif g.tensorrt_signature is not None:
                problems += g.tensorrt_signature.problems(f"graphs.{n}.tensorrt_signature", g.tensorrt, n)
        io = {n: (g.inputs, g.outputs, g.signature) for n, g in (self.graphs or {}).items() if g is not None}
        return problems + self.io_problems(io, "graphs'")


@dataclass(kw_only=True)
class EngineManifest(ModelFacts, Sealed):
    format: str = ENGINE_FORMAT
    export_dir: str  # absolute path of the export (ONNX Runtime on an engine folder runs that export)
    export_manifest_sha256: str
    tensorrt_version: str
    precision: str
    export_max_seq_len: int
    max_prefill: int
    plugin: Plugin | None
    build: BuildInfo = field(default_factory=BuildInfo)
    engines: dict[str, EngineEntry]

    def signature(self, graph: str) -> Signature:
        """The signature of the graph the engine was built from."""
        return self.engines[graph].signature

    def check(self) -> list[str]:
        problems = super().check()
        problems += [f"engines.{g}: expected an engine (the runtime needs both target and drafter engines), "
                     f"found none" for g in ("target", "drafter") if g not in (self.engines or {})]
        for n, e in (self.engines or {}).items():
            if e is not None and e.signature is None:
                problems.append(f"engines.{n}.signature: expected the engine's signature, found none (made by an "
                                "older dflash2: rebuild with dflash2-build)")
            elif e is not None:
                problems += e.signature.problems(f"engines.{n}.signature", GraphIo(e.inputs, e.outputs), n)
        io = {n: (e.inputs, e.outputs, e.signature) for n, e in (self.engines or {}).items() if e is not None}
        return problems + self.io_problems(io, "engines'")


KINDS = {EXPORT_FORMAT: ExportManifest, ENGINE_FORMAT: EngineManifest}
Manifest = Union[ExportManifest, EngineManifest]


# ------------------------------------------------------------------------------------------- typed reading

def _type_name(tp) -> str:
    if dataclasses.is_dataclass(tp):
        return f"an object ({tp.__name__})"
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"an object of {_type_name(typing.get_args(tp)[1])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false", type(None): "null",
            Any: "anything"}.get(tp, str(tp))


def _found(value) -> str:
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
    text = json.dumps(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def _convert(tp, value, where: str, problems: list[str]):
    """value (parsed JSON) as type `tp`; appends 'where: expected T, found V' on mismatch."""
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{where or 'manifest'}: expected {_type_name(tp)}, found {_found(value)}")
            return None
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            problems.append(f"{where or 'manifest'}: unknown field(s) {unknown} (expected only {sorted(fields)}; "
                            f"made by a newer dflash2?)")
        kw = {}
        for name, f in fields.items():
            key = f"{where}.{name}" if where else name
            if name in value:
                kw[name] = _convert(hints[name], value[name], key, problems)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(f"{key}: expected {_type_name(hints[name])}, found nothing (missing)")
                kw[name] = None  # reported; None lets the remaining checks run and report too
        return tp(**kw)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        # an object / list for an optional record or list: its own problems ("bits: expected an integer"),
        # not "expected an object or null, found an object"
        shaped = [a for a in typing.get_args(tp) if isinstance(value, dict) and
                  (dataclasses.is_dataclass(a) or typing.get_origin(a) is dict) or
                  isinstance(value, list) and typing.get_origin(a) is list]
        if len(shaped) == 1:
            return _convert(shaped[0], value, where, problems)
        for arm in typing.get_args(tp):
            trial: list[str] = []
            out = _convert(arm, value, where, trial)
            if not trial:
                return out
        problems.append(f"{where}: expected {_type_name(tp)}, found {_found(value)}")
        return None
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{where}: expected {_type_name(tp)}, found {_found(value)}")
            return None
        (arg,) = typing.get_args(tp)
        return [_convert(arg, v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{where}: expected {_type_name(tp)}, found {_found(value)}")
            return None
        arg = typing.get_args(tp)[1]
        return {k: _convert(arg, v, f"{where}.{k}", problems) for k, v in value.items()}
    ok = (value is None if tp is type(None) else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else isinstance(value, tp))
    if not ok:
        problems.append(f"{where}: expected {_type_name(tp)}, found {_found(value)}")
        return None
    return float(value) if tp is float else value


def _plain(value):
    """A record as JSON-able data; optional fields left at their None default are omitted (readers
    fill the default back in), so e.g. a graph without a TensorRT flavour has no `tensorrt` key."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (getattr(value, f.name) is None and f.default is None)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def content_sha256(data: dict) -> str:
    """sha256 of the canonical JSON of a manifest without its own `manifest_sha256` field."""
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _newer(data: dict, key: str, ours: int) -> str | None:
    found = data.get(key)
    if isinstance(found, int) and not isinstance(found, bool) and found > ours:
        return (f"{key}: made by a newer dflash2 (version {found} > {ours}); upgrade dflash2 to read this "
                f"folder, or re-export with this one")
    return None


def file_problems(folder: Path, files: dict[str, FileEntry], rehash: bool = False) -> list[str]:
    """Every listed file exists with its recorded size and sha256. A file hashed before and unchanged
    since (size, mtime, inode: dflash2.verified) is not hashed again unless `rehash`."""
    problems = []
    record = verified.Record(folder)
    for name, meta in files.items():
        p = folder / name
        if not p.is_file():
            problems.append(f"files.{name}: expected a file of {meta.bytes} bytes, found none (missing)")
        elif p.stat().st_size != meta.bytes:
            problems.append(f"files.{name}: expected {meta.bytes} bytes, found {p.stat().st_size}")
        elif not rehash and record.trusted(name, meta.sha256):
            continue
        else:
            started = verified.now_ns()
            if sha256(p) != meta.sha256:
                problems.append(f"{name}: sha256 does not match the manifest (file changed after export)")
            else:
                record.add(name, meta.sha256, started)
    record.save()
    return problems


def remember_hashes(folder: Path, manifest: Manifest) -> None:
    """The hashes write() just took, recorded for `folder` (where the written folder now is: renamed, the files'
    inode and times unchanged), so the first start does not hash gigabytes again (dflash2.verified). A file
    written within RACY_NS of the hashing stays untrusted there and is hashed at its first check."""
    hashed = getattr(manifest, "hashed_ns", None)
    if hashed is None:
        return
    record = verified.Record(folder)
    for name, meta in manifest.files.items():
        record.add(name, meta.sha256, hashed)
    record.save()


def load(folder: str | Path, kinds: type | tuple[type, ...] = (ExportManifest, EngineManifest),
         check_files: bool = True, rehash: bool = False) -> Manifest:
    """The typed manifest of an export or engine folder; ManifestError lists every problem at once.
    rehash: hash every file even where dflash2.verified's record says it is unchanged since its last check."""
    folder = Path(folder)
    path = folder / NAME
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    formats = [k.__dataclass_fields__["format"].default for k in kinds]
    if not folder.is_dir():
        found = ("a file (give the folder that holds manifest.json)" if folder.is_file() else
                 "something that is not a folder" if folder.exists() else "no such directory")
        raise ManifestError(folder, [f"expected an export or engine folder, found {found}"])
    if not path.is_file():
        raise ManifestError(folder, [f"expected {NAME} (a folder written by dflash2-export or dflash2-build), "
                                     f"found none"])
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ManifestError(path, [f"expected valid JSON, found a parse error{where}"]) from None
    if not isinstance(data, dict):
        raise ManifestError(path, [f"expected a JSON object, found {_found(data)}"])
    if data.get("format") not in formats:
        raise ManifestError(path, [f"format: expected one of {formats}, found {data.get('format')!r}"])
    newer = [p for p in (_newer(data, "format_version", FORMAT_VERSION),
                         _newer(data, "contract_version", C.CONTRACT_VERSION)) if p]
    if newer:
        raise ManifestError(path, newer)
    old = data.get("contract_version")
    if isinstance(old, int) and not isinstance(old, bool) and old < MIN_CONTRACT_VERSION:
        raise ManifestError(path, [f"contract_version: expected >= {MIN_CONTRACT_VERSION}, found {old} (made by an "
                                   "older dflash2, before confidence and sampling: re-export with dflash2-export)"])
    if data.get("format_version") != FORMAT_VERSION:
        raise ManifestError(path, [f"format_version: expected {FORMAT_VERSION}, found {data.get('format_version')!r} "
                                   f"(made by an older dflash2: re-export / rebuild this folder)"])
    problems = []
    stored, actual = data.get("manifest_sha256"), content_sha256(data)
    if stored != actual:
        problems.append(f"manifest_sha256: expected {actual} (the sha256 of the manifest's content), found "
                        f"{stored!r}: {NAME} was edited after it was written; re-export / rebuild the folder")
    manifest = _convert(KINDS[data["format"]], data, "", problems)
    problems += manifest.check()
    if check_files:
        problems += checked_file_problems(folder, manifest, rehash)
    if problems:
        raise ManifestError(path, problems)
    return manifest


def checked_file_problems(folder: Path, manifest: Manifest, rehash: bool = False) -> list[str]:
    """file_problems for a loaded manifest's files. A deleted tokenizer file is not a broken folder: only
    text in / out needs it (and says so)."""
    optional = set((manifest.tokenizer.files or []) if manifest.tokenizer is not None else [])
    return file_problems(Path(folder), {n: f for n, f in (manifest.files or {}).items()
                                        if n not in optional or (Path(folder) / n).exists()}, rehash)


def check_files(folder: str | Path, manifest: Manifest, rehash: bool = False) -> None:
    """Raise ManifestError naming every file that is missing, resized or changed since it was written."""
    problems = checked_file_problems(Path(folder), manifest, rehash)
    if problems:
        raise ManifestError(Path(folder) / NAME, problems)


def file_table(folder: Path, names: list[str]) -> dict[str, FileEntry]:
    return {n: FileEntry(sha256(folder / n), (folder / n).stat().st_size) for n in sorted(names)}


def reseal(folder: Path, manifest: Manifest) -> Manifest:
    """Rewrite manifest.json after a change to the manifest alone (a validation record added): the file table
    and its hashing time stay as `write` made them."""
    data = manifest.to_dict()
    manifest.manifest_sha256 = data["manifest_sha256"] = content_sha256(data)
    write_atomic(folder / NAME, json.dumps(data, indent=2))
    return manifest


def write(folder: Path, manifest: Manifest) -> Manifest:
    """Checksum every file of the folder into manifest.files, seal, then write manifest.json atomically.
    `manifest.hashed_ns` says when the hashing began (remember_hashes)."""
    names = [p.name for p in folder.iterdir() if p.is_file() and p.name != NAME and not p.name.startswith(".")]
    manifest.hashed_ns = verified.now_ns()
    manifest.files = file_table(folder, names)
    data = manifest.to_dict()
    manifest.manifest_sha256 = data["manifest_sha256"] = content_sha256(data)
    write_atomic(folder / NAME, json.dumps(data, indent=2))
    return manifest
