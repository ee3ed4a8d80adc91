"""The export's per-graph stages (dflash2.export.routes calls them for each job of the plan): the graphs built
from layer templates with their weights streamed from the checkpoints (the plain target with its truncated check,
the gqa target, the fused drafter), each validated at bounded memory or quantized with its deviation measured, and
the records the manifest keeps of them."""


import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from dflash2 import dtypes
from dflash2 import manifest as mf
from dflash2.checkpoint import Weights
from dflash2.errors import Dflash2Error, ValidationError
from dflash2.export import deviation, fused_drafter, gqa, plain, qdq
from dflash2.export import quantize as qz
from dflash2.export import signature as sig
from dflash2.export.family import template
from dflash2.export import trace as tr
from dflash2.export import weights as W
from dflash2.export.graphs import graph_specs
from dflash2.export.validate import validate_graph
from dflash2.folders import OutputError
from dflash2.progress import Progress
from dflash2.quant_manifest import QUANT_OPS
from dflash2.export.qwen3_5_gqa import hybrid_gqa_spec
from dflash2 import families
from dflash2.families import DENSE
from dflash2.reference.streamed import streamed_target, truncated


WHOLE_GRAPH_BYTES = 2 << 30  # a target checked whole when its weights fit (ONNX Runtime maps them all, beside
# the reference's layer and the feeds; int4: prepacks them); past it a truncated build of the same templates does


def held_bytes(nbytes: int, dtype: str) -> int:
    """What a validation session holds for `nbytes` of weights: fp16 / bf16 twice over (ONNX Runtime's CPU provider
    has no fp16 GEMM on x86 and runs each fp16 MatMul on an fp32 copy of its weights; a bf16 graph runs emulated on
    fp32 copies, export.bf16_emulation)."""
    return nbytes * 2 if dtype in ("float16", "bfloat16") else nbytes


def weight_bytes(tc, dtype: str) -> int:
    return _fp32_weight_bytes(tc) // 4 * dtypes.BY_NAME[dtype].itemsize


def not_whole(progress: Progress, name: str, tc, dtype: str, dc, nbytes: int) -> mf.Validation:
    """The record of a graph not run whole (WHOLE_GRAPH_BYTES): said, and never reported validated.
    dc: the drafter's config for a drafter graph (nbytes its weights), else the target's."""
    graph, rest = name.split(".", 1) if "." in name else (name, "")
    instead = f"{graph}.truncated" + (f".{rest}" if rest else "")
    depth = (f"{truncated_drafter(dc).num_layers} of {dc.num_layers} layers, the real head and selector" if dc else
             f"{truncated_depth(tc)} layers, the real embedding and head")
    fp32_copies = " (run on fp32 copies by ONNX Runtime's CPU provider)" if dtype in ("float16", "bfloat16") else ""
    why = (f"not run whole here: {nbytes / 2**30:.2f} GiB of {dtype} weights{fp32_copies}, past the "
           f"{WHOLE_GRAPH_BYTES / 2**30:.0f} GiB a bounded-memory validation holds; the same templates validated end "
           f"to end as {instead} ({depth}); no replay files for the whole graph (its reference would stream every "
           f"layer per feed)")
    with progress.step(f"{name}.onnx: validation") as step:
        step.outcome = f"NOT validated whole ({why})"
    return mf.Validation(ok=False, failures=[], skipped=why)


def drafter_weight_bytes(dc, tc, draft_ids, fuse_context: bool, dtype: str) -> int:
    return _drafter_fp32_bytes(dc, tc, draft_ids, fuse_context) // 4 * dtypes.BY_NAME[dtype].itemsize


def truncated_drafter(dc):
    """The drafter's first layers, as few as show every kind of attention it has (causal / sliding window): up to
    the first layer of each kind."""
    kinds = list(zip(dc.layer_causal, dc.layer_window))
    k = 1 + max(kinds.index(kind) for kind in set(kinds))  # up to the first layer of the last kind to appear
    return dataclasses.replace(dc, num_layers=k, layer_causal=dc.layer_causal[:k], layer_window=dc.layer_window[:k])


