"""The device check: everything that runs on a GPU machine WITHOUT TensorRT, as one command.

    bash scripts/device_check.sh            (= python -m dflash2.native.device_check --out "$OUT")

Pieces, each under its own time budget, each failure caught as a row (nothing passes silently):
  environment   GPU, driver, Python, torch, cuda-bindings, nvcc; which project dependencies are missing
  build         libdflash2_kernel.so + the CPU twin with nvcc, no TensorRT headers (DFLASH2_KERNEL_ONLY=1)
  kernel-twin   the CUDA kernel against its CPU twin: every op flavour (logits dtype x codebook dtype x
                mode x softcap), seeded random cases and hand-built ones (NaN / inf / ties, known sample
                answers, T <= 0 walking greedily, many uniforms on K = 64 rows)
  kernel-time   microseconds per launch at real shapes: block 8 and 16 (S = 7, 15), top-K 16, rank 256,
                vocabulary 248,320, batch 1 and 8, greedy and sample; kernel == twin there too
  cuda-graph    the kernel captured into a CUDA graph through cuda-bindings (cuda.bindings.runtime),
                replayed onto zeroed outputs: equal to the twin; replay vs plain launch microseconds
  torch-ref     the PyTorch references of every target family (llama, qwen3: reference/target.py;
                qwen3_5 hybrid: reference/qwen3_5.py) on the GPU against the CPU, prefill + a verify step
  trainer       dflash2-train on a small random target on the GPU for --train-minutes (default 3):
                label tokens/s
  tensorrt      skipped here: no TensorRT in this image (scripts/gpu_check.sh runs it where it is)

Prints one table (piece, cases, result, seconds, detail) and writes device_check.json and
device_check.txt under --out. Exit 0: every piece that ran passed; 1: a piece failed, errored or ran
out of time; 2: refused (no GPU here), in one line. docs/gpu.md says which check runs where.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TOTAL_BUDGET_S = 470  # the 8 minutes, less what Python's start and the wheel install take
# (name, budget in seconds); the trainer's budget is its training minutes plus BUDGETS["trainer"]
BUDGETS = {"environment": 20, "build": 100, "kernel-twin": 60, "kernel-time": 60, "cuda-graph": 40,
           "torch-ref": 60, "trainer": 75, "tensorrt": 10}
PIECES = tuple(BUDGETS)
REAL_V, REAL_K, REAL_R = 248320, 16, 256
REAL_BLOCKS = (8, 16)  # S = block - 1 draft positions
# what pyproject.toml's runtime / export / train extras import (module name: distribution)
PROJECT_MODULES = {"numpy": "numpy", "onnxruntime": "onnxruntime", "tokenizers": "tokenizers", "jinja2": "jinja2",
                   "ml_dtypes": "ml_dtypes", "torch": "torch", "transformers": "transformers",
                   "safetensors": "safetensors", "onnx": "onnx", "onnxscript": "onnxscript",
                   "polygraphy": "polygraphy", "matplotlib": "matplotlib"}
PASS, FAIL, ERROR, TIMEOUT, SKIP = "pass", "FAIL", "ERROR", "TIMEOUT", "skipped"


# ---------------------------------------------------------------- rows, runner, table, JSON

@dataclass
class Row:
    piece: str
    result: str = PASS
    cases: int = 0
    seconds: float = 0.0
    detail: str = ""
    data: dict = field(default_factory=dict)


class PieceTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise PieceTimeout()


def run_piece(name: str, fn, ctx: dict, budget_s: float) -> Row:
    """Run fn(ctx) -> Row (or dict of Row fields) under a wall-clock budget (SIGALRM; a call blocked in C
    is cut when it returns). Any exception becomes an ERROR row, running out of time a TIMEOUT row."""
    t0 = time.monotonic()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, max(budget_s, 0.001))
    try:
        got = fn(ctx)
        row = got if isinstance(got, Row) else Row(name, **(got or {}))
        row.piece = name
    except PieceTimeout:
        row = Row(name, TIMEOUT, detail=f"ran past its budget of {budget_s:.0f} s")
    except Exception as e:  # noqa: BLE001 - every failure becomes a row, never a traceback that stops the check
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        row = Row(name, ERROR, detail=msg[:400])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    row.seconds = round(time.monotonic() - t0, 2)
    return row


def format_table(rows: list[Row]) -> str:
    w = max([len(r.piece) for r in rows] + [5])
    lines = [f"{'piece':<{w}}  {'cases':>6}  {'result':<8}  {'seconds':>8}  detail"]
    for r in rows:
        lines.append(f"{r.piece:<{w}}  {r.cases:>6}  {r.result:<8}  {r.seconds:>8.1f}  {r.detail}")
    return "\n".join(lines)


def verdict(rows: list[Row]) -> tuple[int, str]:
    bad = [r.piece for r in rows if r.result not in (PASS, SKIP)]
    skipped = [r.piece for r in rows if r.result == SKIP]
    ran = len(rows) - len(skipped)
    if bad:
        return 1, f"device_check: FAILED: {', '.join(bad)} ({ran - len(bad)}/{ran} pieces passed; skipped: " \
                  f"{', '.join(skipped) or 'none'})"
    return 0, f"device_check: {ran}/{ran} pieces passed; skipped: {', '.join(skipped) or 'none'}"


def write_report(out: Path, rows: list[Row], meta: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rc, line = verdict(rows)
    doc = {"format": "dflash2-device-check", "version": 1, "exit_code": rc, "verdict": line, **meta,
           "rows": [asdict(r) for r in rows]}
    path = out / "device_check.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    (out / "device_check.txt").write_text(format_table(rows) + "\n" + line + "\n")
    return path


# ---------------------------------------------------------------- the refusal

def gpu_present() -> tuple[bool, str]:
    """(a GPU is visible, why not): nvidia-smi on PATH listing at least one GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False, "no nvidia-smi on PATH"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"nvidia-smi -L failed ({e})"
    if out.returncode != 0 or "GPU " not in out.stdout:
        why = (out.stderr or out.stdout).strip().splitlines()
        return False, f"nvidia-smi lists no GPU ({why[0] if why else f'exit {out.returncode}'})"
    return True, ""


