"""Random-weight DFlash2 pairs of real shapes, and exports of them measured under `/usr/bin/time -v`.

`python scripts/scale_check.py --shape qwen3-0.6b --modes fp32,int4` writes the pair once (cached under
$DFLASH2_CACHE/scale/<shape>, streamed: the checkpoint writer holds one chunk, never a tensor), exports it
once per mode, and prints peak RSS, wall time per export step and the output's size, as JSON and a table.
A watchdog stops an export whose resident memory passes --max-rss-gib (an 8B-shaped export of the
in-memory kind would otherwise take the machine down) and records that it was stopped, and where.

The configs carry what real checkpoints carry (Qwen3-8B / Qwen3-0.6B `config.json` fields, z-lab's DFlash2
drafter fields: block 16, top-K 16, rank 256, sliding-window layers, taps spread over the target, a mask
token past the tokenizer's ids), and a tokenizer with as many ids as the real one (151,669 of 151,936 rows).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dflash2.folders import cache_root

QWEN3_TOKENS = 151_669  # ids of Qwen3's tokenizer (151,643 + 26 added) for 151,936 embedding rows


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    draft_layers: int
    taps: tuple[int, ...]
    block: int = 16
    top_k: int = 16
    rank: int = 256
    head_dim: int = 128
    dtype: str = "bfloat16"
    sliding_window: int | None = 2048
    tokens: int = QWEN3_TOKENS
    max_positions: int = 40960
    family: str = "qwen3"  # dflash2.families name: its tiny_config writes the config.json
    extra: tuple[tuple[str, object], ...] = ()  # more config.json fields (a hybrid's GDN heads, layer interval)
    draft_intermediate: int | None = None  # the drafter's MLP width where the target's differs (a MoE target's)
    full_layers: int | None = None  # set by truncate(): the real model's layer count, of which `layers` are kept


# Qwen3.5 / 3.8 dense hybrids: 3 Gated DeltaNet layers to 1 gated full-attention layer, GDN heads of 128 x 128
# (transformers' Qwen3_5TextConfig defaults and the public configs' fields, docs/families/qwen3_5.md)
QWEN3_5_TOKENS = 248_077  # ids below the mask id of most Qwen3.5 drafters (248,320 embedding rows)


def _hybrid(k_heads: int, v_heads: int) -> tuple[tuple[str, object], ...]:
    return (("full_attention_interval", 4), ("linear_num_key_heads", k_heads), ("linear_num_value_heads", v_heads),
            ("linear_key_head_dim", 128), ("linear_value_head_dim", 128), ("linear_conv_kernel_dim", 4),
            ("rope_parameters", {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True}))


SHAPES = {
    "qwen3-8b": Shape("qwen3-8b", 4096, 36, 32, 8, 12288, 151_936, False, 5, (1, 9, 17, 25, 33)),
    "qwen3-0.6b": Shape("qwen3-0.6b", 1024, 28, 16, 8, 3072, 151_936, True, 1, (1, 13, 25)),
    # CI-sized: the vocabulary of a real model, a few narrow layers (the embedding is the largest tensor)
    # Qwen3.5-0.8B-shaped (24 layers, hidden 1024; the edge pair Qwen3.5-0.8B-DFlash, block 16)
    "qwen3.5-0.8b": Shape("qwen3.5-0.8b", 1024, 24, 8, 2, 3584, 248_320, True, 1, (1, 12, 22), head_dim=256,
                          tokens=QWEN3_5_TOKENS, max_positions=262_144, sliding_window=None, family="qwen3_5",
                          extra=_hybrid(16, 16)),
    # Qwen3.8-27B-shaped DFlash2 pair (64 layers = 48 GDN + 16 full, hidden 5120; drafter 5 layers, block 8)
    "qwen3.8-27b": Shape("qwen3.8-27b", 5120, 64, 24, 4, 17408, 248_320, False, 5, (5, 19, 33, 47, 61), block=8,
                         head_dim=256, tokens=QWEN3_5_TOKENS, max_positions=262_144, family="qwen3_5",
                         extra=_hybrid(16, 48)),
    # Qwen3.5-9B-shaped (32 layers = 24 GDN + 8 full, hidden 4096, untied head; z-lab's drafter 5 layers, block 16)
    "qwen3.5-9b": Shape("qwen3.5-9b", 4096, 32, 16, 4, 12288, 248_320, False, 5, (1, 8, 15, 22, 29), head_dim=256,
                        tokens=QWEN3_5_TOKENS, max_positions=262_144, family="qwen3_5", extra=_hybrid(16, 32)),
    # Qwen3.6-35B-A3B-shaped (Qwen3_5Moe: 40 hybrid layers, hidden 2048, 256 experts top-8 of width 512 plus a
    # shared expert of 512 on every layer; a DFlash2 drafter of 5 layers, block 8). The experts are ~95% of it.
    "qwen3.6-35b-a3b": Shape("qwen3.6-35b-a3b", 2048, 40, 16, 2, 512, 248_320, False, 5, (1, 10, 19, 28, 37),
                             block=8, head_dim=256, tokens=QWEN3_5_TOKENS, max_positions=262_144,
                             family="qwen3_5_moe", draft_intermediate=6144,
                             extra=_hybrid(16, 32) + (("num_experts", 256), ("num_experts_per_tok", 8),
                                                      ("moe_intermediate_size", 512),
                                                      ("shared_expert_intermediate_size", 512))),
    "wide-vocab": Shape("wide-vocab", 256, 2, 4, 2, 512, 151_936, False, 1, (0, 1), block=8, top_k=8, rank=32,
                        head_dim=64, tokens=QWEN3_TOKENS),
    # Muse-Glimmer-30B-shaped text target (text_config defaults, docs/families/plan_muse_glimmer_gpt_oss.md 1.1:
    # 52 layers, 3 sliding (window 2048) : 1 NoPE full, gated attention, 32 / 2 heads of 128) with a DFlash2 drafter
    # of 5 layers on Meta's assistant's taps, block 16. ~28 B text parameters: ~60 GB bf16 with the drafter: run it only
    # cut to its first layers (a --layers cut), never whole on a shared disk
    # the same attention at a small width: hidden 1024, 4 layers (3 sliding of window 2048, 1 full), its real
    # window, so the validation's prefill (2,051 rows) crosses it; a minute's export (docs/export.md's comparison rules)
    "muse-glimmer-w2048": Shape("muse-glimmer-w2048", 1024, 4, 8, 2, 3072, 32_000, False, 1, (1, 2), block=8,
                                top_k=8, rank=32, tokens=31_000, max_positions=8192, family="muse_glimmer",
                                extra=(("sliding_window", 2048),)),
    "muse-glimmer-30b": Shape("muse-glimmer-30b", 6656, 52, 32, 2, 19968, 202_048, False, 5, (1, 13, 25, 37, 49),
                              tokens=200_000, max_positions=131_072, family="muse_glimmer",
                              extra=(("sliding_window", 2048),)),
}


# ------------------------------------------------------------------------------------ the checkpoints

def _bf16_bits(x: np.ndarray) -> np.ndarray:
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def _std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a tensor's random init, as dflash2.tiny draws them (logits of realistic magnitude)."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if "embed_tokens" in name:
        return 0.0, 1.0
    if name == "lm_head.weight":
        return 0.0, 3.0 / math.sqrt(shape[1])
    if name.endswith("codebook"):
        return 0.0, shape[1] ** -0.25
    if name.endswith("base_kernel"):
        return 0.0, 0.2
    return 0.0, shape[-1] ** -0.5


def write_safetensors(folder: Path, shapes: dict[str, tuple[int, ...]], dtype: str, seed: int,
                      shard_bytes: int = 4 << 30, chunk: int = 1 << 23) -> int:
    """Random tensors streamed into safetensors shards (+ the index when sharded); returns total bytes."""
    item = {"bfloat16": 2, "float32": 4}[dtype]
    st_dtype = {"bfloat16": "BF16", "float32": "F32"}[dtype]
    names = sorted(shapes)
    shards, cur, size = [], [], 0
    for n in names:
        b = math.prod(shapes[n]) * item
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    shards.append(cur)
    rng = np.random.default_rng(seed)
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = 0
    for fname, part in zip(files, shards):
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for n in part:
            b = math.prod(shapes[n]) * item
            header[n] = {"dtype": st_dtype, "shape": list(shapes[n]), "data_offsets": [off, off + b]}
            off += b
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        tmp = folder / f".{fname}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little") + raw)
            for n in part:
                mean, std = _std(n, shapes[n])
                left = math.prod(shapes[n])
                while left:
                    k = min(chunk, left)
                    x = rng.standard_normal(k, dtype=np.float32) * np.float32(std) + np.float32(mean)
                    fh.write((_bf16_bits(x) if dtype == "bfloat16" else x).tobytes())
                    left -= k
        os.replace(tmp, folder / fname)
        total += off
    if len(files) > 1:
        wm = {n: f for f, part in zip(files, shards) for n in part}
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=1))
    return total


def write_tokenizer(folder: Path, tokens: int) -> None:
    """A word-level tokenizer with `tokens` ids (the ChatML specials among them) and tiny's chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dflash2 import tiny

    vocab = {t: i for i, t in enumerate(tiny.SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(vocab), tokens)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(tiny.SPECIALS))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "chat_template": tiny.CHAT_TEMPLATE}, indent=2))


