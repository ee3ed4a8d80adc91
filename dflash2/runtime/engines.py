"""One engine interface, several backends (Polygraphy-style runners).

    backend.engine(name).run(inputs={name: View}, outputs={name: View})

runs one graph with every input read from and every output written into caller-owned buffers.
The ONNX Runtime backend binds views with IOBinding (raw pointers, no OrtValue per step).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from dflash2 import dtypes
from dflash2.errors import Dflash2Error
from dflash2.onnxrt import open_session
from dflash2.runtime.memory import Buffer, HostBuffer, View


class Engine(Protocol):
    name: str
    inputs: list[str]  # input names: the session binds by them (fixed-shape graphs have `past_len`)

    def run(self, inputs: dict[str, View], outputs: dict[str, View]) -> None: ...


class Backend(Protocol):
    name: str

    def engine(self, graph: str) -> Engine: ...

    def device_buffer(self, shape: tuple[int, ...], dtype) -> Buffer:
        """Memory the engines read and write (the host never touches it but through push / pull)."""

    def host_buffer(self, shape: tuple[int, ...], dtype) -> Buffer:
        """Small I/O the host fills or reads every step (token ids, drafts)."""

    def max_rows(self, graph: str) -> int | None:
        """The most rows one step of `graph` may have (engine profiles); None: no limit but the buffers."""


class OrtEngine:
    def __init__(self, name: str, path: Path, providers: list[str], threads: int | None = None,
                 spin: bool = True):
        self.name = name
        self.session = open_session(path, providers, threads, spin)
        self.binding = self.session.io_binding()
        self.output_names = {o.name for o in self.session.get_outputs()}
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.bound: dict[tuple[str, str], View] = {}  # what the binding holds: it persists across runs
        # Only the CPU provider reads a bound input at run time; others copy it to the device when it is
        # bound (IOBinding::BindInput), so their inputs are bound again every run.
        self.cache_inputs = self.session.get_providers() == ["CPUExecutionProvider"]

    def run(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        # Only views that changed are bound again: a gqa target binds 2L KV buffers in and out, the same
        # every step (120 binds a step for SmolLM2).
        b, bound = self.binding, self.bound
        for name, v in inputs.items():  # ONNX element types: bfloat16 has no numpy type ORT knows
            if not self.cache_inputs or bound.get(("in", name)) != v:
                b.bind_input(name, v.device, 0, dtypes.onnx_type(v.dtype), v.shape, v.ptr)
                bound["in", name] = v
        for name, v in outputs.items():
            if bound.get(("out", name)) != v:
                b.bind_output(name, v.device, 0, dtypes.onnx_type(v.dtype), v.shape, v.ptr)
                bound["out", name] = v
        for name in self.output_names - outputs.keys():  # every run: the binding keeps what ORT allocated
            b.bind_output(name, "cpu")  # an output nobody reads (e.g. debug logits): ORT allocates it
            bound.pop(("out", name), None)  # as a preallocated output of last run's shape otherwise
        self.session.run_with_iobinding(b)


class OrtBackend:
    """ONNX Runtime on the CPU (host buffers). The CUDA provider, when installed, is used for compute;
    buffers stay in host memory, so ORT copies inputs to the GPU each step: use TensorRT on GPUs."""

    name = "onnxruntime"

    def __init__(self, folder: Path, graphs: dict[str, str], provider: str | None = None,
                 threads: int | None = None):
        import onnxruntime as ort

        available = ort.get_available_providers()
        if provider and provider not in available:
            raise Dflash2Error(f"ONNX Runtime provider {provider!r} is not available; found {available}")
        self.providers = [provider] if provider else ["CPUExecutionProvider"]
        self.folder, self.graphs = folder, graphs
        self.threads = threads or int(os.environ.get("DFLASH2_THREADS", "0")) or None

    def engine(self, graph: str) -> OrtEngine:
        # Target and drafter alternate every round. Threads spin-waiting after the drafter steal the cores
        # from the verify that follows; the target's spinning speeds up back-to-back steps. SmolLM2, 2 cores,
        # ms per round (verify + draft): both spin 37.6 + 8.6, none 26.0 + 6.4, target only 21.7 + 7.2.
        return OrtEngine(graph, self.folder / self.graphs[graph], self.providers, self.threads,
                         spin=graph == "target")

    def device_buffer(self, shape, dtype) -> HostBuffer:
        return HostBuffer(shape, dtype)

    def host_buffer(self, shape, dtype) -> HostBuffer:
        return HostBuffer(shape, dtype)

    def max_rows(self, graph: str) -> None:
        return None