# ---------------------------------------------------------------- kernel cases and the comparison rule

def flavours() -> list[tuple[str, str, str, float, float]]:
    """Every op flavour: (logits dtype, codebook dtype, mode, output_multiplier, logit_softcap)."""
    from dflash2.ops import contract as C
    return [(tl, tc, mode, mult, cap) for tl in C.FLOAT_TYPES for tc in C.FLOAT_TYPES for mode in C.MODES
            for mult, cap in ((1.0, 0.0), (1.7, 30.0))]


RANDOM_SHAPES = ((1, 7, 16, 256, 2000), (8, 15, 16, 256, 2000), (2, 1, 1, 1, 50), (2, 5, 64, 1024, 500),
                 (3, 40, 4, 33, 64))


def random_cases(seed: int = 0, shapes=RANDOM_SHAPES, temperature: float = 0.7):
    """(name, inputs, attrs) for every flavour x shape, seeded; yields lazily (inputs are made on demand)."""
    from dflash2.native.bench import random_inputs
    for i, (tl, tc, mode, mult, cap) in enumerate(flavours()):
        for j, (B, S, K, R, V) in enumerate(shapes):
            x = random_inputs(B, S, K, R, V, codebook_dtype=tc, logits_dtype=tl, seed=seed + 1000 * i + j,
                              temperature=temperature)
            yield (f"{tl}/{tc}/{mode}/m{mult}/cap{cap:g}/B{B}S{S}K{K}R{R}V{V}", x,
                   {"top_k": K, "rank": R, "output_multiplier": mult, "logit_softcap": cap, "mode": mode})


def _rows_inputs(rows, T, u) -> dict:
    """Each row its own batch element, S = 1, zero codebooks: the scores are the row's logits."""
    N, K = len(rows), len(rows[0])
    return {"cand_logits": np.array(rows, np.float32)[:, None, :],
            "cand_ids": np.tile(np.arange(K, dtype=np.int32), (N, 1, 1)), "gate": np.ones((N, 1, 1), np.float32),
            "anchor": np.zeros(N, np.int32), "pred_codebook": np.zeros((K, 1), np.float32),
            "succ_codebook": np.zeros((K, 1), np.float32), "uniforms": np.array(u, np.float32)[:, None],
            "temperature": np.array(T, np.float32)}


