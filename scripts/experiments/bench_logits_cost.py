"""What the target graph's `logits` output (sampling) costs the greedy path, measured.

    .venv/bin/python scripts/experiments/bench_logits_cost.py EXPORT [--steps 300]

Opens EXPORT's target.onnx twice on ONNX Runtime: as exported, and with the `logits` output removed
(ONNX Runtime then drops the slice feeding it). Times 1-row decode steps and B-row verify steps on the
same past, the two sessions interleaved step by step; prints the medians and their ratio (JSON + table).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from dflash2 import manifest as mf
from dflash2.onnxrt import open_session


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", type=Path)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--past", type=int, default=200, help="rows of KV before each step")
    a = p.parse_args()
    m = mf.load(a.export, mf.ExportManifest, check_files=False)
    path = a.export / m.graphs["target"].flavours.portable
    model = onnx.load(str(path), load_external_data=False)
    if not any(o.name == "logits" for o in model.graph.output):
        raise SystemExit(f"{path}: no logits output (an export made before sampling existed)")
    keep = [o for o in model.graph.output if o.name != "logits"]
    del model.graph.output[:]
    model.graph.output.extend(keep)
    with tempfile.NamedTemporaryFile(suffix=".onnx", dir=a.export, prefix=".nologits-") as tmp:  # beside its data
        onnx.save_model(model, tmp.name)
        sessions = {"with_logits": open_session(path, ["CPUExecutionProvider"]),
                    "without": open_session(Path(tmp.name), ["CPUExecutionProvider"])}
        kv_shape = [a.past, *m.kv.rows.target]
        rng = np.random.default_rng(0)
        past = rng.standard_normal(kv_shape).astype(np.float32) * 0.1
        times = {(name, n): [] for name in sessions for n in (1, m.block_size)}
        for i in range(a.steps):
            for n in (1, m.block_size):
                feeds = {"input_ids": rng.integers(0, m.vocab_size, n).astype(np.int32), "past_kv": past}
                order = list(sessions) if i % 2 == 0 else list(reversed(sessions))  # alternate who goes first
                for name in order:
                    t0 = time.perf_counter()
                    sessions[name].run(None, feeds)
                    times[(name, n)].append(time.perf_counter() - t0)
    med = {f"{name} n={n}": 1e3 * float(np.median(v)) for (name, n), v in times.items()}
    ratio = {f"n={n}": med[f"with_logits n={n}"] / med[f"without n={n}"] for n in (1, m.block_size)}
    print(f"{'step':<24}{'ms (median)':>12}")
    for k, v in med.items():
        print(f"{k:<24}{v:>12.3f}")
    for k, v in ratio.items():
        print(f"{'with / without ' + k:<24}{v:>12.3f}")
    print(json.dumps({"export": str(a.export), "steps": a.steps, "past": a.past, "median_ms": med,
                      "ratio_with_over_without": ratio}))


if __name__ == "__main__":
    main()