def make_pair(shape: Shape, root: Path | None = None, out_bytes_per_param: float = 0.0,
              out_root: Path | None = None) -> tuple[Path, Path]:
    """(drafter folder, target folder) of random weights, written once (a DONE marker makes it reusable). The disk is
    checked first: the pair, and the export of out_bytes_per_param per target parameter under out_root."""
    from dflash2 import tiny
    from dflash2.checkpoint import drafter_tensor_shapes, family_tensor_shapes
    from dflash2.config import load_drafter_config, load_target_config

    root = Path(root or cache_root() / "scale" / shape.name)
    target, drafter = root / "target", root / "drafter"
    for d in (target, drafter):
        d.mkdir(parents=True, exist_ok=True)
    eos = tiny.SPECIALS.index("<|im_end|>")
    cfg = tiny.target_config(shape.family, shape.vocab, shape.hidden, shape.layers, shape.heads, shape.kv_heads,
                             shape.intermediate, shape.tied, eos, shape.dtype, head_dim=shape.head_dim,
                             rope_theta=1_000_000.0, max_position_embeddings=shape.max_positions, **dict(shape.extra))
    tc_text = json.dumps(cfg, indent=2)
    if (root / "DONE").is_file() and (target / "config.json").read_text() != tc_text:
        raise RuntimeError(f"{root}: cached pair's target/config.json is not {shape.name}'s (a shape changed): "
                           f"delete {root}")
    (target / "config.json").write_text(tc_text)
    if not (root / "DONE").is_file():
        (target / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}))
        tc = load_target_config(target)
        extra = {}
        if shape.sliding_window:
            extra = {"layer_types": ["sliding_attention"] * shape.draft_layers, "sliding_window": shape.sliding_window}
        dcfg = tiny.drafter_config(tc, 2, shape.draft_layers, shape.block, list(shape.taps), shape.tokens, shape.top_k,
                                   shape.rank, 16, 2, 1.0, None, shape.draft_intermediate or shape.intermediate,
                                   torch_dtype=shape.dtype, **extra)
        (drafter / "config.json").write_text(json.dumps(dcfg, indent=2))
    from dflash2.bench.scalecut import check_disk, pair_sizes

    pair_bytes, params, scratch = pair_sizes(shape, target, drafter)
    cached = (root / "DONE").is_file()
    check_disk(0 if cached else pair_bytes, root, int(params * out_bytes_per_param) + scratch, Path(out_root or root),
               shape.name)
    if cached:
        return drafter, target
    write_tokenizer(target, shape.tokens)
    print(f"scale check: writing {shape.name} random weights ({pair_bytes / 1e9:.1f} GB) to {root} ...",
          file=sys.stderr, flush=True)
    write_safetensors(target, family_tensor_shapes(load_target_config(target)), shape.dtype, seed=0)
    write_safetensors(drafter, drafter_tensor_shapes(load_drafter_config(drafter), shape.hidden), shape.dtype, seed=1)
    (root / "DONE").write_text("random weights: dflash2.bench.scalecheck.make_pair\n")
    return drafter, target


