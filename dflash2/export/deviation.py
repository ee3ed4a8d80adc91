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

import tempfile
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import onnx
import torch

from dflash2.export import signature as N
from dflash2 import manifest as mf
from dflash2.export.graphs import GraphSpec
from dflash2.export.replay import ReplayWriter
from dflash2.export.validate import np_of, own_storage, reference_outputs
from dflash2.numerics import max_abs_difference
from dflash2.progress import release_freed
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


def _reference(spec: GraphSpec, feed, logits: bool) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The reference outputs of one feed, and with `logits` the target's [n, V] logits caught on the way (one
    reference pass instead of two; a streamed target reads its layers once per pass)."""
    target = getattr(spec.module, "target", None)
    if not logits or spec.name != "target" or not isinstance(target, torch.nn.Module):
        return reference_outputs(spec, [feed])[0], None
    captured: list[np.ndarray] = []
    hook = target.register_forward_hook(lambda m, args, out: captured.append(np_of(out[0].float())))
    try:
        ref = reference_outputs(spec, [feed])[0]
    finally:
        hook.remove()
    if len(captured) != 1:
        with torch.no_grad():
            captured = [np_of(spec.module.target_logits(feed))]
    return ref, captured[0]


def _spill(folder: Path, ref: dict[str, np.ndarray], logits: np.ndarray | None):
    """The reference's outputs written to a temporary folder beside the graph (.npy: the same bits back), so
    that the memory they hold is free while ONNX Runtime runs; (the folder, the output names in order)."""
    tmp = tempfile.TemporaryDirectory(prefix=".deviation.", dir=folder)
    for i, a in enumerate([*ref.values(), *([] if logits is None else [logits])]):
        np.save(Path(tmp.name) / f"{i}.npy", a, allow_pickle=False)
    return tmp, list(ref), logits is not None


def _unspill(spilled) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """_spill's outputs read back whole (not mapped) and its folder removed."""
    tmp, names, logits = spilled
    with tmp:
        got = [np.load(Path(tmp.name) / f"{i}.npy", allow_pickle=False) for i in range(len(names) + logits)]
    return dict(zip(names, got)), got[-1] if logits else None


def measure(spec: GraphSpec, path: Path, save_dir: Path | None = None) -> tuple[list[str], dict, mf.Deviation]:
    """(failures, per-step report, summary) of the quantized graph at `path` against the PyTorch reference.
    save_dir: also write the feeds and reference outputs as Polygraphy files (`dflash2-compare` replays them).
    One feed at a time (its reference, replay files' part, run and comparison; dflash2.export.validate says why)."""
    feeds = own_storage(spec.feeds())
    release_freed()  # the feeds' reference passes (per-row states) freed: their heap back to the OS
    probe = _with_logits(path) if spec.name == "target" else None
    failures, report = [], {}
    names = list(spec.outputs) + ([LOGITS] if probe else [])
    try:
        with ReplayWriter(save_dir, spec.name) if save_dir is not None else nullcontext() as replay:
            for step, feed in enumerate(feeds):
                ref, ref_logits = _reference(spec, feed, probe is not None)
                if replay is not None:
                    replay.add({k: np_of(v) for k, v in feed.items()}, ref)
                spilled = _spill(path.parent, ref, ref_logits)  # on disk while the session holds its weights
                del ref, ref_logits
                release_freed()  # the reference pass's heap (its streamed layer, its activations) back first
                # the session opened per feed, after its reference pass, and the reference's outputs on disk while it
                # runs: neither the pass nor the reference's [n, V] logits resident beside the session. Measured at
                # Muse-Glimmer-30B's shape (the windowed prompt feed: 2,052 rows, 1.54 GiB of fp32 logits; the int4
                # session 2.92 GiB): the session held across the feeds, 10.06 GiB; opened per feed, the pass peaked
                # at 4.46 and the run at 9.54 (its own [n, V] tensors beside the held logits). The session generation
                # opens (prepacked weights, every fusion: the kernels that run), without the arena; a fresh one
                # computes what a kept one would, bit for bit.
                sess = open_session(probe or path, arena=False)
                g = dict(zip(names, sess.run(names, {k: np_of(v) for k, v in feed.items()})))
                del sess  # its weights and prepacked copies gone before the reference comes back
                release_freed()
                ref, ref_logits = _unspill(spilled)
                failures += _compared(spec, step, feed, g, ref, ref_logits, report)
                del g, ref, ref_logits
                release_freed()
    finally:
        if probe is not None:
            probe.unlink(missing_ok=True)
    dev = mf.Deviation(judged="deviation from fp32")
    if spec.name == "target" and not failures:
        ids = [report[s][N.NEXT_IDS] for s in report]
        dev.top1_agreement = sum(i["agreement"] * i["total"] for i in ids) / sum(i["total"] for i in ids)
        if probe is not None:
            dev.max_logit_error = max(report[s][N.LOGITS]["max_abs"] for s in report)
    return failures, report, dev


def _compared(spec: GraphSpec, step: int, feed, g: dict, r: dict, ref_logits: np.ndarray | None,
              report: dict) -> list[str]:
    """One feed's outputs against its reference: report[f"step{step}"] filled, the failures returned."""
    failures, row = [], {}
    for name, want in r.items():
        out = g[name]
        if spec.trim is not None:
            out, want = spec.trim(name, out, feed), spec.trim(name, want, feed)
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
        row[name] = {"max_abs": max_abs_difference(out, want)}
    if ref_logits is not None:  # row by row: the [n, V] float64 difference and its temporaries (~0.1 GB for a
        # 19-row feed at Qwen3.5-0.8B's 248,320 words) made the int4 export's peak; the maximum is the same, the mean
        # equal up to float64 rounding (summed per row)
        got = g[LOGITS]
        total = sum(float(np.abs(got[r].astype(np.float64) - ref_logits[r]).sum()) for r in range(len(ref_logits)))
        row[N.LOGITS] = {"max_abs": max_abs_difference(got, ref_logits),
                         "mean_abs": total / ref_logits.size if ref_logits.size else 0.0}
    report[f"step{step}"] = row
    return failures
