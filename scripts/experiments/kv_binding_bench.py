"""ONNX Runtime CPU: the portable prefix-view target vs the fixed-shape TensorRT flavour (target.trt.onnx) of one
export, in one interleaved run; checks both give the same ids. `python scripts/experiments/kv_binding_bench.py EXPORT_DIR`
prints a table and JSON (ms per target step, median of 7 interleaved repeats)."""

import json
import sys
import time
from pathlib import Path

import numpy as np

from dflash2 import manifest as mf
from dflash2.onnxrt import open_session

folder = Path(sys.argv[1])
m = mf.load(folder, check_files=False)
T = m.max_seq_len
row = m.kv.rows.target
port = open_session(folder / m.graphs["target"].flavours.portable, threads=None, spin=True)
fixed = open_session(folder / m.graphs["target"].flavours.tensorrt, threads=None, spin=True)
rng = np.random.default_rng(0)
kv = (rng.standard_normal((T, *row)) * 0.1).astype(np.float32)
rows = {}
for P in (64, 256, 1024):
    for n in (1, 8):
        ids = rng.integers(0, m.vocab_size, n).astype(np.int32)
        feeds_p = {"input_ids": ids, "past_kv": kv[:P]}
        feeds_f = {"input_ids": ids, "kv_cache": kv, "past_len": np.array([P], np.int32)}
        a, b = port.run(["next_ids"], feeds_p)[0], fixed.run(["next_ids"], feeds_f)[0]
        assert np.array_equal(a, b), (P, n)
        tp, tf = [], []
        for _ in range(7):
            t0 = time.perf_counter(); port.run(["next_ids"], feeds_p); tp.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); fixed.run(["next_ids"], feeds_f); tf.append(time.perf_counter() - t0)
        rows[f"P={P} n={n}"] = {"prefix_view_ms": 1e3 * float(np.median(tp)), "fixed_ms": 1e3 * float(np.median(tf))}
print(f"{'step':<14}{'prefix view ms':>16}{'fixed shapes ms':>17}{'ratio':>8}   (T = {T})")
for k, v in rows.items():
    print(f"{k:<14}{v['prefix_view_ms']:>16.2f}{v['fixed_ms']:>17.2f}{v['fixed_ms'] / v['prefix_view_ms']:>7.2f}x")
print(json.dumps({"max_seq_len": T, "rows": rows}))
