"""How far a low-precision export's target graph and PyTorch's own run in that dtype each land from the fp32 reference,
on the export's own validation feeds (its Polygraphy replay file, target.inputs.json; a bf16 graph run as the validation emulates it):

    python scripts/experiments/low_precision_drift.py EXPORT DRAFTER TARGET [--json out.json]

Per feed and output: max |graph - ref32|, max |ref_dtype - ref32|, max |graph - ref_dtype|, and whether each pair meets
the dtype's rule (dflash2.numerics). What docs/export.md's fallback to the fp32 reference rests on: where the graph and
PyTorch's fp16 are further from each other than either is from fp32 (docs/results, 2026-12-07, fp16 hybrids).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import torch

from dflash2 import dtypes
from dflash2.config import load_target_config
from dflash2.export.graphs import graph_specs
from dflash2.export.plain import sliding
from dflash2.export.window_spec import windowed_spec
from dflash2.export.bf16_emulation import emulated_copy
from dflash2.export.validate import graph_array, reference_outputs
from dflash2.manifest import ExportManifest, load
from dflash2.numerics import TOLERANCES, compare_floats
from dflash2.onnxrt import open_session, run
from dflash2.reference.load import load_pair


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export", type=Path)
    p.add_argument("drafter", type=Path)
    p.add_argument("target", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--dtype", help="a folder without a manifest (an export's .failed one): its dtype")
    a = p.parse_args(argv)
    from polygraphy.json import load_json

    if (a.export / "manifest.json").exists():
        m = load(a.export, ExportManifest, check_files=False)
        dtype, fused = m.dtype, m.context.fused
    else:  # the validation's kept files: the export's default context (fused)
        dtype, fused = a.dtype, True
    low = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype)
    if low is None:
        p.error(f"{a.export}: a float16 / bfloat16 export (or --dtype), found {dtype}")
    specs = [graph_specs(*load_pair(a.drafter, a.target, dt), fused)[0] for dt in (low, torch.float32)]
    graph = a.export / "target.onnx"
    if any(i.name == "past_window_kv" for i in onnx.load(str(graph), load_external_data=False).graph.input):
        # a windowed target (the sliding layers on their own buffer): the export's windowed spec
        window = sliding(load_target_config(a.target))
        specs = [windowed_spec(s, *window) for s in specs]
    with contextlib.ExitStack() as stack:
        if dtype == "bfloat16":  # the CPU provider has no bf16 kernels: the export validation's emulation
            graph, why = stack.enter_context(emulated_copy(graph))
            if graph is None:
                p.error(f"{a.export / 'target.onnx'}: not emulated: {why}")
        sess = open_session(graph, ["CPUExecutionProvider"])
    kinds = {i.name: i.type for i in sess.get_inputs()}
    atol, rtol = TOLERANCES[dtype]
    rows = []
    for i, f in enumerate(load_json(str(a.export / "target.inputs.json"))):
        feed = {k: torch.from_numpy(np.asarray(v)) for k, v in f.items()}  # the replay file widens bf16 to fp32
        feed = {k: v.to(low) if kinds.get(k) == f"tensor({dtype})" else v for k, v in feed.items()}
        got = run(sess, {k: graph_array(v) for k, v in feed.items()}, specs[0].outputs)
        own = reference_outputs(specs[0], [feed])[0]
        wide = reference_outputs(specs[1], [{k: v.float() if v.is_floating_point() else v for k, v in feed.items()}])[0]
        for name in specs[0].outputs:
            if not np.issubdtype(wide[name].dtype, np.floating):
                continue
            g, o, w = (np.asarray(x, np.float32) for x in (got[name], own[name], wide[name]))
            rows.append({"feed": i, "output": name, "graph_vs_fp32": float(np.abs(g - w).max()),
                         "own_vs_fp32": float(np.abs(o - w).max()), "graph_vs_own": float(np.abs(g - o).max()),
                         "graph_meets_fp32": compare_floats(g, w, atol, rtol).ok,
                         "own_meets_fp32": compare_floats(o, w, atol, rtol).ok,
                         "graph_meets_own": compare_floats(g, o, atol, rtol).ok})
    print(f"{'feed':>4} {'output':<16} {'graph-fp32':>10} {'own-fp32':>10} {'graph-own':>10}  meets: graph/fp32 own/fp32 "
          f"graph/own")
    for r in rows:
        print(f"{r['feed']:>4} {r['output']:<16} {r['graph_vs_fp32']:>10.4f} {r['own_vs_fp32']:>10.4f} "
              f"{r['graph_vs_own']:>10.4f}  {r['graph_meets_fp32']!s:>5} {r['own_meets_fp32']!s:>5} "
              f"{r['graph_meets_own']!s:>5}")
    doc = {"export": str(a.export), "dtype": dtype, "itemsize": dtypes.get(dtype).itemsize, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
