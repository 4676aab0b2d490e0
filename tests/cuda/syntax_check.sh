#!/usr/bin/env bash
# The CUDA check's front end without nvcc or a GPU: clang parses every translation unit that
# gpu_check.sh compiles, host side and sm_90 device side, with -fsyntax-only (templates are
# instantiated, so a kernel construct that metal_cuda.h lacks fails here rather than on a lent
# GPU). Code generation (ptxas), register reports and every run still need gpu_check.sh on a GPU.
#
# CUDA headers: $CUDA_PATH when it holds include/crt/host_defines.h; else NVIDIA's wheels
# (nvidia-cuda-nvcc-cu12 for crt/ and libdevice, -cuda-runtime-, -cuda-cccl-, and -curand-cu12,
# which clang's CUDA wrapper includes) installed once with pip into .build/cuda-headers and laid
# out as a CUDA root there. clang: $CLANG, else clang++ on PATH.
#
# Usage: tests/cuda/syntax_check.sh [UNIT.cu ...]   (default: every unit; prints one line each)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
GPU_DIR="$ROOT/tests/cuda"
CLANG=${CLANG:-clang++}
die() { echo "syntax_check: $*" >&2; exit 2; }
command -v "$CLANG" >/dev/null || die "clang++ not found (set CLANG)"

cuda_root() {  # prints a CUDA root with headers, ptxas and libdevice
    if [ -n "${CUDA_PATH:-}" ] && [ -f "$CUDA_PATH/include/crt/host_defines.h" ]; then
        echo "$CUDA_PATH"
        return
    fi
    local cache="$ROOT/.build/cuda-headers" wheels package
    wheels="$cache/wheels/nvidia"
    if [ ! -f "$cache/root/include/crt/host_defines.h" ]; then
        python3 -m pip install --quiet --target "$cache/wheels" nvidia-cuda-nvcc-cu12 \
            nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12 nvidia-curand-cu12 >&2 \
            || die "pip could not install NVIDIA's CUDA header wheels (or set CUDA_PATH)"
        rm -rf "$cache/root"
        mkdir -p "$cache/root/bin" "$cache/root/include" "$cache/root/lib64"
        for package in cuda_runtime cuda_cccl curand cuda_nvcc; do
            cp -rs "$wheels/$package/include/." "$cache/root/include/" 2>/dev/null
        done
        ln -s "$wheels/cuda_nvcc/bin/ptxas" "$cache/root/bin/ptxas"
        ln -s "$wheels/cuda_nvcc/nvvm" "$cache/root/nvvm"
    fi
    echo "$cache/root"
}

CUDA=$(cuda_root) || exit 2
BUILD=$(mktemp -d "${TMPDIR:-/tmp}/fa-cuda-syntax.XXXXXX")
trap 'rm -rf "$BUILD"' EXIT
. "$GPU_DIR/copy_metal.sh"
copy_metal "$BUILD/src" "" "$ROOT"/Shaders/* || die "cannot copy Shaders/"
copy_metal "$BUILD/tests" "" "$ROOT/tests/kernels/"*.metal || die "cannot copy tests/kernels/"

units=("$@")
[ ${#units[@]} -gt 0 ] || units=($(cd "$GPU_DIR" && ls *.cu))
failed=0
for unit in "${units[@]}"; do
    unit=$(basename "$unit")
    if "$CLANG" -x cuda --cuda-path="$CUDA" --cuda-gpu-arch=sm_90 -Wno-unknown-cuda-version \
        -std=c++17 -fsyntax-only -I"$GPU_DIR/include" -I"$GPU_DIR" -I"$BUILD/src" -I"$BUILD/tests" \
        "$GPU_DIR/$unit" >"$BUILD/$unit.log" 2>&1; then
        echo "syntax_check: $unit PASS"
    else
        echo "syntax_check: $unit FAIL"
        grep -E "error" "$BUILD/$unit.log" | head -n 20
        failed=1
    fi
done
exit $failed
