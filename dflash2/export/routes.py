"""The export's graphs written one job at a time (dflash2.export.plan.GraphJob), one function per route:
"templates" (plain ONNX ops from the layer templates, weights streamed), "gqa" (ONNX Runtime's fused ops,
quantized as written), "traced" (torch.onnx). Each returns the manifest's record of its graph; write_all
then shares the bytes the graphs have in common and assembles the manifest."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash2 import families
from dflash2 import manifest as mf
from dflash2.checkpoint import Weights
from dflash2.export import dedupe, fused_drafter, stages
from dflash2.export import signature as sig
from dflash2.export.family import template
from dflash2.export import trace as tr
from dflash2.export import weights as W
from dflash2.export.graphs import graph_specs
from dflash2.export.plan import ExportPlan, GraphJob
from dflash2.ops import contract as C
from dflash2.progress import Progress

KV_BINDING = ("prefix-view: past_kv is the contiguous prefix buffer[:P] of one preallocated sequence-major buffer "
              "[max_seq_len, L, 2, kv, hd]; new_kv is bound to buffer[P:P+n], so a step copies nothing and "
              "rollback moves P. A static buffer + write position would make every step attend over max_seq_len "
              "rows and scatter inside the graph.")


@dataclass
class Run:
    """What every route reads and adds to: the plan, the temporary folder, the loaded references, and the
    validation and quantization records so far."""

    plan: ExportPlan
    tmp: Path
    target: object  # the reference target (streamed: a layer at a time)
    drafter: object
    progress: Progress
    validation: dict[str, mf.Validation] = field(default_factory=dict)
    quantized: dict[str, mf.QuantizedGraph] = field(default_factory=dict)

    @property
    def sources(self) -> tuple:
        """(drafter folder, target folder): read tensor by tensor by the graphs built from templates."""
        return self.plan.drafter_dir, self.plan.target_dir


def gqa_route(run: Run, job: GraphJob, spec) -> mf.Graph:
    """ONNX Runtime's fused-op target or drafter: no TensorRT flavour, quantized as it is written."""
    p, t0 = run.plan, time.perf_counter()
    if job.name == "target":
        spec, files, checked, q_report = stages.gqa_target(run.tmp, spec, run.target, run.drafter, p.tc, p.dc,
                                                           run.sources, p.fuse_context, p.max_seq_len, job.quant,
                                                           run.progress, p.dtype, window_kv=p.window is not None)
    else:
        files, checked, q_report = stages.template_drafter(run.tmp, spec, run.drafter, p.tc, p.dc, run.sources,
                                                           p.fuse_context, p.max_seq_len, job.quant, run.progress,
                                                           p.dtype)
    run.validation.update(checked)
    if q_report is not None:
        run.quantized[job.name] = q_report
    io = tr.io_spec(run.tmp / files["portable"])
    gqa_kv = families.by_name(p.tc.family).fused_kv == "gqa-shared"
    kind = "gqa-shared" if job.name == "target" and gqa_kv else "prefix"
    # a hybrid target's GroupQueryAttention layers are its full-attention layers only
    layers = len(p.tc.full_layers) if gqa_kv and hasattr(p.tc, "full_layers") else p.tc.num_layers
    return mf.Graph(flavours=mf.Flavours(**files), data="", inputs=[mf.IoSpec(**d) for d in io["inputs"]],
                    outputs=[mf.IoSpec(**d) for d in io["outputs"]], seconds=time.perf_counter() - t0,
                    signature=stages.graph_signature(job.name, kind, io, layers, p.dc.block_size, _window(p, job)))


def templates_route(run: Run, job: GraphJob, spec) -> mf.Graph:
    """The plain target or drafter from the layer templates, weights streamed from safetensors; past the budget
    the same templates are validated end to end on a truncated build first (job.truncated_check)."""
    p, t0 = run.plan, time.perf_counter()
    if job.truncated_check:  # the templates end to end at bounded memory, both flavours
        check = stages.plain_truncated if job.name == "target" else stages.drafter_truncated
        kw = {"window_kv": (p.window if job.name == "target" else _window(p, job)) is not None}
        run.validation.update(check(run.tmp, run.target, run.drafter, p.tc, p.dc, run.sources, p.fuse_context,
                                    p.dtype, run.progress, **kw))
    ids = None if run.drafter.draft_ids is None else run.drafter.draft_ids.numpy()
    with run.progress.step(f"{job.name}.onnx + {job.name}.trt.onnx: standard ONNX ops from the layer "
                           f"templates, {p.dtype}, streamed from safetensors") as step:
        dw, tw = Weights(run.sources[0]), Weights(run.sources[1])
        with W.DataFile(run.tmp / f"{job.name}.onnx.data") as data:
            if job.name == "target":
                build = template(p.tc, "plain")  # the family's standard-op templates (plain.build)
                kw = {"window_kv": True} if p.window is not None else {}  # the sliding layers' bounded buffer
                model, fixed = build(p.tc, p.dc, tw, dw, p.fuse_context, p.dtype, data, progress=step.layer, **kw)
            else:
                model, fixed = fused_drafter.build_plain(p.dc, p.tc, dw, tw, p.fuse_context, p.dtype, ids, data,
                                                         progress=step.layer, window=_window(p, job) is not None)
        files = tr.write_graph(model, run.tmp, spec, p.dc.num_drafts, fixed)
        del model, fixed
    return _checked(run, job, spec, files, t0)


