"""Where a decode step's time goes outside the graph's op list (issue 50), in one interleaved run:

    python scripts/experiments/step_loops.py EXPORT --genai GENAI_INT4 [--threads 2] [--steps 40] [--passes 30] \
        [--kernels] [--json out.json]

Loops, each timed over `steps` one-row decode steps at positions 40..40+steps, taken in turns (order reversed every
pass; the median of the per-pass ratios to the first loop is the comparison: this machine's speed drifts between
passes by up to 2x, not within one):
  dflash2            the runtime's own loop (`generate(..., speculative=False)`: a 40-token prefill, then decode)
  dflash2 graph      the export's target graph alone in a bare IOBinding loop, KV bound once (past = present), the
                     40 context rows written by 40 one-row steps: what the graph costs with nothing around it
  dflash2 graph +prefill   the same, the 40 rows written by one 40-row call first, as every generation does
  dflash2 graph +prefill elsewhere   the bare loop, a 40-row call run first on a second session of the same graph
                     (its own KV): whether what a multi-row call leaves behind is the session's or the process's
  dflash2 graph +prefill other KV    the bare loop, a 40-row call run first on the same session into another KV
                     buffer: whether it is the session's or the KV rows' (bitwise the same either way)
  genai graph        onnxruntime-genai's model.onnx in the same bare loop (past = present, attention_mask grown)
  genai              onnxruntime-genai's own greedy generator (its prefill, then generate_next_token)
--timeline N adds the steps one by one: on one session of the export's graph, N one-row steps right after a 40-row
call against N right after 40 one-row steps (the same KV rows, bitwise), medians over `passes` per step, in bands.
--kernels adds MatMulNBits at one row and one thread, per accuracy level (4: int8 activations; 0-3: fp32 / fp16 /
bf16 compute) and block size, at the SmolLM2 shapes: 30 distinct weights in a chain (cold, as a decode step reads
them) and one weight run repeatedly (hot in L2), microseconds per call.
Measurement only; nothing here ships with the runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

L, CAP, PROMPT = 30, 2048, 40


def _bare_session(path: Path, threads: int):
    from dflash2.onnxrt import open_session

    return open_session(path, ["CPUExecutionProvider"], threads, spin=True)  # the runtime's target options


def bind_kv(b, kv: np.ndarray):
    """Every layer's past and present bound to the same rows of `kv` [2L, 3, CAP, 64]: the step writes in place."""
    for i in range(L):
        for j, name in enumerate(("key", "value")):
            v = kv[2 * i + j:2 * i + j + 1]
            b.bind_input(f"past_key_values.{i}.{name}", "cpu", 0, np.float32, list(v.shape), v.ctypes.data)
            b.bind_output(f"present.{i}.{name}", "cpu", 0, np.float32, list(v.shape), v.ctypes.data)
    return b


def dflash2_graph(export: Path, threads: int, prefill: str | None):
    """A closure timing `n` one-row steps of the export's target graph; the bound arrays live in the closure.
    prefill: None, "same" (a 40-row call on this session first), "other" (on a second session, its own KV) or
    "other-kv" (on this session, into another KV buffer)."""
    s = _bare_session(export / "target.onnx", threads)
    kv = np.zeros((2 * L, 3, CAP, 64), np.float32)  # SmolLM2: 3 KV heads of 64
    other = _bare_session(export / "target.onnx", threads) if prefill == "other" else None
    other_kv = np.zeros_like(kv) if prefill in ("other", "other-kv") else None
    ids, plen, nxt = (np.zeros((1,), np.int32) for _ in range(3))
    ctx, logits = np.zeros((1, 576), np.float32), np.zeros((1, 49152), np.float32)
    b = bind_kv(s.io_binding(), kv)
    for name, arr in (("input_ids", ids), ("past_len", plen)):
        b.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
    for name, arr in (("next_ids", nxt), ("context", ctx), ("logits", logits)):
        b.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)

    def run(n: int) -> float:
        start = 0
        if prefill:  # one 40-row call, as the runtime's prefill
            sess, cache = {"same": (s, kv), "other": (other, other_kv), "other-kv": (s, other_kv)}[prefill]
            p = sess.io_binding()
            bind_kv(p, cache)
            p.bind_cpu_input("input_ids", np.arange(100, 100 + PROMPT, dtype=np.int32))
            p.bind_cpu_input("past_len", np.zeros((1,), np.int32))
            for name in ("next_ids", "context", "logits"):
                p.bind_output(name, "cpu")
            sess.run_with_iobinding(p)
            start = PROMPT if prefill == "same" else 0
        for t in range(start, PROMPT + n):
            if t == PROMPT:
                t0 = time.perf_counter()
            ids[0] = 100 + t if t < PROMPT else nxt[0]
            plen[0] = t
            s.run_with_iobinding(b)
        return (time.perf_counter() - t0) / n
    run.keep = (kv, other_kv, ctx, logits, ids, plen, nxt)  # the binding holds raw pointers into these
    return run


