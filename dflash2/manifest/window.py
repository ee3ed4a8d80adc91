"""The window buffer's contract, once for the target and the drafter: its record (`WindowSignature`, a field of a
graph's Signature) and its sizing rule (runtime.window.CompactingKv allocates by it). Here, below the stages, so
that the runtime that allocates it and dflash2-build that profiles it read one rule (engines must not import the
runtime)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: records imports this module
    from dflash2.manifest.records import GraphIo

# the most rows one step writes, beyond the block: a long prefill is cut into steps of this many rows, so a big
# window (Muse-Glimmer's 2048) costs window + 2 x 512 rows rather than a prompt's length
MAX_STEP = 512
# the buffer's base (the real position of row 0) is always a multiple of ALIGN. Why: a key's column in the window
# rows is its position - base, and ONNX Runtime's softmax sums a row's columns in SIMD lanes (8 floats with AVX2,
# 16 with AVX-512, unrolled): a k-row verify and the 1-row decodes at the same positions compact at different
# commit points, and with bases that differ by other than a multiple of the lane pattern the same keys land in
# other lanes and the sums round differently. Measured on an AVX-512 CPU (runtime.invariance's row check, 3224 rows
# of a tiny gpt-oss pair with window 100): 1487 rows differ (up to 7.6e-6) with base = pos - keep, 450 with ALIGN
# 8, none with 16 or 64. 64 (16 lanes x 4) leaves a margin for wider unrolling; it costs ALIGN - 1 buffer rows
ALIGN = 64


def window_rows(sig: WindowSignature, block_size: int) -> tuple[int, int]:
    """(step, capacity C) of a window buffer: step = the most rows one step may write (>= the block, so a verify
    always fits; >= keep + 1 up to MAX_STEP), C = keep + ALIGN - 1 + 2 x step: a compaction keeps keep .. keep +
    ALIGN - 1 rows (its base aligned down), then room for a step and slack of another (a compaction every >= step
    tokens)."""
    step = max(block_size, min(sig.keep + 1, MAX_STEP))
    return step, sig.keep + ALIGN - 1 + 2 * step


WINDOW_KINDS = ("compacting",)


@dataclass
class WindowSignature:
    """The sliding-window layers' own KV binding (dflash2.runtime.window.CompactingKv): their rows live in a buffer
    of about window + a step + slack rows, not max_seq_len. The graph keeps the other layers on `kv`.
    compacting  past = [the valid rows [0, v) of the window buffer], present = [the step's rows, written at
                [v, v + n)], base = an int64 [1] input: the real position of row 0 (rotary and window mask
                read real positions); length (the fixed flavour): past is the whole buffer and length its valid
                rows. Before a step at a committed position, and only there, the runtime moves the last `keep`
                rows to the front when the step would not fit (base moves with them): inside a verify nothing
                is evicted, so rollback stays "commit fewer rows".
    layers: the model's layer indices the buffer holds, in its order; keep: the rows any later query can see
    (W - 1 for a causal window q - k < W).
    A drafter whose every layer slides (its context KV is one tensor [rows, Ld, 2, kv, hd] of every layer) has a
    window binding that REPLACES its KV binding: the same past / present / length tensors, layers 0 .. Ld - 1, keep
    = W - 1 (the block's first query, at the block start, sees context rows q - k < W: fused_drafter.sliding). The
    drafter writes committed context rows only (never a verify's), so its every step is at a commit point."""
    kind: str
    past: list[str]
    present: list[str]
    base: str
    layers: list[int]
    keep: int
    length: str | None = None

    def split_rows(self, row: list[int]) -> tuple[list[int], list[int]]:
        """(the KV binding's row, this buffer's row) from a manifest row [L, 2, kv, hd] that counts every layer: the
        buffer takes its layers off the first axis (kv.rows.target counts them all; the runtime and the manifest's io
        check both read it this way). Unchecked: callers judge the counts."""
        Lw = len(self.layers)
        return [row[0] - Lw, *row[1:]], [Lw, *row[1:]]

    def problems(self, where: str, io: "GraphIo | None" = None) -> list[str]:
        """The binding is well formed and, where the graph's io is given, agrees with its tensors: past an input
        [rows, len(layers), ...] and present an output of the same row and element type, base an int64 [1] input,
        length an int32 [1] input. (Fields that failed their type check are None here, already reported.)"""
        out, w = [], f"{where}.window"
        if self.kind is not None and self.kind not in WINDOW_KINDS:
            out.append(f"{w}.kind: expected one of {list(WINDOW_KINDS)}, found {self.kind!r}")
        for name in ("past", "present"):
            value = getattr(self, name)
            if value is not None and len(value) != 1:
                out.append(f"{w}.{name}: expected one tensor, found {value}")
        if self.layers is not None and (not self.layers or len(set(self.layers)) != len(self.layers)
                                        or any(not isinstance(i, int) or i < 0 for i in self.layers)):
            out.append(f"{w}.layers: expected distinct layer indices >= 0 (at least one), found {self.layers}")
        if self.keep is not None and self.keep < 0:
            out.append(f"{w}.keep: expected >= 0, found {self.keep}")
        names = [n for n in (self.past or []) + (self.present or []) + [self.base, self.length] if n is not None]
        if len(set(names)) != len(names):
            out.append(f"{w}: expected distinct tensor names, found past {self.past}, present {self.present}, "
                       f"base {self.base!r}, length {self.length!r}")
        if out or io is None or None in (self.past, self.present, self.base, self.layers) or \
                io.inputs is None or io.outputs is None:
            return out
        return out + self._io_problems(w, io)

    def _io_problems(self, w: str, io: "GraphIo") -> list[str]:
        out, sides = [], ({s.name: s for s in io.inputs if s}, {s.name: s for s in io.outputs if s})
        specs = [sides[0].get(self.past[0]), sides[1].get(self.present[0])]
        for side, (name, spec) in enumerate(zip((self.past[0], self.present[0]), specs)):
            shape = list(spec.shape or []) if spec is not None else None
            if spec is None:
                out.append(f"{w}: {name} is not an {('input', 'output')[side]} of the graph ({sorted(sides[side])})")
            elif len(shape) != 5 or shape[1] != len(self.layers):
                out.append(f"{w}: {name} expected shape [rows, {len(self.layers)} (window.layers), 2, kv, hd], "
                           f"found {shape}")
        rows = [(s.dtype, list(s.shape or [])[1:]) for s in specs if s is not None]
        if len(rows) == 2 and rows[0] != rows[1]:
            out.append(f"{w}: {self.present[0]} expected the rows of {self.past[0]} ({rows[0][0]} {rows[0][1]}), "
                       f"found {rows[1][0]} {rows[1][1]}")
        for name, dt in ((self.base, "int64"), (self.length, "int32")):
            spec = sides[0].get(name)
            if name is not None and spec is None:
                out.append(f"{w}: {name} is not an input of the graph ({sorted(sides[0])})")
            elif name is not None and (spec.dtype != dt or list(spec.shape or []) != [1]):
                out.append(f"{w}: {name} expected {dt} [1], found {spec.dtype} {list(spec.shape or [])}")
        return out

    def drafter_problems(self, where: str, kv) -> list[str]:
        """A drafter's window binding replaces its KV binding `kv` (a KvSignature; class docstring): the same
        tensors, every layer in order."""
        out, w = [], f"{where}.window"
        if kv is None:
            return [f"{w}: expected beside the drafter's KV binding (whose tensors it takes over), found no kv"]
        for name, mine, theirs in (("past", self.past, kv.past), ("present", self.present, kv.present),
                                   ("length", self.length, kv.length)):
            if mine is not None and theirs is not None and mine != theirs:
                out.append(f"{w}.{name}: expected the drafter's kv.{name} {theirs!r} (the window buffer replaces "
                           f"the context KV), found {mine!r}")
        if isinstance(self.layers, list) and self.layers != list(range(len(self.layers))):
            out.append(f"{w}.layers: expected every drafter layer in order 0 .. {len(self.layers) - 1} (a drafter "
                       f"whose every layer slides), found {self.layers}")
        return out
