// Writes EmbeddedShaders.swift (the build-tool plugin Plugins/EmbedShadersPlugin runs it on every
// build whose Shaders/ changed): the MSL source of Shaders/flash_attention.metal (and of
// flash_attention_tensor.metal, the tensor-op library) with every quoted
// #include of a file in Shaders/ replaced by its text, the headers' own includes expanded where they
// stand, each header once (every header has an include guard), because
// MTLDevice.makeLibrary(source:options:) has no include path; and a hash of that source, which
// names the precompiled library build.sh makes on a Mac (flash_attention-<hash>-msl<version>.metallib;
// the tensor-op source's hash names flash_attention-tensor-<hash>-msl4.0.metallib): the library loads
// only a .metallib built from the source it embeds.
//
// Usage: EmbedShaders SHADERS_DIR OUTPUT.swift   write the Swift file
//        EmbedShaders --hash SHADERS_DIR         print the hash
import Foundation
import ShaderSplice

/// `source` as a raw string literal whose delimiter cannot occur in it.
func rawLiteral(_ source: String) -> String {
    var hashes = "#"
    while source.contains("\"" + hashes) || source.contains("\\" + hashes) { hashes += "#" }
    return hashes + "\"\"\"\n" + source + "\"\"\"" + hashes
}

/// The Swift file holding `source` and `tensorSource` (flash_attention_tensor.metal's) as raw
/// string literals.
func swiftFile(_ source: String, tensorSource: String) -> String {
    return """
        // Generated at build time by Sources/EmbedShaders (the EmbedShadersPlugin build-tool plugin)
        // from Shaders/flash_attention.metal and the headers it includes.

        /// The self-contained MSL source of the attention kernels, compiled at run time by the Metal
        /// backend with makeLibrary(source:options:).
        enum EmbeddedShaders {
            /// Names the .metallibs compiled from this source: flash_attention-<sourceHash>-msl<version>.metallib.
            static let sourceHash = "\(sourceHash(source))"

            static let source: String = \(rawLiteral(source))

            /// Names the .metallib compiled from `tensorSource`:
            /// flash_attention-tensor-<tensorSourceHash>-msl4.0.metallib.
            static let tensorSourceHash = "\(sourceHash(tensorSource))"

            /// The Metal 4 tensor-op kernels' source (Shaders/flash_attention_tensor.metal), compiled
            /// as a library of its own at MSL 4.0, so that a failure loses only the tensor-op path.
            static let tensorSource: String = \(rawLiteral(tensorSource))
        }

        """
}

let arguments = Array(CommandLine.arguments.dropFirst())
do {
    switch arguments.count == 2 ? arguments[0] : "" {
    case "--hash":
        print(sourceHash(try splicedSource(folder: URL(fileURLWithPath: arguments[1]), metal: "flash_attention.metal")))
    case "":
        FileHandle.standardError.write("usage: EmbedShaders SHADERS_DIR OUTPUT.swift | --hash SHADERS_DIR\n".data(using: .utf8)!)
        exit(2)
    default:
        let folder = URL(fileURLWithPath: arguments[0])
        let source = try splicedSource(folder: folder, metal: "flash_attention.metal")
        let tensorSource = try splicedSource(folder: folder, metal: "flash_attention_tensor.metal")
        let output = URL(fileURLWithPath: arguments[1])
        let text = swiftFile(source, tensorSource: tensorSource)
        // An unchanged file is left alone: SwiftPM reruns this tool whenever it relinks it (every
        // build), and a rewritten file would recompile the library's Swift module each time.
        if (try? String(contentsOf: output, encoding: .utf8)) != text {
            try text.write(to: output, atomically: true, encoding: .utf8)
        }
    }
} catch {
    FileHandle.standardError.write("EmbedShaders: \(error)\n".data(using: .utf8)!)
    exit(1)
}
