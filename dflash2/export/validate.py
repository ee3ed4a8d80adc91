"""Validation right after export: ONNX Runtime vs the PyTorch reference on deterministic feeds.

Every failing output of every graph is collected, then one `ValidationError` lists them all with
max abs / rel differences. The same feeds and reference outputs are saved as Polygraphy JSON so
`polygraphy run X.onnx --onnxrt --load-inputs X.inputs.json --load-outputs X.reference.json`
replays the check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from dflash2.errors import ValidationError
from dflash2.onnxrt import open_session
from dflash2.export.graphs import GraphSpec
from dflash2.numerics import ID_MISMATCH_SHARE, TOLERANCES


def np_of(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()


def reference_outputs(spec: GraphSpec, feeds: list[dict[str, torch.Tensor]]) -> list[dict[str, np.ndarray]]:
    out = []
    with torch.no_grad():
        for feed in feeds:
            res = spec.module(*[feed[n] for n in spec.inputs])
            out.append({n: np_of(t) for n, t in zip(spec.outputs, res)})
    return out


def compare(graph: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray], dtype: str,
            step: int) -> tuple[list[str], dict]:
    atol, rtol = TOLERANCES[dtype]
    failures, report = [], {}
    for name, ref in want.items():
        out = got[name]
        if out.shape != ref.shape:
            failures.append(f"{graph}.{name} (step {step}): shape {list(out.shape)} != reference {list(ref.shape)}")
            continue
        if np.issubdtype(ref.dtype, np.integer):
            bad = int((out != ref).sum())
            report[name] = {"mismatches": bad, "total": int(ref.size)}
            if bad > ID_MISMATCH_SHARE[dtype] * ref.size:
                failures.append(f"{graph}.{name} (step {step}): {bad}/{ref.size} ids differ "
                                f"(allowed {ID_MISMATCH_SHARE[dtype]:.0%} in {dtype})")
            continue
        a, b = out.astype(np.float64), ref.astype(np.float64)
        diff = np.abs(a - b)
        max_abs = float(diff.max()) if diff.size else 0.0
        max_rel = float((diff / np.maximum(np.abs(b), 1e-6)).max()) if diff.size else 0.0
        report[name] = {"max_abs": max_abs, "max_rel": max_rel}
        if diff.size and not np.all(diff <= atol + rtol * np.abs(b)):
            failures.append(f"{graph}.{name} (step {step}): max abs {max_abs:.3g}, max rel {max_rel:.3g} "
                            f"(atol {atol}, rtol {rtol})")
    return failures, report


def validate_graph(spec: GraphSpec, path: Path, dtype: str, save_dir: Path | None = None) -> tuple[list[str], dict]:
    feeds = spec.feeds()
    refs = reference_outputs(spec, feeds)
    np_feeds = [{k: np_of(v) for k, v in f.items()} for f in feeds]
    if save_dir is not None:
        save_polygraphy(save_dir, spec.name, np_feeds, refs)
    if dtype == "bfloat16" and "CUDAExecutionProvider" not in ort.get_available_providers():
        return [], {"skipped": "ONNX Runtime's CPU provider has no bfloat16 kernels; validate with "
                               "`dflash2-compare --engines` on a GPU"}
    sess = open_session(path)
    failures, report = [], {}
    for step, (feed, ref) in enumerate(zip(np_feeds, refs)):
        got = dict(zip(spec.outputs, sess.run(spec.outputs, feed)))
        f, r = compare(spec.name, got, ref, dtype, step)
        failures += f
        report[f"step{step}"] = r
    return failures, report


def raise_if_failed(failures: list[str]) -> None:
    if failures:
        raise ValidationError(failures)


def save_polygraphy(folder: Path, name: str, feeds: list[dict[str, np.ndarray]],
                    refs: list[dict[str, np.ndarray]]) -> None:
    from polygraphy.comparator import IterationResult, RunResults
    from polygraphy.json import save_json
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.WARNING

    save_json(feeds, str(folder / f"{name}.inputs.json"))
    results = RunResults()
    results.append(("pytorch", [IterationResult(outputs=r, runner_name="pytorch") for r in refs]))
    results.save(str(folder / f"{name}.reference.json"))
