"""A decode step's int4 MatMuls: ONNX Runtime's MatMulNBits (MLAS) against a prefetching GEMV (issue 50):

    python scripts/experiments/q4_gemv.py [--threads 1,2] [--copies 1,4] [--passes 3] [--json out.json]

The SmolLM2-135M int4 target's weight MatMuls, in a step's order (30 layers of qkv 576x960, o 576x576, gate|up
576x3072, down 1536x576, then the 576x49152 head: 80 MiB of 4-bit weights and fp32 block-32 scales), random weights,
one row. `copies` distinct copies of them are run in turn: 1 copy partly stays in this machine's share of the L3,
4 copies (320 MiB) make every step read its weights from DRAM, as a real decode does once anything else ran.
Runners, each in its own process (two ONNX Runtime thread pools or an OpenMP team beside one would spin against
each other on 2 cores), taken in turns, order reversed every pass; the medians of per-pass ratios compare:
  ort         one ONNX Runtime session, the copies' MatMulNBits nodes chained (accuracy level 4, as the export)
  q4          scripts/experiments/q4_gemv/q4_gemv.c with a software prefetch 8 KiB ahead (-DPF=8192)
  q4 no-pf    the same kernel without the prefetch: what the prefetch buys
  read        the same bytes read by a plain streaming loop: the ceiling
The kernel is built here with gcc (-O3 -march=native -fopenmp) and first checked against MatMulNBits on each shape
(the same CompInt8 arithmetic, so only the fp32 summation order differs: relative error ~1e-7).
--rows 1,2,4,8,17,40,200 [--shapes 576x3072,1536x576,576x49152] instead times the op as it ships
(ai.dflash2.Q4MatMul from build/plugins, through ONNX Runtime) against MatMulNBits at those row counts: per shape,
64 MiB or more of distinct weights in one session per op, in turns, medians of 9 runs, at each --threads count.
Measurement only (the experiment's kernel is not the one that ships; plugins/dflash2Q4MatMul is).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent / "q4_gemv"
LAYER = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
SHAPES = LAYER * 30 + [(576, 49152)]
RUNNERS = ["ort", "q4", "q4 no-pf", "read"]
RUNS = 12


def build(out: Path) -> dict[str, Path]:
    libs = {}
    for name, flags in (("q4", ["-DPF=8192"]), ("q4 no-pf", [])):
        lib = out / f"lib{name.replace(' ', '_')}.so"
        subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *flags, "-o", str(lib),
                        str(HERE / "q4_gemv.c")], check=True)
        libs[name] = lib
    return libs


def weights(copies: int):
    rng = np.random.default_rng(0)
    return [[(k, n, rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8),
              (rng.random((n, k // 32), dtype=np.float32) * 0.01 + 0.001)) for k, n in SHAPES] for _ in range(copies)]


def ort_session(ws, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    nodes, inits = [], []
    for i, (k, n, q, s) in enumerate(ws):  # chained as in a model: each MatMul's input is the one before, sliced
        inits += [numpy_helper.from_array(q, f"w{i}"), numpy_helper.from_array(s, f"s{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["x" if i == 0 else f"c{i - 1}", f"w{i}", f"s{i}"], [f"y{i}"],
                                      domain="com.microsoft", K=k, N=n, bits=4, block_size=32, accuracy_level=4))
        nodes.append(helper.make_node("Slice", [f"y{i}", "zero", f"end{ws[(i + 1) % len(ws)][0]}", "last"], [f"c{i}"]))
    inits += [numpy_helper.from_array(np.array([v], np.int64), name)
              for name, v in (("zero", 0), ("last", -1), ("end576", 576), ("end1536", 1536))]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 576])],
                          [helper.make_tensor_value_info(f"c{len(ws) - 1}", TensorProto.FLOAT, [1, 576])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    o = ort.SessionOptions()
    o.intra_op_num_threads, o.log_severity_level = threads, 3
    return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])


class Chain:
    """ctypes driver of q4_chain over all copies' weights (pointers built once)."""

    def __init__(self, lib: Path, ws):
        self.lib, P = ctypes.CDLL(str(lib)), ctypes.c_void_p
        self.L = len(ws)
        rng = np.random.default_rng(1)
        self.x = {k: rng.standard_normal(k).astype(np.float32) for k in (576, 1536)}
        self.args = [ctypes.c_int(self.L), (ctypes.c_int * self.L)(*[k for k, _, _, _ in ws]),
                     (ctypes.c_int * self.L)(*[n for _, n, _, _ in ws]),
                     (P * self.L)(*[q.ctypes.data for _, _, q, _ in ws]),
                     (P * self.L)(*[s.ctypes.data for _, _, _, s in ws]),
                     (P * self.L)(*[self.x[k].ctypes.data for k, _, _, _ in ws])]
        self.scratch = [np.zeros(13 * 64, np.int8), np.zeros(13 * 64, np.int8), np.zeros(13 * 16, np.int32),
                        np.zeros(13 * 16, np.float32), np.zeros(49152, np.float32)]
        self.args += [P(b.ctypes.data) for b in self.scratch]

    def __call__(self):
        self.lib.q4_chain(*self.args)
        return self.scratch[-1]


