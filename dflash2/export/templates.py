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

    def __init__(self, data: W.DataFile | None = None, quant=None, native=None, dtype=np.float32):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.names: set[str] = set()
        self.data = data
        self.dtype = np.dtype(dtype)  # of the float weights (fw, linear, matmul): the graph dtype
        self.nbits = None if quant is None else W.weight_quantizer(quant)  # quantize as the weights are written
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

    def fw(self, name: str, a: np.ndarray) -> str:
        """A float weight in the graph dtype."""
        return self.weight(name, np.asarray(a).astype(self.dtype, copy=False))

    def held(self, a: np.ndarray) -> np.ndarray:
        """A float weight as a reference in the graph dtype holds it (rounded to that dtype), widened to fp32: what
        enters an fp32 product of the graph (a zero-centred norm's 1 + w, a recurrence's gates)."""
        return np.asarray(a).astype(self.dtype).astype(np.float32)

    def chunked(self, name: str, chunks, shape: tuple[int, ...], dtype=None) -> str:
        """A large weight written row chunk by row chunk (never whole in memory with a DataFile), as `dtype`
        (default the graph dtype)."""
        dtype = self.dtype if dtype is None else dtype
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

    def model(self, name: str, inputs, outputs, opset: int = OPSET, prologue_at: int | None = None,
              prologue=(), domains: tuple[tuple[str, int], ...] = ()) -> onnx.ModelProto:
        """The graph as a model; `prologue` (one flavour's nodes) inserted at node `prologue_at`, so flavours that
        differ only in where their past is share every other node and initializer."""
        at = len(self.nodes) if prologue_at is None else prologue_at
        graph = helper.make_graph(self.nodes[:at] + list(prologue) + self.nodes[at:], name, inputs, outputs, self.inits)
        opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in domains]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="dflash2")
        model.ir_version = 8
        return model

    def linear(self, x: str, name: str, src, prefixes: list[str], quantize: bool = True, rows: bool = False) -> str:
        """One MatMul over the [K, sum N] concatenation of Linear weights `{prefix}.weight` (+ biases);
        MatMulNBits when the builder quantizes (ONNX Runtime's own block quantizer, dflash2.export.weights).
        rows: x is a matrix [n, K] (the standard-op targets), so a biased fp16 / bf16 Linear can be one Gemm;
        otherwise (the drafter's [1, n, K]) a MatMul and an Add."""
        blocks = self.native_blocks([f"{p}.weight" for p in prefixes], src) if quantize else None
        bias = np.concatenate([src.get(f"{p}.bias") for p in prefixes]) if f"{prefixes[0]}.bias" in src else None
        if blocks is not None:
            y = self.matmul_blocks(x, name, blocks)
        else:
            w = np.concatenate([src.get(f"{p}.weight").T for p in prefixes], axis=1)  # [K, sum N]
            if rows and bias is not None and (self.nbits is None or not quantize) and \
                    self.dtype != np.dtype(np.float32):
                # fp16 / bf16: one Gemm, rounded once as nn.Linear's addmm is (a MatMul's rounded output plus the
                # bias rounds twice: 0.16 on a tiny biased Llama's bf16 logits); Gemm takes a matrix only
                return self.op("Gemm", [x, self.fw(f"{name}.weight", w), self.fw(f"{name}.bias", bias)], name)[0]
            y = self.matmul(x, name, w, quantize)
            del w
        if bias is not None:
            y = self.op("Add", [y, self.fw(f"{name}.bias", bias)], f"{name}.bias")[0]
        return y

    def matmul(self, x: str, name: str, w: np.ndarray, quantize: bool = True) -> str:
        """x @ w for a [K, N] weight: MatMulNBits when the builder quantizes, else a MatMul in the graph dtype."""
        if self.nbits is not None and quantize:
            return self.matmul_nbits(x, name, w.shape, [w])
        return self.op("MatMul", [x, self.fw(f"{name}.weight", w)], name)[0]

    def head(self, x: str, rows: str, name: str) -> str:
        """x [n, H] @ rows [V, H]^T as one Gemm (transB): a MatMul over a Transpose of the vocabulary-sized matrix
        makes ONNX Runtime compute (or fold) a transposed copy of it, 1.16 GiB at 151,936 x 4,096 fp16."""
        return self.op("Gemm", [x, rows], name, transB=1)[0]

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
        if q.dynamic:
            return self._matmul_dynamic(x, name, column_blocks)
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

    def _matmul_dynamic(self, x: str, name: str, column_blocks) -> str:
        """DynamicQuantizeMatMul over per-column int8 weights (weights.DynamicInt8). Its B is [K, N], so column
        blocks are joined in memory, each held twice while joined (int8: half an fp32 copy of the tensor; a draft
        vocabulary's head is small, a whole 152k-row head of an 8B target would be ~1.2 GB at this step)."""
        parts = [self.nbits.quantize(block) for block in column_blocks]
        w8 = np.concatenate([p[0] for p in parts], axis=1)
        scales = np.concatenate([p[1] for p in parts])
        del parts
        inputs = [x, self.weight(f"{name}.weight_int8", w8), self.weight(f"{name}.weight_scale", scales)]
        return self.op("DynamicQuantizeMatMul", inputs, f"{name}_I8", domain="com.microsoft")[0]


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