def drafter_truncated(tmp: Path, target, drafter, tc, dc, sources, fuse_context: bool, dtype: str,
                      progress: Progress, window_kv: bool = False) -> dict[str, mf.Validation]:
    """The plain drafter's templates end to end at bounded memory (the drafter past WHOLE_GRAPH_BYTES: its LM head
    alone is 1.2 GB fp16 at a 151,936 x 4096 vocabulary, and ONNX Runtime's CPU kernels run fp16 MatMuls on fp32
    copies): a build of its first layers (truncated_drafter) with the real context projection, embedding, head and
    selector, both flavours, validated against the layer-streamed reference; its files removed once checked.
    window_kv: the windowed drafter's build (every layer slides: fused_drafter.sliding), fed through a compaction."""
    from dflash2.checkpoint import drafter_tensor_shapes
    from dflash2.reference.streamed import StreamedDrafter

    dw, tw = Weights(sources[0]), Weights(sources[1])
    short_dc = truncated_drafter(dc)
    short = StreamedDrafter(short_dc, target, dw, list(drafter_tensor_shapes(short_dc, tc.hidden_size)))
    short.set_draft_vocab(None if drafter.draft_ids is None else drafter.draft_ids.tolist())
    spec = graph_specs(target, short, fuse_context)[1]
    window = fused_drafter.sliding(short_dc) if window_kv else None
    if window is not None:
        from dflash2.export.window_spec import windowed_drafter_spec

        spec = windowed_drafter_spec(spec, window[1])
    name = "drafter.truncated"
    ids = None if drafter.draft_ids is None else drafter.draft_ids.numpy()
    with progress.step(f"{name}.onnx + {name}.trt.onnx: the drafter's templates end to end ({short_dc.num_layers} "
                       f"of {dc.num_layers} layers, the real head and selector), {dtype}") as step:
        with W.DataFile(tmp / f"{name}.onnx.data") as data:
            model, fixed = fused_drafter.build_plain(short_dc, tc, dw, tw, fuse_context, dtype, ids, data,
                                                     progress=step.layer, window=window is not None)
        files = tr.write_graph(model, tmp, dataclasses.replace(spec, name=name), dc.num_drafts, fixed)
        del model, fixed
    return _checked_truncated(tmp, name, spec, files, dtype, progress, dc.num_drafts if spec.has_selector else None)


def plain_truncated(tmp: Path, target, drafter, tc, dc, sources, fuse_context: bool, dtype: str,
                     progress: Progress, window_kv: bool = False) -> dict[str, mf.Validation]:
    """A truncated_depth()-layer build of the plain templates (both flavours) with the real embedding, head and
    context projection, the taps spread over its layers, validated against the layer-streamed reference; its
    files removed once checked (a failure keeps them: keep_failed). window_kv: the windowed target's build."""
    tw, dw = Weights(sources[1]), Weights(sources[0])
    short_tc, short_dc = truncated(tc, dc, truncated_depth(tc))
    short = streamed_target(short_tc, short_dc.target_layer_ids, tw, like=target)
    spec, kw = _windowed(graph_specs(short, drafter, fuse_context)[0], short_tc, window_kv)
    name = "target.truncated"
    with progress.step(f"{name}.onnx + {name}.trt.onnx: the templates end to end ({short_tc.num_layers} layers, "
                       f"the real embedding and head), {dtype}") as step:
        with W.DataFile(tmp / f"{name}.onnx.data") as data:
            build = template(short_tc, "plain")  # the family's standard-op templates (plain.build)
            model, fixed = build(short_tc, short_dc, tw, dw, fuse_context, dtype, data, progress=step.layer, **kw)
        onnx.save_model(model, str(tmp / f"{name}.onnx"))
        onnx.save_model(fixed, str(tmp / f"{name}.trt.onnx"))
        del model, fixed
    return _checked_truncated(tmp, name, spec, {"portable": f"{name}.onnx", "tensorrt": f"{name}.trt.onnx"}, dtype,
                              progress)


