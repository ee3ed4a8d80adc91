"""Weight-only int4 / int8 graphs for ONNX Runtime with ONNX Runtime's own quantizer.

`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer` turns MatMul nodes with a
constant [K, N] weight into `com.microsoft.MatMulNBits` (blockwise, per-column scales and zero
points); activations stay fp32 unless `accuracy_level` 4 lets the CPU kernel quantize them to int8
on the fly (AVX-512 VNNI / AVX-VNNI dot products). What this module adds around it:

- The dynamo exporter writes `nn.Linear` as Gemm(transB=1) and the tied LM head as
  MatMul(x, Transpose(embedding)); the quantizer only takes MatMul with an initializer weight, so
  `weights_as_matmul` rewrites both into MatMul with a [K, N] initializer first (numerically the
  same graph: tested on the fp32 graph before quantizing).
- Which weights are quantized is data (`OrtQuant`): the LM head (the MatMul feeding the target's
  ArgMax or the drafter's TopK) and the drafter can be kept fp32; the embedding Gather stays fp32
  (a lookup reads one row per token, quantizing it saves memory only). The selector's own math is
  never touched (its codebooks are inputs of the DFlash2Selector node, not MatMul weights).

The defaults were chosen by measurement on SmolLM2-135M (docs/quantization.md).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.export import fuse

ORT_METHODS = {"int4": 4, "int8": 8}
from dflash2.quant_manifest import DYNAMIC  # DynamicQuantizeMatMul (weights.DynamicInt8): the drafter's only
DRAFTER_METHODS = (*ORT_METHODS, DYNAMIC)
QUANTIZER = "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer"


class QuantizeError(Dflash2Error):
    pass


def check_block_size(flag: str, size: int | None, power_of_two: bool = True) -> None:
    """The one block-size rule of dflash2-export and export(): 16..256 is what ONNX Runtime's MatMulNBits and
    ModelOpt's block quantizers take; MatMulNBits also needs a power of two (ModelOpt's check is its own)."""
    if size is None:
        return
    if not 16 <= size <= 256:
        raise QuantizeError(f"{flag}: expected a power of two in 16..256 (what ONNX Runtime's MatMulNBits and "
                            f"ModelOpt's block quantizers take), found {size}")
    if power_of_two and size & (size - 1):
        raise QuantizeError(f"{flag}: expected a power of two >= 16, found {size}")


class Quantization(Protocol):
    """What the export asks of a quantization choice (OrtQuant here, dflash2.export.qdq.TrtQuant), so that its
    stages never ask which one they hold: dflash2.export.plan decides per graph what is quantized and when."""

    method: str
    block_size: int
    backend: ClassVar[str]  # "onnxruntime" (MatMulNBits graphs) | "tensorrt" (a Q/DQ TensorRT flavour)

    def graphs(self) -> list[str]:
        """The graphs it quantizes."""

    def for_graph(self, name: str) -> "Quantization":
        """The quantization graph `name` is written with."""

    def memory_note(self, gib: float) -> str:
        """Why quantizing a validated `gib` GiB fp32 graph is not memory-bounded (the progress line says it)."""

    def manifest_entry(self, per_graph: dict[str, mf.QuantizedGraph]) -> mf.Quantization:
        """The manifest's record, given each graph's report."""


@dataclass(frozen=True)
class OrtQuant:
    """What `dflash2-export --quantize int4|int8` does to the target and drafter graphs."""

    method: str  # "int4" | "int8"
    block_size: int = 32  # weights per scale along K (a power of two >= 16)
    accuracy_level: int = 4  # MatMulNBits compute type: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 activations
    symmetric: bool = True
    lm_head: bool = True  # quantize the LM heads (target and drafter)
    drafter: bool = True  # quantize the drafter graph as well as the target
    fuse: bool = True  # merge parallel MatMuls and fuse RMSNorms first (dflash2.export.fuse)
    native: str | None = None  # a GGUF of the target: its quantized blocks as they are (dflash2.gguf_blocks)
    # The drafter's own method / block size (None: the target's). Only the target must be row-invariant (lossless
    # verification); the drafter's rows only decide what is proposed, so its kernel is chosen for speed alone: at
    # the drafter's 8 rows ONNX Runtime's int8-activation kernel costs about the same for 4- and 8-bit weights and
    # less for larger blocks (docs/quantization.md, "The drafter's own quantization")
    drafter_method: str | None = None
    drafter_block_size: int | None = None
    backend: ClassVar[str] = "onnxruntime"

    def __post_init__(self):
        if self.method not in DRAFTER_METHODS:  # DYNAMIC only as the drafter's (for_graph); export() refuses it
            raise QuantizeError(f"--quantize: expected one of {list(ORT_METHODS)}, found {self.method!r}")
        if self.drafter_method is not None and self.drafter_method not in DRAFTER_METHODS:
            raise QuantizeError(f"--quant-drafter: expected one of {list(DRAFTER_METHODS)}, found "
                                f"{self.drafter_method!r}")
        if (self.drafter_method or self.drafter_block_size) and not self.drafter:
            raise QuantizeError("--quant-drafter / --quant-drafter-block-size: expected a quantized drafter, found "
                                "--quant-target-only (the drafter kept fp32)")
        if self.drafter_block_size is not None and self.drafter_method == DYNAMIC:
            raise QuantizeError(f"--quant-drafter-block-size: no effect with --quant-drafter {DYNAMIC} (per-column "
                                f"weights, no blocks)")
        check_block_size("--quant-block-size", self.block_size)
        check_block_size("--quant-drafter-block-size", self.drafter_block_size)
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise QuantizeError(f"--quant-accuracy-level: expected one of 0..4, found {self.accuracy_level}")

    @property
    def bits(self) -> int:
        return 8 if self.dynamic else ORT_METHODS[self.method]

    @property
    def dynamic(self) -> bool:
        """DynamicQuantizeMatMul weights: only ever the drafter's (for_graph), export() refuses it for a target."""
        return self.method == DYNAMIC

    def graphs(self) -> list[str]:
        return ["target", "drafter"] if self.drafter else ["target"]

    def for_graph(self, name: str) -> "OrtQuant":
        """The quantization graph `name` is written with: the drafter's own method and block size where given."""
        if name != "drafter":
            return self
        return dataclasses.replace(self, method=self.drafter_method or self.method,
                                   block_size=self.drafter_block_size or self.block_size)

    def memory_note(self, gib: float) -> str:
        return (f" (ONNX Runtime's quantizer loads the whole fp32 graph, {gib:.2f} GiB: this stage is not "
                f"memory-bounded; --target-attention gqa, the default, quantizes as it writes)")

    def manifest_entry(self, per_graph: dict[str, mf.QuantizedGraph]) -> mf.Quantization:
        return mf.Quantization(method=self.method, backend=self.backend, library=QUANTIZER, bits=self.bits,
                               format="MatMulNBits (weight-only, blockwise)", graphs=per_graph,
                               block_size=self.block_size, accuracy_level=self.accuracy_level,
                               symmetric=self.symmetric, lm_head=self.lm_head, drafter=self.drafter,
                               fuse=self.fuse, native=self.native, drafter_method=self.drafter_method,
                               drafter_block_size=self.drafter_block_size)


