"""The device check's kernel pieces: the kernel-only build (build), the CUDA kernel against its CPU twin on
every op flavour with hand-built and random cases (kernel-twin), its microseconds at real shapes
(kernel-time); with the case generators and the comparison rule kernel == twin they share with the
CUDA-graph piece (graph.py). The cases and the rule run on the CPU (the twin standing in for the kernel),
which is how tests/test_device_check.py proves them without a GPU."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np

from dflash2.bench.device.runner import FAIL, PASS, ROOT, SKIP

REAL_V, REAL_K, REAL_R = 248320, 16, 256
REAL_BLOCKS = (8, 16)  # S = block - 1 draft positions


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


