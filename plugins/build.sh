#!/usr/bin/env bash
# Build the DFlash2 TensorRT plugin library, the CPU twin and the lifecycle test driver into
# build/plugins/ (Release). Builds and runs nothing else.
#
#   bash plugins/build.sh                          TensorRT 10.14.1 headers from the kernel-lens wheel
#   TENSORRT_ROOT=/opt/TensorRT bash plugins/build.sh      your own TensorRT (headers in $TENSORRT_ROOT/include)
#   DFLASH2_CPU_ONLY=1 bash plugins/build.sh       CPU twin only (no nvcc, no TensorRT headers)
#   DFLASH2_KERNEL_ONLY=1 bash plugins/build.sh    CPU twin + libdflash2_kernel.so (nvcc, no TensorRT headers)
# Other knobs: BUILD_DIR (default build/plugins), JOBS (default 2), CUDA_ARCHS (e.g. "90-real"),
# PYTHON (default python3; runs pip download and unzips the wheel).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/plugins}"
JOBS="${JOBS:-2}"
KERNEL_LENS="kernel-lens==2.0.1"
TRT_HEADERS="$ROOT/third_party/tensorrt/include"
CMAKE_ARGS=(-S "$ROOT/plugins" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release)

fetch_headers() {
  # Idempotent: a header set already unpacked is kept.
  if [[ -f "$TRT_HEADERS/NvInferRuntime.h" ]]; then
    echo "build.sh: TensorRT headers already in $TRT_HEADERS"
    return
  fi
  local cache="$ROOT/third_party/cache"
  mkdir -p "$cache"
  if ! compgen -G "$cache/kernel_lens-2.0.1-*.whl" >/dev/null; then
    echo "build.sh: fetching TensorRT headers ($KERNEL_LENS) into $cache"
    "${PYTHON:-python3}" -m pip download --quiet --no-deps "$KERNEL_LENS" -d "$cache"
  fi
  local wheel tmp
  wheel="$(compgen -G "$cache/kernel_lens-2.0.1-*.whl" | head -n1)"
  tmp="$(mktemp -d)"
  "${PYTHON:-python3}" - "$wheel" "$tmp" <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.startswith("kernel_lens/include/tensorrt/")]
    if not members:
        sys.exit(f"build.sh: {wheel} holds no kernel_lens/include/tensorrt/")
    z.extractall(dest, members)
EOF
  mkdir -p "$(dirname "$TRT_HEADERS")"
  rm -rf "$TRT_HEADERS"
  mv "$tmp/kernel_lens/include/tensorrt" "$TRT_HEADERS"
  rm -rf "$tmp"
  echo "build.sh: TensorRT headers unpacked into $TRT_HEADERS"
}

if [[ "${DFLASH2_CPU_ONLY:-0}" == "1" ]]; then
  CMAKE_ARGS+=(-DDFLASH2_CPU_ONLY=ON)
elif [[ "${DFLASH2_KERNEL_ONLY:-0}" == "1" ]]; then
  CMAKE_ARGS+=(-DDFLASH2_KERNEL_ONLY=ON)
elif [[ -n "${TENSORRT_ROOT:-}" ]]; then
  CMAKE_ARGS+=(-DTENSORRT_ROOT="$TENSORRT_ROOT")
else
  fetch_headers
  CMAKE_ARGS+=(-DTENSORRT_INCLUDE_DIR="$TRT_HEADERS")
fi
if [[ -n "${CUDA_ARCHS:-}" ]]; then
  CMAKE_ARGS+=(-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS")
fi
if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi

start=$SECONDS
cmake "${CMAKE_ARGS[@]}"
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "build.sh: built in $((SECONDS - start)) s -> $BUILD_DIR"