def check(lib: Path) -> dict:
    """Each shape once, the kernel against one MatMulNBits node on the same weights and input: max relative error."""
    import onnxruntime as ort

    from dflash2.native import q4
    every = weights(1)[0]
    out = {}
    for k, n, q, s in every[:4] + every[-1:]:
        chain = Chain(lib, [(k, n, q, s)])
        ref = ort.InferenceSession(q4.model(k, n, [(q, s)], x_dims=(1,)), providers=["CPUExecutionProvider"]).run(
            None, {"x": chain.x[k][None]})[0][0]
        out[f"{k}x{n}"] = float(np.abs(chain()[:n] - ref).max() / np.abs(ref).max())
    return out


def worker(runner: str, threads: int, copies: int, lib: str) -> list[float]:
    """Milliseconds per step (one pass over one copy's weights), RUNS times after a warm-up over all copies."""
    ws = weights(copies)
    if runner == "ort":
        sess, x = ort_session([w for c in ws for w in c], threads), np.ones((1, 576), np.float32)
        run = lambda: sess.run(None, {"x": x})  # noqa: E731
    elif runner == "read":
        blob = np.ones(sum(q.nbytes + s.nbytes for c in ws for _, _, q, s in c) // 4 // 128 * 128, np.float32)
        f = ctypes.CDLL(lib).stream_read
        run = lambda: f(ctypes.c_void_p(blob.ctypes.data), ctypes.c_size_t(blob.size))  # noqa: E731
    else:
        run = Chain(Path(lib), [w for c in ws for w in c])
    run()
    times = []
    for _ in range(RUNS):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1e3 / copies)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--copies", default="1,4")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rows", help="time the shipped op against MatMulNBits at these row counts instead")
    ap.add_argument("--shapes", default="576x3072,1536x576,576x49152", help="KxN list for --rows")
    ap.add_argument("--worker", nargs=4, metavar=("RUNNER", "THREADS", "COPIES", "LIB"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], int(a.worker[1]), int(a.worker[2]), a.worker[3])))
        return
    if a.rows:
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in a.shapes.split(",")]
        return rows_main([int(x) for x in a.rows.split(",")], [int(t) for t in a.threads.split(",")], shapes, a.json)
    tmp = Path(tempfile.mkdtemp(prefix="q4_gemv_"))
    libs = build(tmp)
    errs = check(libs["q4"])
    print("kernel vs MatMulNBits, max relative error per shape:", {k: f"{v:.1e}" for k, v in errs.items()})
    mib = sum(k * n // 2 + k * n // 32 * 4 for k, n in SHAPES) / 2**20
    cells = [(t, c) for t in map(int, a.threads.split(",")) for c in map(int, a.copies.split(","))]
    res = {(t, c, r): [] for t, c in cells for r in RUNNERS}
    for p in range(a.passes):
        order = [(t, c, r) for t, c in cells for r in RUNNERS]
        for t, c, r in (order if p % 2 == 0 else order[::-1]):
            env = dict(os.environ, OMP_NUM_THREADS=str(t), OMP_PROC_BIND="false")
            cmd = [sys.executable, __file__, "--worker", r, str(t), str(c), str(libs.get(r, libs["q4"]))]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            res[t, c, r].append(float(np.median(json.loads(out.splitlines()[-1]))))
            print(f"pass {p + 1}/{a.passes}  {t} thread(s)  {c} copies  {r:9s} {res[t, c, r][-1]:.2f} ms", flush=True)
    rows = []
    print(f"\n{mib:.0f} MiB of weights and scales a step; ms a step (median of passes), ORT / runner (median of per-pass "
          "ratios), GB/s")
    print(f"{'threads':>7} {'copies':>6} " + " ".join(f"{r:>22}" for r in RUNNERS))
    for t, c in cells:
        cell = {"threads": t, "copies": c}
        line = f"{t:>7} {c:>6} "
        for r in RUNNERS:
            ms = float(np.median(res[t, c, r]))
            ratio = float(np.median(np.array(res[t, c, "ort"]) / np.array(res[t, c, r])))
            gbs = mib * 2**20 / (ms * 1e-3) / 1e9
            cell[r] = {"ms": ms, "ort_over": ratio, "gb_s": gbs, "passes": res[t, c, r]}
            line += f" {ms:6.2f} ms {ratio:4.2f}x {gbs:5.1f}GB/s"
        rows.append(cell)
        print(line)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"mib_per_step": mib, "relerr": errs, "runs": RUNS, "cells": rows,
                                      "cpu": _cpu()}, indent=1) + "\n")


