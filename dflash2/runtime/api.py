"""Open an export folder (ONNX Runtime) or an engine folder (TensorRT) and generate.

    rt = open_runtime("out/smollm2")
    ids = rt.prompt_ids(text="Hello", chat=True)
    gen = rt.generate(ids, max_new_tokens=128)            # draft_len="auto" (default) or a fixed K
    gen = rt.generate(ids, sampling=rt.sampling(temperature=0.7, seed=1))   # lossless sampling
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Sequence

from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.runtime import schedule_cache as schedule_cache_mod
from dflash2.runtime.invariance import COSTS
from dflash2.runtime.schedule import AutoSchedule, CostModel
from dflash2.runtime.session import SpecSession
from dflash2.runtime.text import Stream, Text
from dflash2.sampling import Sampling, defaults_from
from dflash2.speculative import DraftSchedule, FixedSchedule, Generation, generate, parse_draft_len

BACKENDS = ("onnxruntime", "tensorrt")


class PromptError(Dflash2Error):
    pass


def pick_backend(manifest: mf.Manifest, requested: str | None) -> str:
    if requested and requested not in BACKENDS:
        raise Dflash2Error(f"--backend: expected one of {BACKENDS}, found {requested!r}")
    return requested or ("tensorrt" if isinstance(manifest, mf.EngineManifest) else "onnxruntime")


def check_runnable(folder: Path, manifest: mf.Manifest, name: str, provider: str | None = None,
                   emulated: bool = False) -> None:
    """What this machine cannot run is refused before any file is hashed or any session opened (emulated: a bf16
    export's emulating copies run in place of its graphs, Runtime's `emulated`)."""
    if emulated and (name != "onnxruntime" or not isinstance(manifest, mf.ExportManifest)
                     or (provider or "CPUExecutionProvider") != "CPUExecutionProvider"):
        raise Dflash2Error(f"{folder}: emulated graphs run on ONNX Runtime's CPU provider from an export folder only "
                           f"(found backend {name}, provider {provider or 'CPUExecutionProvider'}, "
                           f"{type(manifest).__name__})")
    if name == "tensorrt":
        from dflash2.native.tensorrt import require_tensorrt

        require_tensorrt()  # "TensorRT is not installed: ..." before any folder-kind message
        if not isinstance(manifest, mf.EngineManifest):
            raise Dflash2Error(f"{folder}: --backend tensorrt needs an engine folder (dflash2-build), "
                               f"found an export folder")
    elif manifest.dtype == "bfloat16" and (provider or "CPUExecutionProvider") == "CPUExecutionProvider" \
            and not emulated:
        raise Dflash2Error(f"{folder}: a bfloat16 export cannot run on ONNX Runtime's CPU provider (it has no "
                           f"bfloat16 kernels); build TensorRT engines from it (dflash2-build), or export with "
                           f"--dtype float32 for the CPU")


def cpu_flavour(graph: mf.Graph, provider: str | None = None) -> str:
    """The file of `graph` ONNX Runtime opens: its cpu_q4 flavour on the CPU provider where the op runs here
    (dflash2.native.q4; DFLASH2_Q4MATMUL=0 turns it off), else the portable graph."""
    if graph.flavours.cpu_q4 and (provider or "CPUExecutionProvider") == "CPUExecutionProvider":
        from dflash2.native import q4

        if q4.usable():
            return graph.flavours.cpu_q4
    return graph.flavours.portable


def make_backend(folder: Path, manifest: mf.Manifest, name: str, provider: str | None = None,
                 threads: int | None = None, drafter_threads: int | None = None, lean: bool = False,
                 emulated: dict[str, str] | None = None):
    check_runnable(folder, manifest, name, provider, bool(emulated))
    if name == "tensorrt":
        from dflash2.runtime.trt import TrtBackend

        return TrtBackend(folder, manifest)
    from dflash2.runtime.ort import OrtBackend

    if isinstance(manifest, mf.EngineManifest):  # an engine folder remembers the export it was built from
        folder = Path(manifest.export_dir)
        manifest = mf.load(folder, mf.ExportManifest, check_files=False)  # weights not rehashed at every start
    graphs = {name: cpu_flavour(g, provider) for name, g in manifest.graphs.items()} | dict(emulated or {})
    return OrtBackend(folder, graphs, {name: manifest.signature(name) for name in graphs}, provider, threads,
                      manifest=manifest, drafter_threads=drafter_threads, lean=lean)


class Runtime:
    def __init__(self, folder: str | Path, backend: str | None = None, verify: bool | str = True,
                 max_seq_len: int | None = None, provider: str | None = None, threads: int | None = None,
                 log: Callable[[str], None] | None = None, schedule_cache: bool | None = None,
                 drafter_threads: int | None = None, lean: bool = False, cost_prior: bool = True,
                 emulated: dict[str, str] | None = None):
        """log: where a line about what is allocated goes before allocating (dflash2-run: stderr).
        threads: ONNX Runtime's intra-op threads (None: DFLASH2_THREADS, else ONNX Runtime's default, one per core);
        drafter_threads: the drafter session's own (None: DFLASH2_DRAFTER_THREADS, else as threads;
        dflash2.runtime.ort says when fewer pay).
        schedule_cache: start `--draft-len auto` from what it learned about this export on this machine
        (dflash2.runtime.schedule_cache; default on unless DFLASH2_SCHEDULE_CACHE=0).
        verify: True checks every file's size and sha256, hashing only files changed since their last check
        (dflash2.manifest.hashcache); "full" hashes every file; False checks nothing.
        cost_prior: a cold `--draft-len auto` starts from the cost model the export's row check timed, where it did
        (`_cost_prior`); False: it calibrates on drafted rounds (what tests of that calibration pin).
        lean: ONNX Runtime only, the export's row check: the drafter's session opened at its first draft, no CPU
        arena (dflash2.runtime.ort.OrtBackend); not for generation, whose first round would then load the drafter.
        emulated: {graph: file in the folder} run in place of its graphs on ONNX Runtime's CPU provider, with the
        same io: a bf16 export's emulating copies (dflash2.export.bf16_emulation.emulated_export: every bf16 value
        computed in fp32 and rounded after its node), so that the export's row check and tests run the loop's bf16
        buffers where no bf16 kernels are. Not a deployment path: a GPU runs the graphs themselves. The copies must
        outlive the Runtime (its sessions open lazily)."""
        self.folder = Path(folder)
        self.manifest = mf.load(self.folder, check_files=False)
        self.backend_name = pick_backend(self.manifest, backend)
        check_runnable(self.folder, self.manifest, self.backend_name, provider, bool(emulated))  # before any hashing
        if verify:
            mf.check_files(self.folder, self.manifest, rehash=verify == "full")
        self.checked_at = time.perf_counter()  # the start before the engine sessions ends here (dflash2-run's start_s)
        backend = make_backend(self.folder, self.manifest, self.backend_name, provider, threads, drafter_threads,
                               lean, emulated)
        self.session = SpecSession(self.manifest, backend, max_seq_len, log)
        # the file each graph runs from (ONNX Runtime: the cpu_q4 flavour where it runs here, see cpu_flavour)
        self.graph_files = dict(getattr(backend, "graphs", None) or {})
        # what runs, for people: "onnxruntime + Q4MatMul" where a graph runs its cpu_q4 flavour
        graphs = getattr(self.manifest, "graphs", None) or {}
        q4 = any(f == graphs[g].flavours.cpu_q4 for g, f in self.graph_files.items() if g in graphs)
        self.backend_label = self.backend_name + (" + Q4MatMul" if q4 else "")
        self._provider, self._use_prior = provider, cost_prior
        self._text: Text | None = None
        self._auto: AutoSchedule | None = None
        self._cache_key = None
        if schedule_cache if schedule_cache is not None else schedule_cache_mod.enabled():
            # the label: a Q4MatMul target has other costs than the same export's MatMulNBits graph
            self._cache_key = schedule_cache_mod.key(self.manifest.manifest_sha256, self.backend_label, provider,
                                                     getattr(backend, "threads", threads),
                                                     getattr(backend, "drafter_threads", None))
        # the target's generation_config.json gives the sampling defaults: the export copied it, and an engine
        # folder carries its own copy (it may be deployed without the export it was built from)
        self.sampling_defaults = defaults_from(self.folder)

    def sampling(self, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None) -> Sampling:
        """Generation options: each one given, else the generation_config.json default, else greedy
        (temperature 0), top_k off, top_p 1, seed 0."""
        given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        return Sampling(**{**self.sampling_defaults, **{k: v for k, v in given.items() if v is not None}})

    @property
    def auto_schedule(self) -> AutoSchedule:
        """The session's draft-length policy: its first rounds measure the cost model (no separate
        engine calls), and it then learns from every round this runtime generates."""
        if self._auto is None:
            B = self.session.block_size
            saved = schedule_cache_mod.load(self._cache_key) if self._cache_key else None
            prior = self._cost_prior()
            self._auto = ((AutoSchedule.from_state(B, saved) if saved else None)
                          or (AutoSchedule.from_prior(B, prior) if prior else AutoSchedule(B)))
        return self._auto

    def _cost_prior(self) -> CostModel | None:
        """The export's row check timed its target calls and a draft on the CPU that exported
        (`dflash2.runtime.invariance.costs_ms`): a cold session on ONNX Runtime's CPU provider starts from that cost
        model (`AutoSchedule.from_prior`). None for an engine, another provider, or an export without it."""
        if not self._use_prior or self.backend_name != "onnxruntime" \
                or (self._provider or "CPUExecutionProvider") != "CPUExecutionProvider":
            return None
        v = getattr(self.manifest, "validation", {}).get(mf.ROW_CHECK)
        c = (v.steps or {}).get(COSTS) if v is not None and v.ok else None
        try:
            verify = [float(x) / 1e3 for x in c["verify"]]
            prior = CostModel(verify, float(c["decode"]) / 1e3, float(c["draft"]) / 1e3)
        except (TypeError, KeyError, ValueError):  # absent or not this version's: calibrate as without one
            return None
        ok = len(verify) == self.session.block_size + 1 and all(0 < x < math.inf for x in (*verify[1:], prior.decode,
                                                                                            prior.draft))
        return prior if ok else None

    @property
    def schedule_from_cache(self) -> bool:
        """The auto schedule started from a saved state (no calibration rounds)."""
        s = self.auto_schedule
        return s.calibration.rounds == 0 and not s.calibration.active

    def schedule(self, draft_len: int | str | None = "auto") -> DraftSchedule:
        """"auto" (or None): the session's AutoSchedule; an int K: K drafts every round."""
        try:
            k = parse_draft_len(draft_len, self.session.block_size)
        except ValueError as e:
            raise Dflash2Error(str(e)) from None
        return self.auto_schedule if k == "auto" else FixedSchedule(k)

    @property
    def text(self) -> Text:
        if self._text is None:
            self._text = Text(self.folder, self.manifest.vocab_size)
        return self._text

    @property
    def eos_ids(self) -> list[int]:
        return list(self.manifest.eos_token_ids)

    def prompt_ids(self, text: str | None = None, ids: Sequence | None = None, chat: bool = False,
                   system: str | None = None) -> list[int]:
        if (text is None) == (ids is None):
            raise PromptError("give exactly one of a text prompt or prompt ids")
        if ids is None:
            if not text.strip():
                raise PromptError("the prompt is empty")
            ids = self.text.encode(text, chat=chat, system=system)
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise PromptError(f"prompt ids must be integers, found {bad[:5]}")
        out = [i for i in ids if not 0 <= i < self.session.vocab_size]
        if out:
            raise PromptError(f"prompt ids {out[:5]} are outside the vocabulary [0, {self.session.vocab_size})")
        if not ids:
            raise PromptError("the prompt is empty (0 tokens)")
        return list(ids)

    def generate(self, ids: Sequence[int], max_new_tokens: int = 128, speculative: bool = True,
                 stop: Sequence[str] = (), on_text: Callable[[str], None] | None = None,
                 draft_len: int | str | None = "auto", sampling: Sampling | None = None) -> Generation:
        """draft_len: "auto" (the calibrated schedule) or a fixed K in 1..S drafts per round.
        sampling: None = `self.sampling()` (the model's defaults; greedy when it has none)."""
        sampling = self.sampling() if sampling is None else sampling
        self.session.check_capacity(len(ids), max_new_tokens)
        schedule = self.schedule(draft_len)  # checked even when not speculating: a bad value is never ignored
        schedule = schedule if speculative else None
        stream = Stream(self.text) if on_text else None
        out: list[int] = []

        def on_tokens(new: list[int]) -> bool:
            out.extend(new)
            if stream is not None:
                on_text(stream.push(new))
            return bool(stop) and any(s in self.text.decode(out[-(len(new) + 32):]) for s in stop)

        gen = generate(self.session, ids, max_new_tokens, self.eos_ids, speculative, on_tokens, schedule=schedule,
                       sampling=sampling)
        if self._cache_key and schedule is not None and schedule is self._auto:  # what it learned, for next time
            schedule_cache_mod.save(self._cache_key, self._auto.state())
        if gen.stop_reason == "stop":
            gen.ids = _trim_at_stop(gen.ids, stop, self.text)
        if stream is not None:
            on_text(stream.flush())
        return gen


def _trim_at_stop(ids: list[int], stops: Sequence[str], text: Text) -> list[int]:
    """Shortest prefix whose text contains a stop string (the stop string is kept)."""
    for k in range(1, len(ids) + 1):
        if any(s in text.decode(ids[max(0, k - 64):k]) for s in stops):
            return ids[:k]
    return ids


def open_runtime(folder: str | Path, **kw) -> Runtime:
    return Runtime(folder, **kw)
