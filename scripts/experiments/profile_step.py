"""Where a decode step's time goes: ONNX Runtime's own profiler over dflash2's target graph and over
onnxruntime-genai's model of the same target, one interleaved run (issue 50: find the gap before closing it).

    python scripts/experiments/profile_step.py EXPORT --genai GENAI_INT4 [--threads 1] [--tokens 64] \
        [--prompts default] [--json out.json]

Per prompt, in turns: dflash2 autoregressive (EXPORT's target session profiled) and genai's greedy generator
(its decoder session profiled through genai_config's session options). From each trace: the decode runs (every
run of one row after the prompt's), per op type the summed kernel time per decode step, and the step's wall time
inside ONNX Runtime (`model_run`) against the kernels' sum (what the executor itself costs). Prints a table of the
ops by time with both columns side by side and writes JSON. Times are per decode step in milliseconds; a profiled
run is slower than an unprofiled one, so compare shares and the difference between the columns, not tok/s.

Measurement only: nothing here ships with the runtime; the profiler is switched on by wrapping
onnxruntime.InferenceSession for this process (dflash2's sessions) and by a genai config overlay.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


def enable_ort_profiling(prefix_dir: str, only: str | tuple[str, ...]) -> None:
    """Every InferenceSession over a file whose name ends with `only` (one ending or several) writes a trace under
    prefix_dir."""
    import onnxruntime as ort

    orig = ort.InferenceSession.__init__

    def init(self, path_or_bytes, sess_options=None, *args, **kwargs):
        if isinstance(path_or_bytes, (str, os.PathLike)) and str(path_or_bytes).endswith(only):
            sess_options = sess_options or ort.SessionOptions()
            sess_options.enable_profiling = True
            sess_options.profile_file_prefix = os.path.join(prefix_dir, "dflash2")
        orig(self, path_or_bytes, sess_options, *args, **kwargs)

    ort.InferenceSession.__init__ = init


def block(node: str) -> str:
    """A node's block, from its name: the first name component after `layers.N` (dflash2: `layers.3.mlp.qmoe` ->
    mlp; genai: `/model/layers.3/moe/...` -> moe), else the first component (the embedding, the head)."""
    m = re.search(r"layers\.\d+[./]([A-Za-z0-9_]+)", node)
    if m:
        return m.group(1)
    return node.strip("/").removeprefix("model/").split("/")[0].split(".")[0]


def summarize(trace: list[dict], decode_runs: int) -> dict:
    """Per decode step: ms per op type, kernel sum, model_run wall, from a trace whose LAST `decode_runs`
    model_run events are decode steps (a trace holds warm-up, prefill and decode runs in order)."""
    runs = sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    keep = runs[-decode_runs:]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in keep]
    ops: dict[str, float] = defaultdict(float)
    blocks: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    nodes = sorted((e for e in trace if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    i = 0
    for e in nodes:  # nodes in decode spans only
        while i < len(spans) and e["ts"] > spans[i][1]:
            i += 1
        if i == len(spans):
            break
        if spans[i][0] <= e["ts"] <= spans[i][1]:
            op = e.get("args", {}).get("op_name", "?")
            ops[op] += e["dur"]
            counts[op] += 1
            blocks[block(e["name"].removesuffix("_kernel_time"))] += e["dur"]
    n = max(len(keep), 1)
    kernels = sum(ops.values()) / n / 1e3
    wall = sum(e["dur"] for e in keep) / n / 1e3
    return {"steps": len(keep), "model_run_ms": wall, "kernels_ms": kernels, "executor_ms": wall - kernels,
            "ops_ms": {k: v / n / 1e3 for k, v in sorted(ops.items(), key=lambda kv: -kv[1])},
            "nodes_per_step": {k: counts[k] / n for k in ops},
            "blocks_ms": {k: v / n / 1e3 for k, v in sorted(blocks.items(), key=lambda kv: -kv[1])}}


def table(d: dict, g: dict | None, top: int) -> str:
    cols = ["dflash2"] + (["genai"] if g else [])
    lines = [f"{'per decode step (ms)':<34}" + "".join(f"{c:>12}" for c in cols)]
    for key in ("model_run_ms", "kernels_ms", "executor_ms"):
        lines.append(f"{key:<34}" + "".join(f"{r[key]:>12.3f}" for r in [d] + ([g] if g else [])))
    names = list(d["ops_ms"])
    if g:
        names += [k for k in g["ops_ms"] if k not in d["ops_ms"]]
    names.sort(key=lambda k: -max(d["ops_ms"].get(k, 0), g["ops_ms"].get(k, 0) if g else 0))
    for k in names[:top]:
        row = f"  {k:<32}" + f"{d['ops_ms'].get(k, 0):>8.3f} x{d['nodes_per_step'].get(k, 0):<3.0f}"
        if g:
            row += f"{g['ops_ms'].get(k, 0):>8.3f} x{g['nodes_per_step'].get(k, 0):<3.0f}"
        lines.append(row)
    for r, who in [(d, "dflash2")] + ([(g, "genai")] if g else []):
        lines.append(f"blocks, {who} (ms per step): " + ", ".join(f"{k} {v:.2f}" for k, v in list(r["blocks_ms"].items())[:top]))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export", type=Path)
    p.add_argument("--genai", type=Path)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--prompts", default="default")
    p.add_argument("--raw", action="store_true", help="prompts are not chat-templated")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    work = tempfile.mkdtemp(prefix="profile_step.")
    enable_ort_profiling(work, ("target.onnx", "target.q4.onnx"))  # whichever flavour the runtime opens here
    from dflash2.prompts import parse_spec
    from dflash2.runtime.api import Runtime
    from dflash2.speculative import generate

    prompts = parse_spec(a.prompts, default_split="eval", log=lambda s: print(s, file=sys.stderr))
    rt = Runtime(a.export, threads=a.threads)
    genai = None
    if a.genai:
        import onnxruntime_genai as og

        config = og.Config(str(a.genai))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": a.threads, "enable_profiling": os.path.join(work, "genai")}}}}))
        genai = og.Model(config)
        del config
    d_steps = g_steps = 0
    for i, prompt in enumerate(prompts):
        ids = rt.prompt_ids(text=prompt, chat=not a.raw)
        g = generate(rt.session, ids, a.tokens, rt.eos_ids, speculative=False)
        d_steps += max(g.stats.new_tokens - 1, 0)  # the first new token comes from the prefill run
        if genai is not None:
            params = og.GeneratorParams(genai)
            params.set_search_options(do_sample=False, max_length=len(ids) + a.tokens)
            gen = og.Generator(genai, params)
            gen.append_tokens(ids)
            n = 0
            while not gen.is_done() and n < a.tokens:
                gen.generate_next_token()
                n += 1
            g_steps += max(n - 1, 0)
            del gen, params  # a live GeneratorParams keeps the model (and its trace unwritten)
        print(f"prompt {i + 1}/{len(prompts)}: {len(ids)} tokens", file=sys.stderr)
    # ONNX Runtime writes a trace when its session is destroyed
    del rt
    genai = None
    import gc

    gc.collect()
    d = _decode_summary(glob.glob(os.path.join(work, "dflash2*.json")), len(prompts))
    out = {"threads": a.threads, "tokens": a.tokens, "prompts": len(prompts), "dflash2": d}
    if a.genai:
        out["genai"] = _decode_summary(glob.glob(os.path.join(work, "genai*.json")), len(prompts))
    print(table(out["dflash2"], out.get("genai"), a.top))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


def _decode_summary(files: list[str], prompts: int) -> dict:
    """One trace per session: drop each prompt's first run (its prefill) and summarize the rest."""
    if len(files) != 1:
        raise SystemExit(f"expected one profile trace, found {files}")
    trace = json.loads(Path(files[0]).read_text())
    runs = sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    # a prefill run is far longer than its neighbours: the runs after a gap between generations start a prompt
    durs = sorted(e["dur"] for e in runs)
    median = durs[len(durs) // 2]
    decode = [e for e in runs if e["dur"] < 3 * median]
    sub = [e for e in trace if e.get("cat") != "Session"] + decode
    return summarize(sub, len(decode))


if __name__ == "__main__":
    sys.exit(main())