def hand_cases():
    """(name, inputs, attrs, known answers or None): special values with known greedy answers, a known
    path through the codebooks, sample rows around every cdf boundary, T <= 0 / NaN, many uniforms."""
    nan, inf = np.nan, np.inf
    logits = np.array([[[1, 3, 3, 2], [nan, -inf, -inf, nan], [1, inf, 5, inf], [-inf, nan, -5, -5]]], np.float32)
    ids = np.array([[[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 42, 43]]], np.int32)
    special = {"cand_logits": logits, "cand_ids": ids, "gate": np.ones((1, 4, 3), np.float32),
               "anchor": np.array([5], np.int32), "pred_codebook": np.zeros((50, 3), np.float32),
               "succ_codebook": np.zeros((50, 3), np.float32), "uniforms": np.full((1, 4), 0.5, np.float32),
               "temperature": np.zeros(1, np.float32)}
    want = {"draft_ids": [[11, 20, 31, 42]], "path_index": [[1, 0, 1, 2]]}
    for mode in ("greedy", "sample"):
        yield f"special-nan-inf-ties/{mode}", special, {"top_k": 4, "rank": 3, "mode": mode}, want
    # known path (tests/test_plugin_cpu.py): P[anchor 0] . Q[3] = 3 beats Q[1] -> token 3; P[3] = 0, equal
    # logits: tie -> index 0 (token 2); P[2] . Q = (1, 3) plus logits (2.5, 0) -> index 0 (token 1)
    path = {"cand_logits": np.array([[[0, 0], [0, 0], [2.5, 0]]], np.float32),
            "cand_ids": np.array([[[1, 3], [2, 0], [1, 3]]], np.int32), "gate": np.ones((1, 3, 2), np.float32),
            "anchor": np.array([0], np.int32),
            "pred_codebook": np.array([[1, 0], [0, 1], [1, 1], [0, 0]], np.float32),
            "succ_codebook": np.array([[1, 0], [0, 1], [0, 2], [3, 0]], np.float32),
            "uniforms": np.zeros((1, 3), np.float32), "temperature": np.ones(1, np.float32)}
    yield "known-path/greedy", path, {"top_k": 2, "rank": 2, "mode": "greedy"}, {"draft_ids": [[3, 2, 1]],
                                                                                "path_index": [[1, 0, 0]]}
    # sample rows: u just below / above every fp32 cdf boundary, at several temperatures
    row = [np.log(0.1), np.log(0.2), np.log(0.3), np.log(0.4)]
    rows, Ts, us = [], [], []
    for T in (0.5, 1.0, 2.0):
        r = np.array(row, np.float32)
        e = np.exp(((r - r.max()) / np.float32(T)).astype(np.float64)).astype(np.float32)
        cdf = np.cumsum(e, dtype=np.float32)
        for c in range(3):
            b = np.float32(cdf[c] / cdf[-1])
            for u in (np.nextafter(b, np.float32(0)), b, np.nextafter(b, np.float32(1))):
                rows.append(row)
                Ts.append(T)
                us.append(u)
    for T in (0.0, -1.0, nan):  # T <= 0 or NaN: greedy
        rows.append(row)
        Ts.append(T)
        us.append(0.05)
    yield "sample-cdf-boundaries", _rows_inputs(rows, Ts, us), {"top_k": 4, "rank": 1, "mode": "sample"}, None
    rng = np.random.default_rng(11)
    N, K = 4000, 64
    many = (rng.standard_normal((N, K)) * 3).astype(np.float32).tolist()
    yield ("sample-many-uniforms-K64", _rows_inputs(many, rng.choice([0.25, 0.7, 1.0, 1.5], N),
                                                    rng.random(N, dtype=np.float32)),
           {"top_k": K, "rank": 1, "mode": "sample"}, None)


