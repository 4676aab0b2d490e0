import Foundation
import PackagePlugin

/// Generates EmbeddedShaders.swift (the kernels' self-contained MSL source and its hash) for the
/// target at build time, with the EmbedShaders tool, from the package's Shaders/: nothing generated
/// is committed. Reruns when a file of Shaders/ changes.
@main
struct EmbedShadersPlugin: BuildToolPlugin {
    func createBuildCommands(context: PluginContext, target: Target) throws -> [Command] {
        let shaders = context.package.directory.appending("Shaders")
        let inputs = try FileManager.default.contentsOfDirectory(atPath: shaders.string).sorted()
            .map { shaders.appending($0) }
        let output = context.pluginWorkDirectory.appending("EmbeddedShaders.swift")
        return [.buildCommand(displayName: "Embedding Shaders/ into EmbeddedShaders.swift",
                              executable: try context.tool(named: "EmbedShaders").path,
                              arguments: [shaders.string, output.string],
                              inputFiles: inputs, outputFiles: [output])]
    }
}
