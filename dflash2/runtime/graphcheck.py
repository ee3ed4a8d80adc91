"""The manifest agrees with the graphs it describes: checked on the file ONNX Runtime actually opened.

The seal (manifest_sha256 + every file's sha256) proves the folder is as the export wrote it, unless
someone edits a file and reseals the manifest. What a resealed forgery can still get wrong is caught
here, when each graph's session opens (no extra load): its inputs / outputs against the manifest's io
(names, element types, fixed dims), and its weight format against the manifest's quantization (an
ONNX Runtime int4 / int8 graph is made of MatMulNBits nodes, an int8-dynamic drafter of DynamicQuantizeMatMul;
a plain fp32 graph has neither). A mismatch
names the graph, the file and both sides, and says to re-export.
"""

from __future__ import annotations

from pathlib import Path

from dflash2.errors import Dflash2Error
from dflash2.native import q4
from dflash2.quant_manifest import QUANT_OPS, graph_method, quant_op

# ONNX Runtime's type strings -> the manifest's dtype names
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
             "tensor(double)": "float64", "tensor(int32)": "int32", "tensor(int64)": "int64", "tensor(int8)": "int8",
             "tensor(uint8)": "uint8", "tensor(bool)": "bool", "tensor(uint16)": "uint16"}


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
        found = _quant_ops(path)
        if found is not None and q4.OP in found:  # the cpu_q4 flavour: MatMulNBits' nodes under the op's name
            found = sorted({"MatMulNBits" if o == q4.OP else o for o in found})
        if found is not None and bool(found) != quantized:
            said = f"quantized {graph_method(q, graph)}" if quantized else "not quantized"
            problems.append(f"weights: the manifest says {said}, "
                            f"the graph {'has ' + ' / '.join(found) if found else 'has no ' + quant_op(q, graph)} "
                            f"nodes")
        elif found and quantized and quant_op(q, graph) not in found:  # e.g. an int4 drafter where int8-dynamic is said
            problems.append(f"weights: the manifest says {quant_op(q, graph)} nodes, the graph has {' / '.join(found)}")
    if problems:
        raise GraphMismatchError(f"{path}: the manifest does not describe this {graph} graph (a file swapped or "
                                 f"edited after export): " + "; ".join(problems) + "; re-export with dflash2-export")


def _quant_ops(path: Path) -> list[str] | None:
    """The quantized op types the graph proto names, read in 8 MiB pieces (weights in external data are not in it;
    a graph with inline weights is read through once). None: unreadable (ONNX Runtime just opened it)."""
    ops = QUANT_OPS + (q4.OP,)  # + the cpu_q4 flavour's op
    keep = max(len(o) for o in ops)
    found: set[str] = set()
    try:
        with open(path, "rb") as f:
            tail = b""
            while piece := f.read(8 << 20):
                found |= {o for o in ops if o.encode() in tail + piece}
                tail = piece[-keep:]
        return [o for o in ops if o in found]
    except OSError:
        return None
