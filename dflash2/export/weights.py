"""Weights streamed from safetensors into a graph's external data: memory bounded by one tensor.

`dflash2.checkpoint.Weights` reads a checkpoint folder (single file or sharded index) with pread in pieces,
one tensor at a time, widened to fp32 on demand (bf16 / fp16 -> fp32 is exact); nothing holds the model. `DataFile`
appends each initializer's bytes to the graph's `.onnx.data` file as the builder makes it and hands back
a TensorProto that only points there, so a graph of any size is built while at most the tensor being
written (plus the one fused from it) is in memory. `ModuleWeights` serves the same names from a loaded
torch module (the small-model path and the tests: one builder, two sources).

Names are the reference modules' (`layers.0.self_attn.q_proj.weight`, `embed_tokens.weight`,
`lm_head.weight`); a target checkpoint's `model.` prefix is looked up behind them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from dflash2.checkpoint import CHUNK_BYTES

class ModuleWeights:
    """The same interface over a loaded torch module's parameters (fp32 copies)."""

    def __init__(self, module):
        self.params = dict(module.named_parameters())

    def __contains__(self, name: str) -> bool:
        return name in self.params

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.params[name].shape)

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        t = self.params[name].detach()
        t = t if rows is None else t[rows]
        return t.float().numpy().copy()

    def row_chunks(self, name: str, max_bytes: int = CHUNK_BYTES):
        rows, cols = self.shape(name)
        step = max(1, max_bytes // (4 * cols))
        for i in range(0, rows, step):
            yield self.get(name, slice(i, min(rows, i + step)))


class DataFile:
    """Appends initializers to one external data file; each `add` returns a TensorProto pointing there.
    Offsets are aligned to 4 KiB pages where the tensor is large (ONNX Runtime memory-maps aligned data)."""

    ALIGN, SMALL = 4096, 1024

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fh = open(self.path, "wb")
        self.bytes = 0

    def _start(self, nbytes: int) -> int:
        if nbytes >= self.SMALL and self.bytes % self.ALIGN:
            pad = self.ALIGN - self.bytes % self.ALIGN
            self.fh.write(b"\0" * pad)
            self.bytes += pad
        return self.bytes

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        a = np.ascontiguousarray(array, dtype=np.asarray(array).dtype.newbyteorder("<"))  # ONNX: little-endian
        offset = self._start(a.nbytes)
        self.fh.write(_raw(a))
        self.bytes += a.nbytes
        return self._proto(name, a.dtype, a.shape, offset, a.nbytes)

    def add_chunks(self, name: str, chunks, dtype, shape: tuple[int, ...]) -> TensorProto:
        """A tensor written piece by piece along its first axis (the embedding: never whole in memory)."""
        want = int(np.prod(shape)) * np.dtype(dtype).itemsize
        offset = self._start(want)
        for c in chunks:
            c = np.ascontiguousarray(c, dtype=np.dtype(dtype).newbyteorder("<"))
            self.fh.write(_raw(c))
            self.bytes += c.nbytes
        if self.bytes - offset != want:
            raise ValueError(f"DataFile: {name}: expected {want} bytes for {np.dtype(dtype)} {list(shape)}, "
                             f"the chunks gave {self.bytes - offset}")
        return self._proto(name, np.dtype(dtype), shape, offset, want)

    def _proto(self, name, dtype, shape, offset, nbytes) -> TensorProto:
        t = TensorProto()
        t.name = name
        t.data_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        t.dims.extend(int(d) for d in shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.path.name), ("offset", str(offset)), ("length", str(nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t

    def close(self) -> None:
        if not self.fh.closed:
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def inline(name: str, array: np.ndarray) -> TensorProto:
    """A small constant stored in the graph itself (shapes, axes)."""
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


class NBits:
    """ONNX Runtime's own blockwise weight quantizer (`DefaultWeightOnlyQuantizer.qbits_block_quant`, what
    MatMulNBitsQuantizer calls per MatMul) applied to one [K, N] weight (or a block of its columns) at a
    time, so a graph is quantized as it is written instead of loaded whole and rewritten."""

    def __init__(self, quant):
        from dflash2.export.quantize import _quantizer_class

        _quantizer_class()  # imports the quantizer's module with its logging side effects undone
        from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                      DefaultWeightOnlyQuantizer)

        self.bits, self.block_size, self.dynamic = quant.bits, quant.block_size, False
        self.symmetric, self.accuracy_level = quant.symmetric, quant.accuracy_level
        self._q = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
            block_size=quant.block_size, is_symmetric=quant.symmetric, accuracy_level=quant.accuracy_level,
            bits=quant.bits))

    def quantize(self, kn: np.ndarray):
        """[K, n] fp32 -> (packed [n, k_blocks, blob] uint8, scales [n, k_blocks], zero points)."""
        return self._q.qbits_block_quant(np.ascontiguousarray(kn, dtype=np.float32))

    def packed_shape(self, K: int, N: int) -> tuple[int, int, int]:
        k_blocks = -(-K // self.block_size)
        return (N, k_blocks, -(-self.block_size * self.bits // 8))


class DynamicInt8:
    """Per-column symmetric int8 weights for ONNX Runtime's DynamicQuantizeMatMul: the rule of
    onnxruntime.quantization's per-channel symmetric QInt8 (scale = max |w| / 127 per output column, round half to
    even, zero point 0). The op quantizes its activations per TENSOR at run time, so a row's result depends on the
    other rows: never row-invariant, hence a drafter-only method (export() refuses it for a target). At the
    drafter's 8 rows ONNX Runtime's QGEMM runs it 2.5-2.9x faster than MatMulNBits int4 (docs/quantization.md)."""

    bits = 8
    dynamic = True
    symmetric = True

    def quantize(self, kn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[K, n] fp32 -> (int8 [K, n], scales [n] fp32)."""
        kn = np.asarray(kn, dtype=np.float32)
        absmax = np.abs(kn).max(axis=0)
        scale = np.where(absmax > 0, absmax / np.float32(127), np.float32(1)).astype(np.float32)
        return np.clip(np.rint(kn / scale), -127, 127).astype(np.int8), scale


def weight_quantizer(quant):
    """The quantizer an OrtQuant writes weights with: ONNX Runtime's block quantizer (MatMulNBits) or DynamicInt8."""
    return DynamicInt8() if quant.dynamic else NBits(quant)


def _raw(a: np.ndarray) -> memoryview:
    """A contiguous array's bytes (ml_dtypes' bfloat16 included, which the buffer protocol does not take)."""
    return memoryview(a.reshape(-1).view(np.uint8))
