"""dflash2 against the peers a CPU user would pick, same machine, same threads, same prompts, greedy, in one
interleaved run per thread count:

    python scripts/bench_peers.py EXPORT --genai GENAI_INT4 --llama-cpp BUILD/bin \
        --target-gguf TARGET.gguf --drafter-gguf DRAFTER.gguf [--threads 1,2] [--prompts default] [--json out.json]

Per prompt, in turns: dflash2 autoregressive and `--draft-len auto` (EXPORT, normally the int4 default),
onnxruntime-genai's int4 model of the same target (`python -m onnxruntime_genai.models.builder -i TARGET -o
GENAI_INT4 -p int4 -e cpu`), llama.cpp autoregressive on the target's GGUF (`llama-bench -n N -d PROMPT_LEN`,
the decode speed at the prompt's depth) and llama.cpp speculative with our drafter converted by its
`convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET` (`llama-speculative-simple`, its DFlash2 path).
llama.cpp is not a dependency: build it from the llama-cpp-python 0.3.36 sdist (docs/quantization.md has the
commands). tokens/s counts the tokens after the first over the time after the prompt for dflash2 and genai; for
llama.cpp it is what its tools print (llama-bench: generation only; speculative-simple: decoded tokens over
decode time). Prints a table and JSON; the ratios within one thread count compare (this machine is shared).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path


def llama_bench(bin_dir: Path, gguf: Path, threads: int, n: int, depth: int) -> float:
    """llama.cpp's own decode speed (tokens/s) for n tokens after `depth` tokens of context."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(n), "-d", str(depth),
                          "-t", str(threads), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    return float(rows[-1]["avg_ts"])


_SPEED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")


def llama_spec(bin_dir: Path, target: Path, drafter: Path, prompt: str, threads: int, n: int,
               draft_max: int) -> dict:
    """llama-speculative-simple, greedy: decoded tokens, seconds, tokens/s and acceptance as it prints them."""
    cmd = [str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-md", str(drafter), "-p", prompt,
           "-n", str(n), "--temp", "0", "-t", str(threads), "-td", str(threads), "--spec-type", "draft-dflash",
           "--spec-draft-n-max", str(draft_max),
           "-c", "2048"]  # llama.cpp's own warm-up run: the others are warmed up too
    r = subprocess.run(cmd, capture_output=True, text=True)
    text = r.stdout + r.stderr
    m = _SPEED.search(text)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"llama-speculative-simple failed (exit {r.returncode}):\n{text[-3000:]}")
    acc, drafted = _ACCEPT.search(text), _DRAFTED.search(text)
    return {"tokens": int(m.group(1)), "seconds": float(m.group(2)), "tps": float(m.group(3)),
            "accepted": int(acc.group(1)) if acc else None, "drafted": int(drafted.group(1)) if drafted else None}


