"""Validation right after export: ONNX Runtime vs the PyTorch reference on deterministic feeds.

Every failing output of every graph is collected, then one `ValidationError` lists them all with
max abs / rel differences. The same feeds and reference outputs are saved as Polygraphy JSON so
`polygraphy run X.onnx --onnxrt --load-inputs X.inputs.json --load-outputs X.reference.json`
replays the check.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from dflash2 import dtypes
from dflash2.errors import ValidationError
from dflash2.export.bf16_emulation import emulated_copy
from dflash2.export.graphs import GraphSpec
from dflash2.export import signature as N
from dflash2.export.replay import ReplayWriter
from dflash2.numerics import (DTYPE_ERROR_MULTIPLIER, ID_MISMATCH_SHARE, TOLERANCES, argmax_agreement, compare_floats,
                              ids_within, within_dtype_error)
from dflash2.onnxrt import open_session, run
from dflash2.progress import release_freed
from dflash2.reference.streamed import widened


def np_of(t: torch.Tensor) -> np.ndarray:
    """A tensor as numpy for the saved Polygraphy files and the reference side (bf16 widened to fp32)."""
    return t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()


def graph_array(t: torch.Tensor) -> np.ndarray:
    """A tensor as numpy in the graph's own dtype (bf16 as ml_dtypes' bfloat16): what the graph is fed."""
    if t.dtype == torch.bfloat16:
        return t.detach().contiguous().view(torch.int16).numpy().view(dtypes.numpy_dtype("bfloat16"))
    return t.detach().numpy()


def own_storage(feeds: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each feed tensor that is a view into a larger tensor copied out on its own (the same values): a hybrid
    target's feeds carry states committed from a reference step's per-row states, views that kept every row of
    that step alive (~300 MB a feed at Qwen3.5-0.8B's shape) for the whole validation."""
    def own(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.numel() * t.element_size():
            return t.clone()
        return t
    return [{k: own(v) for k, v in f.items()} for f in feeds]


def reference_outputs(spec: GraphSpec, feeds: list[dict[str, torch.Tensor]]) -> list[dict[str, np.ndarray]]:
    out = []
    with torch.no_grad():
        for feed in feeds:
            res = spec.module(*[feed[n] for n in spec.inputs])
            out.append({n: np_of(t) for n, t in zip(spec.outputs, res)})
    return out


def compare(graph: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray], dtype: str,
            step: int) -> tuple[list[str], dict]:
    """dflash2.numerics' rule for every output of one step; (failures, report). graph: the name each
    failing line starts with, the flavour included ("target.trt")."""
    atol, rtol = TOLERANCES[dtype]
    failures, report = [], {}
    for name, ref in want.items():
        out = got[name]
        if out.shape != ref.shape:
            failures.append(f"{graph}.{name} (step {step}): shape {list(out.shape)} != reference {list(ref.shape)}")
            continue
        if np.issubdtype(ref.dtype, np.integer):
            ties = _argmax_ties(name, out, ref, want, dtype)
            bad = int((out != ref).sum()) - ties
            report[name] = {"mismatches": bad, "total": int(ref.size), **({"argmax_ties": ties} if ties else {})}
            if not ids_within(bad, ref.size, ID_MISMATCH_SHARE[dtype]):
                failures.append(f"{graph}.{name} (step {step}): {bad}/{ref.size} ids differ "
                                f"(allowed {ID_MISMATCH_SHARE[dtype]:.0%} in {dtype})")
            continue
        d = compare_floats(out, ref, atol, rtol)
        report[name] = {"max_abs": d.max_abs, "max_rel": d.max_rel, "atol_scale": round(d.scale, 3)}
        agree = ""
        if name == N.LOGITS and ref.ndim == 2:  # what greedy decoding reads off them
            report[name]["argmax_agreement"] = argmax_agreement(out, ref)
            agree = f", argmax agrees on {report[name]['argmax_agreement']:.0%} of {len(ref)} rows"
        if not d.ok:
            failures.append(f"{graph}.{name} (step {step}): max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g} "
                            f"(atol {atol} x {d.scale:.3g} for the output's magnitude, rtol {rtol}){agree}")
    return failures, report