def traced_route(run: Run, job: GraphJob, spec) -> mf.Graph:
    """torch.onnx (dynamo) over the loaded module: the selector (small: its codebooks and the walk)."""
    t0 = time.perf_counter()
    with run.progress.step(f"{job.name}.onnx: tracing with torch.onnx (dynamo)"):
        model = tr.trace(spec, run.plan.max_seq_len)
        fixed = tr.trace(spec.tensorrt, run.plan.max_seq_len) if spec.tensorrt is not None else None
        files = tr.write_graph(model, run.tmp, spec, run.plan.dc.num_drafts, fixed)
    return _checked(run, job, spec, files, t0)


ROUTES = {"templates": templates_route, "gqa": gqa_route, "traced": traced_route}


def _checked(run: Run, job: GraphJob, spec, files: dict, t0: float) -> mf.Graph:
    """A written templates / traced graph validated (each flavour), quantized after validation where the job
    says, and its record."""
    p, tmp, built = run.plan, run.tmp, job.route == "templates"  # validated in the bounded-memory session

    def check(name: str, what: str, s, path: Path, **kw) -> mf.Validation:
        if job.truncated_check:  # its truncated build was validated already
            return stages.not_whole(run.progress, name, p.tc, p.dtype, p.dc if job.name == "drafter" else None,
                                    job.weight_bytes)
        return stages.validated(run.progress, f"{name}.onnx: {what}", s, path, p.dtype, tmp, name,
                                weights_in_place=built, **kw)

    run.validation[job.name] = check(job.name, "validating against PyTorch on ONNX Runtime", spec,
                                     tmp / files["portable"])
    tensorrt_io = None
    if spec.tensorrt is not None:
        run.validation[f"{job.name}.trt"] = check(f"{job.name}.trt", "fixed step shapes, validating on ONNX Runtime",
                                                  spec.tensorrt, tmp / files["tensorrt"],
                                                  selector_drafts=p.dc.num_drafts if spec.has_selector else None)
        trt_io = tr.io_spec(tmp / files["tensorrt"])
        tensorrt_io = mf.GraphIo(inputs=[mf.IoSpec(**d) for d in trt_io["inputs"]],
                                 outputs=[mf.IoSpec(**d) for d in trt_io["outputs"]])
    if job.quantize_when == "after-validation":
        files, tensorrt_io = _quantize_after(run, job, spec, files, tensorrt_io)
    io = tr.io_spec(tmp / files["portable"])
    return mf.Graph(flavours=mf.Flavours(**files), data=f"{job.name}.onnx.data",
                    inputs=[mf.IoSpec(**d) for d in io["inputs"]], outputs=[mf.IoSpec(**d) for d in io["outputs"]],
                    seconds=time.perf_counter() - t0, tensorrt_io=tensorrt_io,
                    signature=stages.graph_signature(job.name, "prefix", io, p.tc.num_layers, p.dc.block_size,
                                                     _window(p, job)),
                    tensorrt_signature=None if tensorrt_io is None else
                    stages.graph_signature(job.name, "fixed", tr.io_spec(tmp / files["tensorrt"]), p.tc.num_layers,
                                           p.dc.block_size, _window(p, job, "fixed")))


def _window(p: ExportPlan, job: GraphJob, kind: str = "prefix") -> tuple[list[int], int] | None:
    """The window binding (sliding layers, keep) of the job's graph: the target's, where the plan has one; the
    drafter's where every drafter layer slides (fused_drafter.sliding), --window-kv on, and the drafter is written
    from the templates in its portable flavour (the fused and TensorRT drafters keep max_seq_len rows)."""
    if job.name == "target":
        return p.window
    if job.name == "drafter" and p.window_kv and job.route == "templates" and kind == "prefix":
        return fused_drafter.sliding(p.dc)
    return None


