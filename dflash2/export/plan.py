"""What dflash2-export will do, resolved and checked once, before any weight is read: the pair, dtype, attention,
capacity, and per graph how it is written (its route), its quantization and when that happens, and so the
progress steps. `dflash2-export` and `export()` resolve through the same rules (plan_export), so Python refuses
exactly what the command line refuses, with the same message; `dflash2-export --print` shows the plan.

Routes: "templates" (the plain ONNX-op graphs written from the layer templates, weights streamed: the target and
drafter in every dtype), "gqa" (ONNX Runtime's fused-op target and drafter, quantized as they are written),
"traced" (torch.onnx: the selector, small: its codebooks and the walk).
The quantization choices (OrtQuant, qdq.TrtQuant) are told apart here only: the stages take a GraphJob.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from dflash2 import draft_vocab, dtypes, families
from dflash2.config import (DrafterConfig, TargetConfig, check_pair, check_tokenizer_files, check_tokenizer_vocab,
                            load_drafter_config, load_target_config, tokenizer_id_count)
from dflash2.drafter_formats import for_target
from dflash2.errors import Dflash2Error
from dflash2.export import fused_drafter, gqa, plain, qdq, qwen3_5_gqa, stages
from dflash2.export import quantize as qz
from dflash2.folders import OutputError, check_output

ATTENTION = ("plain", "gqa")
ROUTES = ("templates", "gqa", "traced")
WHEN = ("as-written", "after-validation")  # when a graph's quantization happens
FIXED_STEPS = ("loading the checkpoints", "sharing weights", "tokenizer and manifest", "row invariance")  # one each
DEFAULT_MAX_SEQ_LEN = 2048


@dataclass(frozen=True)
class QuantFlags:
    """dflash2-export's quantization flags as given (None / False: not given); QuantFlags.resolve() checks them
    and makes the quantization choice they name."""

    method: str | None = None
    block_size: int | None = None
    accuracy_level: int = 4
    keep_head: bool = False
    target_only: bool = False
    drafter: str | None = None
    drafter_block_size: int | None = None
    no_fuse: bool = False
    from_gguf: Path | None = None

    def resolve(self) -> qz.Quantization | None:
        if self.method is None:  # flags without effect are errors, not silently ignored
            unused = [f for f, on in (("--quant-block-size", self.block_size is not None),
                                      ("--quant-keep-head", self.keep_head),
                                      ("--quant-target-only", self.target_only),
                                      ("--quant-drafter", self.drafter is not None),
                                      ("--quant-drafter-block-size", self.drafter_block_size is not None),
                                      ("--quant-no-fuse", self.no_fuse)) if on]
            if unused:
                raise Dflash2Error(f"{', '.join(unused)}: no effect without --quantize (the export is not quantized)")
        # the range before anything else (as it always was); the power of two is OrtQuant's own rule below
        qz.check_block_size("--quant-block-size", self.block_size, power_of_two=False)
        qz.check_block_size("--quant-drafter-block-size", self.drafter_block_size, power_of_two=False)
        if (self.drafter is not None or self.drafter_block_size is not None) and (
                self.method not in qz.ORT_METHODS or self.target_only):
            raise Dflash2Error("--quant-drafter / --quant-drafter-block-size: expected with --quantize int4 or int8 "
                               "and a quantized drafter, found " + ("--quant-target-only" if self.target_only else
                                                                    f"--quantize {self.method}"))
        if self.from_gguf is not None and self.method not in qz.ORT_METHODS:
            raise Dflash2Error(f"--quant-from-gguf: expected with --quantize int4 or int8, found "
                               f"{'no --quantize' if self.method is None else '--quantize ' + self.method}")
        if self.from_gguf is not None:
            check_gguf(Path(self.from_gguf))
        if self.method in qdq.TRT_METHODS:
            return qdq.TrtQuant(self.method, self.block_size or 128)
        if self.method is None:
            return None
        return qz.OrtQuant(self.method, self.block_size or 32, self.accuracy_level, lm_head=not self.keep_head,
                           drafter=not self.target_only, fuse=not self.no_fuse,
                           native=None if self.from_gguf is None else str(Path(self.from_gguf).absolute()),
                           drafter_method=self.drafter, drafter_block_size=self.drafter_block_size)


def check_gguf(path: Path) -> None:
    if not path.is_file():
        raise Dflash2Error(f"--quant-from-gguf {path}: expected a GGUF file, found "
                           f"{'a folder' if path.is_dir() else 'nothing there'}")


@dataclass(frozen=True)
class GraphJob:
    """One graph of the export: how it is written and checked."""

    name: str  # "target" | "drafter" | "selector"
    route: str  # ROUTES
    tensorrt: bool  # a fixed-shape TensorRT flavour, validated as its own step
    quant: qz.Quantization | None = None  # this graph's own (for_graph), None: float
    quantize_when: str | None = None  # WHEN, None: not quantized
    truncated_check: bool = False  # a truncated build of the same templates validated first (past the budget)
    weight_bytes: int | None = None  # templates: what its validation session would hold the weights in

    @property
    def steps(self) -> int:
        """Its progress steps: written, validated (or its deviation measured), its TensorRT flavour validated,
        the truncated build written and validated (each flavour), quantized after validation."""
        truncated = (2 + self.tensorrt) if self.truncated_check else 0
        return 2 + self.tensorrt + truncated + (self.quantize_when == "after-validation") + self.cpu_q4

    @property
    def cpu_q4(self) -> bool:
        """An int4 block-32 ONNX Runtime graph: its Q4MatMul flavour is written and checked where the op runs
        (dflash2.export.q4_flavour; one step either way)."""
        q = self.quant
        return (q is not None and q.backend == "onnxruntime" and q.method == "int4" and q.block_size == 32
                and getattr(q, "accuracy_level", 4) == 4)

    @property
    def quantizer(self):
        """The stage that quantizes this validated float graph (quantize_when "after-validation")."""
        return stages.qdq_graph if self.quant.backend == "tensorrt" else stages.quantize_graph

    def describe(self, dtype: str) -> str:
        how = {"templates": f"standard ONNX ops from the layer templates, {dtype}, weights streamed",
               "gqa": "ONNX Runtime's fused ops from the layer templates, float32, weights streamed",
               "traced": f"torch.onnx (dynamo) over the loaded module, {dtype}"}[self.route]
        parts = [how + (" + its fixed-shape TensorRT flavour" if self.tensorrt else "")]
        if self.truncated_check:
            parts.append("a truncated build of the same templates validated first")
        parts.append("not quantized" if self.quant is None else
                     f"{self.quant.method} {self.quantize_when.replace('-', ' ')}")
        if self.cpu_q4:
            parts.append("+ its Q4MatMul flavour where this CPU runs it")
        return f"{self.name:<9} {self.route:<10} {self.steps} steps: {'; '.join(parts)}"


@dataclass(frozen=True)
class ExportPlan:
    """What export_plan() writes; made by plan_export(), which has checked all of it."""

    drafter_dir: str | Path  # as given (the manifest records them absolute)
    target_dir: str | Path
    out: Path  # absolute
    dtype: str
    max_seq_len: int
    attention: str  # ATTENTION, resolved from "auto"
    fuse_context: bool
    full_vocab: bool
    draft_block: int | None
    force: bool
    quiet: bool
    quantize: qz.Quantization | None
    dc: DrafterConfig  # with --draft-block applied
    tc: TargetConfig
    jobs: tuple[GraphJob, ...] = ()
    window_kv: bool = True  # --window-kv on (the default) / off

    @property
    def window(self) -> tuple[list[int], int] | None:
        """(sliding layers, keep) of the target's window buffer (export.plain.sliding), None: every layer on the one
        KV binding (no sliding layers, or --window-kv off)."""
        return plain.sliding(self.tc) if self.window_kv else None

    @property
    def steps(self) -> int:
        """The progress total: the jobs' steps and the fixed ones (the Progress of export_plan counts to it)."""
        return len(FIXED_STEPS) + sum(j.steps for j in self.jobs)

    def job(self, name: str) -> GraphJob:
        return next(j for j in self.jobs if j.name == name)

    def describe(self) -> str:
        """dflash2-export --print: one block, what the export will do."""
        dc, tc, q = self.dc, self.tc, self.quantize
        quant = "none" if q is None else f"{q.method} ({q.backend}, block {q.block_size}; {', '.join(q.graphs())})"
        layers = lambda n: f"{n} layer{'s' if n != 1 else ''}"  # noqa: E731
        lines = [f"pair:        {'DFlash2' if dc.version == 2 else 'DFlash'} drafter "
                 f"{Path(self.drafter_dir).absolute()} ({layers(dc.num_layers)}, block size {dc.block_size})",
                 f"             target {Path(self.target_dir).absolute()} ({tc.arch}, {layers(tc.num_layers)}, "
                 f"vocab {tc.vocab_size})",
                 f"dtype:       {self.dtype}",
                 f"attention:   {self.attention} (target graph)",
                 f"max_seq_len: {self.max_seq_len}",
                 f"context:     {'fused into the target' if self.fuse_context else 'raw taps'}",
                 f"quantize:    {quant}",
                 f"window KV:   {self._window_line()}",
                 "graphs:"]
        lines += [f"  {j.describe(self.dtype)}" for j in self.jobs]
        lines.append(f"steps:       {self.steps} = graphs {sum(j.steps for j in self.jobs)} + "
                     f"{' / '.join(FIXED_STEPS)}")
        lines.append(f"out:         {self.out}" + (" (replaced: --force)" if self.force else ""))
        return "\n".join(lines)


    def _window_line(self) -> str:
        drafter = self._drafter_window_note()
        if self.window is not None:
            layers, keep = self.window
            return (f"on: sliding layers {layers} in a bounded buffer (keep {keep} rows; the other "
                    f"{self.tc.num_layers - len(layers)} layers on max_seq_len rows){drafter}")
        if plain.sliding(self.tc) is not None:
            return "off (--window-kv off: the sliding layers keep max_seq_len rows)"
        return "none (no sliding-window layers beside full-attention ones)" + drafter

    def _drafter_window_note(self) -> str:
        """The drafter's half of the line: its context KV on the window buffer where every drafter layer slides and the
        drafter is written from the templates in its portable flavour (export.routes._window decides it)."""
        d = fused_drafter.sliding(self.dc) if self.window_kv else None
        if d is None or not any(j.name == "drafter" and j.route == "templates" for j in self.jobs):
            return ""
        return f"; drafter: every layer slides, its context KV in a bounded buffer (keep {d[1]} rows)"


