"""CUDA through cuda-python for the TensorRT backend: one stream, buffers allocated once, CUDA graphs.

No torch. The cuda-python module and checked calls come from `dflash2.native.cudart`.

`DeviceBuffer` is a `dflash2.runtime.memory.Buffer` (rows, whole, ptr, capacity, host, push, pull),
so `SpecSession` runs unchanged: `ptr` is device memory, `host` a pinned mirror
(allocated eagerly for the small host-visible buffers, lazily for device-only ones like the KV cache),
and push / pull are one async copy on the session stream plus a sync.
"""

from __future__ import annotations

import ctypes
import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Hashable

import numpy as np

from dflash2.native.cudart import CudaError, call, cudart
from dflash2.runtime.memory import Buffer

class Stream:
    def __init__(self):
        self.handle = call(cudart().cudaStreamCreate(), "cudaStreamCreate")
        self.ptr = int(self.handle)  # what TensorRT's execute_async_v3 takes
        weakref.finalize(self, cudart().cudaStreamDestroy, self.handle)

    def sync(self) -> None:
        call(cudart().cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")


def _pinned_array(ptr: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (ctypes.c_byte * max(nbytes, 1)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape, dtype=np.int64))).reshape(shape)


class DeviceBuffer(Buffer):
    """Device memory allocated once (zeroed), rows(a, b) by pointer arithmetic, optional pinned mirror."""

    device = "cuda"

    def __init__(self, shape: tuple[int, ...], dtype, stream: Stream, pinned: bool = False):
        rt = cudart()
        self._layout(shape, dtype)
        self.stream = stream
        self.ptr = int(call(rt.cudaMalloc(max(self.nbytes, 1)), f"cudaMalloc({self.nbytes} bytes)"))
        weakref.finalize(self, rt.cudaFree, self.ptr)
        call(rt.cudaMemset(self.ptr, 0, self.nbytes), "cudaMemset")
        self._host: np.ndarray | None = None
        if pinned:
            self._alloc_host()

    def _alloc_host(self) -> np.ndarray:
        rt = cudart()
        hptr = int(call(rt.cudaMallocHost(max(self.nbytes, 1)), f"cudaMallocHost({self.nbytes} bytes)"))
        weakref.finalize(self, rt.cudaFreeHost, hptr)
        self._host = _pinned_array(hptr, self.shape, self.dtype)
        self._host[...] = 0
        return self._host

    @property
    def host(self) -> np.ndarray:
        """Pinned host mirror; device-only buffers get one on first use (a debugging path)."""
        return self._host if self._host is not None else self._alloc_host()

    def _copy(self, n: int, to_device: bool) -> None:
        if not 0 <= n <= self.capacity:
            raise IndexError(f"{n} rows outside a buffer of {self.capacity} rows")
        rt, host = cudart(), self.host
        kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice if to_device else rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        dst, src = (self.ptr, host.ctypes.data) if to_device else (host.ctypes.data, self.ptr)
        call(rt.cudaMemcpyAsync(dst, src, n * self.row_bytes, kind, self.stream.handle), "cudaMemcpyAsync")

    def push(self, n: int) -> None:
        """Host mirror -> device for the first n rows (the session wrote host[:n]). No sync: everything
        runs on one stream, so the engine that reads the rows runs after the copy; and the session
        writes host rows again only after a pull, which waits for the stream."""
        self._copy(n, to_device=True)

    def pull(self, n: int, wait: bool = True) -> np.ndarray:
        """Device -> host mirror for the first n rows; returns host[:n] (no allocation of data). Waits for
        the stream (the host reads the rows next) unless wait=False: then a later waiting pull on the
        same stream makes these rows valid too."""
        self._copy(n, to_device=False)
        if wait:
            self.stream.sync()
        return self.host[:n]

    def copy_rows(self, src: Buffer, n: int, at: int) -> None:
        """Device -> device on the stream (no sync: the next engine on the stream reads the rows)."""
        self._check_copy(src, n, at)
        rt = cudart()
        call(rt.cudaMemcpyAsync(self.ptr + at * self.row_bytes, src.ptr, n * self.row_bytes,
                                rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream.handle), "cudaMemcpyAsync")

    def move_rows(self, src: int, n: int, at: int) -> None:
        """Overlapping ranges: cudaMemcpy's are undefined, so ascending chunks of at most src - at rows, each chunk's
        source never written by an earlier chunk (on the stream, in order)."""
        self._check_move(src, n, at)
        rt, step, done = cudart(), max(src - at, 1), 0
        while done < n and src != at:
            k = min(step, n - done)
            call(rt.cudaMemcpyAsync(self.ptr + (at + done) * self.row_bytes, self.ptr + (src + done) * self.row_bytes,
                                    k * self.row_bytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                    self.stream.handle), "cudaMemcpyAsync")
            done += k


class GraphCache:
    """CUDA graphs keyed by (graph, profile, input shapes, I/O addresses), as in Edge-LLM.

    First sighting of a key: a plain enqueue (the warm-up TensorRT needs after a shape change).
    Second: capture that enqueue into a graph, instantiate, launch. Later: replay only. The engines'
    fixed-shape flavours bind the same shapes and addresses for every step of n rows, so a generation
    captures at most one graph per (engine, row count) and replays it afterwards; `limit` bounds the
    graphs kept. A key whose capture fails is remembered and runs uncaptured from then on.
    Counters: direct (plain enqueues), captures, replays, launches (= captures + replays).
    """

    def __init__(self, stream: Stream, limit: int = 64, seen_limit: int = 4096):
        self.stream, self.limit, self.seen_limit = stream, limit, seen_limit
        self.graphs: OrderedDict[Hashable, tuple] = OrderedDict()
        self.seen: OrderedDict[Hashable, None] = OrderedDict()
        self.failed: set[Hashable] = set()
        self.direct = self.captures = self.replays = self.launches = 0

    def launch(self, key: Hashable, enqueue: Callable[[], None]) -> None:
        rt = cudart()
        hit = self.graphs.get(key)
        if hit is not None:
            self.graphs.move_to_end(key)
            call(rt.cudaGraphLaunch(hit[1], self.stream.handle), "cudaGraphLaunch")
            self.launches += 1
            self.replays += 1
            return
        if key not in self.seen or key in self.failed:
            self.seen[key] = None
            if len(self.seen) > self.seen_limit:
                self.seen.popitem(last=False)
            self.direct += 1
            enqueue()
            return
        mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        call(rt.cudaStreamBeginCapture(self.stream.handle, mode), "cudaStreamBeginCapture")
        try:
            enqueue()
        finally:
            ended = rt.cudaStreamEndCapture(self.stream.handle)
        try:
            graph = call(ended, "cudaStreamEndCapture")
            exe = call(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        except CudaError as e:
            self.failed.add(key)
            warnings.warn(f"CUDA graph capture failed, running this shape uncaptured: {e}", RuntimeWarning)
            self.direct += 1
            enqueue()
            return
        self.graphs[key] = (graph, exe)
        self.captures += 1
        if len(self.graphs) > self.limit:
            _, (g, x) = self.graphs.popitem(last=False)
            call(rt.cudaGraphExecDestroy(x), "cudaGraphExecDestroy")
            call(rt.cudaGraphDestroy(g), "cudaGraphDestroy")
        call(rt.cudaGraphLaunch(exe, self.stream.handle), "cudaGraphLaunch")
        self.launches += 1