class FusedOps:
    """Norms and rotary as ONNX Runtime's contrib ops, fp32: the CPU path's fused graphs (gqa.py's target,
    fused_drafter.build). TensorRT parses none of them."""

    def __init__(self, b: Builder, rope, hd: int, eps: float, rows: int):
        self.b, self.hd, self.eps, self.dt = b, hd, eps, onnx.TensorProto.FLOAT
        self.cos, self.sin = rope_caches(b, rope, hd, rows)  # positions reach rows - 1

    def f32(self, x: str, name: str) -> str:  # already fp32
        return x

    back = f32

    def at(self, pos: str, name: str) -> str:
        """Positions [rows] int64 -> what `rotary` reads: [1, rows] (RotaryEmbedding's position_ids)."""
        return self.b.op("Unsqueeze", [pos, "axis0"], f"{name}.batch")[0]

    def rotary(self, x: str, at: str, heads: int, name: str) -> str:  # [1, rows, heads*hd]
        return self.b.op("RotaryEmbedding", [x, at, self.cos, self.sin], name, domain="com.microsoft", interleaved=0,
                         num_heads=heads)[0]

    def norm(self, x: str, weight: np.ndarray | None, name: str, heads: int = 0, eps: float | None = None) -> str:
        """RMSNorm over the last axis ([1, rows, heads*hd] normed per head when heads); weight None: ones."""
        b, hd = self.b, self.hd
        if heads:
            x = b.op("Reshape", [x, b.const(f"{name}.heads", [0, 0, heads, hd])], f"{name}.split")[0]
        w = np.ones(hd, np.float32) if weight is None else weight
        y = b.op("SimplifiedLayerNormalization", [x, b.weight(f"{name}.weight", w)], name, axis=-1,
                 epsilon=self.eps if eps is None else eps, stash_type=1)[0]
        return b.op("Reshape", [y, b.const(f"{name}.flat", [0, 0, heads * hd])], f"{name}.merge")[0] if heads else y

    def add_norm(self, a: str, h: str, weight: np.ndarray, name: str) -> tuple[str, str]:
        """(norm(h + a), h + a) as one SkipSimplifiedLayerNormalization."""
        y, _, _, s = self.b.op("SkipSimplifiedLayerNormalization", [a, h, self.b.weight(f"{name}.weight", weight)],
                               name, outputs=4, domain="com.microsoft", epsilon=self.eps)
        return y, s


