"""The TensorRT backend: engines from an engine folder (dflash2-build) behind the `Backend` protocol.

Follows Edge-LLM's runtime design: every buffer is allocated once in the constructor (device
buffers, pinned mirrors, one execution-context scratch shared by all contexts since the engines run
one after another on one stream); per step only `set_input_shape` / `set_tensor_address` (skipped
when unchanged) and `execute_async_v3`. One execution context per optimization profile, so a step
picks a context instead of switching profiles. The engines are built from the fixed-shape flavours
(whole KV buffer + `past_len` in, new rows to a staging buffer the session copies into place), so a
step of n rows binds the same shapes and addresses anywhere in the sequence. Optional CUDA graphs
per (graph, shapes, addresses) after one warm-up run, replayed for every later step of that row
count: `TrtBackend(..., cuda_graphs=True)` or DFLASH2_CUDA_GRAPHS=1.

Importing this module never fails; constructing `TrtBackend` without TensorRT raises
`dflash2.native.tensorrt.TensorRTMissingError` saying what to install. No torch.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np

from dflash2 import dtypes
from dflash2 import manifest as mf
from dflash2.native.cudart import cudart
from dflash2.native.library import recorded_library
from dflash2.native.tensorrt import EngineError, load_plugin, make_logger, require_tensorrt
from dflash2.runtime.cuda import DeviceBuffer, GraphCache, Stream
from dflash2.runtime.memory import View

GRAPHS_ENV = "DFLASH2_CUDA_GRAPHS"


def max_shape(shape: list, profiles: list[mf.ProfileRecord]) -> tuple[int, ...]:
    """An io-spec shape with its symbolic dims at their largest value over the manifest's profiles.
    A dim may be an expression of named dims as ONNX shape inference writes it (the target's logits:
    `Max(0, n - Max(0, n - 8))`, i.e. min(n, 8)), evaluated at the named dims' largest values."""
    names = {d for p in profiles for d in p.dims}
    largest = {d: max(p.dims[d][2] for p in profiles if d in p.dims) for d in names}
    return tuple(dim_value(d, largest) if isinstance(d, str) else int(d) for d in shape)


def dim_value(expr: str, dims: dict[str, int]) -> int:
    """Evaluate a symbolic dim: names, integers, + - *, Max / Min; anything else is an EngineError."""
    def ev(node) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in dims:
            return dims[node.id]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Max", "Min")
                and node.args and not node.keywords):
            return (max if node.func.id == "Max" else min)(ev(a) for a in node.args)
        raise EngineError(f"io shape dim {expr!r}: expected names of {sorted(dims)}, integers, + - *, Max, Min")

    try:
        return ev(ast.parse(expr, mode="eval"))
    except SyntaxError:
        raise EngineError(f"io shape dim {expr!r}: not an expression") from None


def pick_profile(order: list[tuple[int, dict]], shapes: dict[str, tuple[int, ...]]) -> int | None:
    """First profile (in `order`: smallest box first) whose [min, max] contains every input shape."""
    for index, box in order:
        if all(len(shapes[n]) == len(lo) and all(a <= s <= b for a, s, b in zip(lo, shapes[n], hi))
               for n, (lo, hi) in box.items()):
            return index
    return None