def _quantize_after(run: Run, job: GraphJob, spec, files: dict, tensorrt_io):
    """The validated float graph quantized whole (not memory-bounded, said in the progress line). Returns its
    files and TensorRT io (None where the quantized graph replaced the fixed-shape flavour)."""
    tmp, q = run.tmp, job.quant
    note = q.memory_note(stages.weight_bytes(run.plan.tc, "float32") / 2**30)
    with run.progress.step(f"{job.name}.onnx: {q.method} weights, deviation from PyTorch{note}"):
        fixed_file = files.get("tensorrt") if spec.tensorrt is not None else None
        before = run.validation.get(job.name)
        files, run.quantized[job.name], run.validation[job.name] = job.quantizer(tmp, spec, files, q)
        if before is not None and before.skipped:  # the float graph's not-run-whole record stays said
            run.validation[f"{job.name}.float"] = before
    if fixed_file is not None and files.get("tensorrt") != fixed_file:
        # the fixed-shape flavour shared the float weights: a quantized graph (or none) replaces it
        run.validation.pop(f"{job.name}.trt", None)
        tensorrt_io = None
        for name in (fixed_file, f"{job.name}.trt.inputs.json", f"{job.name}.trt.reference.json"):
            (tmp / name).unlink(missing_ok=True)
    return files, tensorrt_io


def write_all(run: Run, tool_versions: dict[str, str]) -> mf.ExportManifest:
    """Every job's graph, the bytes they share written once, and the manifest (sources, vocabulary and
    tokenizer are export()'s to add)."""
    p = run.plan
    specs = {s.name: s for s in graph_specs(run.target, run.drafter, p.fuse_context)}
    if p.window is not None:  # the target's sliding layers on the window buffer: fed and checked that way
        from dflash2.export.window_spec import windowed_spec

        specs["target"] = windowed_spec(specs["target"], *p.window)
    drafter_window = next((_window(p, j) for j in p.jobs if j.name == "drafter"), None)
    if drafter_window is not None:  # every drafter layer slides: its context KV on the window buffer
        from dflash2.export.window_spec import windowed_drafter_spec

        specs["drafter"] = windowed_drafter_spec(specs["drafter"], drafter_window[1])
    graphs = {job.name: ROUTES[job.route](run, job, specs[job.name]) for job in p.jobs}
    with run.progress.step("each weight once: graphs share the bytes they have in common") as step:
        written = [f for g in graphs.values() for f in dataclasses.asdict(g.flavours).values() if f]
        shared = dedupe.share(run.tmp, written)
        step.outcome = (f"{shared['tensors_shared']} tensors shared, {shared['bytes_before'] / 2**20:.0f} -> "
                        f"{shared['bytes_after'] / 2**20:.0f} MiB of weights")
        for g in graphs.values():  # the data files each graph reads now
            files = [f for f in dataclasses.asdict(g.flavours).values() if f]
            g.data = ", ".join(sorted({loc for f in files for loc in dedupe.data_files_of(run.tmp / f)}))
    if any(j.cpu_q4 for j in p.jobs):  # after the dedupe: the data references it copies are final
        from dflash2.export import q4_flavour

        q4_flavour.add(run, {j.name: graphs[j.name] for j in p.jobs if j.cpu_q4})
    dc, tc = p.dc, p.tc
    selector = None
    if dc.version == 2:
        selector = mf.Selector(op=C.OP_NAME, domain=C.ONNX_DOMAIN, plugin_version=C.PLUGIN_VERSION,
                               plugin_namespace=C.PLUGIN_NAMESPACE, top_k=dc.selector_top_k, rank=dc.selector_rank,
                               output_multiplier=dc.output_multiplier, logit_softcap=dc.logit_softcap)
    why = ("target emits hidden_norm(fc(taps)): one H-wide row per token instead of n_taps*H (see docs/export.md "
           "for the measurement)" if p.fuse_context else "raw taps")
    gqa_kv = families.by_name(tc.family).fused_kv == "gqa-shared"  # the target's fused graph binds GQA buffers
    return mf.ExportManifest(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), tools=tool_versions, dtype=p.dtype,
        max_seq_len=p.max_seq_len, block_size=dc.block_size, num_drafts=dc.num_drafts, drafter_version=dc.version,
        tap_ids=list(dc.target_layer_ids), mask_token_id=dc.mask_token_id, vocab_size=tc.vocab_size,
        eos_token_ids=list(tc.eos_token_ids),
        context=mf.Context(fused=p.fuse_context, width=graphs["drafter"].inputs[0].shape[1], why=why),
        kv=mf.Kv(layout=["seq", "layer", "k|v", "kv_head", "head_dim"],
                 rows=mf.KvRows(target=list(run.target.kv_row_shape()), drafter=list(run.drafter.kv_row_shape())),
                 dtype=p.dtype, binding=KV_BINDING if p.attention == "plain" or not gqa_kv else
                 f"target: {sig.GQA_BINDING} drafter: {KV_BINDING}", target_attention=p.attention),
        selector=selector, target_config=tc.to_dict(), drafter_config=dc.to_dict(), graphs=graphs,
        validation=run.validation,
        quantization=p.quantize.manifest_entry(run.quantized) if p.quantize is not None else None)