def rows_main(rows: list[int], threads: list[int], shapes: list[tuple[int, int]], out: Path | None) -> None:
    """The shipped op against MatMulNBits per shape and row count: distinct weights of one shape (64 MiB or more
    of them, so each run reads them from DRAM as a decode does) in one session per op, the sessions in turns."""
    import onnxruntime as ort

    from dflash2.native import q4

    rng, res = np.random.default_rng(0), []
    for k, n in shapes:
        count = max(2, -(-64 * 2**20 // (k * n // 2 + k * n // 32 * 4)))
        ws = [(rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8),
               rng.random((n, k // 32), dtype=np.float32) * 0.01) for _ in range(count)]

        for t in threads:
            sess = {}
            for name, op in (("MatMulNBits", "MatMulNBits"), ("Q4MatMul", q4.OP)):
                o = ort.SessionOptions()
                o.intra_op_num_threads = t
                if op == q4.OP:
                    q4.register(o)
                sess[name] = ort.InferenceSession(q4.model(k, n, ws, op=op), o, providers=["CPUExecutionProvider"])
            for m in rows:
                x = rng.standard_normal((m, k)).astype(np.float32)
                times = {name: [] for name in sess}
                for r in range(9):
                    for name, s in (sess.items() if r % 2 == 0 else reversed(list(sess.items()))):
                        t0 = time.perf_counter()
                        s.run(None, {"x": x})
                        times[name].append((time.perf_counter() - t0) / len(ws) * 1e6)
                med = {name: float(np.median(v)) for name, v in times.items()}
                res.append({"shape": [k, n], "weights": len(ws), "threads": t, "rows": m, "us": med,
                            "ratio": med["MatMulNBits"] / med["Q4MatMul"]})
                print(f"{k:5d}x{n:<6d} {t} thread(s) {m:4d} rows: MatMulNBits {med['MatMulNBits']:8.1f} us  "
                      f"Q4MatMul {med['Q4MatMul']:8.1f} us  MatMulNBits / Q4MatMul {res[-1]['ratio']:.2f}", flush=True)
            del sess
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cells": res, "cpu": _cpu()}, indent=1) + "\n")


def _cpu() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