# ------------------------------------------------------------------------------------ the measurement

MODES = {"fp32": [], "int4": ["--quantize", "int4"], "fp16": ["--dtype", "float16"], "bf16": ["--dtype", "bfloat16"],
         # the streamed stage alone: the CPU target graph from its templates, as the export builds it
         "target-int4": ["int4"], "target-fp32": ["fp32"]}

# `python -m dflash2.bench.scalecheck --stage target ...`: the export's streamed target stage by itself, with the
# same progress lines
STAGE = "target"


@dataclass
class Measured:
    shape: str
    mode: str
    rc: int
    peak_rss_gib: float | None
    wall_s: float
    steps: list[dict] = field(default_factory=list)  # {"step", "seconds", "peak_rss_gib"} per export step
    output_gb: float | None = None
    stopped: str | None = None  # why the watchdog stopped it
    error: str | None = None  # the export's last stderr line when it failed
    run: dict | None = None  # --run-check: dflash2-run on the export (run_check)
    load_average: list | None = None  # the machine's 1 / 5 / 15-minute load when the export ended (times compare
    # only at like loads)
    judged: dict | None = None  # the validation steps a fallback rule passed (judgments)


def judgments(out: Path) -> dict | None:
    """The validation steps of an export that passed by a fallback rule (docs/export.md, "How outputs are
    compared"): against the fp32 reference, or by PyTorch's own dtype error (with each output's RMSEs); the graphs
    recorded not validated, with why. None: no manifest."""
    f = out / "manifest.json"
    if not f.is_file():
        return None
    found = {}
    for graph, v in json.loads(f.read_text()).get("validation", {}).items():
        if v.get("skipped"):
            found[graph] = {"skipped": v["skipped"]}
        for step, r in (v.get("steps") or {}).items():
            if not isinstance(r, dict):
                continue
            if "judged_by_dtype_error" in r:
                found[f"{graph}.{step}"] = {"rule": "dtype error", **r["judged_by_dtype_error"]["outputs"]}
            elif "judged_against_fp32" in r:
                found[f"{graph}.{step}"] = {"rule": "fp32"}
    return found