def default_max_seq_len(tc) -> int:
    """--max-seq-len when not given: 2048, or fewer for a target trained on shorter sequences."""
    return min(DEFAULT_MAX_SEQ_LEN, tc.max_position_embeddings)


def check_inputs(drafter_dir: str | Path, target_dir: str | Path, out: Path, dtype: str, max_seq_len: int | None,
                 force: bool, beyond_max_positions: bool, draft_block: int | None = None):
    """The checks before any weight is read: the output folder (before anything is read at all), both
    configs and their agreement, the tokenizer, the capacity (None: default_max_seq_len). Returns
    (drafter config, target config)."""
    if dtype not in dtypes.GRAPH_DTYPES:
        raise OutputError(f"--dtype: expected one of {list(dtypes.GRAPH_DTYPES)}, found {dtype!r}")
    check_output(out, force, {"--model": drafter_dir, "--target": target_dir})
    dc, tc = load_drafter_config(drafter_dir, draft_block), load_target_config(target_dir)
    check_pair(dc, tc, drafter_dir, target_dir)
    dc = for_target(dc, tc, drafter_dir)  # Meta's assistant: the target's layer count and vocabulary filled in
    max_seq_len = default_max_seq_len(tc) if max_seq_len is None else max_seq_len
    check_tokenizer_files(target_dir)
    from dflash2.sampling import defaults_from

    defaults_from(target_dir)  # the sampling defaults the export copies: a bad top_p refused here, naming the file
    if (Path(target_dir) / "tokenizer.json").is_file():
        path = Path(target_dir) / "tokenizer.json"
        check_tokenizer_vocab(path, tokenizer_id_count(path), tc.vocab_size)
    if max_seq_len < dc.block_size + 2:
        raise OutputError(f"--max-seq-len: expected >= block_size + 2 = {dc.block_size + 2}, found {max_seq_len}")
    if max_seq_len > tc.max_position_embeddings and not beyond_max_positions:
        raise OutputError(f"--max-seq-len: expected <= max_position_embeddings {tc.max_position_embeddings} of "
                          f"{Path(target_dir) / 'config.json'}, found {max_seq_len} (the target was not trained on "
                          f"longer sequences; pass --beyond-max-positions to export it anyway)")
    return dc, tc