def compare(got, want, exact_scores: bool) -> list[str]:
    """The rule kernel == twin (tests/test_plugin_gpu.py's): draft_ids and path_index exact; path_scores
    bit-identical when softcap is 0 (same code, no FMA contraction), else to 1e-5; confidence and
    draft_probs to rtol 1e-5 / atol 1e-7 (the device's exp). -> what differs (empty: equal)."""
    from dflash2.ops import contract as C
    names = C.output_names()
    if len(got) != len(names) or len(want) != len(names):
        return [f"expected {len(names)} outputs, got {len(got)} and {len(want)}"]
    bad = []
    for i, (name, a, b) in enumerate(zip(names, got, want)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            bad.append(f"{name}: shape {a.shape} vs {b.shape}")
            continue
        if i < 2 or (i == 2 and exact_scores):
            same = np.array_equal(a, b)  # NaN never appears: NaN scores are already -inf
        elif i == 2:
            same = np.allclose(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
        else:
            same = np.allclose(a, b, rtol=1e-5, atol=1e-7, equal_nan=True)
        if not same:
            where = np.argwhere(~np.isclose(a, b, rtol=0 if i < 2 else 1e-5, atol=0, equal_nan=True))[:3]
            bad.append(f"{name} differs at {where.tolist()}")
    return bad


def check_cases(cases, kernel, twin, deadline: float | None = None) -> dict:
    """Run each (name, inputs, attrs[, known]) through kernel and twin; -> {cases, mismatches, stopped}."""
    n, bad = 0, []
    for case in cases:
        if deadline is not None and time.monotonic() > deadline:
            return {"cases": n, "mismatches": bad, "stopped": f"budget spent after {n} cases"}
        name, x, attrs = case[:3]
        known = case[3] if len(case) > 3 else None
        g, c = kernel(**x, **attrs), twin(**x, **attrs)
        n += 1
        diff = compare(g, c, exact_scores=attrs.get("logit_softcap", 0.0) == 0.0)
        if known:
            for k, v in known.items():
                i = ("draft_ids", "path_index").index(k)
                if not np.array_equal(g[i], np.asarray(v)):
                    diff.append(f"{k} {np.asarray(g[i]).tolist()} != known {v}")
        bad += [f"{name}: {d}" for d in diff]
    return {"cases": n, "mismatches": bad, "stopped": ""}


def _kernel_fns():
    from dflash2.native import selector
    from dflash2.ops import contract as C

    def kernel(**kw):
        return selector.select_path_cuda(**kw)[:len(C.OUTPUTS)]
    return kernel, selector.select_path_cpu


def _cases_row(res: dict, what: str) -> dict:
    bad = res["mismatches"]
    if res["stopped"]:
        return {"result": FAIL, "cases": res["cases"], "detail": f"{res['stopped']}: not every case ran",
                "data": res}
    return {"result": FAIL if bad else PASS, "cases": res["cases"], "data": res,
            "detail": f"{len(bad)} mismatching: {bad[0]}" if bad else what}


# ---------------------------------------------------------------- the pieces

def piece_environment(ctx: dict) -> dict:
    env = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        env["gpu"] = q.stdout.strip().splitlines()[0] if q.stdout.strip() else q.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        env["gpu"] = f"nvidia-smi failed: {e}"
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc:
        v = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        m = re.search(r"release ([\d.]+)", v)
        env["nvcc"] = m.group(1) if m else v.strip()[-80:]
    else:
        env["nvcc"] = None
    versions, missing = {}, []
    for mod, dist in PROJECT_MODULES.items():
        if importlib.util.find_spec(mod) is None:
            missing.append(dist)
            continue
        try:
            from importlib.metadata import version
            versions[dist] = version(dist)
        except Exception:  # noqa: BLE001
            versions[dist] = "?"
    for dist in ("cuda-bindings", "cupy-cuda13x", "tensorrt"):
        try:
            from importlib.metadata import version
            versions[dist] = version(dist)
        except Exception:  # noqa: BLE001
            versions[dist] = None
    env["versions"], env["missing"] = versions, missing
    ctx["env"] = env
    gpu = env["gpu"].split(",")[0] if env["gpu"] else "?"
    detail = f"{gpu}; py {env['python']}; torch {versions.get('torch')}; nvcc {env['nvcc']}"
    detail += f"; missing: {', '.join(missing)}" if missing else "; every project dependency importable"
    return {"result": PASS, "cases": 1, "detail": detail, "data": env}


def compute_arch() -> str:
    q = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                       text=True, timeout=30)
    return q.stdout.strip().splitlines()[0].replace(".", "").strip() + "-real"


def use_library(path: Path) -> None:
    """Point the bindings at `path` (libdflash2_kernel.so or libdflash2_plugins.so) and its folder's twin."""
    from dflash2.native import selector
    os.environ["DFLASH2_PLUGIN_LIB"] = str(path)
    selector.load_plugin_library.cache_clear()
    selector.load_cpu_twin.cache_clear()


def piece_build(ctx: dict) -> dict:
    if ctx.get("lib"):
        use_library(Path(ctx["lib"]))
        ctx["lib_ready"] = True
        return {"result": SKIP, "detail": f"--lib {ctx['lib']}: not built here"}
    build = Path(ctx["work"]) / "kernel-build"
    env = {**os.environ, "DFLASH2_KERNEL_ONLY": "1", "BUILD_DIR": str(build), "JOBS": str(os.cpu_count() or 2),
           "CUDA_ARCHS": ctx.get("archs") or compute_arch()}
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(ROOT / "plugins" / "build.sh")], env=env, capture_output=True, text=True,
                       timeout=max(ctx["budget"] - 5, 5))
    log = Path(ctx["work"]) / "kernel-build.log"
    log.write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        tail = " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:])
        return {"result": FAIL, "detail": f"plugins/build.sh exit {p.returncode}: {tail[:300]}"}
    lib = build / "libdflash2_kernel.so"
    use_library(lib)
    from dflash2.native import selector
    n, why = selector.cuda_device_count()
    if n == 0:
        return {"result": FAIL, "detail": f"built, but the kernel library sees no CUDA device: {why}"}
    ctx["lib_ready"] = True
    return {"result": PASS, "cases": 1, "data": {"library": str(lib), "archs": env["CUDA_ARCHS"]},
            "detail": f"libdflash2_kernel.so for sm {env['CUDA_ARCHS']} in {time.monotonic() - t0:.0f} s "
                      f"(nvcc, no TensorRT headers); {n} device(s)"}


def _need_lib(ctx: dict) -> None:
    if not ctx.get("lib_ready"):
        raise RuntimeError("no kernel library: the build piece did not produce one")


def piece_kernel_twin(ctx: dict) -> dict:
    _need_lib(ctx)
    kernel, twin = _kernel_fns()
    deadline = time.monotonic() + ctx["budget"] - 3
    hand = check_cases(hand_cases(), kernel, twin, deadline)
    rand = check_cases(random_cases(), kernel, twin, deadline)
    res = {"cases": hand["cases"] + rand["cases"], "mismatches": hand["mismatches"] + rand["mismatches"],
           "stopped": hand["stopped"] or rand["stopped"], "hand_cases": hand["cases"], "random_cases": rand["cases"],
           "flavours": len(flavours())}
    return _cases_row(res, f"kernel == twin: {hand['cases']} hand-built + {rand['cases']} random cases, "
                           f"{len(flavours())} flavours, greedy + sample")


