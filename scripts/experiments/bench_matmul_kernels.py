"""ONNX Runtime's CPU weight-MatMul kernels at the row counts speculative decoding runs, in one interleaved run:

    python scripts/experiments/bench_matmul_kernels.py [--threads 1] [--rows 1,2,8] [--repeats 200] [--json out.json]

Per weight shape of the SmolLM2 default pair (the drafter's 8192-row head, gate|up, down) and per row count M:
MatMulNBits int4 / int8 at blocks 32 and 128 (accuracy level 4: int8 activations, the fast path), DynamicQuantizeMatMul
(per-column int8 weights, activations quantized per tensor at run time: what `--quant-drafter int8-dynamic` writes)
and an fp32 MatMul. Random weights (the kernels' time does not depend on the values). Each cell is the median of
`repeats` calls taken in turns with the other kernels' (a shared machine drifts between runs, not within one), each
right after an untimed call of the same kernel and rows: compute with the weights in cache (in a decode loop they are
not: the target's pass evicts the drafter's, docs/quantization.md measures that in the loop).
Why it matters (docs/quantization.md, "The drafter's own quantization"): a draft runs every weight MatMul at 8 rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

SHAPES = {"draft head 576x8192": (576, 8192), "gate|up 576x3072": (576, 3072), "down 1536x576": (1536, 576)}
KERNELS = ("int4 b32", "int4 b128", "int8 b32", "int8 b128", "int8-dynamic", "fp32")


def _session(kernel: str, K: int, N: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    if kernel == "fp32":
        inits = [numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "W")]
        node = helper.make_node("MatMul", ["A", "W"], ["Y"])
    elif kernel == "int8-dynamic":
        inits = [numpy_helper.from_array(rng.integers(-127, 128, (K, N)).astype(np.int8), "W"),
                 numpy_helper.from_array(np.full(N, 0.01, np.float32), "S")]
        node = helper.make_node("DynamicQuantizeMatMul", ["A", "W", "S"], ["Y"], domain="com.microsoft")
    else:
        bits, block = int(kernel[3]), int(kernel.split(" b")[1])
        blocks = -(-K // block)
        inits = [numpy_helper.from_array(rng.integers(0, 256, (N, blocks, block * bits // 8)).astype(np.uint8), "W"),
                 numpy_helper.from_array(np.full(N * blocks, 0.01, np.float32), "S")]
        node = helper.make_node("MatMulNBits", ["A", "W", "S"], ["Y"], domain="com.microsoft", K=K, N=N, bits=bits,
                                block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,2,8")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",")]
    results = {}
    for shape, (K, N) in SHAPES.items():
        sessions = {k: _session(k, K, N, a.threads) for k in KERNELS}
        feeds = {M: {"A": np.random.default_rng(M).standard_normal((M, K)).astype(np.float32)} for M in rows}
        times = {(k, M): [] for k in KERNELS for M in rows}
        for s in sessions.values():  # warm-up
            for f in feeds.values():
                s.run(None, f)
        for i in range(a.repeats):
            for k, s in sessions.items():
                for M, f in feeds.items():
                    s.run(None, f)  # warm: the timed call finds its weights in cache, whatever ran before
                    t0 = time.perf_counter()
                    s.run(None, f)
                    times[k, M].append(time.perf_counter() - t0)
            if i and i % 50 == 0:
                print(f"{shape}: {i}/{a.repeats} rounds", flush=True)
        results[shape] = {k: {str(M): round(1e6 * statistics.median(times[k, M]), 1) for M in rows} for k in KERNELS}
    print(json.dumps({"threads": a.threads, "us_median": results}, indent=1))
    print(f"\n| shape | kernel | " + " | ".join(f"M={M} us" for M in rows) + f" | M={rows[-1]} / M={rows[0]} |")
    print("| --- | --- | " + " | ".join("---:" for _ in rows) + " | ---: |")
    for shape, per in results.items():
        for k, us in per.items():
            ratio = us[str(rows[-1])] / us[str(rows[0])]
            print(f"| {shape} | {k} | " + " | ".join(f"{us[str(M)]:.0f}" for M in rows) + f" | {ratio:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "us_median": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
