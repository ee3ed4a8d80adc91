"""How far a quantized graph is from the fp32 PyTorch reference: measured and recorded, not judged
against fp32 tolerances (an int4 graph is a different model; "lossless" is then defined against the
quantized target itself, see docs/quantization.md).

A quantized graph still fails validation when it cannot run, an output is missing or mis-shaped, or
a float output is not finite. Otherwise the report holds, per validation feed: the share of ids that
agree with the reference (for the target that is the top-1 agreement), max abs error of every float
output, and for the target the max logit error (the LM head's output is exposed in a temporary copy
of the graph that shares the external data; the copy is deleted afterwards).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from dflash2.export import signature as N
from dflash2 import manifest as mf
from dflash2.export.graphs import GraphSpec
from dflash2.export.validate import np_of, reference_outputs, save_polygraphy
from dflash2.onnxrt import open_session

LOGITS = "dflash2_logits"


def _with_logits(path: Path) -> Path | None:
    """A copy of the target graph that also outputs the ArgMax's input (the fp32 logits [n, V])."""
    m = onnx.load(str(path), load_external_data=False)
    argmax = [n for n in m.graph.node if n.op_type == "ArgMax"]
    if len(argmax) != 1:
        return None
    m.graph.node.append(onnx.helper.make_node("Identity", [argmax[0].input[0]], [LOGITS], name="dflash2_expose"))
    m.graph.output.append(onnx.helper.make_tensor_value_info(LOGITS, onnx.TensorProto.FLOAT, None))
    out = path.with_name(f".{path.stem}.deviation.onnx")  # beside the data file it points at
    onnx.save_model(m, str(out))
    return out


def _reference_logits(spec: GraphSpec, feeds: list[dict[str, torch.Tensor]]) -> list[np.ndarray]:
    with torch.no_grad():
        return [np_of(spec.module.target_logits(f)) for f in feeds]


def _references(spec: GraphSpec, feeds) -> tuple[list[dict[str, np.ndarray]], list[np.ndarray]]:
    """The reference outputs of every feed, and the target's [n, V] logits of each, caught on the way (one
    reference pass instead of two)."""
    target = getattr(spec.module, "target", None)
    captured: list[np.ndarray] = []
    if spec.name != "target" or not isinstance(target, torch.nn.Module):
        return reference_outputs(spec, feeds), captured
    hook = target.register_forward_hook(lambda m, args, out: captured.append(np_of(out[0].float())))
    try:
        refs = reference_outputs(spec, feeds)
    finally:
        hook.remove()
    return refs, captured


def measure(spec: GraphSpec, path: Path, save_dir: Path | None = None) -> tuple[list[str], dict, mf.Deviation]:
    """(failures, per-step report, summary) of the quantized graph at `path` against the PyTorch reference.
    save_dir: also write the feeds and reference outputs as Polygraphy files (`dflash2-compare` replays them)."""
    feeds = spec.feeds()
    refs, captured = _references(spec, feeds)
    if save_dir is not None:
        save_polygraphy(save_dir, spec.name, [{k: np_of(v) for k, v in f.items()} for f in feeds], refs)
    np_feeds = [{k: np_of(v) for k, v in f.items()} for f in feeds]
    probe = _with_logits(path) if spec.name == "target" else None
    try:
        sess = open_session(probe or path)
        names = list(spec.outputs) + ([LOGITS] if probe else [])
        got = [dict(zip(names, sess.run(names, f))) for f in np_feeds]
    finally:
        if probe is not None:
            probe.unlink(missing_ok=True)
    failures, report = [], {}
    ref_logits = None
    if probe:  # the reference pass already computed every row's logits (a streamed target reads its layers once)
        ref_logits = captured if len(captured) == len(feeds) else _reference_logits(spec, feeds)
    for step, (g, r) in enumerate(zip(got, refs)):
        row = {}
        for name, want in r.items():
            out = g[name]
            if spec.trim is not None:
                out, want = spec.trim(name, out, feeds[step]), spec.trim(name, want, feeds[step])
            if out.shape != want.shape:
                failures.append(f"{spec.name}.{name} (step {step}, quantized): shape {list(out.shape)} != "
                                f"reference {list(want.shape)}")
                continue
            if np.issubdtype(want.dtype, np.integer):
                row[name] = {"agreement": float((out == want).mean()), "total": int(want.size)}
                continue
            if not np.all(np.isfinite(out)):
                failures.append(f"{spec.name}.{name} (step {step}, quantized): non-finite values")
                continue
            row[name] = {"max_abs": float(np.abs(out.astype(np.float64) - want).max()) if out.size else 0.0}
        if ref_logits is not None:
            err = np.abs(g[LOGITS].astype(np.float64) - ref_logits[step])
            row[N.LOGITS] = {"max_abs": float(err.max()), "mean_abs": float(err.mean())}
        report[f"step{step}"] = row
    dev = mf.Deviation(judged="deviation from fp32")
    if spec.name == "target" and not failures:
        ids = [report[s][N.NEXT_IDS] for s in report]
        dev.top1_agreement = sum(i["agreement"] * i["total"] for i in ids) / sum(i["total"] for i in ids)
        if ref_logits is not None:
            dev.max_logit_error = max(report[s][N.LOGITS]["max_abs"] for s in report)
    return failures, report, dev
