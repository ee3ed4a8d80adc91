"""Graph rewrites for ONNX Runtime's CPU provider, applied to the MatMul-form graph before quantization
(dflash2.export.quantize). Each keeps the graph's inputs, outputs and arithmetic; each was measured
against the plain-op graph (docs/quantization.md) and is kept because it helped.

- `merge_parallel_matmuls`: MatMuls that read the same activation with constant weights of the same K
  (q/k/v projections, gate/up) become ONE MatMul over the weights concatenated along N, then a Split.
  Blockwise quantization runs along K per output column, so the merged int4 weight holds exactly the
  blocks of the separate ones: fewer, larger MatMulNBits calls for the same numbers.
- `fuse_norms`: RMSNorm written as Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul/Mul becomes ONNX Runtime's
  SimplifiedLayerNormalization, using ONNX Runtime's own transformer-optimizer fusion. (Its residual
  Add + norm fusion, SkipSimplifiedLayerNormalization, matches only [batch, seq, hidden] activations;
  ours are [n, hidden], so it never applies: not run.)
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper


def merge_parallel_matmuls(model: onnx.ModelProto, keep: set[str] = frozenset()) -> int:
    """In place; returns the number of MatMuls merged away. Nodes named in `keep` stay alone."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    groups: dict[tuple[str, int], list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        if n.op_type == "MatMul" and n.name not in keep and n.input[1] in inits and len(inits[n.input[1]].dims) == 2:
            groups[(n.input[0], inits[n.input[1]].dims[0])].append(n)
    merged: dict[str, list[onnx.NodeProto]] = {}  # first node's name -> replacement nodes
    drop: set[str] = set()
    for (_, _), nodes in groups.items():
        if len(nodes) < 2:
            continue
        ws = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        if len({w.dtype for w in ws}) != 1:
            continue
        name = nodes[0].name + ".merged"
        w = numpy_helper.from_array(np.ascontiguousarray(np.concatenate(ws, axis=1)), f"{name}.weight")
        sizes = numpy_helper.from_array(np.array([x.shape[1] for x in ws], np.int64), f"{name}.split")
        g.initializer.extend([w, sizes])
        merged[nodes[0].name] = [
            helper.make_node("MatMul", [nodes[0].input[0], w.name], [f"{name}.out"], name=name),
            helper.make_node("Split", [f"{name}.out", sizes.name], [n.output[0] for n in nodes], axis=-1,
                             name=f"{name}.split")]
        drop.update(n.name for n in nodes[1:])
    new_nodes = []
    for n in g.node:
        if n.name in merged:
            new_nodes += merged[n.name]
        elif n.name not in drop:
            new_nodes.append(n)
    del g.node[:]
    g.node.extend(new_nodes)
    used = {i for n in g.node for i in n.input} | {i for f in model.functions for n in f.node for i in n.input}
    for t in [t for t in g.initializer if t.name not in used]:
        g.initializer.remove(t)
    return len(drop)


def fuse_norms(model: onnx.ModelProto) -> dict[str, int]:
    """In place: ONNX Runtime's SimplifiedLayerNormalization fusion; returns how many the graph has after."""
    from onnxruntime.transformers.fusion_simplified_layernorm import FusionSimplifiedLayerNormalization
    from onnxruntime.transformers.onnx_model import OnnxModel

    om = OnnxModel(model)
    FusionSimplifiedLayerNormalization(om).apply()
    om.prune_graph()
    om.topological_sort()  # the fusions append their nodes at the end
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return {"SimplifiedLayerNormalization": sum(n.op_type == "SimplifiedLayerNormalization" for n in model.graph.node)}