def _checked_truncated(tmp: Path, name: str, spec, files: dict, dtype: str, progress: Progress,
                       selector_drafts: int | None = None) -> dict[str, mf.Validation]:
    """Both flavours of a truncated build validated in the bounded-memory session, then its files removed (a
    failure raises first and keeps them: keep_failed)."""
    checked = {name: validated(progress, f"{name}.onnx: validating against PyTorch on ONNX Runtime", spec,
                               tmp / files["portable"], dtype, tmp, name, weights_in_place=True),
               f"{name}.trt": validated(progress, f"{name}.trt.onnx: fixed step shapes, validating on ONNX Runtime",
                                        spec.tensorrt, tmp / files["tensorrt"], dtype, tmp, f"{name}.trt",
                                        selector_drafts=selector_drafts, weights_in_place=True)}
    for f in (*files.values(), f"{name}.onnx.data", f"{name}.inputs.json", f"{name}.reference.json",
              f"{name}.trt.inputs.json", f"{name}.trt.reference.json"):
        (tmp / f).unlink(missing_ok=True)
    return checked


def validated(progress: Progress, what: str, spec, path: Path, dtype: str, tmp: Path, name: str,
              selector_drafts: int | None = None, weights_in_place: bool = False) -> mf.Validation:
    """One graph flavour against PyTorch. A failure stops the export here (no minutes spent on the graphs
    after it); a graph no available provider can run is recorded ok: false with why, and said.
    weights_in_place: the streamed stages' bounded-memory session (dflash2.onnxrt.open_session)."""
    with progress.step(what) as step:
        f, report = validate_graph(spec, path, dtype, save_dir=tmp, name=name, selector_drafts=selector_drafts,
                                   weights_in_place=weights_in_place)
        skipped = report.pop("skipped", None)
        rules = {k for r in report.values() if isinstance(r, dict) for k in r if k.startswith("judged_")}
        if skipped:
            step.outcome = f"NOT validated ({skipped})"
        elif "judged_by_dtype_error" in rules:  # said: the fixed tolerance could not judge it (docs/export.md)
            step.outcome = f"passed, judged by PyTorch's own {dtype} error from fp32 (past {dtype}'s tolerance itself)"
        elif "judged_against_fp32" in rules:
            step.outcome = "passed, judged against the fp32 reference"
    if f:
        raise ValidationError(f)
    return mf.Validation(ok=skipped is None, failures=f, skipped=skipped, steps=report)


def graph_signature(graph: str, kind: str, io: dict, num_layers: int, window: int | None = None,
                    sliding: tuple[list[int], int] | None = None) -> mf.Signature:
    """window: the pair's block size, the state rows a hybrid target's graph returns per step (its state binding);
    sliding: (layers, keep) of a windowed target's window buffer (plain.sliding), checked against the io."""
    ins, outs = [d["name"] for d in io["inputs"]], [d["name"] for d in io["outputs"]]
    hybrid = graph == "target" and sig.state_layers(ins) > 0
    out = sig.signature(graph, kind, ins, outs, num_layers, selector_io=(ins, outs),
                        state_window=window if hybrid else None, io=io if hybrid else None, window=sliding)
    if out.window is not None:  # a builder bug otherwise: the window binding and the graph's io disagree
        graph_io = mf.GraphIo([mf.IoSpec(**d) for d in io["inputs"]], [mf.IoSpec(**d) for d in io["outputs"]])
        problems = out.window.problems(f"{graph} signature ({kind})", graph_io)
        if problems:
            raise ValueError("; ".join(problems))
    return out


def _windowed(spec, tc, window_kv: bool):
    """(the target spec, the builder's extra arguments) of a build of config tc: windowed where asked and tc has
    sliding layers beside full ones (a truncated config keeps a layer of each kind: streamed.truncated)."""
    window = plain.sliding(tc) if window_kv else None
    if window is None:
        return spec, {}
    from dflash2.export.window_spec import windowed_spec

    return windowed_spec(spec, *window), {"window_kv": True}


