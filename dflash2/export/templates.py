"""Layer templates shared by the graphs built from weights instead of traced (gqa.py: the fused-op target;
fused_drafter.py: the drafter): one `Builder` (nodes + initializers written straight into a data file,
quantized as written when asked), the packed projections, the per-head norm, the rotary caches.
onnxruntime-genai's builder is the model: a layer is a few calls here, not a traced module.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from dflash2.export import weights as W
from dflash2.reference.layers import rope_cos_sin, rope_inv_freq

OPSET = 17


class Builder:
    """Nodes and initializers of one graph. Weights go through `data` (a DataFile: written to disk as they
    are made, the proto only points at them) or, without one, inline into the proto."""

    def __init__(self, data: W.DataFile | None = None, quant=None, native=None):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.names: set[str] = set()
        self.data = data
        self.nbits = None if quant is None else W.NBits(quant)  # quantize as the weights are written
        self.native = native  # a GgufBlocks: weights it holds go in as its blocks, not requantized

    def _name(self, name: str) -> str:
        if name in self.names:  # ONNX Runtime would only warn and keep one of them
            raise ValueError(f"graph builder: initializer {name!r} defined twice")
        self.names.add(name)
        return name

    def weight(self, name: str, a: np.ndarray) -> str:
        a = np.ascontiguousarray(a) if np.ndim(a) else np.asarray(a)  # (ascontiguousarray makes scalars 1-D)
        self.inits.append(self.data.add(self._name(name), a) if self.data is not None and a.nbytes >= W.DataFile.SMALL
                          else numpy_helper.from_array(a, self._name(name)))
        return name

    def chunked(self, name: str, chunks, shape: tuple[int, ...], dtype=np.float32) -> str:
        """A large weight written row chunk by row chunk (never whole in memory with a DataFile), as `dtype`."""
        if self.data is None:
            return self.weight(name, np.concatenate(list(chunks)).astype(dtype))
        self.inits.append(self.data.add_chunks(self._name(name), chunks, dtype, shape))
        return name

    def const(self, name: str, values, dtype=np.int64) -> str:
        return self.weight(name, np.asarray(values, dtype))

    def op(self, op: str, inputs: list[str], name: str, outputs: int | list[str] = 1, domain: str = "",
           **attrs) -> list[str]:
        outs = outputs if isinstance(outputs, list) else [f"{name}.out{i}" if outputs > 1 else f"{name}.out"
                                                          for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        return outs

    def linear(self, x: str, name: str, src, prefixes: list[str], quantize: bool = True) -> str:
        """One MatMul over the [K, sum N] concatenation of Linear weights `{prefix}.weight` (+ biases);
        MatMulNBits when the builder quantizes (ONNX Runtime's own block quantizer, dflash2.export.weights)."""
        blocks = self.native_blocks([f"{p}.weight" for p in prefixes], src) if quantize else None
        if blocks is not None:
            y = self.matmul_blocks(x, name, blocks)
        else:
            w = np.concatenate([src.get(f"{p}.weight").T for p in prefixes], axis=1)  # [K, sum N]
            y = self.matmul(x, name, w, quantize)
            del w
        if f"{prefixes[0]}.bias" in src:
            b = np.concatenate([src.get(f"{p}.bias") for p in prefixes])
            y = self.op("Add", [y, self.weight(f"{name}.bias", b)], f"{name}.bias")[0]
        return y

    def matmul(self, x: str, name: str, w: np.ndarray, quantize: bool = True) -> str:
        """x @ w for a [K, N] weight: MatMulNBits when the builder quantizes, else an fp32 MatMul."""
        if self.nbits is not None and quantize:
            return self.matmul_nbits(x, name, w.shape, [w])
        return self.op("MatMul", [x, self.weight(f"{name}.weight", w)], name)[0]

    def native_blocks(self, names: list[str], src):
        """The native blocks of these weights concatenated by rows (q|k|v, gate|up), each checked to dequantize to
        the checkpoint's tensor; None unless the builder quantizes and every one has blocks of one bit width."""
        if self.native is None or self.nbits is None:
            return None
        from dflash2.gguf_blocks import Blocks

        parts = [self.native.checked(n, src) for n in names]
        if any(p is None for p in parts) or len({p.bits for p in parts}) != 1:
            return None
        return Blocks.concat(parts)

    def matmul_blocks(self, x: str, name: str, blocks) -> str:
        """MatMulNBits over blocks given as they are (dflash2.gguf_blocks): block 32, their own bits, float zero
        points where the format has them; the builder's accuracy level."""
        N, K = blocks.shape
        w = f"{name}.weight"
        self.inits.append(self.data.add(self._name(f"{w}_Q{blocks.bits}"), blocks.packed))
        inputs = [x, f"{w}_Q{blocks.bits}", self.weight(f"{w}_scales", blocks.scales.reshape(-1))]
        attrs = {"K": K, "N": N, "bits": blocks.bits, "block_size": 32}
        if self.nbits.accuracy_level:
            attrs["accuracy_level"] = self.nbits.accuracy_level
        node = f"{name}_Q{blocks.bits}"
        self.native.used[node] = blocks.kind  # the export reports what went in unchanged
        y = self.op("MatMulNBits", inputs, node, domain="com.microsoft", **attrs)[0]
        if blocks.zero_points is None:
            return y
        # Float zero points (Q4_1's w = (q - zp) * scale) send ONNX Runtime's kernel down a path that dequantizes
        # the whole weight on every call (measured 50x slower). Instead: the symmetric kernel (zero point 8) plus
        # the rest, exactly: w = s (q - 8) + s (8 - zp), and x @ [s (8 - zp)] per block = (block sums of x) @ C.
        # (x is [1, n, K] here: the fused target's activations.)
        nb = K // 32
        c = (blocks.scales * (2 ** (blocks.bits - 1) - blocks.zero_points)).T  # [nb, N]
        split = self.op("Reshape", [x, self.const(f"{name}.blocks", [0, 0, nb, 32])], f"{name}.blocks")[0]
        sums = self.op("ReduceSum", [split, self.const(f"{name}.last", [-1])], f"{name}.block_sums", keepdims=0)[0]
        rest = self.op("MatMul", [sums, self.weight(f"{w}_offsets", np.ascontiguousarray(c, np.float32))],
                       f"{name}.offsets")[0]  # [1, n, N]
        return self.op("Add", [y, rest], f"{name}.q4_1")[0]

    def matmul_nbits(self, x: str, name: str, kn: tuple[int, int], column_blocks) -> str:
        """MatMulNBits of x and a [K, N] weight given as consecutive [K, n_i] column blocks (the LM head:
        the transposed embedding, one vocabulary slice at a time). Names and attributes as ONNX Runtime's
        MatMulNBitsQuantizer writes them (`W_Q4`, `W_scales`, `W_zero_points`; node `NAME_Q4`)."""
        q, (K, N) = self.nbits, kn
        w = f"{name}.weight"
        scales, zeros = [], []

        def packed():
            for block in column_blocks:
                pk, sc, zp = q.quantize(block)
                scales.append(sc)
                zeros.append(zp)
                yield pk

        self.inits.append(self.data.add_chunks(self._name(f"{w}_Q{q.bits}"), packed(), np.uint8,
                                               q.packed_shape(K, N)))
        inputs = [x, f"{w}_Q{q.bits}", self.weight(f"{w}_scales", np.concatenate(scales))]
        if not q.symmetric:
            inputs.append(self.weight(f"{w}_zero_points", np.concatenate(zeros)))
        attrs = {"K": K, "N": N, "bits": q.bits, "block_size": q.block_size}
        if q.accuracy_level:
            attrs["accuracy_level"] = q.accuracy_level
        return self.op("MatMulNBits", inputs, f"{name}_Q{q.bits}", domain="com.microsoft", **attrs)[0]


def head_norm(b: Builder, x: str, heads: int, hd: int, weight: np.ndarray, eps: float, name: str) -> str:
    """[1, n, heads*hd] -> RMSNorm over each head's hd -> [1, n, heads*hd]."""
    shape = b.const(f"{name}.heads", [1, -1, heads, hd])
    y = b.op("Reshape", [x, shape], f"{name}.split_heads")[0]
    y = b.op("SimplifiedLayerNormalization", [y, b.weight(f"{name}.weight", weight)], name, axis=-1, epsilon=eps,
             stash_type=1)[0]
    return b.op("Reshape", [y, b.const(f"{name}.flat", [1, -1, heads * hd])], f"{name}.merge_heads")[0]


def rope_caches(b: Builder, rope, hd: int, rows: int) -> tuple[str, str]:
    """cos / sin caches [rows, hd / 2] as ONNX Runtime's GroupQueryAttention and RotaryEmbedding read them
    (the halves of the reference's rotate-half tables; HF's scaling rules in rope_inv_freq)."""
    cos, sin = rope_cos_sin(torch.arange(rows), rope_inv_freq(rope, hd))  # [rows, hd] (halves repeated)
    return b.weight("rope.cos", cos[:, :hd // 2].numpy()), b.weight("rope.sin", sin[:, :hd // 2].numpy())
