"""export(): a DFlash / DFlash2 checkpoint and its target -> a self-contained, validated folder.

Written into a temporary sibling folder and renamed into place only when every graph passed
validation, so a failure leaves nothing behind and an existing folder is replaced only with --force.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import onnx
import torch

from dflash2 import __version__, draft_vocab, dtypes
from dflash2.checkpoint import Weights
from dflash2 import manifest as mf
from dflash2.config import (check_pair, check_tokenizer_files, check_tokenizer_vocab, load_drafter_config,
                            load_target_config, tokenizer_id_count)
from dflash2.errors import ValidationError
from dflash2.export import dedupe, fused_drafter, gqa, plain, qdq, stages
from dflash2.export import signature as sig
from dflash2.export import weights as W
from dflash2.export import quantize as qz
from dflash2.export import trace as tr
from dflash2.export.graphs import graph_specs
from dflash2.export.validate import raise_if_failed
from dflash2.folders import (
    OutputError,
    check_output,
    copy_present,
    keep_failed,
    replace_folder,
    temp_folder,
)
from dflash2.ops import contract as C
from dflash2.progress import Progress
from dflash2.reference.load import load_pair, load_streamed_pair

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")
ATTENTION = ("plain", "gqa")
KV_BINDING = ("prefix-view: past_kv is the contiguous prefix buffer[:P] of one preallocated sequence-major buffer "
              "[max_seq_len, L, 2, kv, hd]; new_kv is bound to buffer[P:P+n], so a step copies nothing and "
              "rollback moves P. A static buffer + write position would make every step attend over max_seq_len "
              "rows and scatter inside the graph.")


def tool_versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript
    import transformers

    return {"dflash2": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__,
            "transformers": transformers.__version__}


def export(drafter_dir: str | Path, target_dir: str | Path, out_dir: str | Path, dtype: str = "float32",
           max_seq_len: int | None = None, force: bool = False, fuse_context: bool = True,
           quiet: bool = False, full_vocab: bool = False, beyond_max_positions: bool = False,
           quantize: qz.OrtQuant | qdq.TrtQuant | None = None,
           target_attention: str = "auto", draft_block: int | None = None) -> mf.ExportManifest:
    """Returns the manifest written. Raises CheckpointError / TensorSetError / ValidationError / OutputError.
    full_vocab: ignore the drafter's draft_vocab.json (draft over the whole vocabulary).
    beyond_max_positions: allow max_seq_len past the target's max_position_embeddings.
    quantize: weight-only int4 / int8 target (and drafter) graphs for ONNX Runtime (dflash2.export.quantize), or
    a Q/DQ TensorRT flavour of the target (dflash2.export.qdq).
    target_attention: "plain" (ONNX ops, with a TensorRT flavour) or "gqa" (ONNX Runtime's fused ops,
    dflash2.export.gqa: the CPU path; no TensorRT flavour of the target); "auto": gqa for the ONNX Runtime
    quantizations (which have no TensorRT flavour anyway: 1.5x faster int4 decode, docs/quantization.md),
    plain otherwise.
    draft_block: draft this many rows a round (2..the drafter's training block size; None: that size;
    docs/export.md)."""
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
    max_seq_len = default_max_seq_len(tc) if max_seq_len is None else max_seq_len
    target_attention = _attention(target_attention, quantize, tc, dc, max_seq_len)
    if isinstance(quantize, qz.OrtQuant) and quantize.native and target_attention != "gqa":
        raise OutputError("--quant-from-gguf: expected the fused-op target graph (--target-attention gqa, the default "
                          f"with --quantize int4|int8), found --target-attention {target_attention}"
                          + (f" ({gqa.unsupported(tc, dc, max_seq_len)})" if gqa.unsupported(tc, dc, max_seq_len) else ""))
    if isinstance(quantize, qz.OrtQuant) and quantize.drafter and quantize.for_graph("drafter").dynamic and \
            target_attention != "gqa":
        raise OutputError(f"--quant-drafter {qz.DYNAMIC}: expected the fused-op graphs (--target-attention gqa, the "
                          f"default with --quantize int4|int8), found --target-attention {target_attention}"
                          + (f" ({gqa.unsupported(tc, dc, max_seq_len)})" if gqa.unsupported(tc, dc, max_seq_len) else ""))
    if isinstance(quantize, qdq.TrtQuant) and not quantize.prompts:
        quantize = dataclasses.replace(quantize, prompts=qdq.shipped_prompt_ids(target_dir))
    specs_count = 3 if dc.version == 2 else 2
    steps = 1 + 2 * specs_count + 2 + 1 + 1 + 1  # + the two fixed-shape TensorRT flavours' validations, sharing,
    # + the row-invariance check of the written export
    # gqa: the target + its truncated build, validated (+2), neither it nor the drafter has a TensorRT flavour (-2),
    # and both are quantized as they are built (no step of their own)
    steps += len(quantize.graphs()) if quantize and target_attention != "gqa" else 0
    progress = Progress(steps, quiet)
    with progress.step("loading and checking the checkpoints"):
        if target_attention == "gqa" or dtype in plain.DTYPES:  # every graph built from templates: the
            # references only validate them, reading one layer at a time
            target, drafter = load_streamed_pair(drafter_dir, target_dir, use_draft_vocab=not full_vocab,
                                                 dtype=dtypes.torch_dtype(dtype), block_size=draft_block)
        else:  # bfloat16: traced from the loaded modules
            target, drafter = load_pair(drafter_dir, target_dir, dtypes.torch_dtype(dtype),
                                        use_draft_vocab=not full_vocab, block_size=draft_block)
    with temp_folder(out) as tmp:  # removed however the block is left (error, Ctrl-C, SIGTERM)
        try:
            manifest = _write_all(tmp, target, drafter, dc, tc, dtype, max_seq_len, fuse_context, progress,
                                  quantize, target_attention, (drafter_dir, target_dir))
            raise_if_failed([f for v in manifest.validation.values() for f in v.failures])
        except ValidationError as e:
            raise ValidationError(e.failures, keep_failed(tmp, out, e.failures)) from None
        manifest.sources = mf.Sources(drafter=str(Path(drafter_dir).absolute()), target=str(Path(target_dir).absolute()))
        manifest.draft_vocab = _draft_vocab_entry(drafter, drafter_dir)
        with progress.step("tokenizer, manifest"):
            manifest.tokenizer = mf.Tokenizer(copy_present(Path(target_dir), list(TOKENIZER_FILES), tmp))
            mf.write(tmp, manifest)
        manifest.validation[ROWS] = rows = _row_invariance(tmp, manifest, progress)
        mf.reseal(tmp, manifest)  # the record joins the manifest; no file but manifest.json changed
        if rows.failures:  # kept for inspection, not runnable: its manifest under another name
            (tmp / mf.NAME).rename(tmp / "manifest.rows-failed.json")
            raise ValidationError(rows.failures, keep_failed(tmp, out, rows.failures))
        replace_folder(tmp, out, force, what="the export")
    mf.remember_hashes(out, manifest)
    return manifest


ROWS = "target.rows"  # the manifest's validation record of the row-invariance check


def _row_invariance(tmp: Path, manifest: mf.ExportManifest, progress: Progress) -> mf.Validation:
    """The written export run as generation runs it (dflash2.runtime.invariance): every k-row verify row
    bitwise equal to the 1-row decode at the same position, or the export fails (not lossless)."""
    g = manifest.graphs["target"]
    data = sum((tmp / f).stat().st_size for f in g.data.split(", ") if f and (tmp / f).is_file())
    with progress.step("target: k-row verify against 1-row decode steps, bitwise (what losslessness rests "
                       "on), on ONNX Runtime as generation runs it") as step:
        why = None
        if manifest.dtype == "bfloat16":
            why = "ONNX Runtime's CPU provider has no bfloat16 kernels"
        elif stages.held_bytes(data, manifest.dtype) > stages.WHOLE_GRAPH_BYTES:
            why = (f"the target graph's {data / 2**30:.2f} GiB of weights are past the "
                   f"{stages.WHOLE_GRAPH_BYTES / 2**30:.0f} GiB a bounded-memory check runs whole")
        if why is None:
            from dflash2.runtime.api import Runtime  # the runtime's own session: the binding generation uses
            from dflash2.runtime.invariance import CONTINUATION, FIELD, PROMPT_TOKENS, validation

            q = manifest.quantization
            hint = (f"ONNX Runtime's {q.method} kernel at block {q.block_size}, accuracy level {q.accuracy_level} "
                    f"is one that is not; on AVX-512 VNNI CPUs int4 block 32 and int8 are invariant, blocks 64 / "
                    f"128 are not (docs/quantization.md)" if q is not None and q.backend == "onnxruntime" else
                    f"{manifest.dtype} graphs are invariant on the CPUs measured (docs/export.md): please report this "
                    f"CPU")
            small = min(manifest.max_seq_len, PROMPT_TOKENS + CONTINUATION + manifest.block_size + 2)
            try:  # buffers for the check's own length, not the export's max_seq_len
                v = validation(Runtime(tmp, verify=False, max_seq_len=small).session,
                               f"target.onnx ({FIELD})", hint)
            except Exception as e:  # noqa: BLE001 - any failure to run is reported, the export is kept
                why = f"the check could not run ({type(e).__name__}: {e})"
        if why is not None:
            step.outcome = f"NOT checked: {why}; dflash2-run OUT --check-rows checks it where it deploys"
            return mf.Validation(ok=False, failures=[], skipped=f"{why}; dflash2-run OUT --check-rows checks it")
        if v.skipped:
            step.outcome = f"NOT checked: {v.skipped}"
            return v
        s = v.steps
        step.outcome = (f"{s['rows']} rows of k = 2..{s['k_max']}: "
                        + ("all bitwise equal" if v.ok else f"{s['differing']} differ (max {s['max_abs']:.3g})"))
    return v


DEFAULT_MAX_SEQ_LEN = 2048


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


def _attention(asked: str, quantize, tc, dc, max_seq_len: int) -> str:
    """auto -> gqa for the ONNX Runtime quantizations when the target fits the kernel, else plain."""
    why = gqa.unsupported(tc, dc, max_seq_len)
    if asked == "gqa" and why:
        raise OutputError(f"--target-attention gqa: {why}")
    if asked == "auto":
        return "gqa" if isinstance(quantize, qz.OrtQuant) and not why else "plain"
    return asked


def preflight(drafter_dir: str | Path, target_dir: str | Path, out: str | Path, dtype: str = "float32",
              max_seq_len: int | None = None, force: bool = False, full_vocab: bool = False,
              beyond_max_positions: bool = False, draft_block: int | None = None):
    """Everything export() checks before it writes: check_inputs, then the weights (names, shapes,
    dtypes, finite values) loaded into the reference modules. Returns (target, drafter)."""
    check_inputs(drafter_dir, target_dir, Path(out).absolute(), dtype, max_seq_len, force, beyond_max_positions,
                 draft_block)
    return load_pair(drafter_dir, target_dir, dtypes.torch_dtype(dtype), use_draft_vocab=not full_vocab,
                     block_size=draft_block)


def _draft_vocab_entry(drafter, drafter_dir) -> mf.DraftVocab | None:
    if drafter.draft_ids is None:
        return None
    path = draft_vocab.path_in(drafter_dir).absolute()
    return mf.DraftVocab(size=int(drafter.draft_ids.numel()), file=str(path), sha256=mf.sha256(path),
                         why="the drafter's LM head covers only these ids; the target still verifies over all")


def _write_all(tmp, target, drafter, dc, tc, dtype, max_seq_len, fuse_context,
               progress, quantize=None, target_attention="plain", sources=None) -> mf.ExportManifest:
    """sources: (drafter folder, target folder), read tensor by tensor by the graphs built from templates."""
    graphs, validation, quantized = {}, {}, {}
    for spec in graph_specs(target, drafter, fuse_context):
        t0 = time.perf_counter()
        built = spec.name in ("target", "drafter") and dtype in plain.DTYPES  # the plain graphs from templates:
        # validated in the bounded-memory session like every graph built from weights
        if target_attention == "gqa" and spec.name in ("target", "drafter"):  # built from templates, no TRT flavour
            if spec.name == "target":
                spec, files, checked, q_report = stages.gqa_target(tmp, spec, target, drafter, tc, dc, sources, fuse_context,
                                                             max_seq_len, quantize, progress, dtype)
            else:
                files, checked, q_report = stages.template_drafter(tmp, spec, drafter, tc, dc, sources, fuse_context,
                                                          max_seq_len, quantize, progress, dtype)
            validation.update(checked)
            if q_report is not None:
                quantized[spec.name] = q_report
            io = tr.io_spec(tmp / files["portable"])
            kind = "gqa-shared" if spec.name == "target" else "prefix"
            graphs[spec.name] = mf.Graph(flavours=mf.Flavours(**files), data="",
                                         inputs=[mf.IoSpec(**d) for d in io["inputs"]],
                                         outputs=[mf.IoSpec(**d) for d in io["outputs"]],
                                         seconds=time.perf_counter() - t0,
                                         signature=stages.graph_signature(spec.name, kind, io, tc.num_layers))
            continue
        elif built:
            ids = None if drafter.draft_ids is None else drafter.draft_ids.numpy()
            nbytes = (stages.weight_bytes(tc, dtype) if spec.name == "target" else
                      stages.drafter_weight_bytes(dc, tc, ids, fuse_context, dtype))
            whole = stages.held_bytes(nbytes, dtype) <= stages.WHOLE_GRAPH_BYTES
            if not whole:  # the templates end to end at bounded memory, both flavours
                progress.total += 3
                truncated_check = stages.plain_truncated if spec.name == "target" else stages.drafter_truncated
                validation.update(truncated_check(tmp, target, drafter, tc, dc, sources, fuse_context, dtype, progress))
            with progress.step(f"{spec.name}.onnx + {spec.name}.trt.onnx: standard ONNX ops from the layer "
                               f"templates, {dtype}, streamed from safetensors") as step:
                with W.DataFile(tmp / f"{spec.name}.onnx.data") as data:
                    if spec.name == "target":
                        model, fixed = plain.build(tc, dc, Weights(sources[1]), Weights(sources[0]), fuse_context,
                                                   dtype, data, progress=step.layer)
                    else:
                        model, fixed = fused_drafter.build_plain(dc, tc, Weights(sources[0]), Weights(sources[1]),
                                                                 fuse_context, dtype, ids, data, progress=step.layer)
                files = tr.write_graph(model, tmp, spec, dc.num_drafts, fixed)
                del model, fixed
        else:
            with progress.step(f"{spec.name}.onnx: tracing with torch.onnx (dynamo)"):
                model = tr.trace(spec, max_seq_len)
                fixed = tr.trace(spec.tensorrt, max_seq_len) if spec.tensorrt is not None else None
                files = tr.write_graph(model, tmp, spec, dc.num_drafts, fixed)
        def check(name: str, what: str, s, path: Path, **kw) -> mf.Validation:
            if built and not whole:  # its truncated build was validated above
                return stages.not_whole(progress, name, tc, dtype, dc if spec.name == "drafter" else None, nbytes)
            return stages.validated(progress, f"{name}.onnx: {what}", s, path, dtype, tmp, name,
                                    weights_in_place=built, **kw)

        validation[spec.name] = check(spec.name, "validating against PyTorch on ONNX Runtime", spec,
                                      tmp / files["portable"])
        tensorrt_io = None
        if spec.tensorrt is not None:
            validation[f"{spec.name}.trt"] = check(f"{spec.name}.trt", "fixed step shapes, validating on ONNX Runtime",
                                                   spec.tensorrt, tmp / files["tensorrt"],
                                                   selector_drafts=dc.num_drafts if spec.has_selector else None)
            trt_io = tr.io_spec(tmp / files["tensorrt"])
            tensorrt_io = mf.GraphIo(inputs=[mf.IoSpec(**d) for d in trt_io["inputs"]],
                                     outputs=[mf.IoSpec(**d) for d in trt_io["outputs"]])
        if quantize is not None and spec.name in quantize.graphs():
            gib = stages.weight_bytes(tc, "float32") / 2**30
            unbounded = (f" (ModelOpt's ONNX quantizer holds the whole fp32 graph, {gib:.2f} GiB, and calibrates it "
                         f"whole: this stage is not memory-bounded)" if isinstance(quantize, qdq.TrtQuant) else
                         f" (ONNX Runtime's quantizer loads the whole fp32 graph, {gib:.2f} GiB: this stage is not "
                         f"memory-bounded; --target-attention gqa, the default, quantizes as it writes)")
            gq = quantize.for_graph(spec.name) if isinstance(quantize, qz.OrtQuant) else quantize
            with progress.step(f"{spec.name}.onnx: {gq.method} weights, deviation from PyTorch{unbounded}"):
                quantizer = stages.qdq_graph if isinstance(quantize, qdq.TrtQuant) else stages.quantize_graph
                fixed_file = files.get("tensorrt") if spec.tensorrt is not None else None
                before = validation.get(spec.name)
                files, quantized[spec.name], validation[spec.name] = quantizer(tmp, spec, files, gq)
                if before is not None and before.skipped:  # the float graph's not-run-whole record stays said
                    validation[f"{spec.name}.float"] = before
            if fixed_file is not None and files.get("tensorrt") != fixed_file:
                # the fixed-shape flavour shared the float weights: a quantized graph (or none) replaces it
                validation.pop(f"{spec.name}.trt", None)
                tensorrt_io = None
                for name in (fixed_file, f"{spec.name}.trt.inputs.json", f"{spec.name}.trt.reference.json"):
                    (tmp / name).unlink(missing_ok=True)
        io = tr.io_spec(tmp / files["portable"])
        kind = "gqa-shared" if spec.name == "target" and target_attention == "gqa" else "prefix"
        graphs[spec.name] = mf.Graph(flavours=mf.Flavours(**files), data=f"{spec.name}.onnx.data",
                                     inputs=[mf.IoSpec(**d) for d in io["inputs"]],
                                     outputs=[mf.IoSpec(**d) for d in io["outputs"]],
                                     seconds=time.perf_counter() - t0, tensorrt_io=tensorrt_io,
                                     signature=stages.graph_signature(spec.name, kind, io, tc.num_layers),
                                     tensorrt_signature=None if tensorrt_io is None else
                                     stages.graph_signature(spec.name, "fixed", tr.io_spec(tmp / files["tensorrt"]), tc.num_layers))
    with progress.step("each weight once: graphs share the bytes they have in common") as step:
        written = [f for g in graphs.values() for f in dataclasses.asdict(g.flavours).values() if f]
        shared = dedupe.share(tmp, written)
        step.outcome = (f"{shared['tensors_shared']} tensors shared, {shared['bytes_before'] / 2**20:.0f} -> "
                        f"{shared['bytes_after'] / 2**20:.0f} MiB of weights")
        for name, g in graphs.items():  # the data files each graph reads now
            files = [f for f in dataclasses.asdict(g.flavours).values() if f]
            g.data = ", ".join(sorted({loc for f in files for loc in dedupe.data_files_of(tmp / f)}))
    selector = None
    if dc.version == 2:
        selector = mf.Selector(op=C.OP_NAME, domain=C.ONNX_DOMAIN, plugin_version=C.PLUGIN_VERSION,
                               plugin_namespace=C.PLUGIN_NAMESPACE, top_k=dc.selector_top_k, rank=dc.selector_rank,
                               output_multiplier=dc.output_multiplier, logit_softcap=dc.logit_softcap)
    why = ("target emits hidden_norm(fc(taps)): one H-wide row per token instead of n_taps*H (see docs/export.md "
           "for the measurement)" if fuse_context else "raw taps")
    return mf.ExportManifest(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), tools=tool_versions(), dtype=dtype,
        max_seq_len=max_seq_len, block_size=dc.block_size, num_drafts=dc.num_drafts, drafter_version=dc.version,
        tap_ids=list(dc.target_layer_ids), mask_token_id=dc.mask_token_id, vocab_size=tc.vocab_size,
        eos_token_ids=list(tc.eos_token_ids),
        context=mf.Context(fused=fuse_context, width=graphs["drafter"].inputs[0].shape[1], why=why),
        kv=mf.Kv(layout=["seq", "layer", "k|v", "kv_head", "head_dim"],
                 rows=mf.KvRows(target=list(target.kv_row_shape()), drafter=list(drafter.kv_row_shape())),
                 dtype=dtype, binding=KV_BINDING if target_attention == "plain" else
                 f"target: {sig.GQA_BINDING} drafter: {KV_BINDING}", target_attention=target_attention),
        selector=selector, target_config=tc.to_dict(), drafter_config=dc.to_dict(), graphs=graphs,
        validation=validation, quantization=quantize.manifest_entry(quantized) if quantize is not None else None)
