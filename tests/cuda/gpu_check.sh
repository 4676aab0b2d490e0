#!/usr/bin/env bash
# Second execution of the kernels of Shaders/ on an NVIDIA GPU (issue 7): builds
# Shaders/flash_attention.metal as CUDA through tests/cuda/metal_cuda.h and runs it through the
# library's exported plans (issue 35): tests/cuda/cases.py writes each case's plans (fa_plan_create,
# on a machine with the library) and inputs, tests/cuda/replay.cu launches every dispatch as the
# plan gives it (launch_table.cu: every instance of the kernel catalogue by name, with the plan's
# function constants) and dumps every case's outputs for tests/cuda/judge.py to judge with the
# Python package's float64 reference and accuracy rule (python/flash_attention_metal/reference.py
# and accuracy.py, the rule's one definition); then compute-sanitizer memcheck, racecheck,
# synccheck and initcheck on the small grid. Prints one summary line per step and exits non-zero on
# any mismatch, error, hazard, crash or timeout. Not part of ./build.sh test: CI has no GPU. The
# plans come from FA_GPU_PLANS (a folder with small.json and full.json that `tests/cuda/cases.py
# plan` wrote, for a GPU machine without the library) or are made here.
#
# Before that, tests/cuda/matrix_check.cu runs the CPU engine's SIMD-group matrix test kernels
# (tests/kernels/matrix.metal) through metal_cuda.h's warp-shuffle emulation. Two planted faults
# afterwards show that the checks can fail: the kernels built with every threadgroup_barrier
# deleted must make racecheck report hazards, and built with exp2 replaced by exp (the kernels'
# one exp2 call, in exp_of, takes x * log2(e), so exp gives the wrong softmax) must make the
# accuracy judgement report mismatches. A detector that misses its fault fails the run too, and so
# does a planted fault that no longer changes the kernel source.
#
# Opt-in, --large: tests/cuda/large_offsets.cu runs the library's plan (cases.py plan large) of
# forward and the backward's delta, lse residual and dQ dispatches on q, out, dout and dq of more
# than 2^32 elements (seqlen_q 2^25 + 5, head_dim 128; about 35 GB of device memory; its inputs made
# on the device) and dumps sampled rows, those past element 2^32 included, for judge.py. Its
# planted fault, the kernels built with every ulong replaced by uint (32-bit offsets), must fail it.
# --large-only builds and runs just that step (and its planted fault).
#
# The build is most of a run (minutes: every kernel instance, fully unrolled). --build-only stops
# after it, and --reuse skips every compile and link whose output is already in the build folder:
# with FA_GPU_BUILD_DIR set, one call builds and the next runs the checks (a device session's
# per-call limit). --mutants-only runs the default steps' planted faults alone (with --reuse,
# after a --no-mutants run on the same build folder). The device code of each unit is optimised
# on all cores (nvcc -split-compile).
#
# The grids hold the Metal 4 tensor-op kernels too (names tensor_*: grid.tensor_cases, planned by
# fa_plan_create_for (tensor-op library ready) under FLASH_ATTENTION_TENSOR_OPS=1; launch_table_tensor.cu, the
# tensor-op library's unit, linked beside launch_table.cu), judged by the rule's tensor-op term,
# under the sanitizers with the small grid, and replayed once more in the permuted
# cooperative-tensor layout, whose outputs must be the M5 layout's bit for bit (steps
# cuda-replay-permuted, cuda-tensor-layouts).
#
# After the matrix check, tests/cuda/tensor_ops_check.cu runs the CPU engine's tensor-op test
# kernels (tests/kernels/tensor_ops.metal) through metal_tensor_ops.h's matmul2d emulation (step
# cuda-tensor-ops: the documented accumulation order, bounds, both layouts, the scope and capacity
# faults) and writes their outputs, which tests/cuda/tensor_ops_compare.py compares bit for bit
# with the CPU engine's, committed as tests/cuda/tensor_ops_engine.txt (step
# cuda-tensor-identity), then runs it under memcheck and synccheck. --tensor-ops-only builds and
# runs just those steps (a minute or two).
#
# Usage: tests/cuda/gpu_check.sh [--no-mutants] [--large | --large-only] [--tensor-ops-only]
#                                [--mutants-only] [--build-only] [--reuse]
# Environment:
#   NVCC               nvcc to use (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc)
#   COMPUTE_SANITIZER  compute-sanitizer to use (default: next to nvcc, else on PATH)
#   FA_GPU_ARCH        -arch value (default: native; e.g. sm_90 to build where no GPU is visible)
#   FA_GPU_BUILD_DIR   build folder (default: a new temporary folder, kept for its logs)
#   FA_GPU_PLANS       folder of small.json and full.json (and large.json for --large; tests/cuda/
#                      cases.py plan); default: made here with the Python package and the library
#                      ./build.sh built
# Needs: bash, GNU sed, timeout (coreutils), a C++17 host compiler that nvcc accepts, python3 with
# numpy and ml_dtypes (judge.py).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
GPU_DIR="$ROOT/tests/cuda"
MUTANTS=1
LARGE=0     # the 2^32-element step (large_offsets.cu)
DEFAULT=1   # the default steps: matrix check, replay and its accuracy, sanitizers, planted faults
TENSOR=1    # the tensor-op steps (tensor_ops_check.cu), with the default steps or alone
BUILD_ONLY=0
REUSE=0     # skip the compiles and links whose output exists (a previous --build-only call's)
CHECKS=1    # the default steps' checks; 0 (--mutants-only): only their planted faults
for arg in "$@"; do
    case "$arg" in
        --no-mutants) MUTANTS=0 ;;
        --large) LARGE=1 ;;
        --large-only) LARGE=1; DEFAULT=0; TENSOR=0 ;;
        --tensor-ops-only) DEFAULT=0; LARGE=0 ;;
        --build-only) BUILD_ONLY=1 ;;
        --reuse) REUSE=1 ;;
        --mutants-only) CHECKS=0; TENSOR=0; LARGE=0 ;;
        *) echo "gpu_check: unknown argument '$arg' (usage: tests/cuda/gpu_check.sh [--no-mutants] [--large | --large-only] [--tensor-ops-only] [--mutants-only] [--build-only] [--reuse])" >&2
           exit 2 ;;
    esac
