"""Preallocated buffers and the views engines bind to.

A `View` is (pointer, shape, dtype, device): binding one allocates nothing and copies nothing.
A `HostBuffer` lives in host memory (ONNX Runtime CPU; the host side of small I/O on a GPU);
a backend may give device buffers instead. Every buffer is allocated once per session.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class View:
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    device: str = "cpu"


class HostBuffer:
    """A C-contiguous numpy array; rows(a, b) views rows [a, b) of axis 0 by pointer arithmetic."""

    device = "cpu"

    def __init__(self, shape: tuple[int, ...], dtype):
        self.host = np.zeros(shape, dtype=dtype)
        self.dtype = self.host.dtype
        self.row_shape = tuple(shape[1:])
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.ptr = self.host.ctypes.data

    @property
    def capacity(self) -> int:
        return self.host.shape[0]

    def rows(self, start: int, stop: int) -> View:
        if not 0 <= start <= stop <= self.capacity:
            raise IndexError(f"rows [{start}, {stop}) outside a buffer of {self.capacity} rows")
        return View(self.ptr + start * self.row_bytes, (stop - start, *self.row_shape), self.dtype, self.device)

    def whole(self) -> View:
        return View(self.ptr, self.host.shape, self.dtype, self.device)

    def push(self, n: int) -> None:
        """Host -> device for the first n rows: nothing to do when the buffer is host memory."""

    def pull(self, n: int) -> np.ndarray:
        """Device -> host for the first n rows; returns the host rows (a view, no allocation of data)."""
        return self.host[:n]
