"""Preallocated buffers and the views engines bind to.

A `View` is (pointer, shape, dtype, device): binding one allocates nothing and copies nothing.
`Buffer` is the one buffer protocol: a backend's host buffers (`HostBuffer`: host memory, ONNX
Runtime CPU) and device buffers (`dflash2.runtime.cuda.DeviceBuffer`) both derive from it, so the
session's code is the same on every backend. Every buffer is allocated once per session.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash2 import dtypes


@dataclass(frozen=True)
class View:
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    device: str = "cpu"


class Buffer:
    """Rows of one allocation along axis 0: `ptr` (where engines read and write), `host` (numpy
    rows the session fills and reads), push / pull between them (nothing to do for host memory)."""

    device = "cpu"
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype

    def _layout(self, shape: tuple[int, ...], dtype) -> None:
        self.shape, self.dtype = tuple(int(d) for d in shape), dtypes.numpy_dtype(dtype)
        self.row_shape = self.shape[1:]
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def capacity(self) -> int:
        return self.shape[0]

    @property
    def host(self) -> np.ndarray:
        raise NotImplementedError

    def rows(self, start: int, stop: int) -> View:
        if not 0 <= start <= stop <= self.capacity:
            raise IndexError(f"rows [{start}, {stop}) outside a buffer of {self.capacity} rows")
        return View(self.ptr + start * self.row_bytes, (stop - start, *self.row_shape), self.dtype, self.device)

    def whole(self) -> View:
        return View(self.ptr, self.shape, self.dtype, self.device)

    def push(self, n: int) -> None:
        """Host rows -> engine memory for the first n rows (the session wrote host[:n])."""
        raise NotImplementedError

    def pull(self, n: int, wait: bool = True) -> np.ndarray:
        """Engine memory -> host rows for the first n rows; returns host[:n] (no allocation of data).
        wait=False queues the copy without waiting: the rows are valid only after a later waiting pull
        on the same stream (one sync per round reads several outputs)."""
        raise NotImplementedError

    def copy_rows(self, src: Buffer, n: int, at: int) -> None:
        """Rows [0, n) of `src` (same row layout) -> rows [at, at+n) of this buffer, in engine memory."""
        raise NotImplementedError

    def move_rows(self, src: int, n: int, at: int) -> None:
        """Rows [src, src + n) -> [at, at + n) of this buffer, at <= src (the ranges may overlap), in engine memory."""
        raise NotImplementedError

    def _check_move(self, src: int, n: int, at: int) -> None:
        if not (0 <= at <= src and n >= 0 and src + n <= self.capacity):
            raise IndexError(f"move of rows [{src}, {src + n}) to [{at}, {at + n}) of a {self.capacity}-row buffer: "
                             f"expected 0 <= at <= src and src + n <= capacity")

    def _check_copy(self, src: Buffer, n: int, at: int) -> None:
        if src.row_bytes != self.row_bytes or not (0 <= n <= src.capacity and 0 <= at and at + n <= self.capacity):
            raise IndexError(f"copy of {n} rows into [{at}, {at + n}) of a {self.capacity}-row buffer from a "
                             f"{src.capacity}-row one (row bytes {src.row_bytes} vs {self.row_bytes})")


class HostBuffer(Buffer):
    """A C-contiguous numpy array: engines read and write the host rows themselves."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self._layout(shape, dtype)
        self._host = np.zeros(self.shape, dtype=self.dtype)
        self.ptr = self._host.ctypes.data

    @property
    def host(self) -> np.ndarray:
        return self._host

    def push(self, n: int) -> None:
        """Nothing to do: the engine reads host memory."""

    def pull(self, n: int, wait: bool = True) -> np.ndarray:
        return self._host[:n]

    def copy_rows(self, src: Buffer, n: int, at: int) -> None:
        self._check_copy(src, n, at)
        self._host[at:at + n] = src.host[:n]

    def move_rows(self, src: int, n: int, at: int) -> None:
        self._check_move(src, n, at)
        self._host[at:at + n] = self._host[src:src + n]  # numpy copies overlapping ranges as if through a temporary
