#!/usr/bin/env bash
# The TensorRT path end to end on a GPU machine (a few minutes):
#   plugin build -> tiny pair -> fp32 + fp16 exports -> dflash2-build engines -> dflash2-compare
#   --engines (PyTorch vs ONNX Runtime vs TensorRT per output) -> dflash2-run on the engines and
#   on the export: ids must be identical (lossless vs the ONNX Runtime path; fp16: spec == no-spec
#   on TensorRT) -> CUDA graphs give the same ids -> speedup (--no-spec vs spec), per-stage times.
#
# A GPU machine WITHOUT TensorRT (the lent device image) runs scripts/device_check.sh instead; this
# script then stops at its first step with one line saying so (docs/gpu.md: which check runs where).
# Needs: an NVIDIA GPU, TensorRT 10.x Python (`pip install tensorrt-cu12`, or JetPack on Jetson),
# cuda-python, nvcc + cmake, and this package installed with its export and trt extras (`pip install -e ".[export,trt]"`).
# Knobs: PYTHON (default python3), WORK (default a temp folder), CUDA_ARCHS (default: this GPU's
# SM), TENSORRT_ROOT (TensorRT headers for the plugin build), SKIP_PLUGIN_BUILD=1, MAX_NEW (64).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WORK="${WORK:-$(mktemp -d -t dflash2-gpu-XXXXXX)}"
MAX_NEW="${MAX_NEW:-64}"
IDS="5,17,42,99,7,250,31,64,12,300,8,77,140,23"
step() { printf '\n=== %s (%ds) ===\n' "$*" "$SECONDS"; }

step "environment"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no GPU here (no nvidia-smi): the TensorRT path needs one; on a CPU machine run the tests (docs/gpu.md)" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader
if ! "$PY" -c "import tensorrt" >/dev/null 2>&1; then
  echo "gpu_check: no TensorRT Python here: for the TensorRT path pip install tensorrt-cu12 (or JetPack); on a GPU without TensorRT run bash scripts/device_check.sh (docs/gpu.md)" >&2
  exit 2
fi
"$PY" - <<'EOF'
import tensorrt
from dflash2.native.cudart import compute_capability
print("tensorrt", tensorrt.__version__, "| device", compute_capability())
EOF
echo "work folder: $WORK"

step "plugin library (bash plugins/build.sh)"
if [[ "${SKIP_PLUGIN_BUILD:-0}" != "1" ]]; then
  if [[ -z "${CUDA_ARCHS:-}" ]]; then
    sm="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' .')"
    export CUDA_ARCHS="${sm}-real"
  fi
  bash plugins/build.sh
fi
"$PY" -m dflash2.cli.plugins find

step "tiny pair, fp32 + fp16 exports"
rm -rf "$WORK/pair"  # make-tiny writes only new folders
"$PY" -m dflash2.cli.make_tiny --out "$WORK/pair" --family qwen3 --drafter v2
for dt in float32 float16; do
  "$PY" -m dflash2.cli.export --model "$WORK/pair/drafter" --target "$WORK/pair/target" \
    --out "$WORK/export-$dt" --dtype "$dt" --max-seq-len 512 --force --quiet
done

step "engines (dflash2-build)"
"$PY" -m dflash2.cli.build "$WORK/export-float32" --out "$WORK/engines-fp32" --max-prefill 256 \
  --timing-cache "$WORK/timing.cache" --force
"$PY" -m dflash2.cli.build "$WORK/export-float16" --out "$WORK/engines-fp16" --precision fp16 \
  --max-prefill 256 --timing-cache "$WORK/timing.cache" --force
"$PY" -m dflash2.cli.build "$WORK/export-float32" --out "$WORK/engines-fp32" --max-prefill 256 --print-trtexec

step "dflash2-compare --engines (PyTorch vs ONNX Runtime vs TensorRT)"
"$PY" -m dflash2.cli.compare "$WORK/export-float32" --engines "$WORK/engines-fp32"
"$PY" -m dflash2.cli.compare "$WORK/export-float16" --engines "$WORK/engines-fp16"

