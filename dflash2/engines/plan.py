"""What dflash2-build will do, checked before TensorRT is imported: export folder, precision vs the
export dtype, capacity limits, the plugin library, the output folder. No tensorrt, no torch.

Precision: engines are built from a STRONGLY TYPED network, which takes every tensor type from the
ONNX graph (TensorRT then rejects the FP16/BF16 builder flags). So precision is decided at export:
`--precision fp16` needs a `dflash2-export --dtype float16` folder, bf16 a bfloat16 one. We never
let TensorRT pick lower precisions on its own: the selector's fp32 scores and the argmax over fp32
logits are what keep greedy decoding lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash2 import manifest as mf
from dflash2.dtypes import PRECISION_OF_DTYPE, PRECISIONS
from dflash2.engines import profiles as pr
from dflash2.errors import Dflash2Error
from dflash2.folders import check_apart, check_output
from dflash2.native import library as native
from dflash2.native.library import PluginVersionError
from dflash2.ops import contract as C

ENGINE_SUFFIX = ".engine"
MODES = ("build", "print", "adopt")


class PrecisionError(Dflash2Error):
    pass


@dataclass
class EngineJob:
    graph: str
    onnx: Path  # absolute path of the flavour TensorRT parses (*.trt.onnx when the graph has the selector)
    engine: str  # file name inside the engine folder
    profiles: list[pr.Profile]
    inputs: list[mf.IoSpec]
    outputs: list[mf.IoSpec]


@dataclass
class BuildPlan:
    export_dir: Path
    export: mf.ExportManifest
    out: Path
    precision: str
    dtype: str
    max_seq_len: int
    max_prefill: int
    plugin: Path | None  # None: the export has no custom op
    plugin_found: bool = True
    timing_cache: Path | None = None
    workspace_mb: int | None = None
    force: bool = False
    jobs: list[EngineJob] = field(default_factory=list)


def resolve_precision(precision: str | None, export_dtype: str, export_dir: Path) -> str:
    if export_dtype not in PRECISION_OF_DTYPE:
        raise PrecisionError(f"{export_dir / mf.NAME}: dtype: expected one of {list(PRECISION_OF_DTYPE)}, "
                             f"found {export_dtype!r}")
    if precision is None:
        return PRECISION_OF_DTYPE[export_dtype]
    if precision not in PRECISIONS:
        raise PrecisionError(f"--precision: expected one of {list(PRECISIONS)}, found {precision!r}")
    if PRECISIONS[precision] != export_dtype:
        want = PRECISIONS[precision]
        raise PrecisionError(
            f"--precision {precision} does not match the export dtype {export_dtype} ({export_dir}): engines are "
            f"strongly typed and take their types from the ONNX graph, so {precision} needs a {want} export "
            f"(dflash2-export ... --dtype {want}); or build this export with --precision "
            f"{PRECISION_OF_DTYPE[export_dtype]}")
    return precision


def check_quantization(export: mf.ExportManifest, export_dir: Path) -> None:
    """ONNX Runtime's MatMulNBits graphs (dflash2-export --quantize int4|int8) have no TensorRT flavour."""
    q = export.quantization
    if q is not None and q.backend == "onnxruntime":
        raise PrecisionError(f"{export_dir / mf.NAME}: quantization {q.method} is ONNX Runtime's MatMulNBits "
                             f"(weight-only, CPU), which TensorRT cannot build; for TensorRT export with "
                             f"--quantize int4_awq or fp8 (nvidia-modelopt Q/DQ graphs), or build a float export")
    if export.kv is not None and export.kv.target_attention != "plain":
        raise PrecisionError(f"{export_dir / mf.NAME}: kv.target_attention is {export.kv.target_attention!r}: the "
                             f"target graph is ONNX Runtime's fused-op one (GroupQueryAttention), which TensorRT "
                             f"cannot parse, and the export has no TensorRT flavour of it; for TensorRT re-export "
                             f"with --target-attention plain (the default for float exports)")


def check_selector_contract(export: mf.ExportManifest, export_dir: Path) -> None:
    """The export's selector node must name the plugin this checkout builds."""
    sel = export.selector
    if sel is None:
        return
    want = {"op": C.OP_NAME, "plugin_version": C.PLUGIN_VERSION, "plugin_namespace": C.PLUGIN_NAMESPACE}
    bad = [f"{k}: export has {getattr(sel, k)!r}, this dflash2 builds {v!r}" for k, v in want.items()
           if getattr(sel, k) != v]
    if bad:
        raise PluginVersionError(f"{export_dir / mf.NAME}: selector plugin version mismatch ("
                                 + "; ".join(bad) + "); re-export with this dflash2 or build the matching plugin")


def resolve_plugin(export: mf.ExportManifest, plugin: str | Path | None, required: bool) -> tuple[Path | None, bool]:
    """(library path, found). Only exports with the DFlash2Selector node need the plugin library."""
    if export.selector is None:
        return None, True
    if plugin is not None:
        path = Path(plugin).absolute()
        if not path.is_file():
            if required:
                raise native.PluginLibraryError(f"--plugin {path}: no such file; {native.BUILD_HINT}")
            return path, False
    else:
        try:
            path = native.find_library(native.PLUGIN_LIB).absolute()
        except native.PluginLibraryError:
            if required:
                raise
            return native.BUILD_DIR / native.PLUGIN_LIB, False
    if required:
        native.check_abi(path, native.library_abi(path))
    return path, True


def plan_build(export_dir: str | Path, out: str | Path, precision: str | None = None, max_seq_len: int | None = None,
               max_prefill: int | None = None, plugin: str | Path | None = None,
               timing_cache: str | Path | None = None, workspace_mb: int | None = None, force: bool = False,
               mode: str = "build") -> BuildPlan:
    """Every check that needs no TensorRT. mode: "build"; "print" (--print-trtexec: no output, checksum or
    plugin checks); "adopt" (--manifest-only: engines already in `out`, so no output-folder check)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, found {mode!r}")
    export_dir, out = Path(export_dir).absolute(), Path(out).absolute()
    if mode == "build":  # before anything is read: --force must never reach an input
        check_output(out, force, {"EXPORT_DIR": export_dir, "--plugin": plugin, "--timing-cache": timing_cache})
    elif mode == "adopt":  # the engines are in --out already; it still must not be or hold the export
        check_apart(out, {"EXPORT_DIR": export_dir})
    export = mf.load(export_dir, mf.ExportManifest, check_files=mode != "print")
    check_quantization(export, export_dir)
    prec = resolve_precision(precision, export.dtype, export_dir)
    T, P = pr.limits(export, max_seq_len, max_prefill)
    check_selector_contract(export, export_dir)
    lib, found = resolve_plugin(export, plugin, required=mode != "print")
    if workspace_mb is not None and workspace_mb <= 0:
        raise Dflash2Error(f"--workspace: expected a positive number of MiB, found {workspace_mb}")
    plan = BuildPlan(export_dir, export, out, prec, export.dtype, T, P, lib, found,
                     Path(timing_cache).absolute() if timing_cache else None, workspace_mb, force)
    profiles = pr.plan_profiles(export, T, P)
    for graph, g in export.graphs.items():
        flavour = g.flavours.tensorrt or g.flavours.portable
        io = g.tensorrt  # the TensorRT flavour's own inputs (fixed-shape target / drafter)
        plan.jobs.append(EngineJob(graph, export_dir / flavour, graph + ENGINE_SUFFIX, profiles[graph],
                                   io.inputs, io.outputs))
    return plan
