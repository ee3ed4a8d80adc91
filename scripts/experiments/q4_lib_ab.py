"""Two builds of libdflash2_ort_q4.so against each other: the same bits, then one int4 export's prefill, decode
and verify with each, in turns:

    python scripts/experiments/q4_lib_ab.py A/libdflash2_ort_q4.so B/libdflash2_ort_q4.so [--export DIR]
        [--threads 1,2] [--passes 2] [--json out.json]

First both libraries run the same random inputs through one Q4MatMul node on each shape of --shapes at 1-9, 17,
40 and 200 rows: their outputs must be bitwise equal (a kernel rewrite that keeps the arithmetic keeps the bits).
Then, with --export (an int4 export with its cpu_q4 flavour), each library in its own process
(DFLASH2_PLUGIN_LIB), passes in turns A B B A ...: a 199-token prompt's prefill (median of 3), autoregressive
tokens/s and a fixed 7-draft speculative run's verify ms a round (96 new tokens, greedy, the ids checked equal).
Measurement only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

LONG = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
        "metal type, oil-based ink and a screw press adapted from wine making. ") * 6


def same_bits(libs: list[str], shapes: list[tuple[int, int]]) -> None:
    import onnxruntime as ort

    from dflash2.native import q4

    rng = np.random.default_rng(0)
    for k, n in shapes:
        w = [(rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8), rng.random((n, k // 32), np.float32))]
        sess = []
        for lib in libs:
            o = ort.SessionOptions()
            o.register_custom_ops_library(lib)
            sess.append(ort.InferenceSession(q4.model(k, n, w, op=q4.OP), o, providers=["CPUExecutionProvider"]))
        for m in (*range(1, 10), 17, 40, 200):
            x = rng.standard_normal((m, k)).astype(np.float32)
            a, b = (s.run(None, {"x": x})[0] for s in sess)
            if not np.array_equal(a, b):
                sys.exit(f"{k}x{n}, {m} rows: the libraries differ by {np.abs(a - b).max():.3e}")
        print(f"{k}x{n}: bitwise equal at 1-9, 17, 40, 200 rows", flush=True)


def worker(export: str, threads: int) -> dict:
    from dflash2.runtime.api import Runtime

    rt = Runtime(export, threads=threads)
    ids, long_ids = rt.prompt_ids(text="Explain why the sky is blue.", chat=True), rt.prompt_ids(text=LONG)
    for spec in (True, False):  # warm-up: the first run of each shape allocates
        rt.generate(ids, 8, speculative=spec, draft_len=7)
    rt.generate(long_ids, 1, speculative=False)
    prefill = [rt.generate(long_ids, 1, speculative=False).stats.times["prefill"] for _ in range(3)]
    ar = rt.generate(ids, 96, speculative=False)
    sp = rt.generate(ids, 96, speculative=True, draft_len=7)
    if sp.ids != ar.ids:
        sys.exit("speculative ids differ from autoregressive ones")
    t = ar.stats.times
    return {"backend": rt.backend_label, "prompt_tokens": len(long_ids), "prefill_ms": 1e3 * float(np.median(prefill)),
            "ar_tok_s": ar.stats.new_tokens / (t["total"] - t["prefill"]),
            "verify_ms": 1e3 * sp.stats.times["verify"] / max(1, sp.stats.rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("libs", nargs=2)
    ap.add_argument("--export")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--shapes", default="576x3072,1536x576,576x49152,4096x4096")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], int(a.worker[1]))))
        return
    same_bits(a.libs, [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")])
    if not a.export:
        return
    res = []
    for t in (int(x) for x in a.threads.split(",")):
        for p in range(a.passes):
            for name, lib in (zip("AB", a.libs) if p % 2 == 0 else list(zip("AB", a.libs))[::-1]):
                env = dict(os.environ, DFLASH2_PLUGIN_LIB=str(Path(lib).resolve()))
                out = subprocess.run([sys.executable, __file__, *a.libs, "--worker", a.export, str(t)], env=env,
                                     check=True, capture_output=True, text=True).stdout
                r = {"lib": name, "threads": t, "pass": p + 1} | json.loads(out.splitlines()[-1])
                res.append(r)
                print(f"{t} thread(s) pass {p + 1} {name}: prefill {r['prefill_ms']:7.1f} ms ({r['prompt_tokens']} "
                      f"tokens)  AR {r['ar_tok_s']:6.1f} tok/s  verify of 8 rows {r['verify_ms']:5.1f} ms", flush=True)
    print("\nB over A, median over passes (prefill and verify: A's ms / B's; AR: B's tok/s / A's)")
    for t in sorted({r["threads"] for r in res}):
        A = [r for r in res if r["threads"] == t and r["lib"] == "A"]
        B = [r for r in res if r["threads"] == t and r["lib"] == "B"]
        ratio = {k: float(np.median([(x[k] / y[k]) if k != "ar_tok_s" else y[k] / x[k] for x, y in zip(A, B)]))
                 for k in ("prefill_ms", "ar_tok_s", "verify_ms")}
        print(f"{t} thread(s): prefill {ratio['prefill_ms']:.2f}x  AR {ratio['ar_tok_s']:.2f}x  "
              f"verify {ratio['verify_ms']:.2f}x")
        res.append({"threads": t, "b_over_a": ratio})
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"libs": a.libs, "runs": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