def run(a) -> dict:
    from dflash2.prompts import parse_spec
    from dflash2.runtime.api import Runtime
    from dflash2.bench.quant import GenaiRunner
    from dflash2.speculative import generate

    prompts = parse_spec(a.prompts, default_split="eval", log=lambda s: print(s, file=sys.stderr))
    results = {}
    for threads in a.threads:
        rt = Runtime(a.export, threads=threads)
        portable = _portable_runtime(a.export, threads, rt)
        genai = GenaiRunner(a.genai, threads) if a.genai else None
        tok = {k: 0 for k in ("dflash2 AR", "dflash2 auto", "dflash2 AR MatMulNBits", "genai int4")}
        sec = {k: 0.0 for k in tok}
        llama_ar, llama_sp, lossless = [], {"tokens": 0, "seconds": 0.0, "accepted": 0, "drafted": 0}, True
        accepted = rounds = 0
        for i, prompt in enumerate(prompts):
            ids = rt.prompt_ids(text=prompt, chat=True)
            rt.session.check_capacity(len(ids), a.max_new_tokens)
            templated = rt.text.render([{"role": "user", "content": prompt}])
            if i == 0:  # untimed warm-up
                generate(rt.session, ids, 8, rt.eos_ids, speculative=False)
                if portable is not None:
                    generate(portable.session, ids, 8, portable.eos_ids, speculative=False)
                generate(rt.session, ids, 8, rt.eos_ids, schedule=rt.schedule("auto"))
                if genai:
                    genai.generate(ids, 8)
            ar = generate(rt.session, ids, a.max_new_tokens, rt.eos_ids, speculative=False)
            sp = generate(rt.session, ids, a.max_new_tokens, rt.eos_ids, schedule=rt.schedule("auto"))
            lossless &= ar.ids == sp.ids
            if portable is not None:  # the same export's portable graph: what the Q4MatMul flavour buys
                pa = generate(portable.session, ids, a.max_new_tokens, portable.eos_ids, speculative=False)
                tok["dflash2 AR MatMulNBits"] += max(pa.stats.new_tokens - 1, 0)
                sec["dflash2 AR MatMulNBits"] += pa.stats.decode_seconds
            accepted += sum(x + 1 for x in sp.stats.accepted)
            rounds += sp.stats.rounds
            for k, g in (("dflash2 AR", ar), ("dflash2 auto", sp)):
                tok[k] += max(g.stats.new_tokens - 1, 0)
                sec[k] += g.stats.decode_seconds
            if genai:
                out, s = genai.generate(ids, a.max_new_tokens)
                tok["genai int4"] += max(len(out) - 1, 0)
                sec["genai int4"] += s
            if a.llama_cpp:
                llama_ar.append(a.max_new_tokens / llama_bench(a.llama_cpp, a.target_gguf, threads, a.max_new_tokens,
                                                               len(ids)))  # seconds for the same token count
                s = llama_spec(a.llama_cpp, a.target_gguf, a.drafter_gguf, templated, threads, a.max_new_tokens,
                               a.draft_max)
                for k in ("tokens", "seconds"):
                    llama_sp[k] += s[k]
                for k in ("accepted", "drafted"):
                    llama_sp[k] += s[k] or 0
            tps = {k: tok[k] / sec[k] for k in tok if sec[k]}
            print(f"[threads {threads}] [prompt {i + 1}/{len(prompts)}] " + "  ".join(
                f"{k} {v:.1f}" for k, v in tps.items()) + (f"  llama.cpp AR {a.max_new_tokens * len(llama_ar) / sum(llama_ar):.1f}  "
                f"llama.cpp spec {llama_sp['tokens'] / llama_sp['seconds']:.1f}" if llama_ar else ""),
                file=sys.stderr, flush=True)
        tps = {k: tok[k] / sec[k] for k in tok if sec[k]}
        if llama_ar:
            tps["llama.cpp AR (Q4_1)"] = a.max_new_tokens * len(llama_ar) / sum(llama_ar)  # pooled, as the others
            tps["llama.cpp speculative"] = llama_sp["tokens"] / llama_sp["seconds"]
        results[str(threads)] = {"tokens_per_second": tps, "dflash2_lossless": lossless,
                                 "dflash2_acceptance": accepted / rounds if rounds else None, "llama_cpp_speculative": llama_sp}
        del rt, genai, portable
    return {"export": str(a.export), "prompts": a.prompts, "n_prompts": len(prompts),
            "max_new_tokens": a.max_new_tokens, "threads": results}


def _portable_runtime(export: Path, threads: int, rt):
    """A second runtime on the export's portable target graph (MatMulNBits) where `rt` opened its Q4MatMul flavour
    (dflash2.export.q4_flavour), else None."""
    import os

    from dflash2.native import q4
    from dflash2.runtime.api import Runtime

    if rt.graph_files.get("target") == rt.manifest.graphs["target"].flavours.portable:
        return None
    os.environ[q4.OFF_VAR] = "0"  # read when the runtime picks its graph files
    try:
        return Runtime(export, threads=threads)
    finally:
        del os.environ[q4.OFF_VAR]


def table(r: dict) -> str:
    lines = [f"{r['n_prompts']} prompts ({r['prompts']}), {r['max_new_tokens']} new tokens, greedy"]
    for t, res in r["threads"].items():
        tps = res["tokens_per_second"]
        ours = max(v for k, v in tps.items() if k.startswith("dflash2"))
        lines.append(f"threads {t}: {'configuration':<26}{'tok/s':>8}{'dflash2 best /':>16}")
        for k, v in tps.items():
            ratio = ours / v if v and not k.startswith("dflash2") else 1.0
            lines.append(f"           {k:<26}{v:>8.1f}{ratio:>15.2f}x")
        lines.append(f"           dflash2 lossless: {res['dflash2_lossless']}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export", type=Path)
    p.add_argument("--genai", type=Path)
    p.add_argument("--llama-cpp", type=Path, help="folder holding llama-bench and llama-speculative-simple")
    p.add_argument("--target-gguf", type=Path)
    p.add_argument("--drafter-gguf", type=Path)
    p.add_argument("--threads", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2])
    p.add_argument("--prompts", default="default")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-max", type=int, default=3, help="llama.cpp's drafts per round")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.llama_cpp and not (a.target_gguf and a.drafter_gguf):
        p.error("--llama-cpp needs --target-gguf and --drafter-gguf")
    r = run(a)
    print(table(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=2))
    print(json.dumps({t: v["tokens_per_second"] for t, v in r["threads"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