done

die() { echo "gpu_check: $*" >&2; exit 2; }

NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
command -v "$NVCC" >/dev/null || die "nvcc not found: install the CUDA toolkit or set NVCC=/path/to/nvcc"
if [ "$DEFAULT" = 1 ] || [ "$TENSOR" = 1 ]; then
    if [ -z "${COMPUTE_SANITIZER:-}" ]; then
        COMPUTE_SANITIZER="$(dirname "$(command -v "$NVCC")")/compute-sanitizer"
        [ -x "$COMPUTE_SANITIZER" ] || COMPUTE_SANITIZER=$(command -v compute-sanitizer || true)
    fi
    [ -n "$COMPUTE_SANITIZER" ] && command -v "$COMPUTE_SANITIZER" >/dev/null \
        || die "compute-sanitizer not found: set COMPUTE_SANITIZER=/path/to/compute-sanitizer"
fi
command -v timeout >/dev/null || die "timeout (coreutils) not found"
{ [ "$DEFAULT" = 0 ] && [ "$LARGE" = 0 ]; } || python3 -c 'import numpy, ml_dtypes' 2>/dev/null \
    || die "python3 with numpy and ml_dtypes not found (tests/cuda/judge.py judges the results with them)"
ARCH=${FA_GPU_ARCH:-native}
BUILD=${FA_GPU_BUILD_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/fa-gpu-check.XXXXXX")}
mkdir -p "$BUILD" || die "cannot create $BUILD"
echo "gpu_check: build folder $BUILD (logs: *.log)"
echo "gpu_check: $("$NVCC" --version | tail -n 1), arch $ARCH"

# --expt-relaxed-constexpr: MSL helpers declared `constexpr` without `inline` (the tensor-op
# backward's matmul2d descriptors) are host functions to nvcc; clang's CUDA mode, like Metal,
# lets device code call them.
FLAGS=(-std=c++17 -O3 -arch="$ARCH" -lineinfo -split-compile=0 --expt-relaxed-constexpr -I"$GPU_DIR/include"
       -I"$GPU_DIR")

# Whether output $1 must be (re)built: always, unless --reuse finds it.
stale() { [ "$REUSE" = 0 ] || [ ! -s "$1" ]; }

. "$GPU_DIR/copy_metal.sh"
# Copies Shaders/ into folder $1, with the fault $2 if given; a fault that changes nothing (the
# kernels no longer contain what it rewrites) is an error, not a silent pass.
copy_sources() {
    copy_metal "$1" "${2:-}" "$ROOT"/Shaders/* || return 1
    if [ -n "${2:-}" ] && diff -rq "$BUILD/src" "$1" >/dev/null; then
        echo "gpu_check: the planted fault '$2' changes nothing in Shaders/" >&2
        return 1
    fi
}

# Compiles the kernels of source folder $1 (slow: every instance of the catalogue, fully unrolled
# loops; the logs hold ptxas' register and spill report): launch_table.cu's catalogue table into $2
# and, in parallel, launch_table_tensor.cu's (the tensor-op library's) into $2 with .o replaced by
# -tensor.o (kernel_objects names both).
compile_kernels() {
    local tensor=${2%.o}-tensor.o tensor_job=""
    # Each object is written under another name and moved into place, so a call cut short leaves
    # no partial object for --reuse to take.
    if stale "$tensor"; then
        { "$NVCC" "${FLAGS[@]}" -I"$1" --resource-usage -c "$GPU_DIR/launch_table_tensor.cu" -o "$tensor.part" \
              && mv "$tensor.part" "$tensor"; } >"$tensor.log" 2>&1 &
        tensor_job=$!
    fi
    if stale "$2"; then
        { "$NVCC" "${FLAGS[@]}" -I"$1" --resource-usage -c "$GPU_DIR/launch_table.cu" -o "$2.part" \
              && mv "$2.part" "$2"; } >"$2.log" 2>&1 || return 1
    fi
    [ -z "$tensor_job" ] || wait "$tensor_job"
}
# The objects compile_kernels made for kernels object $1, space-separated.
kernel_objects() {
    echo "$1 ${1%.o}-tensor.o"
}

SECONDS=0
# The library's plans (here, or FA_GPU_PLANS): the replay's grids (small, full) for the default
# steps, large_offsets.cu's problem (large) for --large; neither can run without its plans.
GRIDS=()
[ "$DEFAULT" = 1 ] && GRIDS+=(small full)
[ "$LARGE" = 1 ] && GRIDS+=(large)
PLANS=${FA_GPU_PLANS:-$BUILD/plans}
if [ "${#GRIDS[@]}" = 0 ]; then
    :  # no step that needs plans
elif [ -z "${FA_GPU_PLANS:-}" ]; then
    mkdir -p "$PLANS"
    for grid in "${GRIDS[@]}"; do
        if ! PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" python3 "$GPU_DIR/cases.py" plan "$grid" \
            "$PLANS/$grid.json" >"$BUILD/plans-$grid.log" 2>&1; then
            tail -n 3 "$BUILD/plans-$grid.log" >&2
            die "cannot export the plans here (build the library with ./build.sh, or set FA_GPU_PLANS)"
        fi
    done
else
    for grid in "${GRIDS[@]}"; do
        [ -f "$PLANS/$grid.json" ] || die "FA_GPU_PLANS ($PLANS) lacks $grid.json"
    done
fi
if [ "$LARGE" = 1 ]; then
    python3 "$GPU_DIR/cases.py" write "$PLANS/large.json" "$BUILD/cases-large" >"$BUILD/cases-large.log" 2>&1 \
        || { cat "$BUILD/cases-large.log" >&2; die "cannot write large_offsets.cu's case file"; }
fi
KERNELS=0   # whether a step needs the attention kernels
{ [ "$DEFAULT" = 1 ] || [ "$LARGE" = 1 ]; } && KERNELS=1
build_jobs=()
if [ "$KERNELS" = 1 ]; then
    copy_sources "$BUILD/src" || die "cannot copy Shaders/ into $BUILD/src"
    compile_kernels "$BUILD/src" "$BUILD/kernels.o" &
    build_jobs+=("$!")
fi
if [ "$DEFAULT" = 1 ]; then
    # The replay's inputs and case files, while the kernels compile (logs: cases-*.o.log).
    # cases.list is the last file written: --reuse takes a folder that has it.
    for grid in small full; do
        stale "$BUILD/cases-$grid/cases.list" || continue
        python3 "$GPU_DIR/cases.py" write "$PLANS/$grid.json" "$BUILD/cases-$grid" >"$BUILD/cases-$grid.o.log" 2>&1 &
        build_jobs+=("$!")
    done
fi
if [ "$DEFAULT" = 1 ]; then
    # The engine's SIMD-group matrix test kernels, for matrix_check.cu.
    copy_metal "$BUILD/tests" "" "$ROOT/tests/kernels/matrix.metal" || die "cannot copy matrix.metal"
    if stale "$BUILD/matrix_check"; then
        "$NVCC" "${FLAGS[@]}" -I"$BUILD/tests" "$GPU_DIR/matrix_check.cu" -o "$BUILD/matrix_check" \
            >"$BUILD/matrix_check.o.log" 2>&1 &
        build_jobs+=("$!")
    fi
fi
if [ "$TENSOR" = 1 ]; then
    # The engine's tensor-op test kernels, for tensor_ops_check.cu.
    copy_metal "$BUILD/tests" "" "$ROOT/tests/kernels/tensor_ops.metal" || die "cannot copy tensor_ops.metal"
    if stale "$BUILD/tensor_ops_check"; then
        "$NVCC" "${FLAGS[@]}" -I"$BUILD/tests" "$GPU_DIR/tensor_ops_check.cu" -o "$BUILD/tensor_ops_check" \
            >"$BUILD/tensor_ops_check.o.log" 2>&1 &
        build_jobs+=("$!")
    fi
fi
if [ "$DEFAULT" = 1 ] && [ "$MUTANTS" = 1 ]; then
    copy_sources "$BUILD/no-barrier" 's/threadgroup_barrier([^;]*);//g' || die "cannot copy Shaders/"
    copy_sources "$BUILD/exp" 's/\bexp2(/exp(/g' || die "cannot copy Shaders/"
    compile_kernels "$BUILD/no-barrier" "$BUILD/kernels-no-barrier.o" &
    build_jobs+=("$!")
    compile_kernels "$BUILD/exp" "$BUILD/kernels-exp.o" &
    build_jobs+=("$!")
fi
if [ "$LARGE" = 1 ] && [ "$MUTANTS" = 1 ]; then
    # 32-bit offsets: every ulong of the kernels becomes uint, so offsets wrap at 2^32 elements.
    copy_sources "$BUILD/offset32" 's/\bulong\b/uint/g' || die "cannot copy Shaders/"
    compile_kernels "$BUILD/offset32" "$BUILD/kernels-offset32.o" &
    build_jobs+=("$!")
fi
compile_host() {  # compile_host UNIT: compiles tests/cuda/UNIT into $BUILD/host-UNIT.o
    local object="$BUILD/host-${1%.*}.o"
    stale "$object" || return 0
    "$NVCC" "${FLAGS[@]}" -I"$BUILD/src" -c "$GPU_DIR/$1" -o "$object" >"$object.log" 2>&1 \
        || { cat "$object.log" >&2; die "compiling tests/cuda/$1 failed"; }
}
if [ "$DEFAULT" = 1 ]; then
    compile_host replay.cu
fi
[ "$LARGE" = 1 ] && compile_host large_offsets.cu
for job in "${build_jobs[@]}"; do
    wait "$job" || { cat "$BUILD"/kernels*.o.log "$BUILD"/matrix_check.o.log "$BUILD"/tensor_ops_check.o.log \
                         "$BUILD"/cases-*.o.log 2>/dev/null >&2
                     die "compiling the kernels, matrix_check.cu or tensor_ops_check.cu, or writing the cases, failed"; }
done
link() {  # link KERNEL_OBJECTS EXECUTABLE MAIN_UNIT [more host units]; KERNEL_OBJECTS space-separated
    local kernels executable=$2 unit objects=()
    read -r -a kernels <<<"$1"
    shift 2
    for unit in "$@"; do
        objects+=("$BUILD/host-$unit.o")
    done
    stale "$executable" || return 0
    "$NVCC" "${FLAGS[@]}" "${kernels[@]}" "${objects[@]}" -o "$executable" || die "linking $executable failed"
}
if [ "$DEFAULT" = 1 ]; then
    link "$(kernel_objects "$BUILD/kernels.o")" "$BUILD/replay" replay
    if [ "$MUTANTS" = 1 ]; then
        link "$(kernel_objects "$BUILD/kernels-no-barrier.o")" "$BUILD/replay-no-barrier" replay
        link "$(kernel_objects "$BUILD/kernels-exp.o")" "$BUILD/replay-exp" replay
    fi
fi
if [ "$LARGE" = 1 ]; then
    link "$(kernel_objects "$BUILD/kernels.o")" "$BUILD/large_offsets" large_offsets
    [ "$MUTANTS" = 1 ] && link "$(kernel_objects "$BUILD/kernels-offset32.o")" "$BUILD/large_offsets-offset32" \
        large_offsets
fi
cat "$BUILD"/*.o.log >"$BUILD/build.log" 2>/dev/null
echo "gpu_check: built in ${SECONDS}s (ptxas register and spill report: $BUILD/build.log)"
[ "$BUILD_ONLY" = 0 ] || exit 0

failures=0
summaries=()

# An empty dump folder $BUILD/dump-$1 (its path printed) for large_offsets.
fresh_dump() {
    rm -rf "$BUILD/dump-$1" && mkdir -p "$BUILD/dump-$1" && echo "$BUILD/dump-$1"
}

# Runs check program $3 with arguments $4... (limit 300 s) with its output shown and logged to $2,
# and records its last line starting with "$1:" as the step's summary (a timeout means a hang,
# e.g. a barrier not every thread reaches); a non-zero exit status counts as a failure.
run_checked_step() {
    local name=$1 log=$2 status line
    shift 2
    SECONDS=0
    timeout 300 "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    line=$(grep -E "^$name:" "$log" | tail -n 1)
    if [ "$status" = 124 ]; then
        line="$name: TIMEOUT after 300 s (a hang, e.g. a barrier not every thread reaches)"
    elif [ -z "$line" ]; then
        line="$name: no summary (exit status $status)"
    fi
    [ "$status" = 0 ] || failures=$((failures + 1))
    summaries+=("$line (${SECONDS}s)")
}

if [ "$DEFAULT" = 1 ] && [ "$CHECKS" = 1 ]; then
    # The SIMD-group emulation against the engine's expectations, before the kernels rely on it.
    run_checked_step cuda-matrix "$BUILD/matrix.log" "$BUILD/matrix_check"
fi
if [ "$TENSOR" = 1 ]; then
    # The tensor-op emulation: its own checks, then bit-identity with the CPU engine's outputs.
    rm -f "$BUILD/tensor_ops_cuda.txt"
    run_checked_step cuda-tensor-ops "$BUILD/tensor-ops.log" "$BUILD/tensor_ops_check" \
        --write "$BUILD/tensor_ops_cuda.txt"
    run_checked_step cuda-tensor-identity "$BUILD/tensor-identity.log" \
        python3 "$GPU_DIR/tensor_ops_compare.py" "$GPU_DIR/tensor_ops_engine.txt" "$BUILD/tensor_ops_cuda.txt"
    # The same program under memcheck and synccheck (the warp shuffles of matmul2d's gather); its
    # fault children, which trap on purpose, run outside the tool (application-only).
    for tool in memcheck synccheck; do
        SECONDS=0
        log="$BUILD/tensor-ops-$tool.log"
        timeout 300 "$COMPUTE_SANITIZER" --tool "$tool" --target-processes application-only \
            "$BUILD/tensor_ops_check" >"$log" 2>&1
        status=$?
        errors=$(sed -nE 's/^========= ERROR SUMMARY: ([0-9]+) error.*/\1/p' "$log" | tail -n 1)
        if [ "$status" = 0 ] && [ "$errors" = 0 ]; then
            summaries+=("tensor-ops-$tool: 0 errors (${SECONDS}s)")
        else
            summaries+=("tensor-ops-$tool: FAIL (exit status $status, ${errors:-no} errors reported; see $log)")
            failures=$((failures + 1))
        fi
    done
fi
if [ "$DEFAULT" = 1 ]; then
    # Accuracy grid through the library's plans: the replay checks determinism and writes outside
    # the outputs ("cuda-replay: N cases, M failures") and dumps next to the cases' inputs; judge.py
    # applies the accuracy rule ("cuda-replay-accuracy: N cases, M mismatches").
    if [ "$CHECKS" = 1 ]; then
        rm -f "$BUILD/cases-full/cases.txt"
        run_checked_step cuda-replay "$BUILD/replay.log" "$BUILD/replay" "$BUILD/cases-full" --dump "$BUILD/cases-full"
        run_checked_step cuda-replay-accuracy "$BUILD/replay-accuracy.log" \
            python3 "$GPU_DIR/judge.py" --name cuda-replay-accuracy "$BUILD/cases-full"
        # The tensor-op cases again in the permuted cooperative-tensor layout (docs/tensor-ops.md): the
        # kernels assume no layout, so every output must keep its bits ("cuda-tensor-layouts: N cases,
        # 0 differ").
        rm -rf "$BUILD/tensor-permuted" && mkdir -p "$BUILD/tensor-permuted"
        run_checked_step cuda-replay-permuted "$BUILD/replay-permuted.log" \
            env FLASH_ATTENTION_TENSOR_LAYOUT=permuted "$BUILD/replay" "$BUILD/cases-full" --case tensor_ \
            --dump "$BUILD/tensor-permuted" --name cuda-replay-permuted
        run_checked_step cuda-tensor-layouts "$BUILD/tensor-layouts.log" \
            python3 "$GPU_DIR/same_bits.py" --name cuda-tensor-layouts "$BUILD/cases-full" "$BUILD/tensor-permuted"
    fi

    # Runs program $2 under compute-sanitizer tool $1 (limit $3 seconds, tool options after that)
    # with PROGRAM_ARGS, writing $BUILD/$LOG_NAME.log, and sets: SAN_STATUS (exit status, 124 on
    # timeout), SAN_CASES ("N cases, M failures" of the program's own checks), SAN_ERRORS (ERROR
    # SUMMARY count), SAN_HAZARDS (racecheck's "N hazards (E errors, W warnings)").
    sanitize() {
        local tool=$1 program=$2 limit=$3
        shift 3
        local log="$BUILD/$LOG_NAME.log"
        echo "gpu_check: compute-sanitizer --tool $tool $(basename "$program") $PROGRAM_ARGS (log: $log)"
        # shellcheck disable=SC2086  # PROGRAM_ARGS is a list of words on purpose
        timeout "$limit" "$COMPUTE_SANITIZER" --tool "$tool" "$@" "$program" $PROGRAM_ARGS >"$log" 2>&1
        SAN_STATUS=$?
        SAN_CASES=$(sed -nE 's/^cuda-replay: ([0-9]+ cases, [0-9]+ failures).*/\1/p' "$log" | tail -n 1)
        SAN_ERRORS=$(sed -nE 's/^========= ERROR SUMMARY: ([0-9]+) error.*/\1/p' "$log" | tail -n 1)
        # racecheck prints "RACECHECK SUMMARY: D hazards displayed (E errors, W warnings)", where D is
        # capped by the print limit; E + W counts them all.
        local counts
        counts=$(sed -nE 's/^========= RACECHECK SUMMARY: [0-9]+ hazards? displayed \(([0-9]+) errors?, ([0-9]+) warnings?\).*/\1 \2/p' "$log" | tail -n 1)
        SAN_HAZARDS=""
        if [ -n "$counts" ]; then
            # shellcheck disable=SC2086  # two numbers, split on purpose
            set -- $counts
            SAN_HAZARDS="$(($1 + $2)) hazards ($1 errors, $2 warnings)"
        fi
    }

    # One sanitizer step on the small grid: passes when the program passes under the tool and the
    # tool's summaries report nothing (the accuracy of these kernels is judged on the full grid).
    check_tool() {  # check_tool LABEL PROGRAM TOOL LIMIT [tool options], PROGRAM_ARGS set
        local label=$1 program=$2 tool=$3 limit=$4
        shift 4
        SECONDS=0
        LOG_NAME=$label sanitize "$tool" "$program" "$limit" "$@"
        local ok=1 summary
        if [ "$SAN_STATUS" = 124 ]; then
            summary="$label: TIMEOUT after $limit s"
            ok=0
        elif [ -z "$SAN_CASES" ] || { [ -z "$SAN_ERRORS" ] && [ -z "$SAN_HAZARDS" ]; }; then
            summary="$label: incomplete run (exit status $SAN_STATUS; see $BUILD/$label.log)"
            ok=0
        else
            summary="$label: $SAN_CASES"
            [ -n "$SAN_ERRORS" ] && summary="$summary, $SAN_ERRORS errors"
            [ -n "$SAN_HAZARDS" ] && summary="$summary, $SAN_HAZARDS"
            [ "$SAN_STATUS" = 0 ] || ok=0
            case "$SAN_ERRORS" in "" | 0) ;; *) ok=0 ;; esac
            case "$SAN_HAZARDS" in "" | "0 hazards"*) ;; *) ok=0 ;; esac
            case "$SAN_CASES" in *", 0 failures") ;; *) ok=0 ;; esac
        fi
        grep -E '^(FAIL|========= +[A-Z][a-z]+.*(hazard|Invalid|Barrier|Uninitialized|Leaked|error))' \
            "$BUILD/$label.log" | head -n 20
        [ "$ok" = 1 ] || failures=$((failures + 1))
        summaries+=("$summary (${SECONDS}s)")
    }
    # Runs the four tools over PROGRAM $2 (step names prefixed with $1).
    check_tools() {
        check_tool "${1}memcheck" "$2" memcheck 150 --leak-check full
        check_tool "${1}racecheck" "$2" racecheck 150 --racecheck-report all
        check_tool "${1}synccheck" "$2" synccheck 120
        check_tool "${1}initcheck" "$2" initcheck 120
    }
    [ "$CHECKS" = 0 ] || PROGRAM_ARGS="$BUILD/cases-small --once" check_tools "replay-" "$BUILD/replay"

    # Planted race: no barriers at all. One small case suffices; racecheck must see hazards. $1:
    # the program, $2: its arguments.
    planted_race() {
        local log_name="mutant-$(basename "$1")"
        SECONDS=0
        LOG_NAME=$log_name PROGRAM_ARGS="$2" sanitize racecheck "$1" 150 --racecheck-report all
        if [ -n "$SAN_HAZARDS" ] && [ "${SAN_HAZARDS%% *}" != 0 ]; then
            summaries+=("planted race (no barriers, $(basename "$1")): racecheck found $SAN_HAZARDS, as it must (${SECONDS}s)")
        else
            summaries+=("planted race (no barriers, $(basename "$1")): racecheck MISSED it (${SAN_HAZARDS:-no summary}; see $BUILD/$log_name.log)")
            failures=$((failures + 1))
        fi
    }
    # Planted arithmetic fault: exp2 -> exp. The accuracy judgement must report mismatches. $1: the
    # program's step name (cuda-replay), $2: the dump folder, then the command.
    planted_exp() {
        local name=$1 dump=$2 log="$BUILD/mutant-exp-$1.log"
        shift 2
        SECONDS=0
        timeout 120 "$@" >"$log" 2>&1
        python3 "$GPU_DIR/judge.py" "$dump" >>"$log" 2>&1
        line=$(sed -nE 's/^cuda-accuracy: ([0-9]+ cases, [0-9]+ mismatches).*/\1/p' "$log")
        # Counts only when the cases ran and the rule, not a CUDA error, rejected them.
        if [[ "$line" =~ ^([1-9][0-9]*)\ cases,\ ([1-9][0-9]*)\ mismatches$ ]] \
            && grep -q "^$name: [1-9][0-9]* cases, 0 failures" "$log"; then
            summaries+=("planted fault (exp2 -> exp, $name): accuracy check found $line, as it must (${SECONDS}s)")
        else
            summaries+=("planted fault (exp2 -> exp, $name): accuracy check MISSED it (${line:-no summary}; see $log)")
            failures=$((failures + 1))
        fi
    }
    if [ "$MUTANTS" = 1 ]; then
        planted_race "$BUILD/replay-no-barrier" "$BUILD/cases-small --once --case d1_"
        rm -f "$BUILD/cases-small/cases.txt"
        planted_exp cuda-replay "$BUILD/cases-small" "$BUILD/replay-exp" "$BUILD/cases-small" --once \
            --dump "$BUILD/cases-small"
    fi
