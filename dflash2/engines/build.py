"""dflash2-build's engine: a checked `BuildPlan` -> TensorRT 10 engines + manifest, written atomically.

Per graph: parse the TensorRT flavour (*.trt.onnx: a bare DFlash2Selector node the plugin
registry resolves) FROM FILE so its external data resolves next to it, into a STRONGLY TYPED
network; add the plan's optimization profiles; build with a shared timing cache and an optional
workspace limit; serialize to <graph>.engine. The plugin library is loaded into TensorRT's
registry before parsing. `plan.py` explains why precision comes from the export dtype.
"""

from __future__ import annotations

import time
from pathlib import Path

from dflash2 import manifest as mf
from dflash2.engines import manifest as em
from dflash2.engines.plan import PRECISIONS, BuildPlan, EngineJob, PrecisionError
from dflash2.errors import Dflash2Error
from dflash2.folders import copy_present, replace_folder, temp_folder, write_atomic
from dflash2.progress import Progress
from dflash2.native.tensorrt import load_plugin, make_logger, require_tensorrt

# Oldest GPU generation with native support of each precision (sm_53: fp16 arithmetic; sm_80:
# Ampere, Orin included, for bf16). fp32 runs everywhere.
MIN_SM = {"fp16": (5, 3), "bf16": (8, 0)}


class BuildError(Dflash2Error):
    pass


class OnnxParseError(BuildError):
    def __init__(self, path: Path, errors: list[str]):
        self.errors = errors
        super().__init__(f"{path}: TensorRT's ONNX parser reported {len(errors)} error(s):\n  " + "\n  ".join(errors))


def check_device_precision(precision: str) -> None:
    """Reject a precision the GPU has no support for before a long build fails obscurely."""
    if precision not in MIN_SM:
        return
    from dflash2.native.cudart import CudaMissingError, compute_capability

    try:
        cc, name = compute_capability()
    except CudaMissingError:  # no cuda-python to ask: TensorRT itself reports an unsupported type
        return
    if cc < MIN_SM[precision]:
        need = "".join(map(str, MIN_SM[precision]))
        raise PrecisionError(f"--precision {precision} ({PRECISIONS[precision]} export): {name} is sm_{cc[0]}{cc[1]}, "
                             f"{precision} needs sm_{need} or newer; build from a float32 export "
                             f"(dflash2-export --dtype float32)")


def parse(trt, builder, logger, path: Path):
    """ONNX file -> strongly typed network; parse errors name the node, operator and description."""
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(path)):
        errors = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            node = getattr(e, "node_name", lambda: "")() or f"#{e.node()}"  # node_name/operator: TensorRT >= 8.6
            errors.append(f"node {node} ({getattr(e, 'node_operator', lambda: '?')()}): {e.desc()} [{e.code()}]")
        raise OnnxParseError(path, errors or [logger.tail()])
    return network, parser  # the parser must outlive the network's use: it owns the weights


def add_profiles(trt, builder, config, network, job: EngineJob) -> None:
    names = {network.get_input(i).name for i in range(network.num_inputs)}
    for p in job.profiles:
        unknown = sorted(set(p.shapes) - names)
        if unknown:
            raise BuildError(f"{job.onnx}: profile {p.name} names inputs {unknown}; the network has {sorted(names)}")
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            profile.set_shape(name, lo, opt, hi)
        if config.add_optimization_profile(profile) < 0:
            raise BuildError(f"{job.onnx}: TensorRT rejected optimization profile {p.name} {p.to_dict()['shapes']}")


def build(plan: BuildPlan, quiet: bool = False) -> mf.EngineManifest:
    """Build every engine of the plan; returns the engine-folder manifest (also written to plan.out)."""
    trt = require_tensorrt()
    logger = make_logger(trt, echo="ERROR" if quiet else "WARNING")
    check_device_precision(plan.precision)
    if plan.plugin is not None:
        load_plugin(trt, plan.plugin, logger)
    builder = trt.Builder(logger)
    progress = Progress(2 * len(plan.jobs) + 1, quiet)
    cache_bytes = plan.timing_cache.read_bytes() if plan.timing_cache and plan.timing_cache.is_file() else b""
    cache, built = None, {}
    with temp_folder(plan.out) as tmp:
        for job in plan.jobs:
            t0 = time.perf_counter()
            with progress.step(f"{job.engine}: parsing {job.onnx.name}"):
                network, _parser = parse(trt, builder, logger, job.onnx)
            names = ", ".join(p.name for p in job.profiles)
            with progress.step(f"{job.engine}: building ({plan.precision}, profiles {names})"):
                config = builder.create_builder_config()
                if plan.workspace_mb is not None:
                    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_mb << 20)
                cache = cache or config.create_timing_cache(cache_bytes)
                if not config.set_timing_cache(cache, ignore_mismatch=False):
                    raise BuildError(f"{plan.timing_cache}: timing cache rejected (another TensorRT version or GPU?); "
                                     f"delete it or pass another --timing-cache")
                add_profiles(trt, builder, config, network, job)
                data = builder.build_serialized_network(network, config)
                if data is None:
                    raise BuildError(f"{job.onnx}: TensorRT failed to build {job.engine}:\n  {logger.tail()}")
                write_atomic(tmp / job.engine, data)
            built[job.graph] = {"seconds": round(time.perf_counter() - t0, 3)}
        with progress.step("timing cache, tokenizer, manifest"):
            if plan.timing_cache is not None and cache is not None:
                plan.timing_cache.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(plan.timing_cache, cache.serialize())
            _copy_tokenizer(plan, tmp)
            manifest = mf.write(tmp, em.build_manifest(plan, built, trt.__version__))
        replace_folder(tmp, plan.out, plan.force, what="the engines")
    mf.remember_hashes(plan.out, manifest)
    return manifest


def adopt(plan: BuildPlan) -> mf.EngineManifest:
    """--manifest-only: write manifest.json (+ tokenizer) for engines already built into plan.out by trtexec."""
    missing = [job.engine for job in plan.jobs if not (plan.out / job.engine).is_file()]
    if missing:
        raise BuildError(f"{plan.out}: expected engine files {missing} (run the `dflash2-build --print-trtexec` "
                         f"commands first), found none")
    try:
        version = require_tensorrt().__version__
    except Dflash2Error:
        version = "unknown (built outside dflash2-build)"
    _copy_tokenizer(plan, plan.out)
    return mf.write(plan.out, em.build_manifest(plan, {}, version))


def _copy_tokenizer(plan: BuildPlan, folder: Path) -> None:
    """The tokenizer travels with the engines so `dflash2-run ENGINE_DIR --prompt` works on its own."""
    copy_present(plan.export_dir, plan.export.tokenizer.files, folder)
