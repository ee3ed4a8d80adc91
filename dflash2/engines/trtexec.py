"""The `trtexec` command lines equivalent to a dflash2-build plan: pure string building.

One engine per graph, one --minShapes/--optShapes/--maxShapes group per optimization profile (the
target repeats the group: prefill, then decode). No --fp16/--bf16 flag: with --stronglyTyped the
types come from the ONNX graph and trtexec rejects precision flags; the precision comment says
which export dtype the engines carry. trtexec writes engines only; `dflash2-build --manifest-only`
then writes the engine folder's manifest.json next to them.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from dflash2.engines.plan import BuildPlan, EngineJob
from dflash2.engines.profiles import Profile


def shape_spec(shapes: dict[str, tuple[int, ...]]) -> str:
    """trtexec shape syntax: name:AxBxC,name2:D (a 0 dim is a legal, empty extent)."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in shape)}" for name, shape in shapes.items())


def profile_args(profiles: list[Profile]) -> list[str]:
    args = []
    for p in profiles:
        if not p.shapes:
            continue
        for i, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes")):
            args.append(f"{flag}={shape_spec({n: s[i] for n, s in p.shapes.items()})}")
    return args


def command(job: EngineJob, out: Path, plugin: Path | None = None, timing_cache: Path | None = None,
            workspace_mb: int | None = None) -> list[str]:
    args = ["trtexec", f"--onnx={job.onnx}", f"--saveEngine={out / job.engine}", "--stronglyTyped"]
    args += profile_args(job.profiles)
    if plugin is not None:
        args.append(f"--dynamicPlugins={plugin}")
    if timing_cache is not None:
        args.append(f"--timingCacheFile={timing_cache}")
    if workspace_mb is not None:
        args.append(f"--memPoolSize=workspace:{workspace_mb}M")
    args.append("--skipInference")
    return args


def commands(plan: BuildPlan) -> list[str]:
    """Shell lines: comments, mkdir, one trtexec per engine, then the manifest step."""
    lines = [f"# precision {plan.precision}: from the {plan.dtype} export (strongly typed, no precision flag); "
             f"max_seq_len {plan.max_seq_len}, max_prefill {plan.max_prefill}"]
    if plan.plugin is not None and not plan.plugin_found:
        lines.append(f"# {plan.plugin} is not built yet: run `bash plugins/build.sh` first")
    lines.append(shlex.join(["mkdir", "-p", str(plan.out)]))
    for job in plan.jobs:
        lines.append(f"# {job.engine}: profiles {', '.join(p.name for p in job.profiles)}")
        lines.append(shlex.join(command(job, plan.out, plan.plugin, plan.timing_cache, plan.workspace_mb)))
    extra = [f"--max-seq-len={plan.max_seq_len}", f"--max-prefill={plan.max_prefill}"]
    if plan.plugin is not None:
        extra.append(f"--plugin={plan.plugin}")
    lines.append(shlex.join(["dflash2-build", str(plan.export_dir), "--out", str(plan.out), "--manifest-only",
                             *extra]))
    return lines