def resolve_attention(asked: str, quantize, tc, dc, max_seq_len: int) -> str:
    """auto -> gqa for the ONNX Runtime quantizations when the target fits the kernel, else plain."""
    fam = families.by_name(tc.family)
    why = (gqa.unsupported(tc, dc, max_seq_len) if fam.name in families.DENSE else
           qwen3_5_gqa.unsupported(max_seq_len) if fam.fused_kv == "gqa-shared" else None) \
        if "fused" in fam.templates \
        else f"expected a target family with fused-op templates, found {tc.arch} ({fam.name}, {fam.description})"
    if asked == "gqa" and why:
        raise OutputError(f"--target-attention gqa: {why}")
    if asked == "auto":
        return "gqa" if isinstance(quantize, qz.OrtQuant) and not why else "plain"
    return asked


def plan_export(drafter_dir: str | Path, target_dir: str | Path, out_dir: str | Path, dtype: str = "float32",
                max_seq_len: int | None = None, force: bool = False, fuse_context: bool = True, quiet: bool = False,
                full_vocab: bool = False, beyond_max_positions: bool = False,
                quantize: qz.Quantization | QuantFlags | None = None, target_attention: str = "auto",
                draft_block: int | None = None, window_kv: bool = True) -> ExportPlan:
    """Every check export() makes before it reads a weight, in the order the command line always made them;
    quantize: a quantization choice (OrtQuant, qdq.TrtQuant), or the command line's flags (QuantFlags);
    window_kv: the sliding layers' K|V in the bounded window buffer where the target has them (plain.sliding)."""
    if isinstance(quantize, QuantFlags):
        quantize = quantize.resolve()
    elif quantize is not None and not isinstance(quantize, (qz.OrtQuant, qdq.TrtQuant)):
        raise OutputError(f"quantize: expected an OrtQuant (dflash2.export.quantize), a TrtQuant "
                          f"(dflash2.export.qdq) or None, found {type(quantize).__name__}")
    if isinstance(quantize, qz.OrtQuant) and quantize.native:
        check_gguf(Path(quantize.native))
    if target_attention not in ("auto", *ATTENTION):
        raise OutputError(f"--target-attention: expected one of {['auto', *ATTENTION]}, found {target_attention!r}")
    if quantize is not None and dtype != "float32":
        raise OutputError(f"--quantize {quantize.method}: expected --dtype float32 (weights are quantized from "
                          f"fp32; activations stay fp32), found {dtype}")
    if isinstance(quantize, qz.OrtQuant) and quantize.dynamic:
        raise OutputError(f"--quantize {quantize.method}: expected int4 or int8 for the target ({quantize.method} "
                          f"quantizes activations per tensor, so a row's logits depend on the rows verified with it: "
                          f"not lossless); it is a drafter method (--quant-drafter {quantize.method})")
    if target_attention == "gqa" and (dtype != "float32" or isinstance(quantize, qdq.TrtQuant)):
        raise OutputError(f"--target-attention gqa: expected --dtype float32 and no TensorRT quantization (it is "
                          f"ONNX Runtime's CPU graph), found --dtype {dtype}"
                          + (f", --quantize {quantize.method}" if quantize is not None else ""))
    out = Path(out_dir).absolute()
    dc, tc = check_inputs(drafter_dir, target_dir, out, dtype, max_seq_len, force, beyond_max_positions, draft_block)
    _family_rules(tc, dtype, quantize)
    max_seq_len = default_max_seq_len(tc) if max_seq_len is None else max_seq_len
    attention = resolve_attention(target_attention, quantize, tc, dc, max_seq_len)
    if isinstance(quantize, qz.OrtQuant) and attention == "plain" and tc.family not in families.DENSE:
        why = "loses the recurrence's If inputs" if tc.family.startswith("qwen3_5") else \
            "is not checked on its graphs: its experts and embedding go in as they are written instead"
        raise OutputError(f"--quantize {quantize.method} --target-attention plain: not for {tc.arch} (ONNX Runtime's "
                          f"quantizer rewrites the graph whole and {why}); the default "
                          f"(--target-attention gqa) writes {quantize.method} as the graph is built")
    # gpt-oss's MXFP4 experts go in as int8 blocks of 32 whatever the block size (export/gpt_oss_qmoe.py)
    qmoe_blocks = hasattr(tc, "num_experts") and getattr(tc, "expert_format", "float") == "float"
    inter = getattr(tc, "moe_intermediate_size", None) or getattr(tc, "intermediate_size", 0)
    inter_field = "moe_intermediate_size" if hasattr(tc, "moe_intermediate_size") else "intermediate_size"
    if attention == "gqa" and isinstance(quantize, qz.OrtQuant) and qmoe_blocks and \
            (tc.hidden_size % quantize.block_size or inter % quantize.block_size):
        raise OutputError(f"--quantize {quantize.method}: ONNX Runtime's QMoE needs hidden_size and "
                          f"{inter_field} divisible by the block size {quantize.block_size}, found "
                          f"{tc.hidden_size} and {inter} in {Path(target_dir) / 'config.json'}")
    why_not_gqa = gqa.unsupported(tc, dc, max_seq_len)
    if isinstance(quantize, qz.OrtQuant) and quantize.native and attention != "gqa":
        raise OutputError("--quant-from-gguf: expected the fused-op target graph (--target-attention gqa, the default "
                          f"with --quantize int4|int8), found --target-attention {attention}"
                          + (f" ({why_not_gqa})" if why_not_gqa else ""))
    if isinstance(quantize, qz.OrtQuant) and quantize.drafter and quantize.for_graph("drafter").dynamic and \
            attention != "gqa":
        raise OutputError(f"--quant-drafter {qz.DYNAMIC}: expected the fused-op graphs (--target-attention gqa, the "
                          f"default with --quantize int4|int8), found --target-attention {attention}"
                          + (f" ({why_not_gqa})" if why_not_gqa else ""))
    if isinstance(quantize, qdq.TrtQuant) and not quantize.prompts:  # calibration: the shipped prompts
        quantize = dataclasses.replace(quantize, prompts=qdq.shipped_prompt_ids(target_dir))
    plan = ExportPlan(drafter_dir, target_dir, out, dtype, max_seq_len, attention, fuse_context, full_vocab,
                      draft_block, force, quiet, quantize, dc, tc, window_kv=bool(window_kv))
    return dataclasses.replace(plan, jobs=tuple(_job(plan, name) for name in _graphs(dc)))


