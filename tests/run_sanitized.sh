#!/usr/bin/env bash
# Runs every XCTest of the package (the engine's and the library's, the attention kernels in
# float16, bfloat16 and float32) in one build under AddressSanitizer and UndefinedBehaviorSanitizer
# together (scratch path .build/sanitized; clang documents -fsanitize=address,undefined as a
# supported combination), and requires zero findings. Then proves both are really watching the
# kernels: the test that reads past the end of a buffer from an MSL test kernel
# (tests/kernels/planted_out_of_bounds.metal), skipped unless MSL_ENGINE_PLANTED_OOB=1, must fail
# with an AddressSanitizer heap-buffer-overflow report, and the one that overflows a signed int
# (tests/kernels/planted_undefined_behaviour.metal), skipped unless MSL_ENGINE_PLANTED_UB=1, with
# UndefinedBehaviorSanitizer's signed-integer-overflow report.
#
# Usage: tests/run_sanitized.sh            (from anywhere; logs go to .build/sanitizers/)
# Prints one line per step and a summary line; exits non-zero when any step fails.
set -u -o pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
command -v swift >/dev/null 2>&1 || { echo "run_sanitized: swift not found on PATH" >&2; exit 2; }

logs="$root/.build/sanitizers"
mkdir -p "$logs"
failed=()

# Findings that must never appear in a clean run's output.
findings='AddressSanitizer|LeakSanitizer|runtime error:|UndefinedBehaviorSanitizer'

report() { # name status detail
    printf '%-34s %s%s\n' "$1" "$2" "${3:+  ($3)}"
    [ "$2" = PASS ] || failed+=("$1")
}

show_tail() {
    echo "---- last lines of $1 ----"
    tail -n 40 "$1"
    echo "----"
}

clean_run() { # name log command...
    local name="$1" log="$2"
    shift 2
    "$@" >"$log" 2>&1
    local rc=$?
    if [ $rc -ne 0 ]; then
        report "$name" FAIL "exit status $rc, log $log"
        show_tail "$log"
    elif grep -Eq "$findings" "$log"; then
        report "$name" FAIL "sanitizer finding in $log"
        grep -En "$findings" "$log" | head -n 20
    else
        report "$name" PASS
    fi
}

# swift-corelibs-xctest and -foundation (Linux) leak objects of their own (XCTest's test-suite
# objects at exit; a weak-reference side table in Foundation's Process.run). They are suppressed
# by module, with allocation stacks cut to 7 frames: those modules then show up only in the stacks
# of objects they allocated themselves, so a leak allocated in the engine or the library (several
# C++ or Swift frames deep) should still be reported. No planted leak checks that.
lsan_suppressions="$logs/lsan.supp"
printf 'leak:libXCTest.so\nleak:libFoundation.so\n' >"$lsan_suppressions"
# LeakSanitizer is not available with ASan on macOS; there only ASan's own checks run.
detect_leaks=0
[ "$(uname -s)" = Linux ] && detect_leaks=1
asan_options="detect_leaks=$detect_leaks:halt_on_error=1:detect_stack_use_after_return=1:malloc_context_size=7"
export LSAN_OPTIONS="suppressions=$lsan_suppressions"

# swiftc has no -sanitize=undefined on Linux (and Swift code traps on overflow anyway), so the C
# and C++ targets (engine, kernels, C ABI) get clang's -fsanitize=undefined and the runtime is
# linked through the clang linker driver, beside swiftc's -sanitize=address.
sanitize=(--sanitize=address --scratch-path "$root/.build/sanitized"
    -Xcc -fsanitize=undefined -Xcxx -fsanitize=undefined
    -Xcc -fno-sanitize-recover=undefined -Xcxx -fno-sanitize-recover=undefined
    -Xswiftc -Xclang-linker -Xswiftc -fsanitize=undefined)
export ASAN_OPTIONS="$asan_options" UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
# The C ABI fuzz target (CABIFuzzTests) runs this long inside the sanitized XCTest run (2 s in a
# plain swift test); docs/testing.md gives the longer run.
export FA_FUZZ_SECONDS="${FA_FUZZ_SECONDS:-40}"

clean_run "ASan and UBSan: swift test" "$logs/sanitized.log" swift test "${sanitize[@]}"

planted_log="$logs/asan-planted.log"
MSL_ENGINE_PLANTED_OOB=1 swift test --skip-build "${sanitize[@]}" \
    --filter 'MSLEngineTests.EngineTests/testPlantedOutOfBoundsRead' >"$planted_log" 2>&1
planted_rc=$?
if [ $planted_rc -ne 0 ] && grep -q "AddressSanitizer" "$planted_log" \
    && grep -q "heap-buffer-overflow" "$planted_log"; then
    report "AddressSanitizer: planted OOB read" PASS "caught: heap-buffer-overflow"
else
    report "AddressSanitizer: planted OOB read" FAIL "not caught (exit status $planted_rc), log $planted_log"
    show_tail "$planted_log"
fi

planted_log="$logs/ubsan-planted.log"
MSL_ENGINE_PLANTED_UB=1 swift test --skip-build "${sanitize[@]}" \
    --filter 'MSLEngineTests.EngineTests/testPlantedSignedOverflow' >"$planted_log" 2>&1
planted_rc=$?
if [ $planted_rc -ne 0 ] && grep -q "runtime error: signed integer overflow" "$planted_log"; then
    report "UBSan: planted signed overflow" PASS "caught: signed integer overflow"
else
    report "UBSan: planted signed overflow" FAIL "not caught (exit status $planted_rc), log $planted_log"
    show_tail "$planted_log"
fi

if [ ${#failed[@]} -eq 0 ]; then
    echo "run_sanitized: PASS (ASan and UBSan: zero findings; planted out-of-bounds read and signed overflow caught)"
    exit 0
fi
echo "run_sanitized: FAIL (${failed[*]})"
exit 1
