"""The Q4MatMul ONNX Runtime custom op (plugins/dflash2Q4MatMul/): find libdflash2_ort_q4.so, say whether this
machine can run it, register it on a SessionOptions, and its kernel alone through ctypes (tests).

A target exported with `--quantize int4` on x86-64 carries a `cpu_q4` flavour: its MatMulNBits nodes as
ai.dflash2.Q4MatMul (same inputs, attributes and arithmetic; faster at the rows a decode or a verify runs). The
runtime opens that flavour where `usable()` and the portable graph everywhere else.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from dflash2.native.library import BUILD_HINT, PluginLibraryError, search_dirs

LIB = "libdflash2_ort_q4.so"
DOMAIN, OP = "ai.dflash2", "Q4MatMul"
MIN_ORT = (1, 17)  # KernelContext_ParallelFor (plugins/dflash2Q4MatMul/ortAbi.h)
OFF_VAR = "DFLASH2_Q4MATMUL"  # "0": run the portable graph even where the op could run


def find() -> str | None:
    for d in search_dirs():
        p = d / LIB
        if p.is_file():
            return str(p)
    return None


@functools.lru_cache(maxsize=None)
def _lib(path: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise PluginLibraryError(f"{path} failed to load: {e}; rebuild it: {BUILD_HINT}") from e
    lib.df2_q4_supported.restype = ctypes.c_int
    lib.df2_q4_matmul.restype = ctypes.c_int
    return lib


def why_not() -> str | None:
    """None where Q4MatMul graphs run here, else the reason in one line."""
    if os.environ.get(OFF_VAR, "1") == "0":
        return f"{OFF_VAR}=0"
    path = find()
    if path is None:
        return f"{LIB} not built ({BUILD_HINT})"
    import onnxruntime as ort

    found = tuple(int(x) for x in ort.__version__.split(".")[:2])
    if found < MIN_ORT:
        return f"onnxruntime {ort.__version__} is older than {MIN_ORT[0]}.{MIN_ORT[1]}"
    if not _lib(path).df2_q4_supported():
        return "this CPU lacks AVX512-VNNI"
    return None


def usable() -> bool:
    return why_not() is None


def register(opts) -> None:
    """Make ai.dflash2.Q4MatMul known to sessions made with `opts` (an onnxruntime.SessionOptions)."""
    reason = why_not()
    if reason is not None:
        raise PluginLibraryError(f"a graph with {DOMAIN}.{OP} nodes cannot run here: {reason}")
    opts.register_custom_ops_library(find())


def matmul(a: np.ndarray, b: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The kernel alone, one thread: a [M, K] fp32, b uint8 [N, K/32, 16], scales fp32 [N, K/32] -> [M, N]."""
    lib = _lib(find() or LIB)
    a = np.ascontiguousarray(a, np.float32)
    b, scales = np.ascontiguousarray(b, np.uint8), np.ascontiguousarray(scales, np.float32)
    (m, k), n = a.shape, b.shape[0]
    y = np.empty((m, n), np.float32)
    p = ctypes.c_void_p
    rc = lib.df2_q4_matmul(m, k, n, p(a.ctypes.data), p(b.ctypes.data), p(scales.ctypes.data), p(y.ctypes.data))
    if rc != 0:
        raise PluginLibraryError(f"df2_q4_matmul refused M={m} K={k} N={n} (K a multiple of 32, a supported CPU)")
    return y


def model(k: int, n: int, weights, op: str = "MatMulNBits", x_dims=("m",), ir_version: int = 8, **attrs) -> bytes:
    """An ONNX graph of one 4-bit MatMul node per (b, s) in `weights`, each reading input x [*x_dims, k] into
    y0, y1, ...: ONNX Runtime's MatMulNBits or this op (op=OP), with the attributes the export writes (4 bits,
    block 32, accuracy level 4) unless `attrs` say otherwise. What the export's node check, the tests and the
    experiments run one op on."""
    from onnx import TensorProto, helper, numpy_helper

    domain = DOMAIN if op == OP else "com.microsoft"
    a = dict(K=k, N=n, bits=4, block_size=32, accuracy_level=4) | attrs
    nodes = [helper.make_node(op, ["x", f"b{i}", f"s{i}"], [f"y{i}"], domain=domain, **a) for i in range(len(weights))]
    inits = [t for i, (b, s) in enumerate(weights)
             for t in (numpy_helper.from_array(b, f"b{i}"), numpy_helper.from_array(s, f"s{i}"))]
    g = helper.make_graph(nodes, "q4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*x_dims, k])],
                          [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [*x_dims, n])
                           for i in range(len(weights))], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)],
                             ir_version=ir_version).SerializeToString()
