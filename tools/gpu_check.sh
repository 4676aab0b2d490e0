#!/usr/bin/env bash
# Second execution of the kernels of Shaders/ on an NVIDIA GPU (issue 7): builds
# Shaders/flash_attention.metal as CUDA through tools/gpu/metal_cuda.h, runs the accuracy grid of
# tools/gpu/harness.cu against the float64 reference, then compute-sanitizer memcheck, racecheck,
# synccheck and initcheck on the small grid. Prints one summary line per tool and exits non-zero on
# any mismatch, error, hazard, crash or timeout. Not part of ./build.sh test: CI has no GPU.
#
# Usage: tools/gpu_check.sh [--no-bench]
# Environment:
#   NVCC               nvcc to use (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc)
#   COMPUTE_SANITIZER  compute-sanitizer to use (default: next to nvcc, else on PATH)
#   FA_GPU_ARCH        -arch value (default: native; use e.g. sm_90 to build without a GPU)
#   FA_GPU_BUILD_DIR   build folder (default: a new temporary folder, kept for its logs)
# Needs: bash, GNU sed, timeout (coreutils), a C++17 host compiler that nvcc accepts.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GPU_DIR="$ROOT/tools/gpu"
BENCH=1
for arg in "$@"; do
    case "$arg" in
        --no-bench) BENCH=0 ;;
        *) echo "gpu_check: unknown argument '$arg' (usage: tools/gpu_check.sh [--no-bench])" >&2; exit 2 ;;
    esac
done

die() { echo "gpu_check: $*" >&2; exit 2; }

NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
command -v "$NVCC" >/dev/null || die "nvcc not found: install the CUDA toolkit or set NVCC=/path/to/nvcc"
if [ -z "${COMPUTE_SANITIZER:-}" ]; then
    COMPUTE_SANITIZER="$(dirname "$(command -v "$NVCC")")/compute-sanitizer"
    [ -x "$COMPUTE_SANITIZER" ] || COMPUTE_SANITIZER=$(command -v compute-sanitizer || true)
fi
[ -n "$COMPUTE_SANITIZER" ] && command -v "$COMPUTE_SANITIZER" >/dev/null \
    || die "compute-sanitizer not found: set COMPUTE_SANITIZER=/path/to/compute-sanitizer"
