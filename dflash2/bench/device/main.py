"""The device check: everything that runs on a GPU machine WITHOUT TensorRT, as one command.

    bash scripts/device_check.sh            (= python -m dflash2.bench.device --out "$OUT")

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
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash2.bench.device.families import piece_torch_ref
from dflash2.bench.device.graph import piece_cuda_graph
from dflash2.bench.device.kernel import piece_build, piece_kernel_time, piece_kernel_twin, use_library
from dflash2.bench.device.runner import (PASS, PIECES, ROOT, TOTAL_BUDGET_S, format_table, run_all, travel_bytes,
                                         verdict, write_report)
from dflash2.bench.device.trainer import piece_tensorrt, piece_trainer

# what pyproject.toml's runtime / export / train extras import (module name: distribution)
PROJECT_MODULES = {"numpy": "numpy", "onnxruntime": "onnxruntime", "tokenizers": "tokenizers", "jinja2": "jinja2",
                   "ml_dtypes": "ml_dtypes", "torch": "torch", "transformers": "transformers",
                   "safetensors": "safetensors", "onnx": "onnx", "onnxscript": "onnxscript",
                   "polygraphy": "polygraphy", "matplotlib": "matplotlib"}


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


# ---------------------------------------------------------------- the environment piece, the piece table, main

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


FUNCS = {"environment": piece_environment, "build": piece_build, "kernel-twin": piece_kernel_twin,
         "kernel-time": piece_kernel_time, "cuda-graph": piece_cuda_graph, "torch-ref": piece_torch_ref,
         "trainer": piece_trainer, "tensorrt": piece_tensorrt}


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
