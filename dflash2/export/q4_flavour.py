"""The `cpu_q4` flavour of an int4 graph: its MatMulNBits nodes as ai.dflash2.Q4MatMul (plugins/dflash2Q4MatMul/).

The op takes MatMulNBits' inputs and attributes as they are and computes its arithmetic (int8 activations per
block of 32, integer block dots, fp32 across blocks), so the flavour is the same graph file with two strings changed
per node, reading the same data file; what differs is the kernel's memory side, which makes a decode step's
MatMuls 1.6-1.7x faster from DRAM on an AVX512-VNNI CPU (docs/results/README.md, 2026-12-07). The runtime opens it
where the op runs (dflash2.native.q4.usable) and the portable graph everywhere else; the export's row check runs
on whichever this machine opens.

Written only where it can be checked here (`compare`: the same int4 model, its distance to the portable graph a
fraction of int4's own distance to the PyTorch reference). Losslessness does not rest on it: generation compares a
graph with itself, and the export's row check runs on the flavour this machine opens.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from dflash2 import manifest as mf
from dflash2.native import q4

SHARE = 0.25  # of the portable graph's own distance to the reference, per feed and output (SmolLM2: at most 0.17)
FLOOR = 1e-5  # of the outputs' scale: outputs int4 leaves (almost) exact
NODE_TOLERANCE = 1e-5  # one node against MatMulNBits, of its output's scale (measured 1e-7..5e-7)
NODE_COLUMNS = 4096  # output columns a node is checked on
FEEDS_BYTES = 64 << 20  # the largest <graph>.inputs.json the whole-graph comparison loads (it is read at once)
SUFFIX = ".q4.onnx"


def convertible(node) -> bool:
    """A MatMulNBits node the op computes exactly: 4 bits, block 32, accuracy level 4, no zero points / g_idx / bias."""
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return False
    a = {x.name: x.i for x in node.attribute}
    optional = [i for i in node.input[3:] if i]
    return (a.get("bits", 4) == 4 and a.get("block_size") == 32 and a.get("accuracy_level", 0) == 4
            and len(node.input) >= 3 and not optional)


def rewrite(folder: Path, portable: str) -> str | None:
    """Write `portable`'s cpu_q4 flavour beside it (the initializers' external references kept: the same data file);
    its name, or None where no node converts."""
    import onnx

    model = onnx.load(str(folder / portable), load_external_data=False)
    nodes = [n for n in model.graph.node if convertible(n)]
    if not nodes:
        return None
    for n in nodes:
        n.op_type, n.domain = q4.OP, q4.DOMAIN
    model.opset_import.append(onnx.helper.make_opsetid(q4.DOMAIN, 1))
    name = portable[: -len(".onnx")] + SUFFIX
    onnx.save(model, str(folder / name))  # no tensor holds raw data here, so none is written out again
    return name


def check_nodes(folder: Path, portable: str) -> tuple[list[str], dict]:
    """Every converted node's kernel against MatMulNBits on its own weights: three random rows through the op's kernel
    and through a one-node MatMulNBits session, within NODE_TOLERANCE of the output's scale. At most NODE_COLUMNS
    output columns a node (every column runs the same code; a 248,320-column head would otherwise hold five copies
    of itself here), one weight in memory at a time: it runs whatever the graph's size."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    model = onnx.load(str(folder / portable), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    failures, worst, rng = [], 0.0, np.random.default_rng(0)
    nodes = [n for n in model.graph.node if convertible(n)]
    for node in nodes:
        a = {x.name: x.i for x in node.attribute}
        k, n = a["K"], a["N"]
        cols = min(n, NODE_COLUMNS)
        b = numpy_helper.to_array(inits[node.input[1]], base_dir=str(folder)).reshape(n, k // 32, 16)[:cols].copy()
        sc = numpy_helper.to_array(inits[node.input[2]], base_dir=str(folder)).reshape(n, k // 32)[:cols].copy()
        x = rng.standard_normal((3, k)).astype(np.float32)
        m = q4.model(k, cols, [(b, sc)], x_dims=(3,), ir_version=model.ir_version)
        want = ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        diff = float(np.abs(q4.matmul(x, b, sc) - want).max()) / (float(np.abs(want).max()) or 1.0)
        worst = max(worst, diff)
        if diff > NODE_TOLERANCE:
            failures.append(f"{node.name or node.output[0]} ({k}x{n}): {diff:.2e} of MatMulNBits' output scale "
                            f"from it, above {NODE_TOLERANCE:g}")
    return failures, {"nodes": len(nodes), "node_max_rel": worst}


def compare(folder: Path, name: str, portable: str, flavour: str, portable_check: mf.Validation | None
            ) -> mf.Validation:
    """`check_nodes`, then, where the export validated `name` whole, the flavour against the portable graph on those
    feeds (`<name>.inputs.json`, written by dflash2.export.replay). Per feed and float output, max |flavour -
    portable| must stay under SHARE of the portable graph's own max |graph - PyTorch reference| on that feed (its
    validation record, `portable_check.steps["stepN"][output]["max_abs"]`; no reference is read or run again): the
    two kernels sum in another order, and an int8 rounding that flips on it carries through the layers (SmolLM2: 1e-7
    at the first layer's keys, 2-4% of the outputs' scale at the head, where int4 itself is 21-37% off fp32), so a
    wrong kernel shows as a distance the size of the quantization's. One session at a time."""
    failures, steps = check_nodes(folder, portable)
    recorded = (portable_check.steps if portable_check is not None else None) or {}
    inputs = folder / f"{name}.inputs.json"
    if not inputs.is_file() or "step0" not in recorded:
        steps["graph"] = (f"not compared whole: no {name}.inputs.json and per-feed record (the graph was validated "
                          f"on a truncated build)")
        return mf.Validation(ok=not failures, failures=failures, steps=steps)
    if inputs.stat().st_size > FEEDS_BYTES:  # read whole: a hybrid target's per-layer states in every feed
        steps["graph"] = (f"not compared whole: its feeds are {inputs.stat().st_size / 2**20:.0f} MiB, past the "
                          f"{FEEDS_BYTES / 2**20:.0f} MiB the check reads (the nodes above and the row check cover it)")
        return mf.Validation(ok=not failures, failures=failures, steps=steps)
    from polygraphy.json import load_json

    from dflash2.onnxrt import open_session
    from dflash2.progress import release_freed

    outputs = [o.name for o in _graph(folder / portable).output]
    worst, compared = 0.0, 0
    feeds = load_json(str(folder / f"{name}.inputs.json"))
    for step, feed in enumerate(feeds):
        with tempfile.TemporaryDirectory(dir=folder) as spill:  # the portable graph's outputs on disk while the
            # flavour's session runs (a hybrid target's per-layer states: ~300 MB a feed at Qwen3.5-0.8B's shape)
            sess = open_session(folder / portable, arena=False)
            for i, x in enumerate(sess.run(outputs, dict(feed))):
                np.save(Path(spill) / f"{i}.npy", x)
            sess = x = None
            release_freed()  # the portable session's weights given back before the flavour's are read
            got = open_session(folder / flavour, arena=False).run(outputs, dict(feed))
            release_freed()
            for i, (out, y) in enumerate(zip(outputs, got)):
                own = recorded.get(f"step{step}", {}).get(out, {}).get("max_abs")
                x = np.load(Path(spill) / f"{i}.npy", mmap_mode="r")
                if x.dtype.kind != "f" or x.size == 0 or own is None:
                    continue  # ids, and outputs the record has no distance for
                diff = float(np.abs(x.astype(np.float64) - y).max())
                floor = FLOOR * (float(np.abs(x).max()) or 1.0)
                compared += 1
                worst = max(worst, diff / max(own, floor))
                if diff > max(SHARE * own, floor):
                    failures.append(f"{flavour} feed {step} {out}: max |difference| {diff:.3g} from {portable}, "
                                    f"above {SHARE:g} x its own {own:.3g} from the PyTorch reference")
            got = x = None  # the last mapped file let go before its folder is removed
    if not compared:
        failures.append(f"{flavour}: no float output with a recorded distance to compare")
    steps.update(feeds=len(feeds), outputs=compared, worst_share=worst)
    return mf.Validation(ok=not failures, failures=failures, steps=steps)


def add(run, graphs: dict) -> None:
    """Each given int4 graph's cpu_q4 flavour (routes.write_all, after the dedupe), written and checked where this
    machine runs the op, else said and not written: the folder then runs its portable graphs everywhere."""
    reason = q4.why_not()
    for name, g in graphs.items():
        with run.progress.step(f"{name}: its {q4.OP} flavour (plugins/dflash2Q4MatMul), checked against "
                               f"{g.flavours.portable}") as step:
            if reason is not None:
                step.outcome = f"not written: {reason}"
                continue
            flavour = rewrite(run.tmp, g.flavours.portable)
            if flavour is None:
                step.outcome = "not written: no MatMulNBits node it computes (4 bits, block 32, accuracy level 4)"
                continue
            v = compare(run.tmp, name, g.flavours.portable, flavour, run.validation.get(name))
            run.validation[f"{name}.{mf.Q4_FLAVOUR}"] = v
            g.flavours.cpu_q4 = flavour
            whole = (f"; {v.steps['outputs']} outputs of {v.steps['feeds']} feeds at most "
                     f"{v.steps['worst_share']:.2f} of int4's own distance from the portable graph"
                     if "outputs" in v.steps else f"; {v.steps['graph']}")
            step.outcome = (f"{flavour}: {v.steps['nodes']} nodes within {v.steps['node_max_rel']:.1e} of "
                            f"MatMulNBits{whole}" + ("" if v.ok else " (FAILED)"))


def _graph(path: Path):
    import onnx

    return onnx.load(str(path), load_external_data=False).graph
