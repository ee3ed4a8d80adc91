"""export(): a DFlash / DFlash2 checkpoint and its target -> a self-contained, validated folder.

Written into a temporary sibling folder and renamed into place only when every graph passed
validation, so a failure leaves nothing behind and an existing folder is replaced only with --force.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import torch
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from dflash2 import __version__, draft_vocab, dtypes
from dflash2.checkpoint import Weights
from dflash2 import manifest as mf
from dflash2.config import (check_pair, check_tokenizer_files, check_tokenizer_vocab, load_drafter_config,
                            load_target_config, tokenizer_id_count)
from dflash2.errors import Dflash2Error, ValidationError
from dflash2.export import dedupe, deviation, fused_drafter, gqa, plain, qdq
from dflash2.export import signature as sig
from dflash2.export import weights as W
from dflash2.export import quantize as qz
from dflash2.export import trace as tr
from dflash2.export.graphs import graph_specs
from dflash2.export.validate import raise_if_failed, validate_graph
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
from dflash2.reference.streamed import StreamedTarget, truncated

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
           target_attention: str = "auto") -> mf.ExportManifest:
    """Returns the manifest written. Raises CheckpointError / TensorSetError / ValidationError / OutputError.
    full_vocab: ignore the drafter's draft_vocab.json (draft over the whole vocabulary).
    beyond_max_positions: allow max_seq_len past the target's max_position_embeddings.
    quantize: weight-only int4 / int8 target (and drafter) graphs for ONNX Runtime (dflash2.export.quantize), or
    a Q/DQ TensorRT flavour of the target (dflash2.export.qdq).
    target_attention: "plain" (ONNX ops, with a TensorRT flavour) or "gqa" (ONNX Runtime's fused ops,
    dflash2.export.gqa: the CPU path; no TensorRT flavour of the target); "auto": gqa for the ONNX Runtime
    quantizations (which have no TensorRT flavour anyway: 1.5x faster int4 decode, docs/quantization.md),
    plain otherwise."""
    if target_attention not in ("auto", *ATTENTION):
        raise OutputError(f"--target-attention: expected one of {['auto', *ATTENTION]}, found {target_attention!r}")
    if quantize is not None and dtype != "float32":
        raise OutputError(f"--quantize {quantize.method}: expected --dtype float32 (weights are quantized from "
                          f"fp32; activations stay fp32), found {dtype}")
    if target_attention == "gqa" and (dtype != "float32" or isinstance(quantize, qdq.TrtQuant)):
        raise OutputError(f"--target-attention gqa: expected --dtype float32 and no TensorRT quantization (it is "
                          f"ONNX Runtime's CPU graph), found --dtype {dtype}"
                          + (f", --quantize {quantize.method}" if quantize is not None else ""))
    out = Path(out_dir).absolute()
    dc, tc = check_inputs(drafter_dir, target_dir, out, dtype, max_seq_len, force, beyond_max_positions)
    max_seq_len = default_max_seq_len(tc) if max_seq_len is None else max_seq_len
    target_attention = _attention(target_attention, quantize, tc, dc, max_seq_len)
    if isinstance(quantize, qz.OrtQuant) and quantize.native and target_attention != "gqa":
        raise OutputError("--quant-from-gguf: expected the fused-op target graph (--target-attention gqa, the default "
                          f"with --quantize int4|int8), found --target-attention {target_attention}"
                          + (f" ({gqa.unsupported(tc, dc, max_seq_len)})" if gqa.unsupported(tc, dc, max_seq_len) else ""))
    if isinstance(quantize, qdq.TrtQuant) and not quantize.prompts:
        quantize = dataclasses.replace(quantize, prompts=qdq.shipped_prompt_ids(target_dir))
    specs_count = 3 if dc.version == 2 else 2
    steps = 1 + 2 * specs_count + 2 + 1 + 1  # + the two fixed-shape TensorRT flavours' validations, sharing
    # gqa: the target + its truncated build, validated (+2), neither it nor the drafter has a TensorRT flavour (-2),
    # and both are quantized as they are built (no step of their own)
    steps += len(quantize.graphs()) if quantize and target_attention != "gqa" else 0
    progress = Progress(steps, quiet)
    with progress.step("loading and checking the checkpoints"):
        if target_attention == "gqa" or dtype in plain.DTYPES:  # every graph built from templates: the
            # references only validate them, reading one layer at a time
            target, drafter = load_streamed_pair(drafter_dir, target_dir, use_draft_vocab=not full_vocab,
                                                 dtype=dtypes.torch_dtype(dtype))
        else:  # bfloat16: traced from the loaded modules
            target, drafter = load_pair(drafter_dir, target_dir, dtypes.torch_dtype(dtype),
                                        use_draft_vocab=not full_vocab)
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
        replace_folder(tmp, out, force, what="the export")
    mf.remember_hashes(out, manifest)
    return manifest


DEFAULT_MAX_SEQ_LEN = 2048


def default_max_seq_len(tc) -> int:
    """--max-seq-len when not given: 2048, or fewer for a target trained on shorter sequences."""
    return min(DEFAULT_MAX_SEQ_LEN, tc.max_position_embeddings)


def check_inputs(drafter_dir: str | Path, target_dir: str | Path, out: Path, dtype: str, max_seq_len: int | None,
                 force: bool, beyond_max_positions: bool):
    """The checks before any weight is read: the output folder (before anything is read at all), both
    configs and their agreement, the tokenizer, the capacity (None: default_max_seq_len). Returns
    (drafter config, target config)."""
    if dtype not in dtypes.GRAPH_DTYPES:
        raise OutputError(f"--dtype: expected one of {list(dtypes.GRAPH_DTYPES)}, found {dtype!r}")
    check_output(out, force, {"--model": drafter_dir, "--target": target_dir})
    dc, tc = load_drafter_config(drafter_dir), load_target_config(target_dir)
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
              beyond_max_positions: bool = False):
    """Everything export() checks before it writes: check_inputs, then the weights (names, shapes,
    dtypes, finite values) loaded into the reference modules. Returns (target, drafter)."""
    check_inputs(drafter_dir, target_dir, Path(out).absolute(), dtype, max_seq_len, force, beyond_max_positions)
    return load_pair(drafter_dir, target_dir, dtypes.torch_dtype(dtype), use_draft_vocab=not full_vocab)


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
                spec, files, checked, q_report = _gqa_target(tmp, spec, target, drafter, tc, dc, sources, fuse_context,
                                                             max_seq_len, quantize, progress, dtype)
            else:
                files, checked, q_report = _fused_drafter(tmp, spec, drafter, tc, dc, sources, fuse_context,
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
                                         signature=_signature(spec.name, kind, io, tc.num_layers))
            continue
        elif built:
            with progress.step(f"{spec.name}.onnx + {spec.name}.trt.onnx: standard ONNX ops from the layer "
                               f"templates, {dtype}, streamed from safetensors") as step:
                with W.DataFile(tmp / f"{spec.name}.onnx.data") as data:
                    if spec.name == "target":
                        model, fixed = plain.build(tc, dc, Weights(sources[1]), Weights(sources[0]), fuse_context,
                                                   dtype, data, progress=step.layer)
                    else:
                        ids = None if drafter.draft_ids is None else drafter.draft_ids.numpy()
                        model, fixed = fused_drafter.build_plain(dc, tc, Weights(sources[0]), Weights(sources[1]),
                                                                 fuse_context, dtype, ids, data, progress=step.layer)
                files = tr.write_graph(model, tmp, spec, dc.num_drafts, fixed)
                del model, fixed
        else:
            with progress.step(f"{spec.name}.onnx: tracing with torch.onnx (dynamo)"):
                model = tr.trace(spec, max_seq_len)
                fixed = tr.trace(spec.tensorrt, max_seq_len) if spec.tensorrt is not None else None
                files = tr.write_graph(model, tmp, spec, dc.num_drafts, fixed)
        validation[spec.name] = _validate(progress, f"{spec.name}.onnx: validating against PyTorch on ONNX Runtime",
                                          spec, tmp / files["portable"], dtype, tmp, spec.name, weights_in_place=built)
        tensorrt_io = None
        if spec.tensorrt is not None:
            validation[f"{spec.name}.trt"] = _validate(
                progress, f"{spec.name}.trt.onnx: fixed step shapes, validating on ONNX Runtime", spec.tensorrt,
                tmp / files["tensorrt"], dtype, tmp, f"{spec.name}.trt",
                selector_drafts=dc.num_drafts if spec.has_selector else None, weights_in_place=built)
            trt_io = tr.io_spec(tmp / files["tensorrt"])
            tensorrt_io = mf.GraphIo(inputs=[mf.IoSpec(**d) for d in trt_io["inputs"]],
                                     outputs=[mf.IoSpec(**d) for d in trt_io["outputs"]])
        if quantize is not None and spec.name in quantize.graphs():
            with progress.step(f"{spec.name}.onnx: {quantize.method} weights, deviation from PyTorch"):
                quantizer = _qdq_graph if isinstance(quantize, qdq.TrtQuant) else _quantize_graph
                fixed_file = files.get("tensorrt") if spec.tensorrt is not None else None
                files, quantized[spec.name], validation[spec.name] = quantizer(tmp, spec, files, quantize)
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
                                     signature=_signature(spec.name, kind, io, tc.num_layers),
                                     tensorrt_signature=None if tensorrt_io is None else
                                     _signature(spec.name, "fixed", tr.io_spec(tmp / files["tensorrt"]), tc.num_layers))
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


def _validate(progress: Progress, what: str, spec, path: Path, dtype: str, tmp: Path, name: str,
              selector_drafts: int | None = None, weights_in_place: bool = False) -> mf.Validation:
    """One graph flavour against PyTorch. A failure stops the export here (no minutes spent on the graphs
    after it); a graph no available provider can run is recorded ok: false with why, and said.
    weights_in_place: the streamed stages' bounded-memory session (dflash2.onnxrt.open_session)."""
    with progress.step(what) as step:
        f, report = validate_graph(spec, path, dtype, save_dir=tmp, name=name, selector_drafts=selector_drafts,
                                   weights_in_place=weights_in_place)
        skipped = report.pop("skipped", None)
        if skipped:
            step.outcome = f"NOT validated ({skipped})"
    if f:
        raise ValidationError(f)
    return mf.Validation(ok=skipped is None, failures=f, skipped=skipped, steps=report)


