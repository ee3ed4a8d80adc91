"""The manifest agrees with the graphs it describes: checked on the file ONNX Runtime actually opened.

The seal (manifest_sha256 + every file's sha256) proves the folder is as the export wrote it, unless
someone edits a file and reseals the manifest. What a resealed forgery can still get wrong is caught
here, when each graph's session opens (no extra load): its inputs / outputs against the manifest's io
(names, element types, fixed dims), and its weight format against the manifest's quantization (an
ONNX Runtime int4 / int8 graph is made of MatMulNBits nodes; a plain fp32 graph has none). A mismatch
names the graph, the file and both sides, and says to re-export.
"""

from __future__ import annotations

from pathlib import Path

from dflash2.errors import Dflash2Error

# ONNX Runtime's type strings -> the manifest's dtype names
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
             "tensor(double)": "float64", "tensor(int32)": "int32", "tensor(int64)": "int64", "tensor(int8)": "int8",
             "tensor(uint8)": "uint8", "tensor(bool)": "bool", "tensor(uint16)": "uint16"}
NBITS = b"MatMulNBits"  # the op type string every weight-only ONNX Runtime graph carries in its proto


class GraphMismatchError(Dflash2Error):
    pass


def io_problems(want, have, kind: str) -> list[str]:
    """want: the manifest's IoSpecs; have: ONNX Runtime's NodeArgs (name, type, shape)."""
    out = []
    got = {a.name: a for a in have}
    names = [w.name for w in want]
    if sorted(names) != sorted(got):
        out.append(f"{kind}s: the manifest lists {sorted(names)}, the graph has {sorted(got)}")
        return out
    for w in want:
        a = got[w.name]
        dtype = ORT_TYPES.get(a.type, a.type)
        if dtype != w.dtype:
            out.append(f"{kind} {w.name}: the manifest says {w.dtype}, the graph has {dtype}")
        shape = list(a.shape or [])
        fixed = [(i, x, y) for i, (x, y) in enumerate(zip(w.shape, shape)) if isinstance(x, int) and isinstance(y, int)
                 and x != y]
        if len(shape) != len(w.shape) or fixed:
            out.append(f"{kind} {w.name}: the manifest says shape {w.shape}, the graph has {shape}")
    return out


def check_graph(manifest, graph: str, path: Path, session) -> None:
    entry = manifest.graphs[graph]
    problems = io_problems(entry.inputs, session.get_inputs(), "input")
    problems += io_problems(entry.outputs, session.get_outputs(), "output")
    q = getattr(manifest, "quantization", None)
    if q is None or q.backend == "onnxruntime":
        quantized = q is not None and graph in q.graphs and (q.graphs[graph].quantized or 0) > 0
        has = _has_nbits(path)
        if has is not None and has != quantized:
            problems.append(f"weights: the manifest says {'quantized ' + q.method if quantized else 'not quantized'}, "
                            f"the graph {'has' if has else 'has no'} MatMulNBits nodes")
    if problems:
        raise GraphMismatchError(f"{path}: the manifest does not describe this {graph} graph (a file swapped or "
                                 f"edited after export): " + "; ".join(problems) + "; re-export with dflash2-export")


def _has_nbits(path: Path) -> bool | None:
    """Whether the graph proto names MatMulNBits, read in 8 MiB pieces (weights in external data are not in it;
    a graph with inline weights is read through once). None: unreadable (ONNX Runtime just opened it)."""
    try:
        with open(path, "rb") as f:
            tail = b""
            while True:
                piece = f.read(8 << 20)
                if not piece:
                    return False
                if NBITS in tail + piece:
                    return True
                tail = piece[-len(NBITS):]
    except OSError:
        return None
