"""torch -> ONNX with the dynamo exporter, and the ONNX files on disk.

The selector op becomes ONE `DFlash2Selector` node through a custom translation; every graph is
written with its weights in an external data file, which both flavours of a graph share (they
differ only in the model-local function).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxscript
import torch

from dflash2 import dtypes
from dflash2.export import selector_onnx as so
from dflash2.export.graphs import GraphSpec
from dflash2.ops import contract as C

_custom = onnxscript.values.Opset(C.ONNX_DOMAIN, C.ONNX_OPSET)


def _select_path_onnx(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms, temperature,
                      top_k: int, rank: int, output_multiplier: float = 1.0, logit_softcap: float = 0.0,
                      mode: str = "greedy"):
    return _custom.DFlash2Selector(
        cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms, temperature, top_k=top_k,
        rank=rank,
        output_multiplier=output_multiplier, logit_softcap=logit_softcap, mode=mode,
        plugin_version=C.PLUGIN_VERSION, plugin_namespace=C.PLUGIN_NAMESPACE, _num_outputs=len(C.OUTPUTS))


def trace(spec: GraphSpec, max_seq_len: int) -> onnx.ModelProto:
    import dflash2.reference.selector  # noqa: F401  (registers torch.ops.dflash2.select_path)

    so.register_schema()
    dims: dict[str, torch.export.Dim] = {}
    limits = {"n": (1, max_seq_len), "past": (0, max_seq_len), "cap": (2, max_seq_len), "batch": (1, 64)}
    for axes in spec.dynamic.values():
        for name in axes.values():
            dims.setdefault(name, torch.export.Dim(name, min=limits[name][0], max=limits[name][1]))
    # positional, in input order: the TensorRT flavour renames inputs the module's forward calls otherwise
    dynamic = tuple({ax: dims[name] for ax, name in spec.dynamic[inp].items()} or None for inp in spec.inputs)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            spec.module.eval(), spec.example, input_names=spec.inputs, output_names=spec.outputs,
            dynamic_shapes=dynamic, dynamo=True, optimize=True, verbose=False,
            custom_translation_table={torch.ops.dflash2.select_path.default: _select_path_onnx})
    model = program.model_proto
    model.producer_name = "dflash2"
    del program
    _forget_rewriter_matches()
    return model


def _forget_rewriter_matches() -> None:
    """onnxscript's module-level rewrite rules (run by torch.onnx.export's optimize pass) keep the state of their
    last match: the traced graph's nodes, and through its initializers the traced module's own weight tensors,
    stay referenced until the next export. For the selector that kept its two vocabulary-sized codebooks (485 MB
    at Qwen3.5's vocabulary, file-backed for the export: dflash2.export.filebacked) mapped through the row check.
    Each matcher's own reset (what it calls before every match) and the graph it last matched in (set by every
    match) drop that state; where an onnxscript version has no such method, nothing is done."""
    try:
        from onnxscript.rewriter import _DEFAULT_REWRITE_RULES
    except ImportError:
        return
    for rule in _DEFAULT_REWRITE_RULES:
        matcher = getattr(rule, "_matcher", None)
        if not callable(getattr(matcher, "_init_match", None)):
            continue
        matcher._init_match(0)
        for name in ("_graph", "_tracer"):  # set anew by every match, like the state _init_match resets
            if hasattr(matcher, name):
                setattr(matcher, name, None)


def flavour_files(name: str, has_tensorrt: bool) -> dict[str, str]:
    files = {"portable": f"{name}.onnx"}
    if has_tensorrt:
        files["tensorrt"] = f"{name}.trt.onnx"
    return files


def write_graph(model: onnx.ModelProto, folder: Path, spec: GraphSpec, num_drafts: int,
                fixed: onnx.ModelProto | None = None, check: bool = True, tensorrt: bool = True) -> dict[str, str]:
    """Write the portable file (+ external data), then the TensorRT flavour: `fixed` (the fixed-shape
    trace of spec.tensorrt) or the same graph, with a bare selector node, reading the same data file.
    check=False: a graph of ONNX Runtime's contrib ops (the gqa target), which onnx.checker does not know
    (ORT registers SimplifiedLayerNormalization in the ONNX domain); validation loads it in ORT instead.
    tensorrt=False: no TensorRT flavour (a graph of ONNX Runtime's contrib ops: TensorRT cannot parse it)."""
    files = flavour_files(spec.name, tensorrt and (spec.has_selector or fixed is not None))
    data = f"{spec.name}.onnx.data"
    if spec.has_selector:
        so.add_flavour(model, "portable", num_drafts)
    streamed = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    if streamed:  # built straight into its data file (dflash2.export.weights.DataFile): only the proto is left
        onnx.save_model(model, str(folder / files["portable"]))
    else:
        onnx.save_model(model, str(folder / files["portable"]), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data, size_threshold=1024)
    if "tensorrt" in files:
        trt = fixed if fixed is not None else onnx.load(str(folder / files["portable"]), load_external_data=False)
        if spec.has_selector:
            so.add_flavour(trt, "tensorrt", num_drafts)
        if fixed is not None:
            share_weights(trt, folder / files["portable"], data)
        onnx.save_model(trt, str(folder / files["tensorrt"]))
    for f in files.values() if check else ():
        onnx.checker.check_model(str(folder / f), full_check=True)
    return files


def share_weights(model: onnx.ModelProto, portable: Path, data: str) -> None:
    """Point every initializer of `model` that the portable file stores with the same name and bytes at
    the portable file's external data (both flavours trace one module: the weights are the same)."""
    stored = {t.name: t for t in onnx.load(str(portable), load_external_data=False).graph.initializer
              if t.data_location == onnx.TensorProto.EXTERNAL}
    blob = np.memmap(portable.parent / data, dtype=np.uint8, mode="r")
    for t in model.graph.initializer:
        ref = stored.get(t.name)
        if ref is None or list(ref.dims) != list(t.dims) or ref.data_type != t.data_type or not t.HasField("raw_data"):
            continue
        info = {e.key: e.value for e in ref.external_data}
        offset, length = int(info.get("offset", 0)), int(info["length"])
        if length != len(t.raw_data) or blob[offset:offset + length].tobytes() != t.raw_data:
            continue
        t.ClearField("raw_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        del t.external_data[:]
        t.external_data.extend(ref.external_data)


def io_spec(path: Path) -> dict:
    """Inputs / outputs of a graph file: names, dtypes, dims (ints or symbolic names)."""
    m = onnx.load(str(path), load_external_data=False)

    def one(v):
        t = v.type.tensor_type
        return {"name": v.name, "dtype": dtypes.from_onnx(t.elem_type).name,
                "shape": [d.dim_param or d.dim_value for d in t.shape.dim]}

    return {"inputs": [one(v) for v in m.graph.input], "outputs": [one(v) for v in m.graph.output]}


def duplicate_initializers(path: Path) -> list[tuple[str, str]]:
    """Pairs of initializers with identical bytes in one file (e.g. a tied embedding stored twice)."""
    import hashlib

    m = onnx.load(str(path))
    seen: dict[tuple, str] = {}
    dups = []
    for t in m.graph.initializer:
        arr = onnx.numpy_helper.to_array(t)
        if arr.size < 1024:
            continue
        key = (arr.dtype.str, arr.shape, hashlib.sha256(arr.tobytes()).hexdigest())
        key_t = (arr.dtype.str, arr.shape[::-1], hashlib.sha256(arr.T.copy().tobytes()).hexdigest())
        hit = seen.get(key) or seen.get(key_t)
        if hit:
            dups.append((hit, t.name))
        seen[key] = t.name
    return dups