def genai_graph(folder: Path, threads: int):
    s = _bare_session(folder / "model.onnx", threads)
    kv = np.zeros((2 * L, 3, CAP, 64), np.float32)
    ids, mask, logits = np.zeros((1, 1), np.int64), np.ones((1, CAP), np.int64), np.zeros((1, 1, 49152), np.float32)
    b = bind_kv(s.io_binding(), kv)
    b.bind_input("input_ids", "cpu", 0, np.int64, [1, 1], ids.ctypes.data)
    b.bind_output("logits", "cpu", 0, np.float32, [1, 1, 49152], logits.ctypes.data)

    def run(n: int) -> float:
        tok = 100
        for t in range(1, PROMPT + 1 + n):
            if t == PROMPT + 1:
                t0 = time.perf_counter()
            ids[0, 0] = tok
            b.bind_input("attention_mask", "cpu", 0, np.int64, [1, t], mask.ctypes.data)
            s.run_with_iobinding(b)
            tok = 100 + t if t < PROMPT else int(logits[0, -1].argmax())  # greedy, as the generator's search
        return (time.perf_counter() - t0) / n
    run.keep = (kv, ids, mask, logits)
    return run


def timeline(export: Path, threads: int, steps: int, passes: int) -> dict:
    """ms per one-row step k = 0..steps-1 after a 40-row call ("prefill") and after 40 one-row steps ("one-row")."""
    s = _bare_session(export / "target.onnx", threads)
    kv = np.zeros((2 * L, 3, CAP, 64), np.float32)
    ids, plen, nxt = (np.zeros((1,), np.int32) for _ in range(3))
    ctx, logits = np.zeros((1, 576), np.float32), np.zeros((1, 49152), np.float32)

    step, pre = bind_kv(s.io_binding(), kv), bind_kv(s.io_binding(), kv)
    for name, arr in (("input_ids", ids), ("past_len", plen)):
        step.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
    for name, arr in (("next_ids", nxt), ("context", ctx), ("logits", logits)):
        step.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
    pre.bind_cpu_input("input_ids", np.arange(100, 100 + PROMPT, dtype=np.int32))
    pre.bind_cpu_input("past_len", np.zeros((1,), np.int32))
    for name in ("next_ids", "context", "logits"):
        pre.bind_output(name, "cpu")
    ms = {"prefill": np.zeros((passes, steps)), "one-row": np.zeros((passes, steps))}
    for r in range(passes):
        for mode in (("prefill", "one-row") if r % 2 == 0 else ("one-row", "prefill")):
            if mode == "prefill":
                s.run_with_iobinding(pre)
            else:
                for t in range(PROMPT):
                    ids[0], plen[0] = 100 + t, t
                    s.run_with_iobinding(step)
            for k in range(steps):
                t0 = time.perf_counter()
                ids[0], plen[0] = nxt[0], PROMPT + k
                s.run_with_iobinding(step)
                ms[mode][r, k] = (time.perf_counter() - t0) * 1e3
    med = {k: np.median(v, axis=0) for k, v in ms.items()}
    bands = [(a, b) for a, b in ((0, 5), (5, 10), (10, 20), (20, 40), (40, 80), (80, 160), (160, 320)) if a < steps]
    return {f"{a}-{min(b, steps)}": {k: float(v[a:b].mean()) for k, v in med.items()} for a, b in bands}


