"""One ONNX Runtime session factory for export validation, dflash2-compare and the runtime.

No torch here: the runtime imports it on edge boards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from dflash2.errors import Dflash2Error


def open_session(path: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",), threads: int | None = None,
                 spin: bool | None = None):
    """An InferenceSession over `path` (external data and model-local functions resolved by ORT).
    spin: intra-op thread spinning (None keeps ORT's default); a load failure names the file."""
    import onnxruntime as ort
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
    if spin is not None:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    try:
        return ort.InferenceSession(str(path), opts, providers=list(providers))
    except (state.Fail, state.InvalidGraph, state.InvalidProtobuf, state.NoSuchFile, state.NotImplemented,
            state.InvalidArgument) as e:
        raise Dflash2Error(f"{path}: ONNX Runtime could not load the graph: {e}") from e