def qdq_graph(tmp: Path, spec, files: dict, q: qdq.TrtQuant) -> tuple[dict, mf.QuantizedGraph, mf.Validation]:
    """ModelOpt's Q/DQ target becomes the TensorRT flavour; the portable fp32 target stays for ONNX Runtime.
    Calibration: prefill steps of the shipped prompts (else of the validation feed's random ids)."""
    kv_row = list(spec.example[1].shape[1:])
    feeds = (qdq.calibration_feeds([list(p) for p in q.prompts], kv_row) if q.prompts else
             [{k: v.numpy() for k, v in f.items()} for f in spec.feeds()[:1]])
    name, report = qdq.quantize_target(tmp / files["portable"], q, feeds)
    try:
        failures, steps, dev = deviation.measure(spec, tmp / name)
        skipped = None
    except (Dflash2Error, ort_state.Fail, ort_state.NotImplemented) as e:  # e.g. blocked int4 DQ on the CPU
        failures, steps, dev = [], {}, mf.Deviation(judged="not run")
        skipped = f"ONNX Runtime's CPU provider cannot run {name}: {str(e).splitlines()[0][:300]}"
    dev.judged = f"deviation from fp32 ({q.method} Q/DQ, TensorRT flavour)"
    return ({**files, "tensorrt": name}, report,
            mf.Validation(ok=not failures, failures=failures, steps=steps, deviation=dev, skipped=skipped))


TRUNCATED_LAYERS = 4  # the end-to-end check of the templates: this many layers, the real embedding and head
# ... fewer where 4 fp32 layers would pass this (never under 2: a tap inside the layer loop, one after it). ONNX
# Runtime's session over the truncated build holds its layers and the fp32 head: at Qwen3-8B's shape 4 layers are
# 3.1 GB beside a 2.5 GB head, the export's peak (6.6 GiB measured); at 0.6B's, 4 layers are 0.24 GB.
TRUNCATED_LAYER_BYTES = 2 << 30


# A quantized export's fp32 end-to-end check above this many bytes of fp32 layers and head is not built: the
# int4 / int8 truncated build of the same templates (the real embedding and head, quantized) is measured against
# the reference in its place. ONNX Runtime's session over the fp32 check holds them whole beside the process (~1-1.5
# GiB: torch, onnxruntime, the reference's layer). Held: Qwen3-8B's shape 3.8 GiB (2 layers), Qwen3.5-0.8B's 1.3;
# Qwen3.5-9B's 7.0, Qwen3.8-27B's 10.4, Qwen3.6-35B-A3B's 14.4 (4 layers: a hybrid keeps one full-attention layer;
# untied 248,320-row heads): past an 8 GiB floor with the process.
TRUNCATED_CHECK_BYTES = 6 << 30


def truncated_check_bytes(short_tc) -> int:
    """What ONNX Runtime holds of the fp32 check build: its layers and head (an untied embedding only Gathers the
    fed rows from the mapped data file: not counted)."""
    embed = 0 if short_tc.tie_word_embeddings else 4 * short_tc.vocab_size * short_tc.hidden_size
    return _fp32_weight_bytes(short_tc) - embed