class StandardOps:
    """The same layers in standard ONNX ops only (TensorRT parses them, every ONNX Runtime provider runs them),
    in the graph dtype, with the reference's numerics (dflash2.reference.layers): RMSNorm in fp32 inside, the
    rotary angles computed from the positions in fp32 (any position: no table of max_seq_len rows)."""

    def __init__(self, b: Builder, rope, hd: int, eps: float, opset: int = OPSET):
        self.b, self.hd, self.eps, self.opset = b, hd, eps, opset
        self.dt = helper.np_dtype_to_tensor_dtype(b.dtype)
        self.low = b.dtype != np.float32
        self.inv_freq = rope_inv_freq(rope, hd).numpy()  # [hd / 2] fp32
        self.two = b.const("two", [2.0], np.float32)
        self.half = b.const("rope.half", [hd // 2, hd // 2])

    def f32(self, x: str, name: str) -> str:
        return b_cast(self.b, x, onnx.TensorProto.FLOAT, f"{name}.f32") if self.low else x

    def back(self, x: str, name: str) -> str:
        return b_cast(self.b, x, self.dt, f"{name}.back") if self.low else x

    def norm(self, x: str, weight: np.ndarray | None, name: str, heads: int = 0, eps: float | None = None,
             fp32_weight: bool = False) -> str:
        """RMSNorm over the last axis: fp32 inside, weight * normalized in the graph dtype; per head of hd when
        heads ([.., heads*hd] in and out); weight None: no weight (ones). fp32_weight: the product taken in fp32
        before the cast (a zero-centred norm's (1 + w), as Qwen3.5's reference multiplies it)."""
        b, hd = self.b, self.hd
        if heads:
            x = b.op("Reshape", [x, b.const(f"{name}.heads", [0, 0, heads, hd])], f"{name}.split")[0]
        x32 = self.f32(x, name)
        sq = b.op("Pow", [x32, self.two], f"{name}.sq")[0]  # x.pow(2): ONNX Runtime's fusion matches Pow, not Mul
        if self.opset >= 18:
            ms = b.op("ReduceMean", [sq, b.const(f"{name}.last", [-1])], f"{name}.mean", keepdims=1)[0]
        else:
            ms = b.op("ReduceMean", [sq], f"{name}.mean", axes=[-1], keepdims=1)[0]
        e = self.eps if eps is None else eps
        r = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [ms, b.const(f"{name}.eps", e, np.float32)],
                                                   f"{name}.add_eps")[0]], f"{name}.sqrt")[0]], f"{name}.rsqrt")[0]
        y = b.op("Mul", [x32, r], f"{name}.scale")[0]
        if weight is not None and fp32_weight and self.low:
            y = self.back(b.op("Mul", [b.weight(f"{name}.weight", np.asarray(weight, np.float32)), y], name)[0], name)
        else:
            y = self.back(y, name)
            if weight is not None:
                y = b.op("Mul", [b.fw(f"{name}.weight", weight), y], name)[0]
        if heads:
            y = b.op("Reshape", [y, b.const(f"{name}.flat", [0, 0, heads * hd])], f"{name}.merge")[0]
        return y

    def times(self, x: str, c: str, name: str) -> str:
        """x times an fp32 scalar constant c as torch multiplies a low-precision tensor by a Python float: in fp32,
        rounded once (c held in fp16 / bf16 would round the scalar itself first: 1.702 is 1.703125 in bf16)."""
        return self.back(self.b.op("Mul", [self.f32(x, name), c], name)[0], name)

    def silu(self, x: str, name: str) -> str:
        return silu(self.b, x, name)

    def add_norm(self, a: str, h: str, weight: np.ndarray, name: str) -> tuple[str, str]:
        s = self.b.op("Add", [h, a], f"{name}.residual")[0]
        return self.norm(s, weight, name), s

    def at(self, pos: str, name: str, scale: float | None = None) -> tuple[str, str]:
        """Positions [rows] int64 -> (cos, sin) [rows, 1, hd] in the graph dtype (reference rope_cos_sin); scale: both
        times it in fp32 before the cast (YaRN's attention factor, as gpt-oss's rotary scales them)."""
        b = self.b
        if "rope.inv_freq" not in b.names:
            b.weight("rope.inv_freq", self.inv_freq[None, :])
        col = b.op("Unsqueeze", [b.op("Cast", [pos], f"{name}.pos.f32", to=onnx.TensorProto.FLOAT)[0], "axis1"],
                   f"{name}.pos.col.f32")[0]
        freqs = b.op("Mul", [col, "rope.inv_freq"], f"{name}.freqs")[0]  # [rows, hd / 2]
        emb = b.op("Concat", [freqs, freqs], f"{name}.emb", axis=-1)[0]  # [rows, hd]
        factor = None if scale is None else b.const(f"{name}.scale", [scale], np.float32)
        out = []
        for nm, op in (("cos", "Cos"), ("sin", "Sin")):
            r = b.op(op, [emb], f"{name}.{nm}")[0]
            if factor is not None:
                r = b.op("Mul", [r, factor], f"{name}.{nm}.scaled")[0]
            r = b_cast(b, r, self.dt, f"{name}.{nm}.dt") if self.low else r
            out.append(b.op("Unsqueeze", [r, "axis1"], f"{name}.{nm}.heads")[0])
        return out[0], out[1]

    def rotate(self, x: str, at: tuple[str, str], name: str) -> str:
        """[.., rows, heads, hd]: HF's rotate-half with the (cos, sin) of `at`."""
        b = self.b
        x1, x2 = b.op("Split", [x, self.half], f"{name}.halves", outputs=2, axis=-1)
        r = b.op("Concat", [b.op("Neg", [x2], f"{name}.neg")[0], x1], f"{name}.rotated", axis=-1)[0]
        return b.op("Add", [b.op("Mul", [x, at[0]], f"{name}.cos")[0], b.op("Mul", [r, at[1]], f"{name}.sin")[0]],
                    name)[0]

    def rotary(self, x: str, at: tuple[str, str], heads: int, name: str) -> str:  # [1, rows, heads*hd]
        b, hd = self.b, self.hd
        x4 = b.op("Reshape", [x, b.const(f"{name}.heads", [0, 0, heads, hd])], f"{name}.split")[0]
        return b.op("Reshape", [self.rotate(x4, at, name), b.const(f"{name}.flat", [0, 0, heads * hd])],
                    f"{name}.merge")[0]


def silu(b: Builder, x: str, name: str) -> str:
    """x * sigmoid(x) in fp32, rounded once to the graph dtype, as torch's silu of a low-precision tensor (a Sigmoid
    then a Mul in fp16 / bf16 rounds twice: the tiny Qwen3.5-MoE's fp16 verify logits 0.26 from fp32, not 0.14)."""
    low = b.dtype != np.float32
    x32 = b_cast(b, x, onnx.TensorProto.FLOAT, f"{name}.f32") if low else x
    y = b.op("Mul", [x32, b.op("Sigmoid", [x32], f"{name}.sigmoid")[0]], name)[0]
    return b_cast(b, y, helper.np_dtype_to_tensor_dtype(b.dtype), f"{name}.back") if low else y


def b_cast(b: Builder, x: str, to: int, name: str) -> str:
    return b.op("Cast", [x], name, to=to)[0]
