"""Test doubles for `tensorrt` (10.x Python API surface we use) and cuda-python's runtime module.

NOT TensorRT: they let the Python around TensorRT run on a CPU-only machine so its logic is tested
(build calls, engine manifest, profile choice, binding by raw address, pinned push/pull, CUDA-graph
policy). "Device memory" is host memory; an "engine" is JSON naming the ONNX file and the profiles
the builder was given; executing it runs ONNX Runtime with IOBinding over the bound addresses, and
set_input_shape enforces the active profile like TensorRT does. Real TensorRT semantics are checked
by scripts/gpu_check.sh on a GPU machine.
"""

from __future__ import annotations

import ctypes
import enum
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from dflash2.ops import contract as C

# ---------------------------------------------------------------------------------------------- cudart


class FakeCudart:
    """cuda-python runtime calls return (err, *values); err 0 is success."""

    cudaError_t = SimpleNamespace(cudaSuccess=0)
    cudaMemcpyKind = SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2, cudaMemcpyDeviceToDevice=3)
    cudaStreamCaptureMode = SimpleNamespace(cudaStreamCaptureModeThreadLocal=1)

    def __init__(self):
        self.blocks: dict[int, ctypes.Array] = {}
        self.capture: list | None = None  # closures recorded while a stream captures
        self.copies = self.launches = self.syncs = 0

    def _alloc(self, n):
        block = ctypes.create_string_buffer(n)
        self.blocks[ctypes.addressof(block)] = block
        return 0, ctypes.addressof(block)

    def cudaGetErrorString(self, err):
        return 0, b"fake cuda error"

    cudaMalloc = cudaMallocHost = _alloc

    def cudaFree(self, ptr):
        self.blocks.pop(ptr, None)
        return (0,)

    cudaFreeHost = cudaFree

    def cudaMemset(self, ptr, value, n):
        ctypes.memset(ptr, value, n)
        return (0,)

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        ctypes.memmove(dst, src, n)
        self.copies += 1
        return (0,)

    def cudaStreamCreate(self):
        return 0, _Handle(7)

    def cudaStreamDestroy(self, stream):
        return (0,)

    def cudaStreamSynchronize(self, stream):
        self.syncs += 1
        return (0,)

    def cudaStreamBeginCapture(self, stream, mode):
        self.capture = []
        return (0,)

    def cudaStreamEndCapture(self, stream):
        graph, self.capture = self.capture, None
        return 0, graph

    def cudaGraphInstantiate(self, graph, flags):
        return 0, list(graph)

    def cudaGraphLaunch(self, exe, stream):
        for fn in exe:
            fn()
        self.launches += 1
        return (0,)

    def cudaGraphExecDestroy(self, exe):
        return (0,)

    cudaGraphDestroy = cudaGraphExecDestroy

    def cudaGetDevice(self):
        return 0, 0

    def cudaGetDeviceProperties(self, dev):
        return 0, SimpleNamespace(major=self.sm[0], minor=self.sm[1], name=b"Fake GPU")

    sm = (9, 0)


class _Handle(int):
    pass


# ---------------------------------------------------------------------------------------------- tensorrt


class DataType(enum.Enum):
    FLOAT, HALF, BF16, INT32, INT64, UINT8 = range(6)


_TRT_NAMES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "int32": "INT32", "int64": "INT64"}


class _Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class ILogger:
    Severity = _Severity

    def __init__(self):
        pass


class _Registry:
    def __init__(self):
        self.libraries: list[str] = []

    def load_library(self, path):
        self.libraries.append(path)
        return object()

    def get_creator(self, name, version, namespace=""):
        return object() if self.libraries and (name, version) == (C.OP_NAME, C.PLUGIN_VERSION) else None

    @property
    def all_creators(self):
        return [SimpleNamespace(name=C.OP_NAME, plugin_version=C.PLUGIN_VERSION)] if self.libraries else []


class _Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, lo, opt, hi):
        self.shapes[name] = [list(lo), list(opt), list(hi)]


class _Config:
    def __init__(self):
        self.profiles, self.workspace = [], None

    def set_memory_pool_limit(self, pool, size):
        self.workspace = size

    def create_timing_cache(self, data):
        return SimpleNamespace(serialize=lambda: b"fake timing cache", loaded=bytes(data))

    def set_timing_cache(self, cache, ignore_mismatch):
        return True

    def add_optimization_profile(self, p):
        self.profiles.append(p.shapes)
        return len(self.profiles) - 1


class _Network:
    def __init__(self):
        self.path = None
        self.input_names: list[str] = []

    @property
    def num_inputs(self):
        return len(self.input_names)

    def get_input(self, i):
        return SimpleNamespace(name=self.input_names[i])


class OnnxParser:
    fail_with: str | None = None  # set by a test: the parser reports this error for every file

    def __init__(self, network, logger):
        self.network, self.errors = network, []

    def parse_from_file(self, path):
        import onnx

        if OnnxParser.fail_with:
            self.errors = [SimpleNamespace(node_name=lambda: "/layers.0/attn/MatMul", node=lambda: 3,
                                           node_operator=lambda: "MatMul", desc=lambda: OnnxParser.fail_with,
                                           code=lambda: "ErrorCode.kUNSUPPORTED_NODE")]
            return False
        self.network.path = path
        self.network.input_names = [i.name for i in onnx.load(path, load_external_data=False).graph.input]
        return True

    @property
    def num_errors(self):
        return len(self.errors)

    def get_error(self, i):
        return self.errors[i]


class Builder:
    def __init__(self, logger):
        self.logger = logger

    def create_network(self, flags):
        assert flags == 1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        return _Network()

    def create_builder_config(self):
        return _Config()

    def create_optimization_profile(self):
        return _Profile()

    def build_serialized_network(self, network, config):
        return json.dumps({"onnx": network.path, "profiles": config.profiles}).encode()


