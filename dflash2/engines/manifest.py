"""The engine folder's manifest (format `dflash2-engines`, the typed `dflash2.manifest.EngineManifest`):
what the runtime needs to run the engines without reopening the export folder, plus where they came from.

    engines      graph -> engine file, the ONNX file it was parsed from, io names/dtypes/shapes,
                 optimization profiles (the session's shapes must fall inside one of them); the
                 runtime loads target and drafter (the selector runs inside drafter.engine), and
                 dflash2-compare also selector.engine (the plugin alone vs the PyTorch op)
    export_dir   absolute path of the export (ONNX Runtime on an engine folder runs that export)
    ModelFacts   block_size, num_drafts, max_seq_len (possibly reduced), dtype, kv rows, context
                 width, vocab_size, eos_token_ids, drafter_version, selector ... copied from the export
    plugin       library path + sha256 + op name/version the engines need loaded before deserializing
    files        sha256 + bytes of every file in the folder

Read with `dflash2.manifest.load(folder, EngineManifest)`; written with `dflash2.manifest.write`.
The folder is written into a temporary sibling and renamed into place, like the export folder.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from dflash2 import manifest as mf
from dflash2.native.library import ABI_VERSION
from dflash2.ops import contract as C

COPIED = tuple(f.name for f in dataclasses.fields(mf.ModelFacts) if f.name != "max_seq_len")


def plugin_entry(path: Path | None) -> mf.Plugin | None:
    if path is None:
        return None
    return mf.Plugin(path=str(path), sha256=mf.sha256(path), op=C.OP_NAME, plugin_version=C.PLUGIN_VERSION,
                     plugin_namespace=C.PLUGIN_NAMESPACE, contract_version=C.CONTRACT_VERSION,
                     abi_version=ABI_VERSION)


def build_manifest(plan, engines: dict[str, dict], tensorrt_version: str) -> mf.EngineManifest:
    """plan: a dflash2.engines.plan.BuildPlan; engines: graph -> {"seconds": ...} for every built job."""
    e = plan.export
    return mf.EngineManifest(
        contract_version=e.contract_version, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        export_dir=str(plan.export_dir), export_manifest_sha256=mf.sha256(plan.export_dir / mf.NAME),
        tensorrt_version=tensorrt_version, precision=plan.precision, max_seq_len=plan.max_seq_len,
        export_max_seq_len=e.max_seq_len, max_prefill=plan.max_prefill,
        **{k: getattr(e, k) for k in COPIED},
        plugin=plugin_entry(plan.plugin),
        build=mf.BuildInfo(workspace_mb=plan.workspace_mb,
                           timing_cache=str(plan.timing_cache) if plan.timing_cache else None),
        engines={job.graph: mf.EngineEntry(file=job.engine, onnx=job.onnx.name, inputs=job.inputs,
                                           outputs=job.outputs,
                                           profiles=[mf.ProfileRecord(**p.to_dict()) for p in job.profiles],
                                           seconds=engines.get(job.graph, {}).get("seconds"),
                                           signature=e.signature(job.graph, tensorrt=True))
                 for job in plan.jobs},
        tokenizer=e.tokenizer)