def real_inputs(B: int, S: int, dtype: str = "bfloat16", seed: int = 0, V: int = REAL_V, cache: dict | None = None):
    """Inputs at real shapes; the two [V, R] codebooks are made once per dtype (cache) and shared."""
    from dflash2.native.bench import random_inputs
    cache = {} if cache is None else cache
    if dtype not in cache:
        base = random_inputs(1, 1, REAL_K, REAL_R, V, codebook_dtype=dtype, logits_dtype=dtype, seed=seed)
        cache[dtype] = (base["pred_codebook"], base["succ_codebook"])
    small = random_inputs(B, S, REAL_K, REAL_R, 2 * REAL_K, codebook_dtype=dtype, logits_dtype=dtype, seed=seed + B + S,
                          temperature=0.7)
    rng = np.random.default_rng(seed + 7 * B + S)
    ids = np.stack([rng.choice(V, size=REAL_K, replace=False) for _ in range(B * S)]).reshape(B, S, REAL_K)
    small["cand_ids"] = ids.astype(np.int32)
    small["anchor"] = rng.integers(0, V, size=B, dtype=np.int32)
    small["pred_codebook"], small["succ_codebook"] = cache[dtype]
    return small


def piece_kernel_time(ctx: dict) -> dict:
    _need_lib(ctx)
    from dflash2.native import selector
    from dflash2.ops import contract as C
    timings, bad, n, cache = [], [], 0, ctx.setdefault("real_cache", {})
    for block in REAL_BLOCKS:
        for B in (1, 8):
            x = real_inputs(B, block - 1, cache=cache)
            for mode in C.MODES:
                *out, us = selector.select_path_cuda(**x, top_k=REAL_K, rank=REAL_R, mode=mode, timing_iters=200)
                twin = selector.select_path_cpu(**x, top_k=REAL_K, rank=REAL_R, mode=mode)
                n += 1
                bad += [f"block {block} B={B} {mode}: {d}" for d in compare(out, twin, exact_scores=True)]
                timings.append({"block": block, "S": block - 1, "batch": B, "mode": mode, "K": REAL_K, "R": REAL_R,
                                "V": REAL_V, "dtype": "bfloat16", "kernel_us": round(us, 2)})
    summary = ", ".join(f"b{t['block']}/B{t['batch']}/{t['mode'][0]} {t['kernel_us']:.1f}" for t in timings)
    return {"result": FAIL if bad else PASS, "cases": n, "data": {"timings": timings, "mismatches": bad},
            "detail": (f"{len(bad)} mismatching: {bad[0]}; " if bad else "kernel == twin; ") + "us/launch " + summary}


def _checked(rt):
    """dflash2.native.cudart.call for this runtime module (cuda.bindings.runtime, or a test's fake)."""
    def call(result, what: str):
        err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if err != rt.cudaError_t.cudaSuccess:
            msg = rt.cudaGetErrorString(err)
            msg = msg[1] if isinstance(msg, tuple) else msg
            raise RuntimeError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg} ({err})")
        return rest[0] if len(rest) == 1 else (rest or None)
    return call