step "dflash2-run: TensorRT vs ONNX Runtime"
run() { "$PY" -m dflash2.cli.run "$@" --prompt-ids "$IDS" --max-new-tokens "$MAX_NEW" --json; }
run "$WORK/engines-fp32" > "$WORK/trt-fp32.json"
run "$WORK/engines-fp32" --no-spec > "$WORK/trt-fp32-nospec.json"
run "$WORK/export-float32" > "$WORK/ort-fp32.json"
run "$WORK/export-float32" --no-spec > "$WORK/ort-fp32-nospec.json"
run "$WORK/engines-fp16" > "$WORK/trt-fp16.json"
run "$WORK/engines-fp16" --no-spec > "$WORK/trt-fp16-nospec.json"
run "$WORK/export-float16" > "$WORK/ort-fp16.json"
DFLASH2_CUDA_GRAPHS=1 run "$WORK/engines-fp32" > "$WORK/trt-fp32-graphs.json"

step "lossless checks, speedup, per-stage times"
"$PY" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path

w = Path(sys.argv[1])
r = {p.stem: json.loads(p.read_text()) for p in w.glob("*.json")}
fails = []

def same(a, b, must=True):
    ok = r[a]["ids"] == r[b]["ids"]
    print(f"{'OK ' if ok else 'DIFF'} ids {a} == {b}" + ("" if must else " (informational)"))
    if must and not ok:
        fails.append(f"{a} != {b}:\n  {r[a]['ids']}\n  {r[b]['ids']}")

for k in r:
    want = "tensorrt" if k.startswith("trt") else "onnxruntime"
    if r[k]["backend"] != want:
        fails.append(f"{k}: ran on {r[k]['backend']}, expected {want}")
same("trt-fp32", "ort-fp32")              # lossless vs the ONNX Runtime path
same("trt-fp32", "trt-fp32-nospec")       # speculative == target-only greedy
same("ort-fp32", "ort-fp32-nospec")
same("trt-fp32-graphs", "trt-fp32")       # CUDA graphs change nothing
same("trt-fp16", "trt-fp16-nospec")       # fp16 engines: greedy lossless on TensorRT itself
same("trt-fp16", "ort-fp16", must=False)  # fp16 kernels differ between backends: ties may flip
print()
print(f"{'run':<20}{'backend':<12}{'tok/s':>9}{'tau':>6}{'prefill':>9}{'draft':>9}{'verify':>9}"
      f"{'decode':>9}{'host':>8}{'total':>8}")
for k in ("ort-fp32-nospec", "ort-fp32", "trt-fp32-nospec", "trt-fp32", "trt-fp32-graphs",
          "trt-fp16-nospec", "trt-fp16"):
    s, t = r[k], r[k]["seconds"]
    print(f"{k:<20}{s['backend']:<12}{s['tokens_per_second']:>9.1f}{s['acceptance_length']:>6.2f}"
          + "".join(f"{t[x]:>9.4f}" for x in ("prefill", "draft", "verify", "decode"))
          + f"{t['host']:>8.4f}{t['total']:>8.4f}")
for prec in ("fp32", "fp16"):
    base, spec = r[f"trt-{prec}-nospec"]["tokens_per_second"], r[f"trt-{prec}"]["tokens_per_second"]
    print(f"TensorRT {prec}: speculative {spec:.1f} tok/s vs target-only {base:.1f} tok/s "
          f"= x{spec / base if base else float('nan'):.2f} (tiny random drafter: tau ~1, so no speedup is expected)")
print(f"TensorRT vs ONNX Runtime (fp32, speculative): x{r['trt-fp32']['tokens_per_second'] / max(r['ort-fp32']['tokens_per_second'], 1e-9):.2f}")
if fails:
    sys.exit("gpu_check: FAILED\n" + "\n".join(fails))
print("gpu_check: all lossless checks passed")
EOF
step "done"