def _argmax_ties(name: str, got: np.ndarray, ref: np.ndarray, want: dict, dtype: str) -> int:
    """fp16 / bf16 next_ids: the entries that differ where the reference's own logits tie up to the dtype's rule (its
    logit at the graph's id within atol * max(1, rms(row)) + rtol * |best| of its best): rounding picks either.
    They are reported as ties, not mismatches (a real vocabulary has such near-ties: a Qwen3.8-27B-shaped random
    target's bf16 verify swapped 1 of 8). Rows without reference logits (a prefill's before the window) count."""
    if name != N.NEXT_IDS or ID_MISMATCH_SHARE[dtype] == 0 or N.LOGITS not in want:
        return 0
    logits = np.asarray(want[N.LOGITS], np.float64)  # [L, V]: the last L rows
    atol, rtol = TOLERANCES[dtype]
    offset, ties = ref.shape[0] - logits.shape[0], 0
    for r in np.flatnonzero(got.reshape(-1) != ref.reshape(-1)):
        if r < offset or not 0 <= int(got.reshape(-1)[r]) < logits.shape[1]:
            continue
        row = logits[r - offset]
        best, theirs = row[int(ref.reshape(-1)[r])], row[int(got.reshape(-1)[r])]
        ties += bool(best - theirs <= atol * max(1.0, float(np.sqrt(np.mean(row * row)))) + rtol * abs(best))
    return ties


def providers_for(dtype: str) -> list[str] | None:
    """ONNX Runtime providers that run a graph of this dtype here; None: none can (bf16 without CUDA)."""
    if dtype != "bfloat16":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in ort.get_available_providers():  # the CPU provider has no bf16 kernels
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return None


def validate_graph(spec: GraphSpec, path: Path, dtype: str, save_dir: Path | None = None, name: str | None = None,
                   selector_drafts: int | None = None, weights_in_place: bool = False) -> tuple[list[str], dict]:
    """name: of the saved Polygraphy files (default the graph's); selector_drafts: the file is a TensorRT
    flavour with a bare selector node, run here with the node's function attached (S drafts);
    weights_in_place: the streamed export stages' bounded-memory session (dflash2.onnxrt.open_session); the
    others validate under the runtime's own session options."""
    name = name or spec.name
    feeds = own_storage(spec.feeds())
    release_freed()  # the feeds' reference passes freed: their heap back to the OS before the session's
    providers = providers_for(dtype)
    failures, report, not_emulated = [], {}, None
    with ExitStack() as stack:
        runnable = path
        if selector_drafts is not None and (providers is not None or dtype == "bfloat16"):
            runnable = stack.enter_context(_with_function(path, selector_drafts))
        if providers is None and dtype == "bfloat16":  # the CPU provider: the bf16 graph emulated (bf16_emulation)
            runnable, not_emulated = stack.enter_context(emulated_copy(runnable))
            if runnable is not None:
                providers, report["emulated"] = ["CPUExecutionProvider"], EMULATED
        sess = open_session(runnable, providers, weights_in_place=weights_in_place) if providers is not None and \
            not weights_in_place else None
        # one feed at a time: its reference, its replay files' part, its run and comparison, then the next (a hybrid
        # target's outputs hold per-row recurrent states, ~300 MB a feed at Qwen3.5-0.8B's shape: every feed's
        # reference and graph outputs at once held GBs). The bounded-memory session (weights_in_place: the weights
        # where ONNX Runtime maps the data file, nothing prepacked or folded, so opening it costs a mapping) is open
        # only while its feed runs: the truncated build's mapped fp32 embedding, which the head reads whole (1 GB
        # at Qwen3.5-0.8B's shape), is then not resident beside the next feed's reference pass.
        with ReplayWriter(save_dir, name) if save_dir is not None else nullcontext() as replay:
            for step, feed in enumerate(feeds):
                ref = reference_outputs(spec, [feed])[0]
                if replay is not None:
                    replay.add({k: np_of(v) for k, v in feed.items()}, ref)
                if providers is None:
                    continue
                release_freed()  # the reference pass's heap (its streamed layers) back before the graph runs
                one = sess or open_session(runnable, providers, weights_in_place=weights_in_place)
                got = run(one, {k: graph_array(v) for k, v in feed.items()}, spec.outputs)  # in the graph's dtype
                del one  # the per-feed session closed (its mapping gone) before the comparison's temporaries
                walked = _on_graph_candidates(spec, feed, got, dtype)
                if walked is not None:
                    ref = walked[0]
                if spec.trim is not None:
                    got = {k: spec.trim(k, v, feed) for k, v in got.items()}
                    ref = {k: spec.trim(k, v, feed) for k, v in ref.items()}
                f, r = compare(name, got, ref, dtype, step)
                if f and dtype != "float32":  # two roundings apart: is the graph within tolerance of the exact one?
                    f, r = _against_fp32(spec, feed, got, ref, dtype, name, step, f, r)
                if walked is not None:  # recorded: what was judged on the graph's own choices
                    r["walked_on_graph_candidates"] = True
                    r["positions_after_a_walk_tie"] = walked[1]
                failures += f
                report[f"step{step}"] = r
                del got, ref
                release_freed()
        del sess
    if providers is None:
        return [], {"skipped": "ONNX Runtime's CPU provider has no bfloat16 kernels" +
                               (f" and the graph is not emulated ({not_emulated})" if not_emulated else "") +
                               "; validate with `dflash2-compare --engines` on a GPU"}
    return failures, report