def _initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def weights_as_matmul(model: onnx.ModelProto) -> int:
    """In place: Gemm(A, W[N, K], transB=1) and MatMul(A, Transpose(W)) with constant W become
    MatMul(A, W'[K, N]) (+ Add of a Gemm bias). Returns the number of rewritten nodes."""
    inits = _initializers(model)
    producers = {o: n for n in model.graph.node for o in n.output}
    added: dict[str, str] = {}  # source initializer -> its [K, N] copy (a tied head shares one)

    def kn_weight(name: str, transpose: bool) -> str:
        key = f"{name}{'.T' if transpose else ''}"
        if key not in added:
            w = numpy_helper.to_array(inits[name])
            t = numpy_helper.from_array(np.ascontiguousarray(w.T if transpose else w), f"{name}.kn")
            model.graph.initializer.append(t)
            added[key] = t.name
        return added[key]

    new_nodes, rewritten = [], 0
    for node in model.graph.node:
        if (node.op_type == "Gemm" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2
                and _attr(node, "transA", 0) == 0 and _attr(node, "alpha", 1.0) == 1.0
                and _attr(node, "beta", 1.0) == 1.0 and (len(node.input) < 3 or node.input[2] in inits)):
            w = kn_weight(node.input[1], bool(_attr(node, "transB", 0)))
            bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
            mm_out = f"{node.output[0]}.mm" if bias else node.output[0]
            new_nodes.append(helper.make_node("MatMul", [node.input[0], w], [mm_out], name=node.name))
            if bias:
                new_nodes.append(helper.make_node("Add", [mm_out, bias], [node.output[0]], name=f"{node.name}.bias"))
            rewritten += 1
            continue
        if node.op_type == "MatMul" and node.input[1] in producers:
            p = producers[node.input[1]]
            if (p.op_type == "Transpose" and p.input[0] in inits and len(inits[p.input[0]].dims) == 2
                    and list(_attr(p, "perm", [1, 0])) == [1, 0]):
                new_nodes.append(helper.make_node("MatMul", [node.input[0], kn_weight(p.input[0], True)],
                                                  list(node.output), name=node.name))
                rewritten += 1
                continue
        new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    _drop_dead(model)
    return rewritten


