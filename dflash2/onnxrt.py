"""One ONNX Runtime session factory for export validation, dflash2-compare and the runtime.

No torch here: the runtime imports it on edge boards.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import numpy as np

from dflash2 import dtypes
from dflash2.errors import Dflash2Error


def open_session(path: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",), threads: int | None = None,
                 spin: bool | None = None, weights_in_place: bool = False, arena: bool = True):
    """An InferenceSession over `path` (external data and model-local functions resolved by ORT).
    spin: intra-op thread spinning (None keeps ORT's default); a load failure names the file.
    weights_in_place: no prepacked, constant-folded or fused copies of the weights (export validation of fp graphs:
    the session then reads them where ONNX Runtime maps the data file. Measured on a 4-layer Qwen3-0.6B-shaped
    build: peak 0.90 GiB against 1.45 with both, whose tied head costs a folded transposed copy and a packed
    one; both rewrites are copies, the results differ by GEMM rounding only, 1.8e-4 on logits of std ~30).
    arena: False gives intermediate tensors back when freed instead of keeping ORT's CPU arena at its peak (the
    int4 deviation of a hybrid target, whose per-row recurrent states are ~300 MB a step at Qwen3.5-0.8B's shape)."""
    import onnxruntime as ort
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
    if spin is not None:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if weights_in_place:
        opts.add_session_config_entry("session.disable_prepacking", "1")
        # the extended fusions write new initializers (copies of the weights: 7.3 GiB at session creation for the
        # 4.3 GB fp16 drafter of a Qwen3-8B pair, 0.06 GiB at the basic level), and the CPU arena keeps every fp32
        # copy the fp16 MatMuls are run on; validation checks the graph as written, not ORT's rewrites of it
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.enable_cpu_mem_arena = False
    if not arena:  # the kernels and their weights as ever; only where ORT puts the intermediate tensors differs
        opts.enable_cpu_mem_arena = False
    if _names_q4(path):  # a cpu_q4 flavour (dflash2.export.q4_flavour): its custom op, or why it cannot run here
        from dflash2.native import q4

        try:
            q4.register(opts)
        except Dflash2Error as e:
            raise Dflash2Error(f"{path}: {e}") from e
    try:
        return ort.InferenceSession(str(path), opts, providers=list(providers),
                                    disabled_optimizers=["ConstantFolding"] if weights_in_place else None)
    except (state.Fail, state.InvalidGraph, state.InvalidProtobuf, state.NoSuchFile, state.NotImplemented,
            state.InvalidArgument) as e:
        raise Dflash2Error(f"{path}: ONNX Runtime could not load the graph: {e}") from e


def _names_q4(path: str | Path) -> bool:
    """Whether the graph file imports the ai.dflash2 op domain (read in 8 MiB pieces; weights in external data are
    not in it)."""
    key, tail = b"ai.dflash2", b""
    try:
        with open(path, "rb") as f:
            while piece := f.read(8 << 20):
                if key in tail + piece:
                    return True
                tail = piece[-len(key):]
    except OSError:
        return False  # ORT's own load error names the file
    return False


def _ort_type_name(type_string: str) -> str:
    """'tensor(float)' -> 'float32', 'tensor(bfloat16)' -> 'bfloat16' (ONNX Runtime's spelling -> the table's)."""
    inner = type_string[len("tensor("):-1]
    return {"float": "float32", "double": "float64"}.get(inner, inner)


def run(session, feeds: dict[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
    """`session.run` for every dtype of the table, bfloat16 (ml_dtypes arrays) included: ONNX Runtime's
    numpy conversion knows no bfloat16, so inputs go in as OrtValues of their ONNX element type and
    outputs are copied out of the OrtValues by pointer."""
    import onnxruntime as ort

    values = {}
    for name, a in feeds.items():
        a = np.ascontiguousarray(a)
        raw = a.view(f"u{a.dtype.itemsize}") if a.dtype.name == "bfloat16" else a
        values[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, dtypes.onnx_type(a.dtype))
    out = {}
    for name, v in zip(names, session.run_with_ort_values(list(names), values)):
        dt = dtypes.numpy_dtype(_ort_type_name(v.data_type()))
        shape = tuple(v.shape())
        n = int(np.prod(shape, dtype=np.int64))
        raw = (ctypes.c_uint8 * max(n * dt.itemsize, 1)).from_address(v.data_ptr()) if n else b""
        out[name] = np.frombuffer(raw, dtype=dt, count=n).reshape(shape).copy()
    return out