EMULATED = ("bf16 emulated on ONNX Runtime's CPU provider: every bf16 value computed in fp32 and rounded to bf16 "
            "after its node (dflash2.export.bf16_emulation); a GPU's own kernels: `dflash2-compare --engines`")


def _on_graph_candidates(spec: GraphSpec, feed: dict, got: dict, dtype: str
                         ) -> tuple[dict[str, np.ndarray], int] | None:
    """fp16 / bf16 (an id share is allowed): rounding swaps near-equal top-K candidates, and a walk over another
    valid lattice differs everywhere after it. Where the graph's candidates are the reference's top-K up to the
    dtype's tolerance, the reference walks the graph's own candidates and every output is judged against that
    (its ids within the dtype's share as ever), the graph's path taken after a row that ties up to rounding
    (SamplingDrafterGraph.on_candidates); otherwise, and in fp32, against the reference's own walk.
    Returns (the outputs to judge against, the positions taken from the graph after a tie)."""
    if spec.on_candidates is None or ID_MISMATCH_SHARE[dtype] == 0 or N.CAND_IDS not in got:
        return None
    atol, rtol = TOLERANCES[dtype]
    with torch.no_grad():
        res = spec.on_candidates({k: np.asarray(v) for k, v in got.items()}, atol, rtol,
                                 *[feed[n] for n in spec.inputs])
    if res is None:
        return None
    outputs, taken = res
    return {n: np_of(t) for n, t in zip(spec.outputs, outputs)}, taken


def _against_fp32(spec: GraphSpec, feed: dict, got: dict, own: dict, dtype: str, name: str, step: int,
                  failures: list[str], report: dict) -> tuple[list[str], dict]:
    """A low-precision graph that missed the reference of its own dtype: judged, by the same rule and the same
    dtype's tolerances, against the reference in fp32 (the function both approximate). The PyTorch reference in
    fp16 is itself one rounding of it: where a layer amplifies rounding (a Gated DeltaNet's l2-normed keys of a
    small norm) the graph and PyTorch's fp16 land on different sides, each within fp16's reach of fp32 but not of
    each other (a tiny Qwen3.5-MoE's verify: graph 0.26 from fp32, PyTorch's fp16 0.32, the two 0.58 apart). The
    step passes only if every output meets that rule; the report records which reference judged it.
    Where an output misses the fp32 reference too, it is judged last by how far PyTorch's own dtype (own: the
    reference outputs in the graph's dtype) lands from fp32 (numerics.within_dtype_error): a Muse-Glimmer-shaped
    target's 2,051-row bf16 prefill is 2.0 from fp32 in PyTorch's own bf16 (new_kv), 5x bf16's tolerance, and no
    fixed tolerance can judge a graph of it."""
    wide_feed = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() and v.dtype != torch.float32 else v
                 for k, v in feed.items()}
    with widened(spec.module):
        ref = reference_outputs(spec, [wide_feed])[0]
    if spec.trim is not None:
        ref = {k: spec.trim(k, v, feed) for k, v in ref.items()}
    f, r = compare(name, got, ref, dtype, step)
    if not f:
        r["judged_against_fp32"] = {"own_dtype_failures": failures}
        return f, r
    missed = [n for n in spec.outputs if any(line.startswith(f"{name}.{n} (") for line in f)]
    judged = {n: within_dtype_error(got[n], own[n], ref[n], dtype) for n in missed}
    beyond = [n for n, (ok, _) in judged.items() if not ok]
    if not missed or beyond:  # the own-dtype failures stand, and why the last rule did not pass them
        return failures + [f"{name}.{n} (step {step}): past the fp32 reference's tolerance too, and not within "
                           f"PyTorch {dtype}'s own error from it ({judged[n][1]})" for n in beyond], report
    report["judged_by_dtype_error"] = {
        "rule": f"where PyTorch {dtype} itself misses fp32 by the fixed rule: the graph's RMSE, worst row's RMSE and "
                f"max abs from fp32 each <= {DTYPE_ERROR_MULTIPLIER:g} x PyTorch {dtype}'s + atol / 10; ids: no "
                f"more differing from fp32's than PyTorch's own + the dtype's share",
        "outputs": {n: rep for n, (_, rep) in judged.items()}, "own_dtype_failures": failures, "fp32_failures": f}
    return [], report


@contextmanager
def _with_function(path: Path, S: int):
    """A copy of a TensorRT-flavour file next to it (same external data) with the selector's function."""
    import onnx

    from dflash2.export import selector_onnx as so

    model = onnx.load(str(path), load_external_data=False)
    so.add_flavour(model, "portable", S)
    copy = path.with_name(f".{path.name}.check.onnx")
    onnx.save_model(model, str(copy))
    try:
        yield copy
    finally:
        copy.unlink(missing_ok=True)


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
