"""The two folder manifests, `ExportManifest` (dflash2-export) and `EngineManifest` (dflash2-build), their format
constants and their rules beyond field types (`check()`): what `dflash2.manifest.load` holds a folder to."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from dflash2.dtypes import GRAPH_DTYPES
from dflash2.errors import Dflash2Error
from dflash2.manifest.jsonio import _plain
from dflash2.manifest.records import (BuildInfo, Context, DraftVocab, EngineEntry, FileEntry, Graph, GraphIo, IoSpec,
                                      Kv, Plugin, Quantization, Selector, Signature, Sources, Tokenizer, Validation)
from dflash2.ops import contract as C

EXPORT_FORMAT = "dflash2-export"
ENGINE_FORMAT = "dflash2-engines"
FORMAT_VERSION = 3  # 2: typed manifests sealed by manifest_sha256; 3: + typed graph signatures
MIN_CONTRACT_VERSION = 3  # older exports (no confidence / sampling i/o) are refused: re-export them
NAME = "manifest.json"
Q4_FLAVOUR = "cpu_q4"  # Flavours.cpu_q4; validation["<graph>.cpu_q4"]: that flavour against the portable graph
ROW_CHECK = "target.rows"  # validation[ROW_CHECK]: the export's row-invariance check (dflash2.runtime.invariance)


class ManifestError(Dflash2Error):
    """Every problem of one manifest: `problems` lists them, the message shows them all."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.path, self.problems = str(path), list(problems)
        head = f"{path}: " + (problems[0] if len(problems) == 1 else f"{len(problems)} problems:")
        super().__init__(head + ("" if len(problems) == 1 else "\n  " + "\n  ".join(problems)))


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
        target_sig = (graphs.get("target") or (None,) * 3)[2]
        window = target_sig.window if target_sig is not None else None
        full_rows = rows and rows.target
        window_rule = []
        if window is not None and full_rows and isinstance(window.layers, list) and isinstance(full_rows[0], int):
            full_rows, slide_rows = window.split_rows(full_rows)
            past = window.past[0] if window.past else None
            shape = next((s.shape for s in (graphs["target"][0] or []) if s is not None and s.name == past), None)
            window_rule = [("kv.rows.target (the window buffer's layers)", slide_rows, shape, slice(1, None))]
        rules = [("kv.rows.drafter", rows and rows.drafter, dims("drafter", 0, "kv"), slice(1, None)),
                 # a gqa target's per-layer buffers [1, kv, cap, hd]: kv heads and head_dim
                 ("kv.rows.target[2:]", rows and rows.target and rows.target[2:], dims("target", 0, "kv"),
                  slice(1, None, 2)) if gqa else
                 ("kv.rows.target" + (" (less the window buffer's layers)" if window is not None else ""),
                  full_rows, dims("target", 0, "kv"), slice(1, None)),
                 *window_rule,
                 ("context.width", self.context and self.context.width, dims("target", 1, "context"), -1),
                 ("num_drafts", self.num_drafts, dims("drafter", 1, "draft_ids"), -1),
                 # the logits' rows: a resealed vocab_size reached ONNX Runtime as "invalid dimensions"
                 ("vocab_size", self.vocab_size, dims("target", 1, "logits"), -1)]
        problems = []
        for name, fact, shape, part in rules:
            if fact is None or not shape:
                continue
            want = shape[part]
            if not isinstance(want, str) and fact != want:  # (a symbolic dim is no fact to compare)
                problems.append(f"{name}: expected {want} (the {where} io shapes), found {fact}")
        target = (graphs.get("target") or (None,) * 3)[2]
        state = target.state if target is not None else None
        # a verify of B rows may accept only its first row: its state must be among the W' = min(B, W) kept
        if state is not None and isinstance(state.window, int) and isinstance(self.block_size, int) \
                and state.window < self.block_size:
            problems.append(f"target signature state.window: expected >= block_size = {self.block_size} (the "
                            f"{where} target keeps the states of a step's last window rows), found {state.window}")
        if where == "graphs'":  # the export's own graphs compute in its dtype: their KV buffers are of that type
            kv = graphs.get("target")
            sig = kv[2] if kv else None
            past = sig.kv.past[0] if sig is not None and sig.kv is not None and sig.kv.past else None
            spec = next((s for s in (kv[0] or []) if s is not None and s.name == past), None) if kv else None
            if spec is not None and isinstance(self.dtype, str) and isinstance(spec.dtype, str) \
                    and spec.dtype != self.dtype:
                problems.append(f"dtype: expected {spec.dtype} (the target graph's {past} element type), "
                                f"found {self.dtype!r}")
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
