#!/usr/bin/env bash
# The wheels the device check carries to the GPU image (nothing can be fetched there): the project's
# Python dependencies that image lacks (docs/gpu.md, "What the device check carries"). Downloads them
# into .whl/ (git-ignored) for Python 3.12 / manylinux x86_64 with the device tool's pip flags, lists
# each with its size and the total (must stay under 64 MiB, with the rest of the tree that travels).
#
#   bash scripts/device_wheels.sh            here, where pip reaches PyPI; then carry ".whl" in the run
# Knobs: PYTHON (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
# name==version: pure-Python, no dependency the image lacks (checked with
# `unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist`).
WHEELS=(
  "polygraphy==0.53.6"  # export / trt extras (dflash2/export/validate.py, engines/compare.py); not in the image
)
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
echo
echo "wheels in .whl/ (carry \".whl\" in the device run):"
total=0
for w in .whl/*.whl; do
  b=$(stat -c %s "$w"); total=$((total + b))
  printf '  %-60s %10d bytes\n' "$(basename "$w")" "$b"
done
printf '  %-60s %10d bytes (%.2f MiB; limit 64 MiB with the tree)\n' "total" "$total" "$(awk "BEGIN{print $total/1048576}")"
PYTHONPATH="$ROOT" "$PY" -m dflash2.bench.device --travel .whl
