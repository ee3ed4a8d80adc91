"""export(): a DFlash / DFlash2 checkpoint and its target -> a self-contained, validated folder.

Written into a temporary sibling folder and renamed into place only when every graph passed
validation, so a failure leaves nothing behind and an existing folder is replaced only with --force.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from dflash2 import __version__, draft_vocab, dtypes
from dflash2 import manifest as mf
from dflash2.errors import ValidationError
from dflash2.export import routes, stages
from dflash2.export.bf16_emulation import emulated_export
from dflash2.export.plan import (DEFAULT_MAX_SEQ_LEN, ExportPlan, QuantFlags, check_inputs,  # noqa: F401 - callers
                                 default_max_seq_len, plan_export)  # import these from here
from dflash2.export.quantize import Quantization
from dflash2.export.validate import EMULATED, raise_if_failed
from dflash2.folders import OutputError, copy_present, keep_failed, replace_folder, temp_folder  # noqa: F401
from dflash2.progress import Progress, release_freed
from dflash2.reference.load import load_pair, load_streamed_pair

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


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
           quantize: Quantization | QuantFlags | None = None,
           target_attention: str = "auto", draft_block: int | None = None,
           window_kv: bool = True) -> mf.ExportManifest:
    """Returns the manifest written. Raises CheckpointError / TensorSetError / ValidationError / OutputError.
    Resolves the plan (dflash2.export.plan.plan_export: the checks dflash2-export makes, with its messages),
    then export_plan.
    full_vocab: ignore the drafter's draft_vocab.json (draft over the whole vocabulary).
    beyond_max_positions: allow max_seq_len past the target's max_position_embeddings.
    quantize: weight-only int4 / int8 target (and drafter) graphs for ONNX Runtime (dflash2.export.quantize), or
    a Q/DQ TensorRT flavour of the target (dflash2.export.qdq); or dflash2-export's flags (plan.QuantFlags).
    target_attention: "plain" (ONNX ops, with a TensorRT flavour) or "gqa" (ONNX Runtime's fused ops,
    dflash2.export.gqa: the CPU path; no TensorRT flavour of the target); "auto": gqa for the ONNX Runtime
    quantizations (which have no TensorRT flavour anyway: 1.5x faster int4 decode, docs/quantization.md),
    plain otherwise.
    draft_block: draft this many rows a round (2..the drafter's training block size; None: that size;
    docs/export.md).
    window_kv: a target with sliding-window and full-attention layers (Muse-Glimmer, gpt-oss) gets its sliding
    layers' K|V in a buffer bounded by the window (manifest.WindowSignature; docs/families/muse_glimmer.md); False:
    every layer on the one max_seq_len-row KV binding."""
    return export_plan(plan_export(drafter_dir, target_dir, out_dir, dtype, max_seq_len, force, fuse_context, quiet,
                                   full_vocab, beyond_max_positions, quantize, target_attention, draft_block,
                                   window_kv))


def export_plan(plan: ExportPlan) -> mf.ExportManifest:
    """The export a resolved plan describes (plan_export checked it); returns the manifest written."""
    progress = Progress(plan.steps, plan.quiet, release=True)  # each step starts from what is held, not the last peak
    drafter_dir, target_dir, out = plan.drafter_dir, plan.target_dir, plan.out
    with progress.step("loading and checking the checkpoints"):
        # every weight-carrying graph is built from templates: the references only validate them, reading one
        # layer at a time
        target, drafter = load_streamed_pair(drafter_dir, target_dir, use_draft_vocab=not plan.full_vocab,
                                             dtype=dtypes.torch_dtype(plan.dtype), block_size=plan.draft_block)
        from dflash2.export.filebacked import file_backed

        # the selector's vocabulary-sized codebooks paged in as read, not held through the target's stages
        file_backed(drafter, Path(out).parent if Path(out).parent.is_dir() else None)
    with temp_folder(out) as tmp:  # removed however the block is left (error, Ctrl-C, SIGTERM)
        try:
            manifest = routes.write_all(routes.Run(plan, tmp, target, drafter, progress), tool_versions())
            raise_if_failed([f for v in manifest.validation.values() for f in v.failures])
        except ValidationError as e:
            raise ValidationError(e.failures, keep_failed(tmp, out, e.failures)) from None
        manifest.sources = mf.Sources(drafter=str(Path(drafter_dir).absolute()), target=str(Path(target_dir).absolute()))
        manifest.draft_vocab = _draft_vocab_entry(drafter, drafter_dir)
        with progress.step("tokenizer, manifest"):
            manifest.tokenizer = mf.Tokenizer(copy_present(Path(target_dir), list(TOKENIZER_FILES), tmp))
            mf.write(tmp, manifest)
        del target, drafter  # the references: not needed past here, and the selector's file-backed codebooks
        release_freed()  # (paged in by its stages) unmapped before the row check's sessions open
        manifest.validation[ROWS] = rows = _row_invariance(tmp, manifest, progress)
        mf.reseal(tmp, manifest)  # the record joins the manifest; no file but manifest.json changed
        if rows.failures:  # kept for inspection, not runnable: its manifest under another name
            (tmp / mf.NAME).rename(tmp / "manifest.rows-failed.json")
            raise ValidationError(rows.failures, keep_failed(tmp, out, rows.failures))
        replace_folder(tmp, out, plan.force, what="the export")
    mf.remember_hashes(out, manifest)
    return manifest


ROWS = mf.ROW_CHECK  # the manifest's validation record of the row-invariance check


def _row_invariance(tmp: Path, manifest: mf.ExportManifest, progress: Progress) -> mf.Validation:
    """The written export run as generation runs it (dflash2.runtime.invariance): every k-row verify row
    bitwise equal to the 1-row decode at the same position, or the export fails (not lossless)."""
    g = manifest.graphs["target"]
    data = sum((tmp / f).stat().st_size for f in g.data.split(", ") if f and (tmp / f).is_file())
    with progress.step("target: k-row verify against 1-row decode steps, bitwise (what losslessness rests "
                       "on), on ONNX Runtime as generation runs it") as step:
        why, bf16 = None, manifest.dtype == "bfloat16"
        if stages.held_bytes(data, manifest.dtype) > stages.WHOLE_GRAPH_BYTES:
            why = (f"the target graph's {data / 2**30:.2f} GiB of weights are past the "
                   f"{stages.WHOLE_GRAPH_BYTES / 2**30:.0f} GiB a bounded-memory check runs whole")
        if why is None:
            from dflash2.runtime.api import Runtime  # the runtime's own session: the binding generation uses
            from dflash2.runtime.invariance import FIELD, PROMPT_TOKENS, continuation_for, validation
            from dflash2.runtime.window import window_rows

            q = manifest.quantization
            hint = (f"ONNX Runtime's {q.method} kernel at block {q.block_size}, accuracy level {q.accuracy_level} "
                    f"is one that is not; on AVX-512 VNNI CPUs int4 block 32 and int8 are invariant, blocks 64 / "
                    f"128 are not (docs/quantization.md)" if q is not None and q.backend == "onnxruntime" else
                    f"{manifest.dtype} graphs are invariant on the CPUs measured (docs/export.md): please report this "
                    f"CPU" + (" (the bf16 graph's emulation: fp32 kernels, each bf16 value rounded after its node)"
                              if bf16 else ""))
            window = manifest.signature("target").window  # a windowed target: a run through compactions
            cap = window_rows(window, manifest.block_size)[1] if window is not None else None
            small = min(manifest.max_seq_len, PROMPT_TOKENS + continuation_for(cap) + manifest.block_size + 2)
            # bf16: ONNX Runtime's CPU provider has no bf16 kernels; the graphs' emulating copies run instead (every
            # bf16 value rounded after its node, dflash2.export.bf16_emulation), the loop's bf16 buffers as ever;
            # untimed (a CPU emulation's costs are no prior for the GPU that runs the export)
            portable = manifest.graphs["target"].flavours.portable
            files = {"target": portable}  # the check runs the target only (lean: the drafter is never opened)
            try:  # buffers for the check's own length, not the export's max_seq_len; lean: no drafter session
                # (the check never drafts) and no CPU arena: the int4 export's peak at Qwen3.5-0.8B's shape
                with emulated_export(tmp, files) if bf16 else nullcontext(None) as emulated:
                    rt = Runtime(tmp, verify=False, max_seq_len=small, lean=True, emulated=emulated)
                    what = f"{portable} (bf16 emulated)" if bf16 else rt.graph_files.get("target", "target.onnx")
                    v = validation(rt.session, f"{what} ({FIELD})", hint, timed=not bf16)
                    del rt
            except Exception as e:  # noqa: BLE001 - any failure to run is reported, the export is kept
                why = f"the check could not run ({type(e).__name__}: {e})"
        if why is not None:
            step.outcome = f"NOT checked: {why}; dflash2-run OUT --check-rows checks it where it deploys"
            return mf.Validation(ok=False, failures=[], skipped=f"{why}; dflash2-run OUT --check-rows checks it")
        if v.skipped:
            step.outcome = f"NOT checked: {v.skipped}"
            return v
        s = v.steps
        if bf16:
            s["emulated"] = EMULATED
        step.outcome = (f"{s['rows']} rows of k = 2..{s['k_max']}"
                        + (" (bf16 emulated on the CPU provider)" if bf16 else "") + ": "
                        + ("all bitwise equal" if v.ok else f"{s['differing']} differ (max {s['max_abs']:.3g})"))
    return v


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