def kernels(passes: int, threads: int = 1) -> dict:
    """MatMulNBits at one row: us per call per (shape, accuracy level, block), cold (30 weights) and hot (one)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    def model(K, N, acc, bs, layers):
        rng, nodes, inits, x = np.random.default_rng(0), [], [], "x"
        for i in range(layers):
            nb = -(-K // bs)
            inits += [numpy_helper.from_array(rng.integers(0, 255, (N, nb, bs // 2), dtype=np.uint8), f"w{i}"),
                      numpy_helper.from_array((rng.random((N, nb)) * 0.01).astype(np.float32), f"s{i}")]
            nodes.append(helper.make_node("MatMulNBits", [x, f"w{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                          K=K, N=N, bits=4, block_size=bs, accuracy_level=acc))
            x = f"y{i}"
            if N != K:  # back to K columns for the next weight: a Slice or a Pad (a few us)
                nodes.append(helper.make_node("Slice", [x, "st", "en", "ax"], [f"c{i}"]) if N > K else
                             helper.make_node("Pad", [x, "pads"], [f"c{i}"]))
                x = f"c{i}"
        inits += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
                  (("st", [0]), ("en", [K]), ("ax", [-1]), ("pads", [0, 0, 0, max(K - N, 0)]))]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, K])], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)]).SerializeToString()

    cells = [(K, N, acc, bs, layers) for K, N in ((576, 3072), (1536, 576), (576, 49152))
             for acc, bs in ((4, 32), (0, 32), (1, 32), (2, 32), (3, 32), (4, 64), (4, 128))
             for layers in ((30, 1) if N != 49152 else (1,))]
    sessions = {}
    for c in cells:
        o = ort.SessionOptions()
        o.intra_op_num_threads, o.log_severity_level = threads, 3
        sessions[c] = ort.InferenceSession(model(*c), o, providers=["CPUExecutionProvider"])
    x = {K: np.random.default_rng(1).standard_normal((1, K)).astype(np.float32) for K, *_ in cells}
    times: dict = {c: [] for c in cells}
    for p in range(passes):
        for c in (cells if p % 2 == 0 else cells[::-1]):
            reps = 10 if c[4] > 1 else 100
            t0 = time.perf_counter()
            for _ in range(reps):
                sessions[c].run(None, {"x": x[c[0]]})
            times[c].append((time.perf_counter() - t0) / reps / c[4] * 1e6)
    out = {}
    for (K, N, acc, bs, layers), v in times.items():
        key = f"{K}x{N} acc{acc} b{bs} {'cold' if layers > 1 or N == 49152 else 'hot'}"
        out[key] = sorted(v)[len(v) // 2]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export", type=Path)
    p.add_argument("--genai", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--passes", type=int, default=30)
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--timeline", type=int, default=0, metavar="N")
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    import onnxruntime_genai as og

    from dflash2.bench.quant import GenaiRunner
    from dflash2.runtime.api import Runtime
    from dflash2.speculative import generate

    rt, genai = Runtime(a.export, threads=a.threads), GenaiRunner(a.genai, a.threads)
    prompt = list(range(100, 100 + PROMPT))

    def dflash2_loop(n: int) -> float:
        g = generate(rt.session, prompt, n + 1, (), speculative=False)
        return g.stats.decode_seconds / max(g.stats.new_tokens - 1, 1)

    def genai_loop(n: int) -> float:
        params = og.GeneratorParams(genai.model)
        params.set_search_options(do_sample=False, max_length=PROMPT + n + 1)
        gen = og.Generator(genai.model, params)
        gen.append_tokens(prompt)
        gen.generate_next_token()
        t0, k = time.perf_counter(), 0
        while not gen.is_done() and k < n:
            gen.generate_next_token()
            k += 1
        return (time.perf_counter() - t0) / max(k, 1)

    loops = {"dflash2": dflash2_loop, "dflash2 graph": dflash2_graph(a.export, a.threads, None),
             "dflash2 graph +prefill": dflash2_graph(a.export, a.threads, "same"),
             "dflash2 graph +prefill elsewhere": dflash2_graph(a.export, a.threads, "other"),
             "dflash2 graph +prefill other KV": dflash2_graph(a.export, a.threads, "other-kv"),
             "genai graph": genai_graph(a.genai, a.threads), "genai": genai_loop}
    ms: dict[str, list[float]] = {k: [] for k in loops}
    for f in loops.values():
        f(10)  # warm-up
    for i in range(a.passes):
        for k in (list(loops) if i % 2 == 0 else list(loops)[::-1]):
            ms[k].append(1e3 * loops[k](a.steps))
        print(f"pass {i + 1}/{a.passes}: " + "  ".join(f"{k} {v[-1]:.2f}" for k, v in ms.items()), file=sys.stderr)
    first = list(loops)[0]
    rows = {}
    for k, v in ms.items():
        r = sorted(x / y for x, y in zip(v, ms[first]))
        rows[k] = {"ms_median": sorted(v)[len(v) // 2], "ratio_median": r[len(r) // 2], "ratio_q1": r[len(r) // 4],
                   "ratio_q3": r[3 * len(r) // 4]}
    out = {"threads": a.threads, "steps": a.steps, "passes": a.passes, "loops": rows}
    print(f"{a.threads} thread(s), {a.steps} one-row steps after {PROMPT} context rows, {a.passes} passes")
    print(f"{'loop':<34}{'ms/step':>9}{'time / ' + first:>18}{'(quartiles)':>16}")
    for k, r in rows.items():
        print(f"{k:<34}{r['ms_median']:>9.3f}{r['ratio_median']:>18.3f}   ({r['ratio_q1']:.3f}-{r['ratio_q3']:.3f})")
    if a.timeline:
        out["timeline_ms"] = timeline(a.export, a.threads, a.timeline, a.passes)
        print(f"one-row steps after a {PROMPT}-row call vs after {PROMPT} one-row steps, ms "
              "(medians per step, band means):")
        for band, v in out["timeline_ms"].items():
            print(f"  steps {band:<8}{v['prefill']:>8.3f}{v['one-row']:>8.3f}{v['prefill'] / v['one-row']:>8.3f}x")
    if a.kernels:
        out["kernels_us"] = kernels(max(a.passes // 3, 5))
        print("MatMulNBits, one row, one thread, us per call (median):")
        for k, v in out["kernels_us"].items():
            print(f"  {k:<34}{v:>9.1f}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