def _rss_tree(pid: int) -> int:
    """Resident bytes of a process and its children (from /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, ValueError):
            pass
    return total


def measure(shape: Shape, mode: str, out_root: Path, max_rss_gib: float, timeout_s: float,
            python: str = sys.executable) -> Measured:
    from dflash2.bench.scalecut import OUT_BYTES_PER_PARAM

    out = out_root / f"{shape.name}-{mode}"
    drafter, target = make_pair(shape, out_bytes_per_param=OUT_BYTES_PER_PARAM[mode], out_root=out_root)
    if mode.startswith("target-"):
        cmd = ["/usr/bin/time", "-v", python, "-m", "dflash2.bench.scalecheck", "--stage", STAGE, str(drafter), str(target),
               str(out), *MODES[mode]]
    else:
        cmd = ["/usr/bin/time", "-v", python, "-m", "dflash2.cli.export", "--model", str(drafter), "--target",
               str(target), "--out", str(out), "--force", *MODES[mode]]
    t0 = time.perf_counter()
    # its own process group: the watchdog stops /usr/bin/time and the export under it (killing time alone left the
    # export running unwatched)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                            start_new_session=True)
    stopped: list[str] = []
    lines: list[str] = []
    current = ["start"]
    peaks: dict[str, int] = {}  # step -> the largest resident size sampled while it ran (every 0.5 s)

    def watch():
        while proc.poll() is None:
            rss = _rss_tree(proc.pid)
            peaks[current[0]] = max(peaks.get(current[0], 0), rss)
            if rss > max_rss_gib * 2**30:
                stopped.append(f"resident memory passed {max_rss_gib} GiB during: {(lines or ['start'])[-1][:120]}")
                os.killpg(proc.pid, signal.SIGKILL)
            elif time.perf_counter() - t0 > timeout_s:
                stopped.append(f"ran past {timeout_s:.0f} s during: {(lines or ['start'])[-1][:120]}")
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    for line in proc.stderr:
        lines.append(line.rstrip())
        m = re.match(r"^\[\d+/\d+\] (.*) \.\.\.$", line.rstrip())
        if m:
            current[0] = m.group(1)
        if line.startswith("[") or "layer" in line:
            print(f"  {shape.name} {mode}: {line.rstrip()}", file=sys.stderr, flush=True)
    rc = proc.wait()
    text = "\n".join(lines)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    # a step's closing line is "[i/n] <its opening title>: <outcome> in S s" (titles and outcomes may hold ": ")
    titles = [m.group(1) for m in re.finditer(r"^\[\d+/\d+\] (.*) \.\.\.$", text, re.M)]
    steps = []
    for m in re.finditer(r"^\[\d+/\d+\] (.*) in ([\d.]+) s$", text, re.M):
        title = next((t for t in titles if m.group(1).startswith(f"{t}: ")), None)
        if title is not None:
            steps.append({"step": title, "seconds": float(m.group(2)),
                          "peak_rss_gib": round(peaks.get(title, 0) / 2**30, 2)})
    size = sum(p.stat().st_size for p in out.iterdir()) / 1e9 if out.is_dir() and rc == 0 else None
    err = next((ln for ln in reversed(lines) if "error" in ln.lower() and "Command" not in ln), None)
    return Measured(shape.name, mode, rc, int(rss.group(1)) / 2**20 if rss else None, time.perf_counter() - t0,
                    steps, size, stopped[0] if stopped else None, None if rc == 0 else err,
                    judged=judgments(out) if rc == 0 else None)


RUN_PROMPT = "1,2,3,4,5,6,7,8"


def run_check(out: Path, new_tokens: int = 48, python: str = sys.executable) -> dict:
    """dflash2-run on an export: speculative ids against target-only ids (greedy, one prompt), and its start
    before the engine sessions (`start_s` of --json) in the first run after the export and the second."""
    runs = {}
    for label, extra in (("target_only", ["--no-spec"]), ("speculative", [])):
        p = subprocess.run([python, "-m", "dflash2.cli.run", str(out), "--prompt-ids", RUN_PROMPT, "--max-new-tokens",
                            str(new_tokens), "--json", *extra], capture_output=True, text=True)
        if p.returncode != 0:
            return {"error": f"dflash2-run {' '.join(extra)}: {p.stderr.strip().splitlines()[-1:]}"}
        runs[label] = json.loads(p.stdout)
    starts = [runs[k]["start_s"] for k in ("target_only", "speculative")]
    spec = runs["speculative"]
    return {"ids_equal": runs["target_only"]["ids"] == spec["ids"], "new_tokens": len(spec["ids"]),
            "acceptance_length": spec["acceptance_length"], "draft_lengths": spec["k_histogram"],
            "start_s": starts, "prompt_ids": RUN_PROMPT}


def step_table(r: Measured) -> str:
    out = [f"{r.shape} {r.mode}: {'step':<100} {'s':>7} {'peak GiB':>8}"]
    for st in r.steps:
        out.append(f"{'':<{len(r.shape) + len(r.mode) + 2}} {st['step'][:100]:<100} {st['seconds']:>7.1f} "
                   f"{st['peak_rss_gib']:>8.2f}")
    return "\n".join(out)


def table(rows: list[Measured]) -> str:
    head = f"{'shape':<20} {'mode':<5} {'rc':>3} {'peak RSS GiB':>12} {'wall s':>8} {'output GB':>9}  note"
    out = [head, "-" * len(head)]
    for r in rows:
        note = r.stopped or r.error or ""
        out.append(f"{r.shape:<20} {r.mode:<5} {r.rc:>3} {r.peak_rss_gib or float('nan'):>12.2f} {r.wall_s:>8.1f} "
                   f"{r.output_gb if r.output_gb is not None else float('nan'):>9.2f}  {note[:90]}")
    return "\n".join(out)


def target_stage(drafter: Path, target: Path, out: Path, method: str) -> None:
    """The export's target stage alone (dflash2.export.stages.gqa_target's build): templates, weights streamed
    from the checkpoint into out/target.onnx.data, quantized as written for int4."""
    from dflash2.checkpoint import Weights
    from dflash2.config import load_drafter_config, load_target_config
    from dflash2.export import gqa
    from dflash2.export import weights as W
    from dflash2.export.quantize import OrtQuant
    from dflash2.progress import Progress

    tc, dc = load_target_config(target), load_drafter_config(drafter)
    out.mkdir(parents=True, exist_ok=True)
    q = OrtQuant("int4") if method == "int4" else None
    progress = Progress(1)
    with progress.step(f"target.onnx: ONNX Runtime's fused ops, streamed from safetensors, {method}") as step:
        with W.DataFile(out / "target.onnx.data") as data:
            model = gqa.build(tc, dc, Weights(target), Weights(drafter), True, min(2048, tc.max_position_embeddings),
                              data, progress=step.layer, quant=q)
        import onnx

        onnx.save_model(model, str(out / "target.onnx"))


def main(argv=None) -> int:
    import argparse

    if argv is None and sys.argv[1:3] == ["--stage", STAGE]:
        target_stage(Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]), sys.argv[6])
        return 0

    p = argparse.ArgumentParser(prog="scale_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable (default qwen3-0.6b)")
    p.add_argument("--modes", default="fp32,int4", help=f"comma-separated of {sorted(MODES)}")
    p.add_argument("--out", type=Path, default=Path("/tmp/dflash2-scale"), help="where the exports go")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--max-rss-gib", type=float, default=20.0, help="stop an export past this resident memory")
    p.add_argument("--timeout-min", type=float, default=30.0, help="stop an export running longer")
    p.add_argument("--keep", action="store_true", help="keep the exports (default: removed after measuring)")
    p.add_argument("--layers", default="",
                   help="comma-separated: the target cut to its first N layers, one run per N (2+ N: the per-layer cost "
                        "and the whole model's extrapolated, dflash2.bench.scalecut)")
    p.add_argument("--drop-pair", action="store_true", help="delete each cached pair after its runs")
    p.add_argument("--run-check", action="store_true",
                   help="dflash2-run on each whole export: speculative ids == target-only ids, start before the sessions")
    a = p.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes: expected some of {sorted(MODES)}, found {bad}")
    import shutil

    from dflash2.bench.scalecut import DiskTooSmall, per_layer, truncate

    try:
        cuts = [int(n) for n in a.layers.split(",") if n.strip()]
        shapes = [truncate(SHAPES[n], k) for n in a.shape or ["qwen3-0.6b"] for k in cuts or [SHAPES[n].layers]]
    except ValueError as e:
        p.error(f"--layers {a.layers!r}: {e}")
    rows = []

    def document() -> dict:
        return {"machine": {"cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                            "mem_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)},
                "shapes": {s.name: asdict(s) for s in shapes}, "results": [asdict(r) for r in rows],
                "per_layer": per_layer(shapes, rows)}

    for shape in shapes:
        name = shape.name
        for mode in modes:
            try:
                rows.append(measure(shape, mode, a.out, a.max_rss_gib, a.timeout_min * 60))
                rows[-1].load_average = [round(x, 2) for x in os.getloadavg()]
            except DiskTooSmall as e:
                print(f"scale check: {e}", file=sys.stderr, flush=True)
                rows.append(Measured(name, mode, -1, None, 0.0, error=f"not run: {e}"))
                continue
            if a.run_check and rows[-1].rc == 0 and not mode.startswith("target-"):
                rows[-1].run = run_check(a.out / f"{name}-{mode}")
                print(f"  {name} {mode}: dflash2-run: {json.dumps(rows[-1].run)}", file=sys.stderr, flush=True)
            if not a.keep:
                shutil.rmtree(a.out / f"{name}-{mode}", ignore_errors=True)
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
            if a.json:  # after every run: a long series stopped part way keeps what it measured
                a.json.write_text(json.dumps(document(), indent=1) + "\n")
        if a.drop_pair:
            shutil.rmtree(cache_root() / "scale" / name, ignore_errors=True)
    doc = document()
    print(json.dumps(doc, indent=1))
    for r in rows:
        print(step_table(r))
    print(table(rows))
    for fit in doc["per_layer"]:
        print(f"{fit['shape']} {fit['mode']}: per layer {fit['per_layer']}, fixed {fit['fixed']}, "
              f"{fit['full_layers']} layers extrapolated {fit['extrapolated']}")
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r.rc == 0 and (r.run is None or r.run.get("ids_equal")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
