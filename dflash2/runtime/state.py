"""The recurrent state of a hybrid target (Gated DeltaNet layers: a conv state and a recurrent state per layer),
rolled back with the KV cache without copying: `RowStates`, built once from the graph's `StateSignature`.

The graph reads the state before the step (the signature's past tensors, [1, *row] each: the Qwen3.5 export binds
`conv_state.{j}` and `rec_state.{j}` per GDN layer j) and writes the state after each of the step's last
W' = min(n, W) rows (its present tensors, [W', *row] each: `conv_states.{j}`, `rec_states.{j}`). A verify of n <= W rows may be
accepted at any a in 1..n, and the next step must start from the state after row a - 1.

Why ping-pong: the binding keeps per state tensor two row buffers A and B [W, *row] and a zero initial row
[1, *row]. A step reads its state as a 1-row view of wherever the accepted row lies and writes its rows into the
buffer that does not hold it; commit only moves the (buffer, row) pointer. The other design, a resident state
that commit overwrites with row a - 1 of the step's output (ONNX Runtime GenAI's state_window, TensorRT Edge-LLM's
intermediate_states), copies the whole state (every layer) once per round on the device; here nothing is copied,
and the addresses a step binds are one of 2W + 1 fixed views. No torch: the runtime imports it.

A decode (a 1-row step its caller always commits: `step(1, in_place=True)`) writes its state over the row it reads,
as a resident state does: rollback never needs the state a decode read (after its commit only the row it wrote is
read again; a later verify writes the other buffer as before), and writing over it keeps the 18 MB state of
Qwen3.5-0.8B in the cache lines it was read from (LinearAttention alone: 0.11 -> 0.06 ms a call at Hv 16,
128 x 128; docs/results, 2026-12-06). The zero initial row is never written: a decode from it writes A.
"""

from __future__ import annotations

import numpy as np

from dflash2 import dtypes
from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.runtime.memory import HostBuffer

try:  # Linux: madvise through libc (release_stale; MADV_DONTNEED zero-fills there, not on macOS); elsewhere None
    import ctypes
    import ctypes.util
    import mmap
    import sys

    if not sys.platform.startswith("linux"):
        raise OSError("MADV_DONTNEED zero-fills on Linux only")
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _DONTNEED, _PAGE = mmap.MADV_DONTNEED, mmap.PAGESIZE
except (OSError, AttributeError):
    _LIBC = None

INITIAL = 2  # buffer index of the zero initial state (0 and 1 are A and B)


def state_bytes(sig: mf.StateSignature | None) -> int:
    """Bytes a RowStates of this binding allocates: (2W + 1) rows of each state tensor."""
    if sig is None:
        return 0
    rows = 2 * sig.window + 1
    return sum(rows * int(np.prod(row, dtype=np.int64)) * dtypes.get(dt).itemsize
               for row, dt in zip(sig.rows, sig.dtypes))


