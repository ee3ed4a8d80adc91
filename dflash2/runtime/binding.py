"""KV binding strategies: how a graph reads and writes its cache, one class per signature kind.

Each is built once from the graph's `KvSignature` (the manifest) and owns its buffers:
    fixed()        the views bound once at session start (they never move)
    step(pos, n)   the views a step of n rows at position pos binds (only what changes)
    after(pos, n)  work after the step (a staging copy)
    spare          rows past the step's the engine also writes (the gqa kernel's extra row)
A new binding kind is one class here and one entry in KINDS. No torch: the runtime imports it.
"""

from __future__ import annotations

import numpy as np

from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error


class CapacityError(Dflash2Error, ValueError):
    pass


class PrefixKv:
    """past = rows [0, pos) of one sequence-major buffer [T, *row]; present = rows [pos, pos + n) of it:
    a step copies nothing and rollback just moves pos."""

    spare = 0

    def __init__(self, sig: mf.KvSignature, backend, graph: str, row: list[int], T: int, dtype):
        (self.past,), (self.present,) = sig.past, sig.present
        self.buffer = backend.device_buffer((T, *row), dtype)

    def fixed(self) -> tuple[dict, dict]:
        return {}, {}

    def step(self, pos: int, n: int) -> tuple[dict, dict]:
        return {self.past: self.buffer.rows(0, pos)}, {self.present: self.buffer.rows(pos, pos + n)}

    def after(self, pos: int, n: int) -> None:
        pass


class FixedKv:
    """past = the whole buffer [T, *row] + its valid length; present = n rows to a staging buffer, copied into
    place after the step: every step of n rows binds the same shapes and addresses (TensorRT's CUDA graphs)."""

    spare = 0

    def __init__(self, sig: mf.KvSignature, backend, graph: str, row: list[int], T: int, dtype):
        (self.past,), (self.present,), self.length_name = sig.past, sig.present, sig.length
        self.buffer = backend.device_buffer((T, *row), dtype)
        self.staging = backend.device_buffer((min(T, backend.max_rows(graph) or T), *row), dtype)
        self.length = backend.host_buffer((1,), np.int32)

    def fixed(self) -> tuple[dict, dict]:
        return {self.past: self.buffer.whole(), self.length_name: self.length.whole()}, {}

    def step(self, pos: int, n: int) -> tuple[dict, dict]:
        if n > self.staging.capacity:
            raise CapacityError(f"a step of {n} rows exceeds the {self.staging.capacity} rows the engines take per "
                                f"step (rebuild them with a larger dflash2-build --max-prefill)")
        self.length.host[0] = pos
        self.length.push(1)
        return {}, {self.present: self.staging.rows(0, n)}

    def after(self, pos: int, n: int) -> None:
        self.buffer.copy_rows(self.staging, n, pos)


class GqaSharedKv:
    """Per layer K and V buffers [1, kv, T, hd] (rows of one [2L, kv, T, hd] allocation, the same bytes as the
    prefix layout), bound once as both the past inputs and the present outputs: ONNX Runtime's
    GroupQueryAttention writes the step's rows at [pos, pos + n) in place, plus one spare row after them."""

    spare = 1

    def __init__(self, sig: mf.KvSignature, backend, graph: str, row: list[int], T: int, dtype):
        L, _, kvh, hd = row
        if len(sig.past) != 2 * L or len(sig.present) != 2 * L:
            raise Dflash2Error(f"{graph} signature: expected {2 * L} per-layer KV inputs and outputs (kv rows {row}), "
                               f"found {len(sig.past)} and {len(sig.present)}")
        self.buffer = backend.device_buffer((2 * L, kvh, T, hd), dtype)
        self.length = backend.host_buffer((1,), np.int32)
        views = [self.buffer.rows(j, j + 1) for j in range(2 * L)]  # [1, kv, T, hd] each, fixed for the session
        self._in = {sig.length: self.length.whole(), **dict(zip(sig.past, views))}
        self._out = dict(zip(sig.present, views))

    def fixed(self) -> tuple[dict, dict]:
        return self._in, self._out

    def step(self, pos: int, n: int) -> tuple[dict, dict]:
        self.length.host[0] = pos
        self.length.push(1)
        return {}, {}

    def after(self, pos: int, n: int) -> None:
        pass


KINDS = {"prefix": PrefixKv, "fixed": FixedKv, "gqa-shared": GqaSharedKv}


def make_kv(sig: mf.KvSignature, backend, graph: str, row: list[int], T: int, dtype):
    if sig.kind not in KINDS:
        raise Dflash2Error(f"{graph} signature: kv.kind expected one of {sorted(KINDS)}, found {sig.kind!r}")
    return KINDS[sig.kind](sig, backend, graph, row, T, dtype)
