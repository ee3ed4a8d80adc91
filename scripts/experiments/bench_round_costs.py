"""What one speculative round costs against one target decode step, per export, in one interleaved run:

    python scripts/experiments/bench_round_costs.py EXPORT [EXPORT ...] [--threads 1] [--repeats 30] [--json out.json]

Per export, the session's real calls (ONNX Runtime included, the same buffers the loop binds) at a context of
~100 tokens: a target decode step (1 row), a draft, and a verify of 2 .. B rows; each the median of `repeats`
timings taken in turns with the other exports' (this machine is shared: ratios within one run, not absolute
times, are what compare). Prints a table and the ratios draft / decode and verify(k) / decode, the two numbers
that decide whether speculation can pay (docs/draft_len.md: a round of k drafts pays when its expected accepted
tokens exceed (draft + verify(k+1)) / decode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(folders: list[str], threads: int | None, repeats: int, context: int = 100) -> list[dict]:
    from dflash2.runtime.api import Runtime

    runtimes = [Runtime(f, threads=threads) for f in folders]
    sessions = [rt.session for rt in runtimes]
    B = min(s.block_size for s in sessions)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(context)]
    for s in sessions:
        s.prefill(prompt)
    samples = [{"decode": [], "draft": [], **{f"verify{k}": [] for k in range(2, B + 1)}} for _ in sessions]
    for r in range(repeats):
        for s, out in zip(sessions, samples):  # interleaved: each export's calls in turn
            s.pos = s.ctx_pos = context  # every timing at the same position (nothing accumulates)
            s.pending = 1
            out["decode"].append(_timed(lambda: s.decode(prompt[-1])))
            s.pos = s.ctx_pos = context
            s.pending = 1
            out["draft"].append(_timed(lambda: s.draft(prompt[-1])))
            for k in range(2, B + 1):
                s.pos = context
                out[f"verify{k}"].append(_timed(lambda: s.verify(prompt[-k:])))
        if r % 10 == 9:
            print(f"[{r + 1}/{repeats}]", file=sys.stderr, flush=True)
    results = []
    for f, rt, out in zip(folders, runtimes, samples):
        ms = {k: statistics.median(v) * 1e3 for k, v in out.items()}
        q = rt.manifest.quantization
        results.append({"export": f, "weights": q.method if q else rt.manifest.dtype,
                        "drafter_quantized": bool(q and "drafter" in q.graphs),
                        "drafter_graph": rt.manifest.graphs["drafter"].flavours.tensorrt is None and "fused" or "traced",
                        "ms": {k: round(v, 3) for k, v in ms.items()},
                        "draft_over_decode": round(ms["draft"] / ms["decode"], 3),
                        "verify_over_decode": {k: round(ms[f"verify{k}"] / ms["decode"], 3) for k in range(2, B + 1)}})
    return results


def table(results: list[dict]) -> str:
    ks = list(results[0]["verify_over_decode"])
    head = "| export | drafter | decode ms | draft ms | draft / decode | " + " | ".join(f"verify {k} / decode" for k in ks)
    lines = [head + " |", "|" + " --- |" * (5 + len(ks))]
    for r in results:
        d = f"{r['drafter_graph']}, {'quantized' if r['drafter_quantized'] else 'fp32'}"
        lines.append(f"| {r['export']} | {d} | {r['ms']['decode']:.2f} | {r['ms']['draft']:.2f} | "
                     f"{r['draft_over_decode']:.2f} | " + " | ".join(f"{r['verify_over_decode'][k]:.2f}" for k in ks) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads of every session")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    results = measure(a.folders, a.threads, a.repeats)
    out = {"threads": a.threads, "repeats": a.repeats, "results": results}
    print(json.dumps(out, indent=1))
    print(table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