class RowStates:
    """Per state tensor i: buffers[k][i] for k = A (0), B (1): [W, *row]; buffers[INITIAL][i]: [1, *row], zero.
    `current` = (k, row): where the state the next step reads lies.
        step(n)       -> (inputs {past name: the current 1-row view}, outputs {present name: rows [0, W') of the
                         buffer that does not hold current}); views are built once, nothing is allocated per step
        step(1, in_place=True): outputs the current row itself (not when current is the zero initial row); the
                         step must then be committed (commit(0, 1) is refused: its input was overwritten)
        commit(a, n)  a of the last step's n rows accepted: current = (the written buffer, a - 1 - (n - W'))
        reset()       current = the zero initial state
    """

    def __init__(self, sig: mf.StateSignature, backend, graph: str = "target"):
        if sig.kind != "rows":
            raise Dflash2Error(f"{graph} signature: state.kind expected 'rows', found {sig.kind!r}")
        self.window = W = sig.window
        self.past, self.present = list(sig.past), list(sig.present)
        self.buffers = [[backend.device_buffer((W, *row), dtypes.numpy_dtype(dt)) for row, dt in
                         zip(sig.rows, sig.dtypes)] for _ in range(2)]
        self.buffers.append([backend.device_buffer((1, *row), dtypes.numpy_dtype(dt)) for row, dt in
                             zip(sig.rows, sig.dtypes)])
        for b in self.buffers[INITIAL]:  # zeroed once; the graph only reads it, so it stays zero
            b.host[...] = 0
            b.push(1)
        # every view a step can bind, built once: inputs per (buffer, row), outputs per (buffer, W')
        self._in = {(k, r): {p: b.rows(r, r + 1) for p, b in zip(self.past, self.buffers[k])}
                    for k in range(3) for r in range(1 if k == INITIAL else W)}
        self._out = {(k, w): {p: b.rows(0, w) for p, b in zip(self.present, self.buffers[k])}
                     for k in range(2) for w in range(1, W + 1)}
        self._same = {(k, r): {p: b.rows(r, r + 1) for p, b in zip(self.present, self.buffers[k])}
                      for k in range(2) for r in range(W)}  # a decode's outputs: the row it reads
        self.reset()

    def reset(self) -> None:
        self.current = (INITIAL, 0)
        self._written: int | None = None  # the buffer the last step wrote (None: no step since the last commit)
        self._n = 0  # that step's rows
        self._in_place = False  # that step wrote over the row current names

    def _target(self) -> int:
        """The buffer a step writes: A after the initial state, else the one current does not lie in."""
        k = self.current[0]
        return 0 if k == INITIAL else 1 - k

    def step(self, n: int, in_place: bool = False) -> tuple[dict, dict]:
        """The views a target step of n rows binds (the caller must not edit the dicts: they are reused).
        in_place: a 1-row step that will be committed writes over the row it reads (class docstring)."""
        self._n, self._in_place = n, in_place and n == 1 and self.current[0] != INITIAL
        if self._in_place:
            self._written = self.current[0]
            return self._in[self.current], self._same[self.current]
        k = self._written = self._target()
        return self._in[self.current], self._out[(k, min(n, self.window))]

    def commit(self, a: int, n: int) -> None:
        """a of the last step's n rows accepted (0: the step is discarded, current stays)."""
        if a == 0:
            if self._in_place and self._written is not None:
                raise Dflash2Error("recurrent state commit of 0 rows: expected a step that can be discarded, found "
                                   "a 1-row step written in place over the state it read (step(1, in_place=True))")
            return
        kept = min(n, self.window)
        r = a - 1 - (n - kept)  # the accepted row's index among the kept rows
        if self._written is None or n != self._n or not 0 < a <= n or not 0 <= r < kept:
            what = ("no target step since the last commit" if self._written is None else
                    f"a commit of a {n}-row step after a {self._n}-row one" if n != self._n else
                    f"row {a - 1} of a {n}-row step, where the graph keeps the states of rows [{n - kept}, {n}) "
                    f"(window {self.window})")
            raise Dflash2Error(f"recurrent state commit of {a} rows: expected an accepted row whose state the target "
                               f"graph kept, found {what}")
        self.current, self._written = (self._written, self.current[1] if self._in_place else r), None

    def release_stale(self) -> int:
        """Hands back to the OS the pages of every A / B row that holds no state the next step can read (all but
        `current`'s row; after reset() all of them): they read as zeros until a step writes them again. Returns the
        bytes released. For the export's row check (dflash2.runtime.invariance), which runs verifies of every k up
        to W and so, with prefills that write W rows, touches both buffers whole: 2 x 16 rows x 19 MiB = 0.6 GiB at
        Qwen3.5-0.8B's shape, where 1 + 16 rows are live at most. A step writes every row it outputs before anything
        reads it and reads only `current`'s row, so what it computes is unchanged; only host buffers (ONNX Runtime's
        CPU provider) are released, and generation does not call it (each re-touched row costs page faults)."""
        if self._written is not None:  # the rows a step just wrote are what its commit will make current
            raise Dflash2Error("recurrent state release: expected no step awaiting its commit, found a "
                               f"{self._n}-row step not committed")
        if _LIBC is None:
            return 0
        released = 0
        for k in range(2):
            live = self.current[1] if self.current[0] == k else None
            for b in self.buffers[k]:
                if not isinstance(b, HostBuffer):  # a device buffer's ptr is not host memory (its host a mirror)
                    continue
                spans = [(0, b.nbytes)] if live is None else [(0, live * b.row_bytes),
                                                              ((live + 1) * b.row_bytes, b.nbytes)]
                for start, stop in spans:  # whole pages inside the span only: a page shared with a live row stays
                    lo = -(-(b.ptr + start) // _PAGE) * _PAGE
                    hi = (b.ptr + stop) // _PAGE * _PAGE
                    if hi > lo and _LIBC.madvise(lo, hi - lo, _DONTNEED) == 0:
                        released += hi - lo
        return released

    def named_buffers(self) -> dict:
        """name -> buffer, for the session's address check (constant for the session)."""
        names = ("a", "b", "initial")
        return {f"{names[k]}.{p}": b for k in range(3) for p, b in zip(self.past, self.buffers[k])}
