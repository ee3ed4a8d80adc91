#!/usr/bin/env bash
# Set up a fresh machine: virtualenv, the package with its dev extra, the native plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch==2.13.0 (CPU) first, explicitly: a looser request could pull a multi-GB CUDA build.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[dev,smollm2]"
if [ -f plugins/build.sh ]; then bash plugins/build.sh; fi
