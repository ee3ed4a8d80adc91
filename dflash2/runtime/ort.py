"""One engine interface, several backends (Polygraphy-style runners).

    engine = backend.engine(name)
    engine.bind(fixed_inputs, fixed_outputs)   # once per session
    engine.run(inputs={name: View}, outputs={name: View})   # per step: only what changed

runs one graph with every input read from and every output written into caller-owned buffers.
The ONNX Runtime backend binds views with IOBinding (raw pointers, no OrtValue per step).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from dflash2 import dtypes
from dflash2.errors import Dflash2Error, check_threads
from dflash2.manifest import Signature
from dflash2.onnxrt import open_session
from dflash2.runtime.memory import Buffer, HostBuffer, View


class Engine(Protocol):
    name: str

    def bind(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        """Views that stay bound for the engine's life (a session binds its fixed buffers once)."""

    def run(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        """One step: these views plus the bound ones."""


class Backend(Protocol):
    name: str

    def engine(self, graph: str) -> Engine:
        """A binding of the graph's engine for one session (the loaded engine itself is shared)."""

    def signature(self, graph: str) -> Signature:
        """The graph's typed contract (manifest): names by role, KV binding kind, capabilities."""

    def device_buffer(self, shape: tuple[int, ...], dtype) -> Buffer:
        """Memory the engines read and write (the host never touches it but through push / pull)."""

    def host_buffer(self, shape: tuple[int, ...], dtype) -> Buffer:
        """Small I/O the host fills or reads every step (token ids, drafts)."""

    def max_rows(self, graph: str) -> int | None:
        """The most rows one step of `graph` may have (engine profiles); None: no limit but the buffers."""


class OrtEngine:
    """One IOBinding over a (shared) InferenceSession: bound views persist across runs, so a step binds only
    the views that changed since the last one."""

    def __init__(self, name: str, session):
        self.name, self.session = name, session
        self.binding = session.io_binding()
        self.output_names = {o.name for o in session.get_outputs()}
        self.bound: dict[tuple[str, str], View] = {}  # what the binding holds: it persists across runs
        self.fixed_in: dict[str, View] = {}
        self.unread: set[str] = set(self.output_names)  # outputs nobody binds: ORT allocates them each run
        # Only the CPU provider reads a bound input at run time; others copy it to the device when it is
        # bound (IOBinding::BindInput), so their inputs are bound again every run.
        self.cache_inputs = session.get_providers() == ["CPUExecutionProvider"]

    def bind(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        self.fixed_in |= inputs
        self._bind(inputs, outputs)
        self.unread -= outputs.keys()

    def _bind(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        b, bound = self.binding, self.bound
        for name, v in inputs.items():  # ONNX element types: bfloat16 has no numpy type ORT knows
            if not self.cache_inputs or bound.get(("in", name)) != v:
                b.bind_input(name, v.device, 0, dtypes.onnx_type(v.dtype), v.shape, v.ptr)
                bound["in", name] = v
        for name, v in outputs.items():
            if bound.get(("out", name)) != v:
                b.bind_output(name, v.device, 0, dtypes.onnx_type(v.dtype), v.shape, v.ptr)
                bound["out", name] = v

    def run(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        if not self.cache_inputs:  # the device copies of the fixed inputs are refreshed every run
            self._bind(self.fixed_in, {})
        self._bind(inputs, outputs)
        if self.unread:
            for name in self.unread - outputs.keys():  # every run: the binding keeps what ORT allocated
                self.binding.bind_output(name, "cpu")  # as a preallocated output of last run's shape otherwise
                self.bound.pop(("out", name), None)
        self.session.run_with_iobinding(self.binding)


class DeferredEngine:
    """An OrtEngine whose session opens at its first run: the views bound before are bound then. The export's row
    check builds a whole SpecSession (the target's binding and buffers exactly as generation's) but never drafts,
    so its drafter session (0.22 GiB at Qwen3.5-0.8B's shape, int4) is never opened (OrtBackend's `lean`)."""

    def __init__(self, name: str, opener):
        self.name, self._open, self._engine = name, opener, None
        self._fixed: list[tuple[dict, dict]] = []

    def bind(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        if self._engine is not None:
            self._engine.bind(inputs, outputs)
        else:
            self._fixed.append((dict(inputs), dict(outputs)))

    def run(self, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        if self._engine is None:
            self._engine = OrtEngine(self.name, self._open())
            for i, o in self._fixed:
                self._engine.bind(i, o)
            self._fixed = []
        self._engine.run(inputs, outputs)


def _env_threads(name: str) -> int | None:
    """A thread count from the environment (unset or empty: None), named when it is not a positive integer."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise Dflash2Error(f"{name}: expected a positive integer (intra-op threads), found {raw!r}")
    check_threads(n, name)
    return n


class OrtBackend:
    """ONNX Runtime on the CPU (host buffers). The CUDA provider, when installed, is used for compute;
    buffers stay in host memory, so ORT copies inputs to the GPU each step: use TensorRT on GPUs.
    Each graph's InferenceSession is opened once per backend, lazily, and shared by every session
    (`engine()` gives each its own binding): a bench's policies load the weights once."""

    name = "onnxruntime"

    def __init__(self, folder: Path, graphs: dict[str, str], signatures: dict[str, Signature],
                 provider: str | None = None, threads: int | None = None, manifest=None,
                 drafter_threads: int | None = None, lean: bool = False):
        """lean: the export's row check (dflash2.runtime.invariance) in the least memory that leaves what it checks
        as generation runs it: the drafter's session opens only if a draft runs (DeferredEngine), and the
        sessions keep no CPU arena (intermediate tensors given back when freed). The graphs, kernels, prepacked
        weights, threads, binding and buffers are generation's; only where ONNX Runtime places intermediate tensors
        differs (64-byte aligned either way)."""
        import onnxruntime as ort

        available = ort.get_available_providers()
        if provider and provider not in available:
            raise Dflash2Error(f"ONNX Runtime provider {provider!r} is not available; found {available}")
        self.providers = [provider] if provider else ["CPUExecutionProvider"]
        self.folder, self.graphs, self.signatures, self.manifest = folder, graphs, signatures, manifest
        self.threads = threads or _env_threads("DFLASH2_THREADS")
        # The drafter's own thread count. Its MatMuls are small (block-size rows), and after each verify the target's
        # spinning worker holds a core: SmolLM2 int4 at 2 threads, in the cost table a draft 2.5-2.7 ms with 1 thread
        # against 2.8-2.9 with 2, a k = 1 round 5% cheaper; the main command did not gain from it (docs/quantization.md),
        # so it is a knob, not a default. A large drafter on many cores wants them all.
        self.drafter_threads = drafter_threads or _env_threads("DFLASH2_DRAFTER_THREADS")
        self.lean = lean
        self._sessions: dict[str, object] = {}

    def session(self, graph: str):
        if graph not in self._sessions:
            # Target and drafter alternate every round. Threads spin-waiting after the drafter steal the cores
            # from the verify that follows; the target's spinning speeds up back-to-back steps. SmolLM2, 2 cores,
            # ms per round (verify + draft): both spin 37.6 + 8.6, none 26.0 + 6.4, target only 21.7 + 7.2.
            threads = self.drafter_threads if graph == "drafter" and self.drafter_threads else self.threads
            session = open_session(self.folder / self.graphs[graph], self.providers, threads, graph == "target",
                                   arena=not self.lean)
            if self.manifest is not None:  # the manifest must describe the file that runs, not a swapped one
                from dflash2.runtime.graphcheck import check_graph

                check_graph(self.manifest, graph, self.folder / self.graphs[graph], session)
            self._sessions[graph] = session
        return self._sessions[graph]

    def engine(self, graph: str) -> OrtEngine | DeferredEngine:
        if self.lean and graph == "drafter" and graph not in self._sessions:
            return DeferredEngine(graph, lambda: self.session(graph))
        return OrtEngine(graph, self.session(graph))

    def signature(self, graph: str) -> Signature:
        return self.signatures[graph]

    def device_buffer(self, shape, dtype) -> HostBuffer:
        return HostBuffer(shape, dtype)

    def host_buffer(self, shape, dtype) -> HostBuffer:
        return HostBuffer(shape, dtype)

    def max_rows(self, graph: str) -> None:
        return None
