#!/usr/bin/env bash
# Builds the Metal backend against the stand-in Metal and IOKit modules (tests/swift/MetalStandIn,
# tests/swift/IOKitStandIn) on Linux, where `canImport(Metal)` is otherwise false:
# build/metal-standin/libFlashAttentionMetal.so, the library with both backends, its Metal one
# running the kernels on the CPU engine (docs/metal.md).
# Sources/FlashAttentionMetal is compiled in Swift 5 mode (the package's) and type-checked in Swift 6
# mode; the stand-in in Swift 6 mode. Reuses the C and C++ objects of the release build (./build.sh
# first). The release library is untouched.
#   tests/metal_standin/build.sh [SOURCES_DIR]   SOURCES_DIR replaces Sources/FlashAttentionMetal
#                                                (the planted-defect test builds a modified copy)
# Environment: METAL_STANDIN_OUT (output folder, default build/metal-standin); METAL_STANDIN_SWIFT6=0
# skips the Swift 6 type-check and METAL_STANDIN_SWIFT_TESTS=0 the Swift tests' executable;
# METAL_STANDIN_MODULES (a previous build's output folder) reuses its Metal and IOKit stand-ins.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$(pwd)
SOURCES=${1:-$ROOT/Sources/FlashAttentionMetal}
OUT=${METAL_STANDIN_OUT:-$ROOT/build/metal-standin}
RELEASE=$ROOT/.build/release
for object in "$RELEASE/MSLEngine.build/flash_attention_kernels_f16.cpp.o" \
    "$RELEASE/CFlashAttentionMetal.build/flash_attention_metal.c.o"; do
    [[ -f $object ]] || { echo "metal_standin/build.sh: $object is missing: run ./build.sh first" >&2; exit 1; }
done
mkdir -p "$OUT"
# Module maps of the two C targets (SwiftPM writes its own under .build; these do not depend on it).
for module in CFlashAttentionMetal MSLEngine; do
    printf 'module %s {\n    umbrella "%s/Sources/%s/include"\n    export *\n}\n' "$module" "$ROOT" "$module" \
        > "$OUT/$module.modulemap"
done
CLANG_MODULES=(-Xcc -D_GNU_SOURCE -Xcc "-fmodule-map-file=$OUT/CFlashAttentionMetal.modulemap"
    -Xcc "-fmodule-map-file=$OUT/MSLEngine.modulemap" -module-cache-path "$OUT/module-cache")
mapfile -t IOKIT < <(find "$ROOT/tests/swift/IOKitStandIn" -name '*.swift' | sort)
mapfile -t STANDIN < <(find "$ROOT/tests/swift/MetalStandIn" -name '*.swift' | sort)
mapfile -t BACKEND < <(find "$SOURCES" -name '*.swift' | sort)
# The embedded kernel source, which the package's EmbedShadersPlugin generated for the release build.
GENERATED=$(find "$ROOT/.build/plugins/outputs" -path '*/FlashAttentionMetal/*' -name EmbeddedShaders.swift | head -n 1)
[[ -n $GENERATED ]] || { echo "metal_standin/build.sh: no generated EmbeddedShaders.swift: run ./build.sh first" >&2; exit 1; }
BACKEND+=("$GENERATED")
mapfile -t OBJECTS < <(find "$RELEASE/MSLEngine.build" "$RELEASE/CFlashAttentionMetal.build" -name '*.o' | sort)

if [[ -n ${METAL_STANDIN_MODULES:-} ]]; then
    # The stand-in modules do not depend on SOURCES_DIR: a previous build's are reused.
    for file in IOKit.swiftmodule libIOKit.a Metal.swiftmodule libMetal.a; do
        cp "$METAL_STANDIN_MODULES/$file" "$OUT/$file"
    done
else
    swiftc -swift-version 6 -parse-as-library -module-name IOKit -emit-module -emit-module-path "$OUT/IOKit.swiftmodule" \
        -emit-library -static -o "$OUT/libIOKit.a" "${IOKIT[@]}"
    swiftc -swift-version 6 -parse-as-library -module-name Metal -emit-module -emit-module-path "$OUT/Metal.swiftmodule" \
        -emit-library -static -o "$OUT/libMetal.a" -I "$OUT" "${CLANG_MODULES[@]}" "${STANDIN[@]}"
fi
[[ ${METAL_STANDIN_SWIFT6:-1} != 1 ]] ||
    swiftc -swift-version 6 -typecheck -module-name FlashAttentionMetal -I "$OUT" "${CLANG_MODULES[@]}" "${BACKEND[@]}"
swiftc -swift-version 5 -Onone -enable-testing -parse-as-library -module-name FlashAttentionMetal \
    -emit-module -emit-module-path "$OUT/FlashAttentionMetal.swiftmodule" -emit-library \
    -o "$OUT/libFlashAttentionMetal.so" -I "$OUT" "${CLANG_MODULES[@]}" "${BACKEND[@]}" \
    "$OUT/libMetal.a" "$OUT/libIOKit.a" "${OBJECTS[@]}" -lstdc++
echo "built $OUT/libFlashAttentionMetal.so (Metal backend on the stand-in)"
[[ ${METAL_STANDIN_SWIFT_TESTS:-1} == 1 ]] || exit 0
# The Swift tests of the Metal backend, run without SwiftPM (whose discovery is replaced by allTests).
printf 'import XCTest\nXCTMain([testCase(MetalBackendTests.allTests)])\n' > "$OUT/main.swift"
swiftc -swift-version 5 -Onone -module-name MetalBackendTests -I "$OUT" "${CLANG_MODULES[@]}" \
    "$ROOT/tests/swift/MetalBackendTests/MetalBackendTests.swift" "$OUT/main.swift" \
    -L "$OUT" -lFlashAttentionMetal -Xlinker -rpath -Xlinker "$OUT" -o "$OUT/metal-backend-tests"
echo "built $OUT/metal-backend-tests (run it to run tests/swift/MetalBackendTests)"
