"""The one dtype table. The CLI choices (dflash2-export --dtype, dflash2-build --precision), numpy
dtypes (bfloat16 through ml_dtypes, never a 16-bit integer stand-in), ONNX element types, TensorRT
types, torch dtypes and the comparison tolerances are all derived from it.

No torch, no onnx, no tensorrt at import (the runtime imports this on edge boards): ONNX element
types are the TensorProto numbers, TensorRT and torch types are looked up by name on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash2.errors import Dflash2Error


@dataclass(frozen=True)
class DType:
    name: str  # numpy / ONNX Runtime / manifest spelling
    onnx: int  # onnx.TensorProto element type
    trt: str  # tensorrt.DataType member
    precision: str | None = None  # dflash2-build --precision spelling; None: not a graph dtype
    # comparison against the PyTorch reference (dflash2.numerics.within): |a-b| <= atol + rtol*|b|
    atol: float = 0.0
    rtol: float = 0.0
    # share of id outputs allowed to differ: in fp16/bf16 the LM-head output is rounded to 16 bits
    # before the fp32 top-K, so near-equal candidates can swap order between backends
    id_share: float = 0.0

    @property
    def numpy(self) -> np.dtype:
        if self.name == "bfloat16":
            try:
                import ml_dtypes  # onnx's dependency; a bare runtime install may lack it
            except ImportError as e:
                raise Dflash2Error("bfloat16 buffers need ml_dtypes: `pip install ml_dtypes`") from e
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.name)

    @property
    def itemsize(self) -> int:
        return 2 if self.name == "bfloat16" else np.dtype(self.name).itemsize


TABLE = (
    DType("float32", 1, "FLOAT", "fp32", atol=1e-4, rtol=1e-3),
    DType("float16", 10, "HALF", "fp16", atol=5e-2, rtol=2e-2, id_share=0.05),
    DType("bfloat16", 16, "BF16", "bf16", atol=2e-1, rtol=5e-2, id_share=0.1),
    DType("int32", 6, "INT32"),
    DType("int64", 7, "INT64"),
    DType("uint8", 2, "UINT8"),
)
BY_NAME = {d.name: d for d in TABLE}
GRAPH_DTYPES = tuple(d.name for d in TABLE if d.precision)  # what an export's graphs may be
PRECISIONS = {d.precision: d.name for d in TABLE if d.precision}  # --precision -> graph dtype
PRECISION_OF_DTYPE = {v: k for k, v in PRECISIONS.items()}


def get(dtype) -> DType:
    """The table row of a name, a numpy dtype or type (ml_dtypes' bfloat16 reports 'bfloat16')."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in BY_NAME:
        raise Dflash2Error(f"dtype: expected one of {list(BY_NAME)}, found {name!r}")
    return BY_NAME[name]


def numpy_dtype(dtype) -> np.dtype:
    return get(dtype).numpy


def onnx_type(dtype) -> int:
    return get(dtype).onnx


def from_onnx(elem_type: int) -> DType:
    for d in TABLE:
        if d.onnx == elem_type:
            return d
    raise Dflash2Error(f"ONNX element type: expected one of {[d.onnx for d in TABLE]}, found {elem_type}")


def trt_type(trt, dtype):
    """The tensorrt.DataType of a dtype (trt: the tensorrt module)."""
    return getattr(trt.DataType, get(dtype).trt)


def from_trt(trt_dtype) -> DType:
    """The table row of a tensorrt.DataType (matched by member name)."""
    name = getattr(trt_dtype, "name", str(trt_dtype)).rsplit(".", 1)[-1]
    for d in TABLE:
        if d.trt == name:
            return d
    raise Dflash2Error(f"TensorRT type: expected one of {[d.trt for d in TABLE]}, found {name!r}")


def torch_dtype(dtype):
    import torch  # the export stage only

    return getattr(torch, get(dtype).name)
