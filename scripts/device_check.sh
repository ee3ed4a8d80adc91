#!/usr/bin/env bash
# The device check: everything that runs on a GPU machine WITHOUT TensorRT, in one command (< 8 min):
# the selector's CUDA kernel built here with nvcc (no TensorRT headers) against its CPU twin on every op
# flavour, its microseconds at real shapes, CUDA-graph capture / replay through cuda-bindings, the PyTorch
# references of every target family on the GPU vs the CPU, a 3-minute trainer run with its throughput.
# Prints one table, writes device_check.json / .txt under $OUT (else out/device-check). The TensorRT path
# is a 'skipped' row: scripts/gpu_check.sh runs it where TensorRT is installed (docs/gpu.md).
#
# Python packages the GPU image lacks travel as wheels in .whl/ (bash scripts/device_wheels.sh, here);
# they are installed into /tmp/dflash2-site first. Without a GPU this refuses in one line (exit 2).
# Extra arguments go to python -m dflash2.bench.device (--only, --train-minutes, --lib, --archs).
# Knobs: PYTHON (default python3).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if command -v nvidia-smi >/dev/null 2>&1 && compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dflash2-site \
    "$ROOT"/.whl/*.whl || { echo "device_check: installing the carried wheels (.whl/) failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/dflash2-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m dflash2.bench.device --out "${OUT:-$ROOT/out/device-check}" "$@"