def _family_rules(tc, dtype: str, quantize) -> None:
    """What a family's templates do not do yet, refused before any weight is read (the dense families: all)."""
    fam = families.by_name(tc.family)
    what = f"{tc.arch} ({fam.name}, {fam.description})"
    if dtype not in fam.dtypes:
        raise OutputError(f"--dtype: expected one of {list(fam.dtypes)} for {what}, found {dtype!r} (its layer "
                          f"templates are checked in {', '.join(fam.dtypes)} only so far)")
    if fam.name in families.DENSE:
        return
    if "fused" not in fam.templates:  # standard-op templates only: checked unquantized
        if quantize is not None:
            raise OutputError(f"--quantize {quantize.method}: not yet for {what} (standard-op templates only, "
                              f"float32)")
        return
    if isinstance(quantize, qdq.TrtQuant):
        raise OutputError(f"--quantize {quantize.method}: not yet for {what} (the TensorRT calibration runs the dense "
                          f"reference); ONNX Runtime's int4 / int8 are")



def _graphs(dc) -> tuple[str, ...]:
    return ("target", "drafter", "selector") if dc.version == 2 else ("target", "drafter")


def _job(plan: ExportPlan, name: str) -> GraphJob:
    q = plan.quantize
    quant = q.for_graph(name) if q is not None and name in q.graphs() else None
    if name in ("target", "drafter") and plan.attention == "gqa":  # no TensorRT flavour; quantized as written
        return GraphJob(name, "gqa", tensorrt=False, quant=quant, quantize_when=None if quant is None else "as-written",
                        truncated_check=name == "target")
    when = None if quant is None else "after-validation"
    if name in ("target", "drafter"):  # every dtype (the plan refused what a family's templates do not write)
        nbytes = _template_bytes(plan, name)
        return GraphJob(name, "templates", tensorrt=True, quant=quant, quantize_when=when,
                        truncated_check=stages.held_bytes(nbytes, plan.dtype) > stages.WHOLE_GRAPH_BYTES,
                        weight_bytes=nbytes)
    return GraphJob(name, "traced", tensorrt=False, quant=quant, quantize_when=when)  # the selector: one flavour


def _template_bytes(plan: ExportPlan, name: str) -> int:
    """The weights a templates graph carries, from the configs (and the drafter's draft vocabulary)."""
    dc, tc = plan.dc, plan.tc
    if name == "target":
        return stages.weight_bytes(tc, plan.dtype)
    ids = None if plan.full_vocab else draft_vocab.read(plan.drafter_dir, dc.vocab_size, draft_vocab.min_size(dc))
    return stages.drafter_weight_bytes(dc, tc, ids, plan.fuse_context, plan.dtype)