def piece_cuda_graph(ctx: dict, rt=None, lib=None, V: int = REAL_V) -> dict:
    """Capture one launch (dflash2_launch_select_path, device pointers) on a cuda-bindings stream into a
    graph, zero the outputs, replay: the outputs equal the twin's; then time replays vs plain launches.
    rt / lib: cuda.bindings.runtime and the kernel library (a test passes fakes)."""
    if lib is None:
        _need_lib(ctx)
    from dflash2.native import selector
    from dflash2.ops import contract as C
    if rt is None:
        from dflash2.native import cudart as cr
        rt = cr.cudart()
    call = _checked(rt)
    lib = lib or selector.load_plugin_library()
    if not hasattr(lib, "dflash2_launch_select_path"):
        raise RuntimeError("the kernel library has no dflash2_launch_select_path (an older build?)")
    lib.dflash2_launch_select_path.argtypes = [ctypes.POINTER(selector._Args), ctypes.c_void_p, ctypes.c_char_p,
                                               ctypes.c_size_t]
    lib.dflash2_launch_select_path.restype = ctypes.c_int32
    H2D, D2H = rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    results, bad, ptrs = [], [], []
    stream = call(rt.cudaStreamCreateWithFlags(getattr(rt, "cudaStreamNonBlocking", 1)), "cudaStreamCreateWithFlags")
    err = ctypes.create_string_buffer(512)
    try:
        for block, mode in ((8, "greedy"), (16, "sample")):
            x = real_inputs(1, block - 1, V=V, cache=ctx.setdefault("real_cache", {}) if V == REAL_V else {})
            names = C.input_names()
            args, outs, keep = selector._prepare(tuple(x[n] for n in names), {"top_k": REAL_K, "rank": REAL_R,
                                                                              "mode": mode})
            dev = {}
            for n in names:
                a = keep[n]
                dev[n] = call(rt.cudaMalloc(max(a.nbytes, 1)), "cudaMalloc")
                ptrs.append(dev[n])
                call(rt.cudaMemcpy(dev[n], a.ctypes.data, a.nbytes, H2D), "cudaMemcpy H2D")
            for n, o in zip(C.output_names(), outs):
                dev[n] = call(rt.cudaMalloc(max(o.nbytes, 1)), "cudaMalloc")
                ptrs.append(dev[n])
            for n in names + C.output_names():
                setattr(args, n, dev[n])
            sp = ctypes.c_void_p(int(stream))  # the handle's value (getPtr() would be its address)

            def launch():
                if lib.dflash2_launch_select_path(ctypes.byref(args), sp, err, len(err)) != 0:
                    raise RuntimeError(err.value.decode())
            launch()  # warm (module load) outside the capture
            call(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
            call(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                 "cudaStreamBeginCapture")
            launch()
            graph = call(rt.cudaStreamEndCapture(stream), "cudaStreamEndCapture")
            gexec = call(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
            for n, o in zip(C.output_names(), outs):
                call(rt.cudaMemsetAsync(dev[n], 0, o.nbytes, stream), "cudaMemsetAsync")
            call(rt.cudaGraphLaunch(gexec, stream), "cudaGraphLaunch")
            call(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
            for n, o in zip(C.output_names(), outs):
                call(rt.cudaMemcpy(o.ctypes.data, dev[n], o.nbytes, D2H), "cudaMemcpy D2H")
            twin = selector.select_path_cpu(**x, top_k=REAL_K, rank=REAL_R, mode=mode)
            bad += [f"block {block} {mode}: {d}" for d in compare(outs, twin, exact_scores=True)]
            iters = 200
            t = {}
            for how, fn in (("graph_replay_us", lambda: call(rt.cudaGraphLaunch(gexec, stream), "cudaGraphLaunch")),
                            ("plain_launch_us", launch)):
                fn()
                call(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                call(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
                t[how] = round((time.perf_counter() - t0) / iters * 1e6, 2)
            results.append({"block": block, "batch": 1, "mode": mode, **t})
            call(rt.cudaGraphExecDestroy(gexec), "cudaGraphExecDestroy")
            call(rt.cudaGraphDestroy(graph), "cudaGraphDestroy")
    finally:
        for p in ptrs:
            rt.cudaFree(p)
        rt.cudaStreamDestroy(stream)
    summary = "; ".join(f"b{r['block']} {r['mode']}: replay {r['graph_replay_us']} us, launch "
                        f"{r['plain_launch_us']} us" for r in results)
    return {"result": FAIL if bad else PASS, "cases": len(results), "data": {"timings": results, "mismatches": bad},
            "detail": (f"{len(bad)} mismatching: {bad[0]}" if bad else "replayed graph == twin") + f"; {summary}"}


def rel_diff(a, b) -> float:
    """max |a - b| / max(1, max |b|) (the references' own parity measure)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max()))) if a.size else 0.0


def argmax_flips(a, b, margin: float = 1e-3) -> int:
    """Rows whose argmax differs although b's top-2 gap exceeds `margin` (a near-tie may flip)."""
    a, b = np.asarray(a), np.asarray(b)
    top2 = np.sort(b, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > margin
    return int(((a.argmax(-1) != b.argmax(-1)) & clear).sum())


TORCH_TOL = 1e-4  # fp32 logits, GPU vs CPU (TF32 off): only the matmul blocking and reduction order differ


def _dense_model(family: str, work: Path):
    import torch

    from dflash2 import tiny
    from dflash2.config import load_target_config
    from dflash2.reference.target import Target
    folder = work / f"ref-{family}"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny.target_config(family, 211, 64, 3, 4, 2, 128, False, 1, "float32", family == "qwen3")
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(3)
    m = Target(load_target_config(folder)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape))
    return m


def _hybrid_model():
    import torch

    from dflash2.reference.qwen3_5 import Qwen35Target, read_qwen3_5_config
    raw = {"architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 211, "hidden_size": 48, "intermediate_size": 96,
           "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    torch.manual_seed(4)
    m = Qwen35Target(read_qwen3_5_config(raw, "<device-check>/config.json")).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape))
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return m


def _run_family(family: str, model, device: str, prompt, verify):
    """prefill `prompt`, then a verify step of `verify` rows on the committed state -> (logits, logits)."""
    import torch
    model = model.to(device)
    with torch.no_grad(), torch.device(device):
        p, v = prompt.to(device), verify.to(device)
        if family == "qwen3_5":
            from dflash2.reference.qwen3_5 import commit
            state = model.empty_state()
            l1, _, step = model(p, state)
            state = commit(state, step, p.shape[0])
            l2, _, _ = model(v, state)
        else:
            c = model.config
            past = torch.zeros(0, c.num_layers, 2, c.num_kv_heads, c.head_dim)
            l1, _, kv = model(p, past)
            l2, _, _ = model(v, kv)
    return l1.float().cpu().numpy(), l2.float().cpu().numpy()


def piece_torch_ref(ctx: dict, device: str = "cuda", families=("llama", "qwen3", "qwen3_5")) -> dict:
    import copy

    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(5)
    prompt, verify = torch.randint(0, 211, (24,), generator=g), torch.randint(0, 211, (8,), generator=g)
    per, bad = {}, []
    for fam in families:
        m = _hybrid_model() if fam == "qwen3_5" else _dense_model(fam, Path(ctx["work"]))
        cpu = _run_family(fam, copy.deepcopy(m), "cpu", prompt, verify)
        dev = _run_family(fam, m, device, prompt, verify)
        d = [rel_diff(x, y) for x, y in zip(dev, cpu)]
        flips = sum(argmax_flips(x, y) for x, y in zip(dev, cpu))
        per[fam] = {"prefill_rel": d[0], "verify_rel": d[1], "argmax_flips": flips}
        if max(d) > TORCH_TOL or flips:
            bad.append(f"{fam}: rel {max(d):.2e} (tol {TORCH_TOL:g}), {flips} argmax flips")
    detail = "; ".join(f"{f} {max(v['prefill_rel'], v['verify_rel']):.1e}" for f, v in per.items())
    return {"result": FAIL if bad else PASS, "cases": 2 * len(families), "data": {"families": per, "tol": TORCH_TOL},
            "detail": (f"{bad[0]}; " if bad else f"{device} == cpu within {TORCH_TOL:g} (prefill + verify): ")
            + detail}


TOKS = re.compile(r"([\d,]+) label tok/s")


def parse_throughput(log: str) -> float | None:
    """The last 'N label tok/s' the trainer printed (dflash2/train/trainer.py), else None."""
    found = TOKS.findall(log)
    return float(found[-1].replace(",", "")) if found else None


def trainer_command(target: Path, out: Path, minutes: float, device: str = "cuda", prompts: int = 300) -> list[str]:
    return [sys.executable, "-m", "dflash2.cli.train", "--target", str(target), "--out", str(out),
            "--prompts", f"templated:{prompts}", "--max-new-tokens", "48", "--minutes", f"{minutes:g}",
            "--device", device, "--steps", "1000000", "--eval-every", "1000000", "--save-every", "1000000",
            "--block-size", "8", "--top-k", "16", "--rank", "64", "--seed", "0"]


def piece_trainer(ctx: dict, command=None) -> dict:
    minutes = ctx["train_minutes"]
    work = Path(ctx["work"]) / "trainer"
    cut = ""
    if command is None:
        fit = (ctx["budget"] - BUDGETS["trainer"]) / 60  # what is left after setup, corpus and evaluation
        if fit < minutes:
            if fit < 0.5:
                return {"result": FAIL, "detail": f"only {ctx['budget']:.0f} s left: too little for a trainer run"}
            minutes, cut = round(fit, 2), f" (cut from {minutes:g} min to fit the check's budget)"
        from dflash2 import tiny
        shutil.rmtree(work, ignore_errors=True)
        target = tiny.make_target(work / "target", family="qwen3", hidden_size=256, num_layers=4,
                                  intermediate_size=512)
        command = trainer_command(target, work / "drafter", minutes)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    try:
        p = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(ctx["budget"] - 5, 1),
                           cwd=str(ROOT))
        log, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        log += (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = "timeout"
    (work / "trainer.log").write_text(log)
    ctx["trainer_log"] = str(work / "trainer.log")
    rate = parse_throughput(log)
    took = time.monotonic() - t0
    data = {"minutes": minutes, "label_tokens_per_s": rate, "exit": rc, "seconds": round(took, 1),
            "command": " ".join(map(str, command)), "log_tail": log.strip().splitlines()[-8:]}
    if rc != 0 or rate is None:
        tail = " | ".join(log.strip().splitlines()[-2:])[:300]
        return {"result": FAIL, "data": data, "detail": f"trainer exit {rc}, throughput "
                                                        f"{'not printed' if rate is None else rate}: {tail}"}
    steps = re.findall(r"step (\d+)/", log)
    return {"result": PASS, "cases": int(steps[-1]) if steps else 0, "data": data,
            "detail": f"{minutes:g} min of training{cut}: {rate:,.0f} label tok/s ({took:.0f} s in all, corpus and "
                      f"evaluation included)"}


def piece_tensorrt(ctx: dict) -> dict:
    if importlib.util.find_spec("tensorrt") is None:
        return {"result": SKIP, "detail": "no TensorRT in this image (scripts/gpu_check.sh runs it where TensorRT "
                                          "is installed)"}
    return {"result": SKIP, "detail": "TensorRT is installed here: run scripts/gpu_check.sh for the TensorRT path"}


DEVICE_TREE_LIMIT = 64 * 1024 * 1024  # what one device call carries: the tree that travels + carried paths


def travel_bytes(root: Path = ROOT, carry: tuple[str, ...] = ()) -> dict:
    """What a device call would send from `root`: tracked files present on disk (a sparse checkout's
    absent ones are not), untracked files git does not ignore, and the `carry` paths; with the largest."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    files = {root / f for f in out.decode(errors="replace").split("\0") if f}
    for c in carry:
        p = root / c
        files |= set(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else ({p} if p.is_file() else set())
    sizes = sorted(((f.stat().st_size, str(f.relative_to(root))) for f in files if f.is_file() and not f.is_symlink()),
                   reverse=True)
    total = sum(b for b, _ in sizes)
    return {"bytes": total, "files": len(sizes), "limit": DEVICE_TREE_LIMIT, "fits": total < DEVICE_TREE_LIMIT,
            "largest": sizes[:5]}


FUNCS = {"environment": piece_environment, "build": piece_build, "kernel-twin": piece_kernel_twin,
         "kernel-time": piece_kernel_time, "cuda-graph": piece_cuda_graph, "torch-ref": piece_torch_ref,
         "trainer": piece_trainer, "tensorrt": piece_tensorrt}


def run_all(ctx: dict, pieces=PIECES, funcs=None, total_s: float = TOTAL_BUDGET_S, echo=print,
            on_row=None) -> list[Row]:
    """Each piece in order under min(its budget, what the whole check has left); a piece left no time is a
    TIMEOUT row. The trainer's budget is its minutes plus its setup allowance."""
    funcs = funcs or FUNCS
    end = time.monotonic() + total_s
    rows = []
    for name in pieces:
        own = BUDGETS.get(name, 60) + (60 * ctx.get("train_minutes", 0) if name == "trainer" else 0)
        left = end - time.monotonic()
        budget = min(own, left)
        if budget < 1:
            row = Row(name, TIMEOUT, detail=f"not started: the check's {total_s:.0f} s were spent")
        else:
            ctx["budget"] = budget
            row = run_piece(name, funcs[name], ctx, budget)
        rows.append(row)
        if on_row:
            on_row(rows)
        if echo:
            echo(f"[device_check] {row.piece}: {row.result} ({row.seconds:.1f} s) {row.detail}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="device_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "out/device-check",
                    help="folder for device_check.json / .txt (default $OUT, else out/device-check)")
    ap.add_argument("--work", help="scratch folder (default a temporary one)")
    ap.add_argument("--lib", help="use this built libdflash2_kernel.so / libdflash2_plugins.so (skip the build)")
    ap.add_argument("--archs", help="CUDA_ARCHS for the build (default: this GPU's, e.g. 90-real)")
    ap.add_argument("--train-minutes", type=float, default=3.0, help="trainer piece's training minutes (3)")
    ap.add_argument("--total-seconds", type=float, default=TOTAL_BUDGET_S,
                    help=f"the whole check's budget ({TOTAL_BUDGET_S})")
    ap.add_argument("--travel", nargs="*", metavar="CARRY",
                    help="print what a device call would send from this checkout (with these carried paths) "
                         "against the 64 MiB limit, and exit (no GPU needed)")
    ap.add_argument("--only", help=f"comma-separated pieces (default all: {','.join(PIECES)})")
    a = ap.parse_args(argv)
    pieces = tuple(a.only.split(",")) if a.only else PIECES
    unknown = [p for p in pieces if p not in FUNCS]
    if unknown:
        ap.error(f"unknown piece(s) {unknown}; known: {', '.join(PIECES)}")
    if a.travel is not None:
        t = travel_bytes(ROOT, tuple(a.travel))
        mib = t["bytes"] / 2**20
        print(f"device_check: the tree that travels{' + ' + ' '.join(a.travel) if a.travel else ''}: {t['files']} "
              f"files, {mib:.1f} MiB of 64 MiB: {'fits' if t['fits'] else 'TOO LARGE'}")
        if not t["fits"]:
            print("  largest: " + ", ".join(f"{n} ({b / 2**20:.1f} MiB)" for b, n in t["largest"]))
        return 0 if t["fits"] else 1
    ok, why = gpu_present()
    if not ok:
        print(f"device_check: refused: no GPU here ({why}); it runs on a GPU machine (docs/gpu.md), "
              f"the CPU runs tests/test_device_check.py", file=sys.stderr)
        return 2
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="dflash2-device-"))
    ctx = {"work": str(work), "lib": a.lib, "archs": a.archs, "train_minutes": a.train_minutes}
    if "build" not in pieces and a.lib:
        use_library(Path(a.lib))
        ctx["lib_ready"] = True
    t0 = time.monotonic()
    out = Path(a.out)

    def report(rows, final=False):  # after every piece: a later crash or kill still leaves the rows so far
        meta = {"seconds": round(time.monotonic() - t0, 1), "complete": final, "environment": ctx.get("env"),
                "work": str(work), "argv": sys.argv[1:] if argv is None else argv}
        return write_report(out, rows, meta)
    rows = run_all(ctx, pieces, total_s=a.total_seconds, on_row=report)
    path = report(rows, final=True)
    for log in (ctx.get("trainer_log"), str(work / "kernel-build.log")):
        if log and Path(log).is_file():
            shutil.copy(log, out / Path(log).name)
    rc, line = verdict(rows)
    print()
    print(format_table(rows))
    print(line)
    print(f"device_check: JSON in {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
