"""The engine folder's manifest.json (format `dflash2-engines`): what the runtime needs to run the
engines without reopening the export folder, plus where they came from.

    engines      graph -> engine file, the ONNX file it was parsed from, io names/dtypes/shapes,
                 optimization profiles (the session's shapes must fall inside one of them)
    export_dir   absolute path of the export (ONNX Runtime on an engine folder runs that export)
    copied       block_size, num_drafts, max_seq_len (possibly reduced), dtype, kv rows, context
                 width, vocab_size, eos_token_ids, drafter_version, selector ... from the export
    plugin       library path + sha256 + op name/version the engines need loaded before deserializing
    files        sha256 + bytes of every file in the folder (dflash2.manifest.file_table)

The folder is written into a temporary sibling and renamed into place, like the export folder.
"""

from __future__ import annotations

import time
from pathlib import Path

from dflash2 import manifest as mf
from dflash2.ops import contract as C

COPIED = ("block_size", "num_drafts", "drafter_version", "vocab_size", "eos_token_ids", "mask_token_id",
          "tap_ids", "kv", "context", "selector")
REQUIRED = ("export_dir", "engines", "max_seq_len", "max_prefill", "dtype", "precision", "plugin",
            "tensorrt_version", "files", *COPIED)
ENGINE_FIELDS = ("file", "onnx", "inputs", "outputs", "profiles")


def plugin_entry(path: Path | None) -> dict | None:
    if path is None:
        return None
    from dflash2.native.library import ABI_VERSION

    return {"path": str(path), "sha256": mf.sha256(path), "op": C.OP_NAME, "plugin_version": C.PLUGIN_VERSION,
            "plugin_namespace": C.PLUGIN_NAMESPACE, "contract_version": C.CONTRACT_VERSION, "abi_version": ABI_VERSION}


def build_manifest(plan, engines: dict[str, dict], tensorrt_version: str) -> dict:
    """plan: a dflash2.engines.plan.BuildPlan; engines: graph -> {"seconds": ...} for every built job."""
    e = plan.export
    missing = [k for k in COPIED if k not in e]
    if missing:
        raise mf.ManifestError(f"{plan.export_dir / mf.NAME}: expected fields {missing} (export too old?), found none")
    return {
        "format": mf.ENGINE_FORMAT, "format_version": mf.FORMAT_VERSION,
        "contract_version": e.get("contract_version"), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "export_dir": str(plan.export_dir), "export_manifest_sha256": mf.sha256(plan.export_dir / mf.NAME),
        "tensorrt_version": tensorrt_version, "precision": plan.precision, "dtype": plan.dtype,
        "max_seq_len": plan.max_seq_len, "export_max_seq_len": e["max_seq_len"], "max_prefill": plan.max_prefill,
        **{k: e[k] for k in COPIED},
        "draft_vocab": e.get("draft_vocab"),  # optional: exports before it existed have none
        "plugin": plugin_entry(plan.plugin),
        "build": {"workspace_mb": plan.workspace_mb,
                  "timing_cache": str(plan.timing_cache) if plan.timing_cache else None},
        "engines": {job.graph: {"file": job.engine, "onnx": job.onnx.name, "inputs": job.inputs,
                                "outputs": job.outputs, "profiles": [p.to_dict() for p in job.profiles],
                                **engines.get(job.graph, {})}
                    for job in plan.jobs},
        "tokenizer": e.get("tokenizer", {"files": []}),
    }


def read(folder: str | Path) -> dict:
    """Load an engine folder's manifest and check the fields the runtime and compare rely on."""
    folder = Path(folder)
    m = mf.load(folder, (mf.ENGINE_FORMAT,))
    problems = [f"{k}: missing" for k in REQUIRED if k not in m]
    for graph, entry in m.get("engines", {}).items():
        problems += [f"engines.{graph}.{k}: missing" for k in ENGINE_FIELDS if k not in entry]
    for graph in ("target", "drafter"):
        if graph not in m.get("engines", {}):
            problems.append(f"engines.{graph}: missing (the runtime needs both target and drafter engines)")
    if problems:
        raise mf.ManifestError(f"{folder / mf.NAME}: not a complete engine manifest:\n  " + "\n  ".join(problems))
    return m
