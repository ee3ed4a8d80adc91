"""A bfloat16 graph run where ONNX Runtime's CPU provider has no bfloat16 kernels (the export's validation here).

`emulated(model)` is the same graph with every float value it holds in bf16 computed in fp32 and rounded to bf16
right after its node (a Cast to bf16 and back: the CPU provider has both; local functions inlined first), the bf16
weights and inputs widened exactly, the bf16 outputs cast back: the io is unchanged, so the validation feeds and
compares it as it would the graph itself. A bf16 kernel that computes in fp32 and rounds its output (cuBLAS / TensorRT GEMMs accumulate in
fp32; elementwise ops compute in fp32) gives these values up to its own summation order; what it checks is the
graph's function in bf16, not a GPU's kernels (`dflash2-compare --engines` is that check).

Ops that only move values (Reshape, Gather, Concat, ...) are not rounded again: their inputs already are. A bf16
weight only gathered from (an embedding) stays bf16 and its rows are widened after the Gather: ONNX Runtime would
fold a Cast of it into an fp32 copy (5 GB at a 248,320 x 5,120 vocabulary); every other weight is widened. A value
inside a subgraph (If / Scan / Loop) in bf16, or an op whose attribute names bf16 other than Cast /
Constant / ConstantOfShape, is not emulated: `emulated` returns why instead, and the graph stays unvalidated (as
before). The hybrid targets' subgraphs are fp32 (the recurrence), so their graphs are emulated whole.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dflash2.errors import Dflash2Error

BF16, F32 = TensorProto.BFLOAT16, TensorProto.FLOAT
MOVES = {"Reshape", "Gather", "Slice", "Concat", "Transpose", "Split", "Squeeze", "Unsqueeze", "Identity", "Expand",
         "Flatten", "Tile", "GatherElements", "ScatterElements", "Where", "Max", "Min", "Neg", "Abs", "Relu"}
SUFFIX = "__bf16emu"


def emulated(model: onnx.ModelProto) -> onnx.ModelProto | str:
    """The emulating copy of `model` (weights left where they are: external data stays external), or why not."""
    if model.functions:  # the selector's portable function: its body inlined, so that its values are typed too
        from onnx import inliner

        model = inliner.inline_local_functions(model)
    typed = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    g = typed.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types.update({t.name: t.data_type for t in g.initializer})
    why = _subgraphs_in_bf16(g)
    if why:
        return why
    low = {n for n, t in types.items() if t == BF16}
    for node in g.node:
        for o in node.output:
            if o and o not in types:
                return f"the type of {node.op_type} {node.name or o!r}'s output {o!r} is not inferred"
    wide = lambda n: n + SUFFIX if n in low else n  # noqa: E731  (the fp32 name of a bf16 value)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    og = out.graph
    nodes = []
    for v in og.input:  # bf16 inputs keep their names and types: widened on entry
        if v.name in low:
            nodes.append(helper.make_node("Cast", [v.name], [wide(v.name)], to=F32, name=f"{v.name}.emu.in"))
    # a bf16 weight only gathered from (an embedding: 5 GB in fp32 at a 248,320 x 5,120 vocabulary) stays bf16 and
    # its gathered rows are widened; any other is widened whole (ONNX Runtime folds the Cast into an fp32 copy)
    readers = {}
    for node in og.node:
        for k, i in enumerate(node.input):
            readers.setdefault(i, []).append((node.op_type, k))
    narrow = {t.name for t in og.initializer if t.name in low and readers.get(t.name) and
              all(r == ("Gather", 0) for r in readers[t.name])}
    for t in og.initializer:
        if t.name in low and t.name not in narrow:
            nodes.append(helper.make_node("Cast", [t.name], [wide(t.name)], to=F32, name=f"{t.name}.emu.w"))
    for node in og.node:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        why = _retype(n)
        if why:
            return why
        if n.op_type == "Gather" and n.input[0] in narrow:  # bf16 rows gathered, then widened
            rows = n.output[0] + ".emu.rows"
            nodes += [n, helper.make_node("Cast", [rows], [wide(n.output[0])], to=F32, name=f"{rows}.widen")]
            n.input[1:] = [wide(i) if i else i for i in n.input[1:]]
            n.output[0] = rows
            continue
        n.input[:] = [wide(i) if i else i for i in n.input]
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _rename_outer(a.g, low, wide)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    _rename_outer(sg, low, wide)
        rounds = []
        for j, o in enumerate(n.output):
            if o not in low:
                continue
            if n.op_type in MOVES:
                n.output[j] = wide(o)
                continue
            raw = o + ".emu.raw"
            n.output[j] = raw
            rounds += [helper.make_node("Cast", [raw], [o + ".emu.r"], to=BF16, name=f"{o}.emu.round"),
                       helper.make_node("Cast", [o + ".emu.r"], [wide(o)], to=F32, name=f"{o}.emu.widen")]
        nodes += [n, *rounds]
    for v in og.output:  # bf16 outputs keep their names and types: narrowed on exit (exact: already rounded)
        if v.name in low:
            nodes.append(helper.make_node("Cast", [wide(v.name)], [v.name], to=BF16, name=f"{v.name}.emu.out"))
    del og.node[:]
    og.node.extend(nodes)
    del og.value_info[:]  # the bf16 types of renamed values no longer hold; ONNX Runtime infers them again
    return out


@contextmanager
def emulated_copy(path: Path) -> Iterator[tuple[Path | None, str | None]]:
    """(a copy of the bf16 graph at `path` that the CPU provider runs, next to it: the same external data; None)
    or (None, why it is not emulated). The copy is removed on exit."""
    model = emulated(onnx.load(str(path), load_external_data=False))
    if isinstance(model, str):
        yield None, model
        return
    copy = path.with_name(f".{path.name}.bf16emu.onnx")
    try:  # a failed write leaves no partial copy either
        onnx.save_model(model, str(copy))
        yield copy, None
    finally:
        copy.unlink(missing_ok=True)


@contextmanager
def emulated_export(folder: Path, files: dict[str, str]) -> Iterator[dict[str, str]]:
    """{graph: file name of its emulating copy} for the graph files of a bf16 export in `folder` (written beside
    them, removed on exit): what `dflash2.runtime.api.Runtime(emulated=...)` runs on the CPU provider, so that the
    row check and the decoding loop (its bf16 buffers, binding and rollback) run where no bf16 kernels are.
    Raises Dflash2Error naming a graph that cannot be emulated."""
    with ExitStack() as stack:
        out = {}
        for graph, name in files.items():
            copy, why = stack.enter_context(emulated_copy(Path(folder) / name))
            if copy is None:
                raise Dflash2Error(f"{Path(folder) / name}: not emulated in bf16 ({why})")
            out[graph] = copy.name
        yield out


def _retype(n: onnx.NodeProto) -> str | None:
    """A node's bf16-naming attributes made fp32 (the rounding after it keeps bf16's values); why not where it can't."""
    for a in n.attribute:
        if n.op_type == "Cast" and a.name == "to" and a.i == BF16:
            a.i = F32
        elif n.op_type in ("Constant", "ConstantOfShape") and a.type == onnx.AttributeProto.TENSOR \
                and a.t.data_type == BF16:
            t = numpy_helper.to_array(a.t).astype(np.float32)
            a.t.CopyFrom(numpy_helper.from_array(t, a.t.name))
        elif a.type == onnx.AttributeProto.INT and a.name in ("dtype", "to") and a.i == BF16:
            return f"{n.op_type} {n.name!r} makes bf16 values by attribute {a.name}"
    return None


def _subgraphs_in_bf16(g: onnx.GraphProto) -> str | None:
    for node in g.node:
        for a in node.attribute:
            for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                vals = [*sg.input, *sg.output, *sg.value_info]
                if any(v.type.tensor_type.elem_type == BF16 for v in vals) or \
                        any(t.data_type == BF16 for t in sg.initializer) or _casts_to_bf16(sg):
                    return f"{node.op_type} {node.name!r} holds bf16 values in a subgraph"
                why = _subgraphs_in_bf16(sg)
                if why:
                    return why
    return None


def _casts_to_bf16(g: onnx.GraphProto) -> bool:
    return any(n.op_type == "Cast" and any(a.name == "to" and a.i == BF16 for a in n.attribute) for n in g.node)


def _rename_outer(g: onnx.GraphProto, low: set[str], wide) -> None:
    """A subgraph's reads of outer-scope bf16 values pointed at their fp32 names (its own names shadow)."""
    own = {v.name for v in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    for n in g.node:
        n.input[:] = [wide(i) if i in low and i not in own else i for i in n.input]
        for a in n.attribute:
            for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                _rename_outer(sg, low - own, wide)