def _drop_dead(model: onnx.ModelProto) -> None:
    """Remove nodes and initializers nothing reads any more (the orphaned Transpose of a tied head)."""
    g = model.graph
    live = {o.name for o in g.output}
    keep = []
    for node in reversed(g.node):
        if any(o in live for o in node.output):
            keep.append(node)
            live.update(node.input)
    del g.node[:]
    g.node.extend(reversed(keep))
    used = live | {i for f in model.functions for n in f.node for i in n.input}
    dead = [t for t in g.initializer if t.name not in used]
    for t in dead:
        g.initializer.remove(t)


def head_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the MatMuls whose output feeds an ArgMax or TopK (through elementwise scaling, a cast or a
    reshape): the target's and the drafter's LM heads."""
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = _initializers(model)
    heads = []
    for node in model.graph.node:
        if node.op_type not in ("ArgMax", "TopK"):
            continue
        p = producers.get(node.input[0])
        while p is not None and p.op_type in ("Cast", "Mul", "Div", "Tanh", "Unsqueeze", "Squeeze", "Reshape"):
            p = next((producers[i] for i in p.input if i in producers and i not in inits), None)
        if p is not None and p.op_type == "MatMul":
            heads.append(p.name)
    return heads


def _quantizer_class():
    """The quantizer's module calls logging.basicConfig(level=INFO) on import, which would turn on every
    library's INFO lines for the rest of the export: undo that, and quiet its own per-node lines."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.setLevel(level)
    for h in root.handlers[len(handlers):]:
        root.removeHandler(h)
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    return MatMulNBitsQuantizer


def quantize_model(model: onnx.ModelProto, q: OrtQuant) -> tuple[onnx.ModelProto, mf.QuantizedGraph]:
    """fp32 graph -> MatMulNBits graph; returns it and a report (what was quantized, sizes)."""
    if q.dynamic:  # ONNX Runtime's MatMulNBitsQuantizer would write int8 blocks (bits 8) instead
        raise QuantizeError(f"{DYNAMIC}: written by the fused drafter only (dflash2.export.fused_drafter)")
    MatMulNBitsQuantizer = _quantizer_class()

    rewritten = weights_as_matmul(model)
    heads = head_nodes(model)
    fused = {}
    if q.fuse:
        fused = {"merged_matmuls": fuse.merge_parallel_matmuls(model, keep=set(heads)), **fuse.fuse_norms(model)}
    inits = _initializers(model)
    mats = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    exclude = [] if q.lm_head else heads
    before = sum(_nbytes(t) for t in model.graph.initializer)
    quantizer = MatMulNBitsQuantizer(model, bits=q.bits, block_size=q.block_size, is_symmetric=q.symmetric,
                                     accuracy_level=q.accuracy_level, nodes_to_exclude=exclude)
    quantizer.process()
    out = quantizer.model.model
    done = sum(n.op_type == "MatMulNBits" for n in out.graph.node)
    return out, mf.QuantizedGraph(
        weight_matmuls=len(mats), quantized=done, lm_heads=sorted(heads), kept_fp32=sorted(exclude),
        weight_mb_before=round(before / 2**20, 2),
        weight_mb_after=round(sum(_nbytes(t) for t in out.graph.initializer) / 2**20, 2), gemm_rewritten=rewritten,
        fused=fused)


def _nbytes(t: onnx.TensorProto) -> int:
    if t.HasField("raw_data"):
        return len(t.raw_data)
    return int(np.prod(t.dims, dtype=np.int64)) * 4


def quantize_file(path: Path, q: OrtQuant) -> mf.QuantizedGraph:
    """Rewrite `path` (+ its external data `<path>.data`) as the quantized graph, in place.
    Only ever called on files inside export()'s temporary folder."""
    model = onnx.load(str(path))  # weights in memory: the old data file can be replaced
    out, report = quantize_model(model, q)
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(out, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
                    size_threshold=1024)
    # No onnx.checker here: ONNX Runtime registers SimplifiedLayerNormalization in the ONNX domain, which the
    # checker does not know. The deviation measurement right after loads the graph in ONNX Runtime instead.
    return report

