#!/usr/bin/env bash
# GPU check of the DFlash2Selector plugin, a few minutes on a machine with a GPU:
#   1. builds build/plugins/ (plugins/build.sh; offline machines need third_party/tensorrt/include
#      already there, e.g. carried from a machine where build.sh fetched it);
#   2. kernel vs CPU twin on odd and production shapes + kernel microseconds per launch at
#      S=7 K=16 R=256 V=151936, batch 1 and 8 (python -m dflash2.cli.plugins gpu: needs numpy only);
#   3. the pytest GPU tests (kernel vs twin vs PyTorch reference, timing, TensorRT engine when
#      `import tensorrt` works) when pytest and torch are importable.
# Usage: bash plugins/gpu_check.sh      (CUDA_ARCHS=90-real to build for one GPU only)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import numpy" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

echo "== build"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
bash plugins/build.sh

echo "== lifecycle driver"
build/plugins/dflash2_plugin_lifecycle_test

echo "== kernel vs CPU twin, kernel timing"
"$PY" -m dflash2.cli.plugins gpu

if "$PY" -c "import pytest, torch, hypothesis" 2>/dev/null; then
  echo "== pytest: GPU + TensorRT tests, CPU twin tests"
  DFLASH2_REQUIRE_PLUGINS=1 "$PY" -m pytest -q -rs -s tests/test_plugin_gpu.py tests/test_plugin_cpu.py
else
  echo "== pytest GPU tests not run: pytest, torch or hypothesis is not importable with $PY"
fi
