"""dflash2-bench's results as types: what a run measured, written once, read by the table, the plot, the CLI's
summary, --combine and the JSON file (whose keys are these fields: files written before the types read back
unchanged). A bench JSON read back is checked field by field: a missing or mistyped field names the file and
the field instead of a KeyError three calls later."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2.errors import Dflash2Error


class BenchResultError(Dflash2Error, ValueError):
    pass


@dataclass
class ModeResult:
    """One timed mode ("ar", a fixed K, "auto") over every prompt of the run."""

    tokens_per_second: float
    speedup: float  # over "ar" in the same run
    acceptance_length: float
    rounds: int
    k_histogram: dict[str, int]
    round_ms: float | None  # draft + verify per round; None without rounds
    new_tokens: int
    decode_seconds: float  # tok/s = (new_tokens - generations) / decode_seconds
    host_overhead_share: float  # of the mode's wall time outside engine calls
    # the speedup once per independent pass (each repeat, or each half of the prompts: bench/ratio.py), its spread;
    # empty in files written before it
    speedup_samples: list[float] = field(default_factory=list)


@dataclass
class SweepPoint:
    draft_len: int
    acceptance_length: float
    tokens_per_second: float
    speedup: float
    round_ms: float


@dataclass
class PromptResult:
    prompt_tokens: int
    tokens_per_second: dict[str, float]  # mode -> tok/s on this prompt
    k_histogram: dict[str, int] | None = None  # of the auto run
    acceptance_length: float | None = None  # of the auto run


@dataclass
class BenchProgress:
    """What a run cut short leaves in --json: the prompts done so far."""

    prompts: int
    repeats: int
    lossless: bool
    modes: dict[str, ModeResult]
    calibration: dict[str, Any]
    per_prompt: list[PromptResult]
    complete: bool = False

    def to_dict(self) -> dict:
        return _plain(self)


@dataclass
class BenchResult:
    folder: str
    backend: str
    prompts: int
    max_new_tokens: int
    block_size: int
    dtype: str
    lossless: bool | None  # None at T > 0: lossless by distribution (tests/test_sampling.py), not by ids
    draft_len: str  # the headline mode: "auto" or a K
    draft_vocab_size: int
    autoregressive_tokens_per_second: float
    speculative_tokens_per_second: float
    speedup: float
    modes: dict[str, ModeResult]
    best_of_ar_and_fixed: str
    auto_vs_best: float
    calibration: dict[str, Any]
    schedule_after: dict[str, Any]
    per_prompt: list[PromptResult]
    calibration_share_128: float
    acceptance_length: dict[str, float]  # draft path (or "sampled") -> tau
    position_acceptance: dict[str, list[float]]
    speculative_seconds: dict[str, float]
    autoregressive_seconds: dict[str, float]
    host_overhead_share: float
    spec_step_ms: float
    ar_step_ms: float
    select_ms_standalone: float | None = None
    selector_gap_closed: float | None = None  # with top1, oracle and selector measured
    draft_len_sweep: list[SweepPoint] = field(default_factory=list)
    # fields later benches added; files written before them were greedy runs of one repeat
    repeats: int = 1
    sampling: str = "greedy"
    weights: str = ""
    quantization: str | None = None
    complete: bool = True

    @property
    def main_mode(self) -> ModeResult:
        return self.modes[self.draft_len]

    def to_dict(self) -> dict:
        d = _plain(self)
        if d["selector_gap_closed"] is None:  # absent, not null, when not measured
            del d["selector_gap_closed"]
        if not d["draft_len_sweep"]:
            del d["draft_len_sweep"]
        return d

    @classmethod
    def from_dict(cls, d: Any, source: str | Path = "bench result") -> BenchResult:
        if isinstance(d, dict) and d.get("complete") is False:
            raise BenchResultError(f"{source}: field complete expected true, found false (a run cut short after "
                                   f"{d.get('prompts', '?')} prompts: its --json holds the prompts done so far)")
        return _read(cls, d, str(source))


@dataclass
class CombinedMode:
    tokens_per_second: float
    rounds: int
    k_histogram: dict[str, int]
    acceptance_length: float
    speedup: float = 0.0
    speedup_samples: list[float] = field(default_factory=list)  # each part's own speedup: the spread


@dataclass
class CombinedResult:
    """Several runs of one folder (a prompt set split across processes) as one."""

    parts: int
    prompts: int
    lossless: bool
    modes: dict[str, CombinedMode]
    best_of_ar_and_fixed: str
    auto_vs_best: float
    per_prompt: list[PromptResult]

    def to_dict(self) -> dict:
        return _plain(self)


@dataclass
class QuantExport:
    folder: str
    describe: str | None
    quantization: dict[str, Any] | None  # method, bits, block_size, accuracy_level, graphs, drafter_method; None: fp32


@dataclass
class BestConfig:
    config: str
    tokens_per_second: float
    vs_genai_int4: float | None = None


@dataclass
class QuantBenchResult:
    """dflash2-bench-quant: every export autoregressive and speculative (+ onnxruntime-genai), one interleaved run."""

    prompts: int
    max_new_tokens: int
    draft_len: int | str
    repeats: int
    threads: int | None
    exports: dict[str, QuantExport]  # label -> export; the first is the agreement reference
    genai: dict[str, str] | None  # folder, version
    tokens_per_second: dict[str, float]  # "LABEL autoregressive|speculative" (+ "onnxruntime-genai int4")
    lossless: dict[str, bool]  # label -> speculative ids == its own target's greedy ids
    acceptance_length: dict[str, float]
    acceptance_change: dict[str, float]  # label -> tau - the first export's
    top1_agreement_vs_first: dict[str, float]
    genai_prefix_agreement_vs_first: float | None
    best: BestConfig
    # per configuration, tok/s once per independent pass (each repeat, or each half of the prompts: bench/ratio.py):
    # the spread of every ratio the table prints
    tokens_per_second_by_pass: dict[str, list[float]] = field(default_factory=dict)

    @property
    def reference(self) -> str:
        return next(iter(self.exports))

    def to_dict(self) -> dict:
        d = _plain(self)
        if d["best"]["vs_genai_int4"] is None:  # absent without genai, as before the types
            del d["best"]["vs_genai_int4"]
        return d


def _plain(obj) -> dict:
    return dataclasses.asdict(obj)


_NESTED = {"modes": ModeResult, "per_prompt": PromptResult, "draft_len_sweep": SweepPoint}


def _read(cls, d: Any, source: str, where: str = ""):
    """A dataclass from its dict, every field present (or defaulted) and of its kind: nested results built too."""
    if not isinstance(d, dict):
        raise BenchResultError(f"{source}: {where or 'the file'} expected a JSON object, found {type(d).__name__}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        name = f"{where}.{f.name}" if where else f.name
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise BenchResultError(f"{source}: field {name} expected, found none (not a complete dflash2-bench "
                                       f"JSON: was the run cut short?)")
            continue
        v = d[f.name]
        nested = _NESTED.get(f.name) if cls in (BenchResult, BenchProgress) else None
        if nested is ModeResult:
            if not isinstance(v, dict):
                raise BenchResultError(f"{source}: field {name} expected an object of modes, found {v!r:.60}")
            v = {m: _read(ModeResult, w, source, f"{name}.{m}") for m, w in v.items()}
        elif nested is not None:
            if not isinstance(v, list):
                raise BenchResultError(f"{source}: field {name} expected a list, found {v!r:.60}")
            v = [_read(nested, w, source, f"{name}[{i}]") for i, w in enumerate(v)]
        elif not _kind_ok(f.type, v):
            raise BenchResultError(f"{source}: field {name} expected {f.type}, found {v!r:.60}")
        kwargs[f.name] = v
    return cls(**kwargs)


def _kind_ok(annotation: str, v: Any) -> bool:
    """The JSON kinds a field's annotation allows (annotations are strings under `from __future__`)."""
    kinds = {"float": (int, float), "int": (int,), "str": (str,), "bool": (bool,), "None": (type(None),),
             "dict": (dict,), "list": (list,)}
    allowed: tuple = ()
    for part in annotation.split("|"):
        base = part.strip().split("[")[0]
        allowed += kinds.get(base, (object,))
    if isinstance(v, bool) and bool not in allowed and object not in allowed:
        return False  # JSON true is not a number here
    return isinstance(v, allowed)
