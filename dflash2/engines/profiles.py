"""Optimization profiles from the export manifest: pure functions, no TensorRT.

Every dynamic input dim of every graph is one of the export's symbolic dims (manifest io specs):
    n     rows of this step (prompt tokens, verify block, context rows)
    past  rows already in the KV cache (prefix view of the preallocated buffer: portable flavour)
    cap   rows of the whole KV buffer (the fixed-shape TensorRT flavour): max_seq_len, always
    batch selector batch
    window_cap   rows of the whole window buffer (a windowed target's fixed flavour: manifest.WindowSignature):
                 the runtime's capacity keep + 2 x step (manifest.window.window_rows), always
    window_past  the window buffer's valid rows (its portable flavour): 0 .. capacity - 1
A profile is a box of (min, opt, max) per symbolic dim; an input's min/opt/max shapes substitute
those ranges into its io spec. TensorRT tunes kernels at `opt`, so the target gets two profiles:
prefill (long n, empty cache) and decode/verify (n <= S+1, the steady state), as in Edge-LLM.

Bounds: rows past + n must fit the max_seq_len buffer and n >= 1, so past <= max_seq_len - 1. A
profile records only the dims its graph's inputs use.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash2.errors import Dflash2Error
from dflash2.manifest import ExportManifest, IoSpec, ModelFacts

SELECTOR_MAX_BATCH = 8


class ProfileError(Dflash2Error):
    pass


@dataclass(frozen=True)
class DimRange:
    min: int
    opt: int
    max: int

    def __post_init__(self):
        if not 0 <= self.min <= self.opt <= self.max:
            raise ProfileError(f"dim range expected 0 <= min <= opt <= max, found ({self.min}, {self.opt}, {self.max})")


@dataclass(frozen=True)
class Profile:
    name: str
    dims: dict[str, DimRange]  # symbolic dim -> range
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]  # dynamic input -> (min, opt, max)

    def to_dict(self) -> dict:
        return {"name": self.name,
                "dims": {d: [r.min, r.opt, r.max] for d, r in self.dims.items()},
                "shapes": {n: {"min": list(s[0]), "opt": list(s[1]), "max": list(s[2])}
                           for n, s in self.shapes.items()}}


def limits(export: ModelFacts, max_seq_len: int | None = None, max_prefill: int | None = None) -> tuple[int, int]:
    """(max_seq_len, max_prefill) for the engines: --max-seq-len may only shrink the export's capacity."""
    exported, block = export.max_seq_len, export.block_size
    T = exported if max_seq_len is None else int(max_seq_len)
    if T > exported:
        raise ProfileError(f"--max-seq-len: expected <= the export's max_seq_len {exported}, found {T} "
                           f"(re-export with dflash2-export --max-seq-len {T})")
    if T < block + 2:
        raise ProfileError(f"--max-seq-len: expected >= block_size + 2 = {block + 2}, found {T}")
    P = T if max_prefill is None else int(max_prefill)
    if not 1 <= P <= T:
        raise ProfileError(f"--max-prefill: expected 1 <= max_prefill <= max_seq_len {T}, found {P}")
    return T, P


def dim_boxes(graph: str, export: ModelFacts, T: int, P: int) -> list[tuple[str, dict[str, DimRange]]]:
    """Named profiles of one graph as ranges of its symbolic dims."""
    S1 = export.block_size  # S + 1 = num_drafts + 1 rows in a verify step
    mid = T // 2  # opt past: the middle of the cache, where decode spends most of its steps
    cap = {"cap": DimRange(T, T, T)}  # the fixed-shape flavours bind the whole KV buffer: T rows, always
    if graph == "target":
        window = window_dims(export)
        return [("prefill", {"n": DimRange(1, P, P), "past": DimRange(0, 0, T - 1), **cap, **window}),
                ("decode", {"n": DimRange(1, S1, S1), "past": DimRange(0, mid, T - 1), **cap, **window})]
    if graph == "drafter":
        # n: the prompt after prefill (<= max_prefill), then acc + 1 <= S + 1 rows per round
        return [("draft", {"n": DimRange(1, S1, max(P, S1)), "past": DimRange(0, mid, T - 1), **cap})]
    if graph == "selector":
        return [("batch", {"batch": DimRange(1, 1, SELECTOR_MAX_BATCH)})]
    raise ProfileError(f"graph {graph!r}: no profile rule (expected one of target, drafter, selector)")


def window_dims(export: ModelFacts) -> dict[str, DimRange]:
    """The window buffer's dims of a windowed target (none without one): its fixed flavour binds the whole buffer,
    CompactingKv's capacity, whatever the step; the portable flavour's valid rows stay below it."""
    g = (getattr(export, "graphs", None) or {}).get("target")
    sig = g and (g.tensorrt_signature or g.signature)
    if sig is None or sig.window is None:
        return {}
    from dflash2.manifest.window import window_rows  # the runtime's own sizing rule, one place

    C = window_rows(sig.window, export.block_size)[1]
    return {"window_cap": DimRange(C, C, C), "window_past": DimRange(0, sig.window.keep, C - 1)}


def input_shapes(graph: str, io_inputs: list[IoSpec], dims: dict[str, DimRange]) -> dict[str, tuple]:
    """min/opt/max shapes of every input with a symbolic dim; static inputs need no profile entry."""
    out = {}
    for spec in io_inputs:
        sym = [d for d in spec.shape if isinstance(d, str)]
        if not sym:
            continue
        missing = [d for d in sym if d not in dims]
        if missing:
            raise ProfileError(f"graph {graph}: input {spec.name} has symbolic dim(s) {missing} with no range "
                               f"(expected only {sorted(dims)})")
        out[spec.name] = tuple(tuple(getattr(dims[d], k) if isinstance(d, str) else int(d) for d in spec.shape)
                                  for k in ("min", "opt", "max"))
    return out


def plan_profiles(export: ExportManifest, max_seq_len: int | None = None,
                  max_prefill: int | None = None) -> dict[str, list[Profile]]:
    """graph -> its optimization profiles, for every graph of the export manifest."""
    T, P = limits(export, max_seq_len, max_prefill)
    plan = {}
    for graph, g in export.graphs.items():
        inputs = g.tensorrt.inputs  # of the file TensorRT parses
        used = {d for spec in inputs for d in spec.shape if isinstance(d, str)}
        plan[graph] = [Profile(name, {d: r for d, r in dims.items() if d in used}, input_shapes(graph, inputs, dims))
                       for name, dims in dim_boxes(graph, export, T, P)]
    return plan