command -v timeout >/dev/null || die "timeout (coreutils) not found"
ARCH=${FA_GPU_ARCH:-native}
BUILD=${FA_GPU_BUILD_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/fa-gpu-check.XXXXXX")}
mkdir -p "$BUILD/src" || die "cannot create $BUILD"
echo "gpu_check: build folder $BUILD (logs: *.log)"
echo "gpu_check: $("$NVCC" --version | tail -n 1), arch $ARCH"

# The one source rewrite: MSL's address-space word `device` becomes `fa_device` (a macro named
# `device` would break CUDA's own __device__, which expands to __location__(device)). Everything
# else in the copies is byte-for-byte Shaders/.
for source in "$ROOT"/Shaders/*; do
    sed 's/\bdevice\b/fa_device/g' "$source" >"$BUILD/src/$(basename "$source")" \
        || die "cannot copy $source"
done

# Build: the kernels (slow: every head-dim bucket, fully unrolled loops) in parallel with the
# host-only files.
FLAGS=(-std=c++17 -O3 -arch="$ARCH" -lineinfo -I"$BUILD/src" -I"$GPU_DIR/include" -I"$GPU_DIR")
compile() {  # compile SOURCE OBJECT [extra flags]
    local source=$1 object=$2
    shift 2
    "$NVCC" "${FLAGS[@]}" "$@" -c "$source" -o "$object" >"$object.log" 2>&1
}
SECONDS=0
compile "$GPU_DIR/kernels.cu" "$BUILD/kernels.o" --resource-usage &
kernels_job=$!
host_ok=1
for unit in harness.cu reference.cpp accuracy.cpp cases.cpp; do
    compile "$GPU_DIR/$unit" "$BUILD/${unit%.*}.o" || { host_ok=0; cat "$BUILD/${unit%.*}.o.log" >&2; }
done
wait "$kernels_job" || { cat "$BUILD/kernels.o.log" >&2; die "compiling the kernels failed"; }
[ "$host_ok" = 1 ] || die "compiling the harness failed"
"$NVCC" "${FLAGS[@]}" "$BUILD"/{kernels,harness,reference,accuracy,cases}.o -o "$BUILD/harness" \
    || die "linking the harness failed"
echo "gpu_check: built in ${SECONDS}s (register and spill report: $BUILD/kernels.o.log)"

failures=0
summaries=()

# Accuracy grid: the harness prints its own summary line "cuda-accuracy: N cases, M mismatches".
SECONDS=0
timeout 300 "$BUILD/harness" 2>&1 | tee "$BUILD/accuracy.log"
status=${PIPESTATUS[0]}
line=$(grep -E '^cuda-accuracy:' "$BUILD/accuracy.log" | tail -n 1)
if [ "$status" = 124 ]; then
    line="cuda-accuracy: TIMEOUT after 300 s (a hang, e.g. a barrier not every thread reaches)"
elif [ -z "$line" ]; then
    line="cuda-accuracy: no summary (harness exit status $status)"
fi
[ "$status" = 0 ] || failures=$((failures + 1))
summaries+=("$line (${SECONDS}s)")

# compute-sanitizer on the small grid, one GPU run per case. A tool passes when the harness
# passes under it and the tool's own summaries report nothing.
sanitize() {  # sanitize TOOL LIMIT_SECONDS [tool options]
    local tool=$1 limit=$2
    shift 2
    local log="$BUILD/$tool.log"
    SECONDS=0
    echo "gpu_check: compute-sanitizer --tool $tool (log: $log)"
    timeout "$limit" "$COMPUTE_SANITIZER" --tool "$tool" "$@" "$BUILD/harness" --small --once \
        >"$log" 2>&1
    local status=$?
    local cases errors hazards summary
    cases=$(sed -nE 's/^cuda-accuracy: ([0-9]+) cases, ([0-9]+) mismatches.*/\1 cases, \2 mismatches/p' "$log" | tail -n 1)
    errors=$(sed -nE 's/^========= ERROR SUMMARY: ([0-9]+) error.*/\1/p' "$log" | tail -n 1)
    hazards=$(sed -nE 's/^========= RACECHECK SUMMARY: ([0-9]+) hazard.*\(([0-9]+) error.*, ([0-9]+) warning.*/\1 hazards (\2 errors, \3 warnings)/p' "$log" | tail -n 1)
    if [ "$status" = 124 ]; then
        summary="$tool: TIMEOUT after $limit s"
    elif [ -z "$cases" ] || [ -z "$errors" ]; then
        summary="$tool: incomplete run (exit status $status; see $log)"
        status=1
    else
        summary="$tool: $cases, $errors errors"
        [ -n "$hazards" ] && summary="$summary, $hazards"
        [ "$errors" = 0 ] || status=1
        case "$hazards" in "" | "0 hazards"*) ;; *) status=1 ;; esac
        case "$cases" in *", 0 mismatches") ;; *) status=1 ;; esac
    fi
    grep -E '^(FAIL|=========  *(Invalid|Race|Barrier|Uninitialized|Program hit|Leaked))' "$log" | head -n 20
    [ "$status" = 0 ] || failures=$((failures + 1))
    summaries+=("$summary (${SECONDS}s)")
}
sanitize memcheck 150 --leak-check full
sanitize racecheck 150 --racecheck-report all
sanitize synccheck 120
sanitize initcheck 120

if [ "$BENCH" = 1 ]; then
    # Throughput of the scalar kernels on an H200: describes their structure, not Apple GPUs.
    timeout 120 "$BUILD/harness" --bench 2>&1 | tee "$BUILD/bench.log" \
        || echo "gpu_check: bench did not finish (not a failure)"
fi

echo "==== gpu_check summary"
printf '%s\n' "${summaries[@]}"
if [ "$failures" = 0 ]; then
    echo "gpu_check: PASS"
    exit 0
fi
echo "gpu_check: FAIL ($failures of ${#summaries[@]} steps)"
exit 1
