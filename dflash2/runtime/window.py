"""The sliding-window layers' bounded KV: `CompactingKv`, built once from the target graph's `WindowSignature`.

A graph with a window binding keeps its sliding layers' K|V rows [C, Lw, 2, kv, hd] apart from the other layers'
(which stay on the ordinary KV binding, max_seq_len rows). C = keep + ALIGN - 1 + step + slack rows, keep = the
past rows any later query can see (W - 1 for a causal window W), step = the most rows one step writes: the buffer
never grows with the sequence. Row r holds real position base + r; the graph reads base (`window_base`) and computes the
rotary and the window mask from real positions.

Why compaction, and only at commit points: a verify of n rows may be accepted in part, and the next step must see
the window as if the rejected rows were never written. A wrapping ring would overwrite rows a rejected verify still
needs to roll back to (ONNX Runtime's own windowed cache has exactly that bug, plan section 0 item 6). Here a step
never evicts: it writes at [v, v + n), v = pos - base, so rollback is only a smaller pos (as for PrefixKv). Before a
step at committed position pos, when v + n would pass C, the binding moves the rows from base' = pos - keep
aligned down to ALIGN (row invariance: ALIGN's comment) to the front and sets base = base'; the rows of a rejected
verify (past pos) are dropped with it. One move of about `keep` rows every >= slack tokens (plan section 3.2).
No torch: the runtime imports it.
"""

from __future__ import annotations

import numpy as np

from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.manifest.window import ALIGN, MAX_STEP, window_rows  # noqa: F401 - the sizing rule, one place


def window_bytes(sig: mf.WindowSignature | None, row: list[int], block_size: int, itemsize: int) -> int:
    """Bytes a CompactingKv of this binding allocates (row: the window buffer's row [Lw, 2, kv, hd])."""
    if sig is None:
        return 0
    return window_rows(sig, block_size)[1] * int(np.prod(row, dtype=np.int64)) * itemsize


class CompactingKv:
    """The window buffer [C, *row] and its real-position base (module docstring).
        step(pos, n)  -> (inputs, outputs) a target step of n rows at committed position pos binds; compacts first
                         when the step would not fit (only here: pos is a commit point)
        after(pos, n) the fixed flavour's staging copy
        reset()       a new sequence: base 0, nothing kept
    `high` is the most rows the graph ever saw in the buffer (past + the step's): <= capacity, by construction."""

    def __init__(self, sig: mf.WindowSignature, backend, row: list[int], block_size: int, dtype,
                 graph: str = "target"):
        if sig.kind != "compacting":
            raise Dflash2Error(f"{graph} signature: window.kind expected 'compacting', found {sig.kind!r}")
        self.keep, (self.step_rows, C) = sig.keep, window_rows(sig, block_size)
        (self.past,), (self.present,), self.base_name, self.length_name = sig.past, sig.present, sig.base, sig.length
        self.buffer = backend.device_buffer((C, *row), dtype)  # [C, Lw, 2, kv, hd]
        self.base_buf = backend.host_buffer((1,), np.int64)
        self.staging = backend.device_buffer((self.step_rows, *row), dtype) if sig.length else None
        self.length = backend.host_buffer((1,), np.int32) if sig.length else None
        self.reset()

    @property
    def capacity(self) -> int:
        return self.buffer.capacity

    def reset(self) -> None:
        self.base = 0
        self.compactions = 0
        self.high = 0

    def fixed(self) -> tuple[dict, dict]:
        ins = {self.base_name: self.base_buf.whole()}
        if self.length is not None:
            ins |= {self.past: self.buffer.whole(), self.length_name: self.length.whole()}
        return ins, {}

    def _compact(self, pos: int) -> None:
        """base' = pos - keep aligned down to ALIGN (module comment: row invariance); rows [base' - base, v) ->
        [0, pos - base'), keep .. keep + ALIGN - 1 of them. The source and the target may overlap (Buffer.move_rows
        moves as if through a temporary)."""
        base = (pos - self.keep) // ALIGN * ALIGN
        if base > self.base:
            self.buffer.move_rows(base - self.base, pos - base, 0)
            self.base = base
            self.compactions += 1

    def step(self, pos: int, n: int) -> tuple[dict, dict]:
        if n > self.step_rows:
            raise Dflash2Error(f"window KV: a step of {n} rows, expected at most {self.step_rows} (the session cuts "
                               f"longer steps: a caller bug)")
        if pos < self.base:
            raise Dflash2Error(f"window KV: a step at position {pos} before the buffer's first row (position "
                               f"{self.base}): expected a committed position (reset() for a new sequence)")
        if pos - self.base + n > self.capacity:
            self._compact(pos)
        v = pos - self.base
        self.high = max(self.high, v + n)
        self.base_buf.host[0] = self.base
        self.base_buf.push(1)
        if self.length is not None:  # the whole buffer is bound once; its valid rows and a staging output per step
            self.length.host[0] = v
            self.length.push(1)
            return {}, {self.present: self.staging.rows(0, n)}
        return {self.past: self.buffer.rows(0, v)}, {self.present: self.buffer.rows(v, v + n)}

    def after(self, pos: int, n: int) -> None:
        if self.staging is not None:
            self.buffer.copy_rows(self.staging, n, pos - self.base)