fi

# Opt-in: offsets above 2^32 elements, and the planted 32-bit-offset fault that must fail it.
if [ "$LARGE" = 1 ]; then
    run_checked_step large-offsets "$BUILD/large-offsets.log" "$BUILD/large_offsets" "$BUILD/cases-large" \
        "$(fresh_dump large)"
    run_checked_step large-offsets-accuracy "$BUILD/large-offsets-accuracy.log" \
        python3 "$GPU_DIR/judge.py" --name large-offsets-accuracy "$BUILD/dump-large"
    if [ "$MUTANTS" = 1 ]; then
        SECONDS=0
        timeout 300 "$BUILD/large_offsets-offset32" "$BUILD/cases-large" "$(fresh_dump offset32)" \
            >"$BUILD/mutant-offset32.log" 2>&1
        python3 "$GPU_DIR/judge.py" --name large-offsets-accuracy "$BUILD/dump-offset32" \
            >>"$BUILD/mutant-offset32.log" 2>&1
        line=$(sed -nE 's/^large-offsets-accuracy: ([0-9]+ cases, [0-9]+ mismatches).*/\1/p' \
            "$BUILD/mutant-offset32.log")
        # Counts only when the rows were dumped and the rule, not a CUDA error, rejected them.
        if [[ "$line" =~ ^1\ cases,\ 1\ mismatches$ ]] \
            && grep -q '^large-offsets: [1-9][0-9]* rows dumped, 0 failures' "$BUILD/mutant-offset32.log"; then
            summaries+=("planted fault (32-bit offsets): large-offsets found $line, as it must (${SECONDS}s)")
        else
            summaries+=("planted fault (32-bit offsets): large-offsets MISSED it (${line:-no summary}; see $BUILD/mutant-offset32.log)")
            failures=$((failures + 1))
        fi
    fi
fi

echo "==== gpu_check summary"
printf '%s\n' "${summaries[@]}"
if [ "$failures" = 0 ]; then
    echo "gpu_check: PASS"
    exit 0
fi
echo "gpu_check: FAIL ($failures of ${#summaries[@]} checks)"
exit 1