def _signature(graph: str, kind: str, io: dict, num_layers: int) -> mf.Signature:
    ins, outs = [d["name"] for d in io["inputs"]], [d["name"] for d in io["outputs"]]
    return sig.signature(graph, kind, ins, outs, num_layers, selector_io=(ins, outs))


def _qdq_graph(tmp: Path, spec, files: dict, q: qdq.TrtQuant) -> tuple[dict, mf.QuantizedGraph, mf.Validation]:
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


def truncated_depth(tc) -> int:
    """How many layers the truncated end-to-end build keeps (TRUNCATED_LAYERS, TRUNCATED_LAYER_BYTES)."""
    from dflash2.checkpoint import target_tensor_shapes

    one = tc if tc.num_layers == 1 else dataclasses.replace(tc, num_layers=1)
    per_layer = 4 * sum(int(np.prod(v)) for k, v in target_tensor_shapes(one).items() if ".layers." in k)
    return max(2, min(TRUNCATED_LAYERS, TRUNCATED_LAYER_BYTES // per_layer))


def _gqa_target(tmp: Path, plain_spec, target, drafter, tc, dc, sources, fuse_context: bool, max_seq_len: int,
                quantize, progress: Progress, dtype: str):
    """The target from ONNX Runtime's fused-op templates (dflash2.export.gqa), weights streamed from the
    checkpoint, checked at bounded memory:
    1. a truncated_depth()-layer build of the same templates with the real embedding, head and context
       projection (the taps spread over its layers), validated against the layer-streamed PyTorch reference
       by the one comparison rule;
    2. the whole graph, quantized as it is written when --quantize int4 / int8 asks: its deviation from
       the reference is measured; else fp32 and validated like every graph.
    Returns (spec, files, validations, quantization report or None)."""
    tw, dw = Weights(sources[1]), Weights(sources[0])
    checked = {}
    short_tc, short_dc = truncated(tc, dc, truncated_depth(tc))
    short = StreamedTarget(short_tc, short_dc.target_layer_ids, tw, like=target)
    short_spec = gqa.gqa_spec(graph_specs(short, drafter, fuse_context)[0])
    name = "target.truncated"
    with progress.step(f"{name}.onnx: the templates end to end ({short_tc.num_layers} layers, the real embedding "
                       f"and head), ONNX Runtime's fused ops") as step:
        with W.DataFile(tmp / f"{name}.onnx.data") as data:
            model = gqa.build(short_tc, short_dc, tw, dw, fuse_context, max_seq_len, data, progress=step.layer)
        onnx.save_model(model, str(tmp / f"{name}.onnx"))
        del model
    checked[name] = _validate(progress, f"{name}.onnx: validating against PyTorch on ONNX Runtime", short_spec,
                              tmp / f"{name}.onnx", dtype, tmp, name, weights_in_place=True)
    for f in (f"{name}.onnx", f"{name}.onnx.data", f"{name}.inputs.json", f"{name}.reference.json"):
        (tmp / f).unlink()  # checked; a failure above keeps them (keep_failed)
    spec = gqa.gqa_spec(plain_spec)
    q = quantize if isinstance(quantize, qz.OrtQuant) else None
    what = f"{q.method} weights quantized as they are written" if q else "fp32"
    with progress.step(f"target.onnx: ONNX Runtime's fused ops (GroupQueryAttention), streamed from safetensors, "
                       f"{what}") as step:
        native = None
        if q is not None and q.native:  # the checkpoint's own quantized blocks, each checked to dequantize to it
            from dflash2.gguf_blocks import GgufBlocks

            native = GgufBlocks(q.native, tc.num_heads, tc.num_kv_heads)
        with W.DataFile(tmp / "target.onnx.data") as data:
            model = gqa.build(tc, dc, tw, dw, fuse_context, max_seq_len, data, progress=step.layer, quant=q,
                              native=native)
        files = tr.write_graph(model, tmp, spec, dc.num_drafts, check=False)
    if q is None:
        checked["target"] = _validate(progress, "target.onnx: validating against PyTorch on ONNX Runtime", spec,
                                      tmp / files["portable"], dtype, tmp, "target", weights_in_place=True)
        return spec, files, checked, None
    with progress.step(f"target.onnx: {q.method} deviation from PyTorch (layer-streamed reference)"):
        failures, steps, dev = deviation.measure(spec, tmp / files["portable"], save_dir=tmp)
    dev.judged = f"deviation from fp32 ({q.method} weights)"
    checked["target"] = mf.Validation(ok=not failures, failures=failures, steps=steps, deviation=dev)
    if failures:
        raise ValidationError(failures)
    report = _nbits_report(model, q, tmp / "target.onnx.data", tc)
    if native is not None:  # ggml type -> MatMulNBits nodes that carry its blocks as they are
        if not native.used:
            raise OutputError(f"--quant-from-gguf {q.native}: none of its tensors went in as blocks (types that map: "
                              f"Q4_0, Q4_1, Q8_0; this file has {native.types()})")
        report.native = dict(sorted(Counter(native.used.values()).items()))
    return spec, files, checked, report


def _fused_drafter(tmp: Path, spec, drafter, tc, dc, sources, fuse_context: bool, max_seq_len: int, quantize,
                   progress: Progress, dtype: str):
    """The drafter from the same templates as the fused target (dflash2.export.fused_drafter), weights streamed
    from both checkpoints; fp32: validated like every graph; with --quantize (and the drafter not excluded)
    written as MatMulNBits and its deviation measured. Returns (files, validations, quantization report)."""
    q = quantize if isinstance(quantize, qz.OrtQuant) and quantize.drafter else None
    draft_ids = None if drafter.draft_ids is None else drafter.draft_ids.numpy()
    what = f"{q.method} weights quantized as they are written" if q else "fp32"
    with progress.step(f"drafter.onnx: ONNX Runtime's fused ops from the layer templates, {what}") as step:
        with W.DataFile(tmp / "drafter.onnx.data") as data:
            model = fused_drafter.build(dc, tc, Weights(sources[0]), Weights(sources[1]), fuse_context, max_seq_len,
                                        draft_ids, data, q, progress=step.layer)
        files = tr.write_graph(model, tmp, spec, dc.num_drafts, check=False, tensorrt=False)
    if q is None:
        return files, {"drafter": _validate(progress, "drafter.onnx: validating against PyTorch on ONNX Runtime", spec,
                                            tmp / files["portable"], dtype, tmp, "drafter",
                                            weights_in_place=True)}, None
    with progress.step(f"drafter.onnx: {q.method} deviation from PyTorch"):
        failures, steps, dev = deviation.measure(spec, tmp / files["portable"], save_dir=tmp)
    dev.judged = f"deviation from fp32 ({q.method} weights)"
    if failures:
        raise ValidationError(failures)
    heads = [n.name for n in model.graph.node if n.name.startswith("draft_head") and n.op_type != "Transpose"]
    report = mf.QuantizedGraph(weight_matmuls=_weight_matmuls(model),
                               quantized=sum(n.op_type == "MatMulNBits" for n in model.graph.node),
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
    from dflash2.checkpoint import target_tensor_shapes

    return 4 * sum(int(np.prod(s)) for s in target_tensor_shapes(tc).values())


def _weight_matmuls(model) -> int:
    """MatMulNBits, and MatMuls whose second input is an initializer or the Transpose of one (the LM head kept
    fp32 reads the embedding through a Transpose: no second copy on disk)."""
    inits = {t.name for t in model.graph.initializer}
    weights = inits | {n.output[0] for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in inits}
    return sum(n.op_type == "MatMulNBits" or (n.op_type == "MatMul" and n.input[1] in weights)
               for n in model.graph.node)


def _quantize_graph(tmp: Path, spec, files: dict, q: qz.OrtQuant) -> tuple[dict, mf.QuantizedGraph, mf.Validation]:
    """Quantize the validated fp32 graph in place; the TensorRT flavour (which shared its data file) goes:
    TensorRT cannot run MatMulNBits (its quantized path is modelopt's Q/DQ graphs, docs/quantization.md)."""
    report = qz.quantize_file(tmp / files["portable"], q)
    for flavour, name in list(files.items()):
        if flavour != "portable":
            (tmp / name).unlink()
    failures, steps, dev = deviation.measure(spec, tmp / files["portable"])
    dev.judged = f"deviation from fp32 ({q.method} weights)"
    return ({"portable": files["portable"]}, report,
            mf.Validation(ok=not failures, failures=failures, steps=steps, deviation=dev))
