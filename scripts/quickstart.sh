#!/usr/bin/env bash
# One command on a fresh machine: set up, then run the main job on the built-in default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/dflash2-demo "$@"
