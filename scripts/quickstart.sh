#!/usr/bin/env bash
# One command on a fresh machine: set up, then the main job on the built-in default model
# (prepare SmolLM2-135M-Instruct -> export with the shipped DFlash2 drafter -> speculative chat).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/dflash2-demo "$@"
