// swift-tools-version:5.9
import PackageDescription

let package = Package(
    name: "FlashAttentionMetal",
    platforms: [.macOS(.v13), .iOS(.v16)],
    products: [
        .library(name: "FlashAttentionMetal", type: .dynamic, targets: ["FlashAttentionMetal"]),
    ],
    targets: [
        // The public C ABI header and the kernel parameter table shared with the shaders.
        .target(name: "CFlashAttentionMetal", path: "Sources/CFlashAttentionMetal"),
        // The CPU engine: <metal_stdlib> for C++ and the fiber threadgroup executor; it compiles
        // Shaders/flash_attention.metal itself.
        .target(
            name: "MSLEngine",
            path: "Sources/MSLEngine",
            cxxSettings: [.headerSearchPath("msl"), .headerSearchPath("engine")]
        ),
        // Embeds Shaders/ into the library at build time (EmbeddedShaders.swift, generated, never
        // committed): the Metal backend compiles that source, and names its .metallib by its hash.
        .target(name: "ShaderSplice", path: "Sources/ShaderSplice"),
        .executableTarget(name: "EmbedShaders", dependencies: ["ShaderSplice"], path: "Sources/EmbedShaders"),
        .plugin(name: "EmbedShadersPlugin", capability: .buildTool(), dependencies: ["EmbedShaders"],
                path: "Plugins/EmbedShadersPlugin"),
        .target(
            name: "FlashAttentionMetal",
            dependencies: ["CFlashAttentionMetal", "MSLEngine"],
            path: "Sources/FlashAttentionMetal",
            linkerSettings: [
                .linkedFramework("Metal", .when(platforms: [.macOS, .iOS])),
                .linkedFramework("CoreGraphics", .when(platforms: [.macOS])),
                .linkedFramework("IOKit", .when(platforms: [.macOS])),
            ],
            plugins: ["EmbedShadersPlugin"]
        ),
        // Purpose-written kernels that pin the engine's semantics.
        .target(
            name: "MSLEngineTestKernels",
            dependencies: ["MSLEngine"],
            path: "tests/kernels",
            cxxSettings: [
                .headerSearchPath("../../Sources/MSLEngine/msl"),
                .headerSearchPath("../../Sources/MSLEngine/engine"),
            ]
        ),
        .testTarget(
            name: "MSLEngineTests",
            dependencies: ["MSLEngine", "MSLEngineTestKernels", "CFlashAttentionMetal"],
            path: "tests/swift/MSLEngineTests"
        ),
        .testTarget(
            name: "FlashAttentionMetalTests",
            dependencies: ["FlashAttentionMetal", "CFlashAttentionMetal", "ShaderSplice"],
            path: "tests/swift/FlashAttentionMetalTests"
        ),
    ],
    cLanguageStandard: .c11,
    cxxLanguageStandard: .cxx17
)