def truncated_depth(tc) -> int:
    """How many layers the truncated end-to-end build keeps (TRUNCATED_LAYERS, TRUNCATED_LAYER_BYTES)."""
    from dflash2.checkpoint import family_tensor_shapes

    layers = [v for k, v in family_tensor_shapes(tc).items() if ".layers." in k]
    per_layer = 4 * sum(int(np.prod(v)) for v in layers) // tc.num_layers  # the mean layer (hybrids mix kinds)
    return max(2, min(TRUNCATED_LAYERS, TRUNCATED_LAYER_BYTES // per_layer))


def gqa_target(tmp: Path, plain_spec, target, drafter, tc, dc, sources, fuse_context: bool, max_seq_len: int,
               q: qz.OrtQuant | None, progress: Progress, dtype: str, window_kv: bool = False):
    """The target from ONNX Runtime's fused-op templates (dflash2.export.gqa), weights streamed from the
    checkpoint, checked at bounded memory:
    1. a truncated_depth()-layer build of the same templates with the real embedding, head and context
       projection (the taps spread over its layers), validated against the layer-streamed PyTorch reference
       by the one comparison rule;
    2. the whole graph, quantized as it is written when --quantize int4 / int8 asks (q, the plan's GraphJob.quant):
       its deviation from the reference is measured; else fp32 and validated like every graph.
    Returns (spec, files, validations, quantization report or None)."""
    tw, dw = Weights(sources[1]), Weights(sources[0])
    checked = {}
    short_tc, short_dc = truncated(tc, dc, truncated_depth(tc))
    short = streamed_target(short_tc, short_dc.target_layer_ids, tw, like=target)
    # the fused graph's KV binding (the family's fused_kv): a dense target's per-layer gqa-shared buffers, a hybrid's
    # on its full-attention layers beside the GDN state rows, else the prefix binding (windowed where it slides)
    gqa_kv = families.by_name(tc.family).fused_kv == "gqa-shared"
    fused_spec = (gqa.gqa_spec if tc.family in DENSE else hybrid_gqa_spec) if gqa_kv else (lambda s: s)
    short_spec, short_kw = _windowed(graph_specs(short, drafter, fuse_context)[0], short_tc, window_kv)
    short_spec = fused_spec(short_spec)
    kw = {"window_kv": True} if window_kv and plain.sliding(tc) is not None else {}  # plain_spec is windowed then
    name = "target.truncated"
    held = truncated_check_bytes(short_tc)
    if q is not None and held > TRUNCATED_CHECK_BYTES:
        why = (f"its fp32 layers and head are {held / 2**30:.1f} GiB, past the {TRUNCATED_CHECK_BYTES / 2**30:.0f} GiB "
               f"a quantized export's fp32 check maps; the {q.method} build of the same templates with the real "
               f"embedding and head is measured against PyTorch below instead")
        for title in (f"{name}.onnx: the templates end to end ({short_tc.num_layers} layers, the real embedding and "
                      f"head), ONNX Runtime's fused ops", f"{name}.onnx: validating against PyTorch on ONNX Runtime"):
            with progress.step(title) as step:  # both steps said, so the plan's count holds
                step.outcome = f"NOT built: {why}"
        checked[name] = mf.Validation(ok=False, failures=[], skipped=why)
    else:
        with progress.step(f"{name}.onnx: the templates end to end ({short_tc.num_layers} layers, the real embedding "
                           f"and head), ONNX Runtime's fused ops") as step:
            with W.DataFile(tmp / f"{name}.onnx.data") as data:
                build = template(short_tc, "fused")  # the family's fused-op templates (gqa.build)
                model = build(short_tc, short_dc, tw, dw, fuse_context, max_seq_len, data, progress=step.layer,
                              **short_kw)
            onnx.save_model(model, str(tmp / f"{name}.onnx"))
            del model
        checked[name] = validated(progress, f"{name}.onnx: validating against PyTorch on ONNX Runtime", short_spec,
                                  tmp / f"{name}.onnx", dtype, tmp, name, weights_in_place=True)
        for f in (f"{name}.onnx", f"{name}.onnx.data", f"{name}.inputs.json", f"{name}.reference.json"):
            (tmp / f).unlink()  # checked; a failure above keeps them (keep_failed)
    spec = fused_spec(plain_spec)
    what = f"{q.method} weights quantized as they are written" if q else "fp32"
    with progress.step(f"target.onnx: ONNX Runtime's fused ops ({tc.family} templates), streamed from safetensors, "
                       f"{what}") as step:
        native = None
        if q is not None and q.native:  # the checkpoint's own quantized blocks, each checked to dequantize to it
            from dflash2.gguf_blocks import GgufBlocks

            native = GgufBlocks(q.native, tc.num_heads, tc.num_kv_heads)
        with W.DataFile(tmp / "target.onnx.data") as data:
            model = template(tc, "fused")(tc, dc, tw, dw, fuse_context, max_seq_len, data, progress=step.layer,
                                          quant=q, native=native, **kw)
        files = tr.write_graph(model, tmp, spec, dc.num_drafts, check=False)
    if q is None:
        checked["target"] = validated(progress, "target.onnx: validating against PyTorch on ONNX Runtime", spec,
                                      tmp / files["portable"], dtype, tmp, "target", weights_in_place=True)
        return spec, files, checked, None
    size = (tmp / "target.onnx.data").stat().st_size
    if size <= WHOLE_GRAPH_BYTES:
        with progress.step(f"target.onnx: {q.method} deviation from PyTorch (layer-streamed reference)"):
            failures, steps, dev = deviation.measure(spec, tmp / files["portable"], save_dir=tmp)
        dev.judged = f"deviation from fp32 ({q.method} weights)"
        checked["target"] = mf.Validation(ok=not failures, failures=failures, steps=steps, deviation=dev)
    else:  # ONNX Runtime's session over the whole quantized graph alone passes the budget (6.3 GiB at 8B): this
        # step measures a truncated build instead (in place of the one above, so the plan's count holds)
        name = f"target.truncated.{q.method}"
        with progress.step(f"{name}.onnx: {q.method} as written, {short_tc.num_layers} layers and the real head: "
                           f"deviation from PyTorch (the whole graph's {size / 2**30:.2f} GiB is past "
                           f"{WHOLE_GRAPH_BYTES / 2**30:.0f} GiB)") as step:
            with W.DataFile(tmp / f"{name}.onnx.data") as data:
                build = template(short_tc, "fused")
                model_short = build(short_tc, short_dc, tw, dw, fuse_context, max_seq_len, data,
                                    progress=step.layer, quant=q, native=native, **short_kw)
            onnx.save_model(model_short, str(tmp / f"{name}.onnx"))
            del model_short
            failures, steps, dev = deviation.measure(short_spec, tmp / f"{name}.onnx")
            why = (f"{q.method} deviation not measured whole here: its data file is {size / 2**30:.2f} GiB, past the "
                   f"{WHOLE_GRAPH_BYTES / 2**30:.0f} GiB a bounded-memory check maps; measured on {name} (the same "
                   f"templates and quantizer, {short_tc.num_layers} layers, the real embedding and head); no replay "
                   f"files for the whole graph (its reference would stream every layer per feed)")
            top1 = "" if dev.top1_agreement is None else f"top-1 agreement {dev.top1_agreement:.0%}; "
            step.outcome = f"{top1}the whole graph NOT measured ({why})"
        dev.judged = f"deviation from fp32 ({q.method} weights), {short_tc.num_layers}-layer build of the same templates"
        checked[name] = mf.Validation(ok=not failures, failures=failures, steps=steps, deviation=dev)
        checked["target"] = mf.Validation(ok=False, failures=[], skipped=why)
        if not failures:
            for f in (f"{name}.onnx", f"{name}.onnx.data"):
                (tmp / f).unlink()
    if failures:
        raise ValidationError(failures)
    report = _nbits_report(model, q, tmp / "target.onnx.data", tc)
    if native is not None:  # ggml type -> MatMulNBits nodes that carry its blocks as they are
        if not native.used:
            raise OutputError(f"--quant-from-gguf {q.native}: none of its tensors went in as blocks (types that map: "
                              f"Q4_0, Q4_1, Q8_0; this file has {native.types()})")
        report.native = dict(sorted(Counter(native.used.values()).items()))
    return spec, files, checked, report


def template_drafter(tmp: Path, spec, drafter, tc, dc, sources, fuse_context: bool, max_seq_len: int,
                     q: qz.OrtQuant | None, progress: Progress, dtype: str, window_kv: bool = False):
    """The drafter from the same templates as the fused target (dflash2.export.fused_drafter), weights streamed
    from both checkpoints; fp32: validated like every graph; with q (the drafter's own quantization, the plan's
    GraphJob.quant) written quantized and its deviation measured. Returns (files, validations, quantization report)."""
    draft_ids = None if drafter.draft_ids is None else drafter.draft_ids.numpy()
    what = f"{q.method} weights quantized as they are written" if q else "fp32"
    with progress.step(f"drafter.onnx: ONNX Runtime's fused ops from the layer templates, {what}") as step:
        with W.DataFile(tmp / "drafter.onnx.data") as data:
            model = fused_drafter.build(dc, tc, Weights(sources[0]), Weights(sources[1]), fuse_context, max_seq_len,
                                        draft_ids, data, q, progress=step.layer)
        files = tr.write_graph(model, tmp, spec, dc.num_drafts, check=False, tensorrt=False)
    if q is None:
        return files, {"drafter": validated(progress, "drafter.onnx: validating against PyTorch on ONNX Runtime", spec,
                                            tmp / files["portable"], dtype, tmp, "drafter",
                                            weights_in_place=True)}, None
    with progress.step(f"drafter.onnx: {q.method} deviation from PyTorch"):
        failures, steps, dev = deviation.measure(spec, tmp / files["portable"], save_dir=tmp)
    dev.judged = f"deviation from fp32 ({q.method} weights)"
    if failures:
        raise ValidationError(failures)
    heads = [n.name for n in model.graph.node if n.name.startswith("draft_head")
             and n.op_type in ("Gemm", "MatMul", *QUANT_OPS)]
    report = mf.QuantizedGraph(weight_matmuls=_weight_matmuls(model),
                               quantized=sum(n.op_type in QUANT_OPS for n in model.graph.node),
                               lm_heads=heads, kept_fp32=[] if q.lm_head else heads,
                               weight_mb_before=round(_drafter_fp32_bytes(dc, tc, draft_ids, fuse_context) / 2**20, 2),
                               weight_mb_after=round((tmp / "drafter.onnx.data").stat().st_size / 2**20, 2))
    return files, {"drafter": mf.Validation(ok=True, failures=[], steps=steps, deviation=dev)}, report


def _drafter_fp32_bytes(dc, tc, draft_ids, fuse_context: bool) -> int:
    """The fp32 bytes the fused drafter graph reads: its own weights (fc / hidden_norm only when the context is not
    fused into the target), its head rows (none of its own for a tied head over the whole vocabulary: the
    embedding), the target's embedding."""
    from dflash2.checkpoint import drafter_tensor_shapes

    shapes = drafter_tensor_shapes(dc, tc.hidden_size)
    own = sum(int(np.prod(s)) for k, s in shapes.items() if not (fuse_context and k in ("fc.weight", "hidden_norm.weight")))
    rows = 0 if draft_ids is None and tc.tie_word_embeddings else tc.vocab_size if draft_ids is None else len(draft_ids)
    return 4 * (own + (rows + tc.vocab_size) * tc.hidden_size)


def _nbits_report(model, q: qz.OrtQuant, data: Path, tc) -> mf.QuantizedGraph:
    nodes = model.graph.node
    heads = [n.name for n in nodes if n.name == "lm_head" or n.name.startswith("lm_head_Q")]  # native Q8_0: _Q8
    return mf.QuantizedGraph(
        weight_matmuls=_weight_matmuls(model), quantized=sum(n.op_type == "MatMulNBits" for n in nodes), lm_heads=heads,
        kept_fp32=[] if q.lm_head else heads,
        weight_mb_before=round(_fp32_weight_bytes(tc) / 2**20, 2), weight_mb_after=round(data.stat().st_size / 2**20, 2))


def _fp32_weight_bytes(tc) -> int:
    """The fp32 bytes of the target's weights (what the fp32 gqa graph stores, the tied head once)."""
    from dflash2.checkpoint import family_tensor_shapes

    return 4 * sum(int(np.prod(s)) for s in family_tensor_shapes(tc).values())


def _weight_matmuls(model) -> int:
    """MatMulNBits, and MatMuls / Gemms whose second input is an initializer or the Transpose of one (the LM head kept
    fp32 reads the embedding through a Transpose: no second copy on disk)."""
    inits = {t.name for t in model.graph.initializer}
    weights = inits | {n.output[0] for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in inits}
    return sum(n.op_type in QUANT_OPS or (n.op_type in ("MatMul", "Gemm") and n.input[1] in weights)
               for n in model.graph.node)


def quantize_graph(tmp: Path, spec, files: dict, q: qz.OrtQuant) -> tuple[dict, mf.QuantizedGraph, mf.Validation]:
    """Quantize the fp32 graph in place (validated, or its truncated build where it was past the budget; ONNX
    Runtime's quantizer loads it whole); the TensorRT flavour (which shared its data file) goes:
    TensorRT cannot run MatMulNBits (its quantized path is modelopt's Q/DQ graphs, docs/quantization.md)."""
    report = qz.quantize_file(tmp / files["portable"], q)
    for flavour, name in list(files.items()):
        if flavour != "portable":
            (tmp / name).unlink()
    failures, steps, dev = deviation.measure(spec, tmp / files["portable"])
    dev.judged = f"deviation from fp32 ({q.method} weights)"
    return ({"portable": files["portable"]}, report,
            mf.Validation(ok=not failures, failures=failures, steps=steps, deviation=dev))