class _Context:
    def __init__(self, engine):
        self.engine, self.profile, self.shapes, self.addresses = engine, None, {}, {}
        self.calls = {"set_input_shape": 0, "set_tensor_address": 0}

    def set_optimization_profile_async(self, i, stream):
        self.profile = i
        return True

    def set_device_memory(self, ptr, size):
        self.memory = (ptr, size)

    def set_input_shape(self, name, shape):
        self.calls["set_input_shape"] += 1
        box = self.engine.profiles[self.profile]
        if name not in box:  # a static input: only its own shape is accepted
            return tuple(shape) == self.engine.get_tensor_shape(name)
        lo, _, hi = box[name]
        if not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False  # TensorRT rejects shapes outside the active profile
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.calls["set_tensor_address"] += 1
        self.addresses[name] = ptr
        return True

    def _dims(self):
        dims = {}
        for spec in self.engine.io["inputs"]:
            for d, v in zip(spec["shape"], self.shapes.get(spec["name"], spec["shape"])):
                if isinstance(d, str):
                    dims[d] = v
        return dims

    def get_tensor_shape(self, name):
        spec = self.engine.spec[name]
        dims = self._dims()
        return tuple(_dim(d, dims) if isinstance(d, str) else d for d in spec["shape"])

    def execute_async_v3(self, stream):
        shapes, addresses = dict(self.shapes), dict(self.addresses)
        out_shapes = {o["name"]: self.get_tensor_shape(o["name"]) for o in self.engine.io["outputs"]}

        def run():
            b = self.engine.session.io_binding()
            for spec in self.engine.io["inputs"]:
                n = spec["name"]
                b.bind_input(n, "cpu", 0, np.dtype(spec["dtype"]), shapes.get(n, tuple(spec["shape"])), addresses[n])
            for spec in self.engine.io["outputs"]:
                n = spec["name"]
                b.bind_output(n, "cpu", 0, np.dtype(spec["dtype"]), out_shapes[n], addresses[n])
            self.engine.session.run_with_iobinding(b)

        if CUDART.capture is not None:
            CUDART.capture.append(run)
        else:
            run()
        return True


class _Engine:
    def __init__(self, data: dict):
        import onnx
        import onnxruntime as ort

        path = Path(data["onnx"])  # the file TensorRT parsed (a .trt.onnx flavour: fixed step shapes)
        m = onnx.load(str(path), load_external_data=False)
        if any(node.op_type == "DFlash2Selector" for node in m.graph.node) and not m.functions:
            # the "plugin": the selector's ONNX function, attached in memory with the weights
            from dflash2.export import selector_onnx as so

            m = onnx.load(str(path))
            out = next(o for o in m.graph.output if o.name == "draft_ids")
            so.add_flavour(m, "portable", out.type.tensor_type.shape.dim[-1].dim_value)
            self.session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        else:
            self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

        def one(v):
            t = v.type.tensor_type
            return {"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                    "shape": [d.dim_param or d.dim_value for d in t.shape.dim]}

        self.io = {"inputs": [one(v) for v in m.graph.input], "outputs": [one(v) for v in m.graph.output]}
        self.spec = {s["name"]: s for s in self.io["inputs"] + self.io["outputs"]}
        self.profiles = data["profiles"]
        self.names = [s["name"] for s in self.io["inputs"] + self.io["outputs"]]
        self.inputs = {s["name"] for s in self.io["inputs"]}
        self.contexts: list[_Context] = []

    num_io_tensors = property(lambda self: len(self.names))
    num_optimization_profiles = property(lambda self: len(self.profiles))
    device_memory_size_v2 = 4096

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return TensorIOMode.INPUT if name in self.inputs else TensorIOMode.OUTPUT

    def get_tensor_shape(self, name):
        return tuple(-1 if isinstance(d, str) else d for d in self.spec[name]["shape"])

    def get_tensor_dtype(self, name):
        return DataType[_TRT_NAMES[self.spec[name]["dtype"]]]

    def get_tensor_profile_shape(self, name, i):
        return [tuple(s) for s in self.profiles[i][name]]

    def create_execution_context(self, strategy):
        ctx = _Context(self)
        self.contexts.append(ctx)
        return ctx


class Runtime:
    def __init__(self, logger):
        self.logger = logger

    def deserialize_cuda_engine(self, data):
        try:
            return _Engine(json.loads(bytes(data)))
        except (ValueError, KeyError):
            self.logger.log(_Severity.ERROR, "fake: not a serialized engine")
            return None


TensorIOMode = SimpleNamespace(INPUT="input", OUTPUT="output")
ExecutionContextAllocationStrategy = SimpleNamespace(USER_MANAGED="user-managed")
NetworkDefinitionCreationFlag = SimpleNamespace(STRONGLY_TYPED=0)
MemoryPoolType = SimpleNamespace(WORKSPACE="workspace")
__version__ = "10.99.0-fake"
REGISTRY = _Registry()
CUDART = FakeCudart()


def get_plugin_registry():
    return REGISTRY


def reset() -> None:
    """Fresh registry and device memory for one test."""
    global REGISTRY, CUDART
    REGISTRY, CUDART = _Registry(), FakeCudart()
    OnnxParser.fail_with = None


def _dim(d: str, dims: dict) -> int:
    """A named dim, or an expression of named dims as ONNX shape inference writes them (the target's
    `logits [Max(0, n - Max(0, n - B)), V]`): what TensorRT computes from the network."""
    if d in dims:
        return dims[d]
    return int(eval(d, {"__builtins__": {}, "Max": max, "Min": min}, dict(dims)))  # noqa: S307 (test-only)