class TrtEngine:
    """One engine: a context per profile, bindings set only when they change, spare outputs."""

    def __init__(self, name: str, engine, entry: mf.EngineEntry, stream: Stream, graphs: GraphCache | None, logger):
        trt = require_tensorrt()
        self.name, self.engine, self.entry, self.stream, self.graphs, self.logger = (
            name, engine, entry, stream, graphs, logger)
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.dtype = {n: dtypes.from_trt(engine.get_tensor_dtype(n)).name for n in names}
        dynamic = [n for n in self.inputs if any(d < 0 for d in engine.get_tensor_shape(n))]
        self.dynamic = set(dynamic)  # static inputs (e.g. anchor [1]) need no set_input_shape
        boxes = []
        for i in range(engine.num_optimization_profiles):
            box = {}
            for n in dynamic:
                lo, _, hi = engine.get_tensor_profile_shape(n, i)
                box[n] = (tuple(lo), tuple(hi))
            boxes.append((i, box))
        self.order = sorted(boxes, key=lambda b: sum(int(np.prod(hi)) for _, hi in b[1].values()))
        self.contexts, self.bound = {}, {}
        for i, _ in boxes:
            ctx = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if ctx is None or not ctx.set_optimization_profile_async(i, stream.ptr):
                raise EngineError(f"{name}: cannot create an execution context for profile {i}: {logger.tail()}")
            self.contexts[i], self.bound[i] = ctx, {}
        self.spare: dict[str, DeviceBuffer] = {}

    def memory_size(self) -> int:
        e = self.engine
        return int(e.device_memory_size_v2 if hasattr(e, "device_memory_size_v2") else e.device_memory_size)

    def use_memory(self, ptr: int, size: int) -> None:
        for ctx in self.contexts.values():
            if hasattr(ctx, "set_device_memory"):  # TensorRT >= 10.1
                ctx.set_device_memory(ptr, size)
            else:
                ctx.device_memory = ptr

    def _spare_view(self, name: str, shape: tuple[int, ...]) -> View:
        """An output nobody reads (e.g. debug logits): one buffer at its largest profile shape."""
        if name not in self.spare:
            spec = next(o for o in self.entry.outputs if o.name == name)
            rows = int(np.prod(max_shape(spec.shape, self.entry.profiles)))
            self.spare[name] = DeviceBuffer((rows,), dtypes.numpy_dtype(self.dtype[name]), self.stream)
        buf = self.spare[name]
        if int(np.prod(shape)) > buf.capacity:
            raise EngineError(f"{self.name}: output {name} shape {list(shape)} exceeds its {buf.capacity}-element "
                              f"buffer")
        return View(buf.ptr, shape, buf.dtype, buf.device)

    def _set(self, ctx, bound: dict, name: str, view: View, is_input: bool) -> None:
        if is_input and name in self.dynamic and bound.get(("shape", name)) != view.shape:
            if not ctx.set_input_shape(name, view.shape):
                raise EngineError(f"{self.name}: set_input_shape({name}, {list(view.shape)}) rejected: "
                                  f"{self.logger.tail(2)}")
            bound[("shape", name)] = view.shape
        if bound.get(name) != view.ptr:
            if not ctx.set_tensor_address(name, view.ptr):
                raise EngineError(f"{self.name}: set_tensor_address({name}) rejected: {self.logger.tail(2)}")
            bound[name] = view.ptr

    def run(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        missing = [n for n in self.inputs if n not in inputs]
        unknown = sorted(set(inputs) - set(self.inputs)) + sorted(set(outputs) - set(self.outputs))
        if missing or unknown:
            raise EngineError(f"{self.name}: inputs expected {self.inputs}; missing {missing}, unknown {unknown}")
        shapes = {n: inputs[n].shape for n in self.inputs}
        index = pick_profile(self.order, shapes)
        if index is None:
            ranges = "; ".join(f"profile {i}: " + ", ".join(f"{n} {list(lo)}..{list(hi)}" for n, (lo, hi) in b.items())
                               for i, b in self.order)
            raise EngineError(f"{self.name}: input shapes {shapes} fit no optimization profile ({ranges}); "
                              f"rebuild with a larger dflash2-build --max-prefill / --max-seq-len")
        for n in self.inputs:
            if inputs[n].dtype.name != self.dtype[n]:
                raise EngineError(f"{self.name}: input {n} expected {self.dtype[n]}, bound {inputs[n].dtype}")
        ctx, bound = self.contexts[index], self.bound[index]
        for n in self.inputs:
            self._set(ctx, bound, n, inputs[n], True)
        views = {}
        for n in self.outputs:
            want = tuple(ctx.get_tensor_shape(n))
            v = outputs.get(n) or self._spare_view(n, want)
            if tuple(v.shape) != want or v.dtype.name != self.dtype[n]:
                raise EngineError(f"{self.name}: output {n} expected shape {list(want)} {self.dtype[n]}, "
                                  f"bound {list(v.shape)} {v.dtype}")
            self._set(ctx, bound, n, v, False)
            views[n] = v
        if self.graphs is None:
            self._enqueue(ctx)
            return
        key = (self.name, index, tuple((n, inputs[n].shape, inputs[n].ptr) for n in self.inputs),
               tuple((n, views[n].ptr) for n in self.outputs))
        self.graphs.launch(key, lambda: self._enqueue(ctx))

    def _enqueue(self, ctx) -> None:
        if not ctx.execute_async_v3(self.stream.ptr):
            raise EngineError(f"{self.name}: execute_async_v3 failed: {self.logger.tail()}")


class TrtBinding:
    """One session's use of a shared engine: the views it bound once, merged into each of its runs. An
    engine sets a tensor address only when it changed, so sessions taking turns on one engine stay correct."""

    def __init__(self, engine: TrtEngine):
        self.engine = engine
        self.fixed_in: dict[str, View] = {}
        self.fixed_out: dict[str, View] = {}

    def bind(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        self.fixed_in |= inputs
        self.fixed_out |= outputs

    def run(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        self.engine.run({**self.fixed_in, **inputs}, {**self.fixed_out, **outputs})

    def __getattr__(self, name):  # name, inputs, outputs, spare, ...: the engine's
        return getattr(self.engine, name)


class TrtBackend:
    """The `Backend` protocol over an engine folder; engines for target and drafter load eagerly."""

    name = "tensorrt"

    def __init__(self, folder: str | Path, manifest: mf.EngineManifest, cuda_graphs: bool | None = None,
                 graphs: tuple[str, ...] = ("target", "drafter")):
        trt = require_tensorrt()
        cudart()  # CudaMissingError before any TensorRT work
        self.folder, self.manifest = Path(folder), manifest
        if not isinstance(manifest, mf.EngineManifest):
            raise EngineError(f"{folder}: the TensorRT backend needs an engine folder (dflash2-build), found "
                              f"format {manifest.format!r}")
        self.logger = make_logger(trt)
        if manifest.plugin is not None:
            load_plugin(trt, recorded_library(manifest.plugin.path, manifest.plugin.sha256), self.logger)
        self.runtime = trt.Runtime(self.logger)
        self.stream = Stream()
        if cuda_graphs is None:
            cuda_graphs = os.environ.get(GRAPHS_ENV, "0") == "1"
        self.graphs = GraphCache(self.stream) if cuda_graphs else None
        self.engines = {g: self._load(trt, g) for g in graphs}
        size = max(e.memory_size() for e in self.engines.values())
        self.scratch = DeviceBuffer((max(size, 1),), np.uint8, self.stream)
        for e in self.engines.values():
            e.use_memory(self.scratch.ptr, size)
        self.stream.sync()  # profiles were selected asynchronously

    def _load(self, trt, graph: str) -> TrtEngine:
        entry = self.manifest.engines.get(graph)
        if entry is None:
            raise EngineError(f"{self.folder / mf.NAME}: engines: expected {graph!r}, found "
                              f"{sorted(self.manifest.engines)}")
        path = self.folder / entry.file
        if not path.is_file():
            raise EngineError(f"{path}: engine file missing (rebuild with dflash2-build)")
        engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise EngineError(f"{path}: TensorRT {trt.__version__} could not deserialize the engine (built with "
                              f"TensorRT {self.manifest.tensorrt_version}; engines are tied to the TensorRT "
                              f"version and GPU: rebuild with dflash2-build):\n  {self.logger.tail()}")
        return TrtEngine(graph, engine, entry, self.stream, self.graphs, self.logger)

    def engine(self, graph: str) -> TrtBinding:
        """A binding of the loaded engine for one session (engines load once per backend)."""
        if graph not in self.engines:
            raise EngineError(f"{self.folder}: no {graph!r} engine loaded (have {sorted(self.engines)})")
        return TrtBinding(self.engines[graph])

    def signature(self, graph: str) -> mf.Signature:
        return self.manifest.signature(graph)

    def device_buffer(self, shape: tuple[int, ...], dtype) -> DeviceBuffer:
        return DeviceBuffer(shape, dtype, self.stream, pinned=False)

    def host_buffer(self, shape: tuple[int, ...], dtype) -> DeviceBuffer:
        return DeviceBuffer(shape, dtype, self.stream, pinned=True)

    def max_rows(self, graph: str) -> int:
        """Largest `n` (rows of one step) over the engine's optimization profiles."""
        return max(p.dims["n"][2] for p in self.manifest.engines[graph].profiles)
