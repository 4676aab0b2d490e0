#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif
import CFlashAttentionMetal

/// The precompiled kernels: `flash_attention-<source hash>-msl<version>.metallib`, one per MSL
/// version, which build.sh compiles on a Mac from exactly ``EmbeddedShaders/source`` (each for the
/// oldest macOS with that version) and links next to the library (and next to the Python package);
/// and the tensor-op kernels' `flash_attention-tensor-<tensor source hash>-msl4.0.metallib`, from
/// exactly ``EmbeddedShaders/tensorSource`` at MSL 4.0 for macOS 26.2 (MLX's NAX build floor).
enum PrecompiledShaders {
    /// (MSL version, whether this OS runs it), newest first: build.sh's METALLIB_VERSIONS.
    private static var versions: [(String, Bool)] {
        var supported = (v32: false, v31: false)
        if #available(macOS 15.0, iOS 18.0, tvOS 18.0, visionOS 2.0, *) { supported.v32 = true }
        if #available(macOS 14.0, iOS 17.0, tvOS 17.0, visionOS 1.0, *) { supported.v31 = true }
        return [("3.2", supported.v32), ("3.1", supported.v31), ("3.0", true)]
    }

    /// The file name of the .metallib of MSL `version` built from the embedded source.
    static func fileName(version: String) -> String {
        "flash_attention-\(EmbeddedShaders.sourceHash)-msl\(version).metallib"
    }

    /// A pattern of the file names, for messages.
    static var fileNames: String { "flash_attention-\(EmbeddedShaders.sourceHash)-msl<version>.metallib" }

    /// The versions whose library this OS may load, newest first: those it runs, less MSL 3.0 where
    /// it runs 3.1 (macOS 14+): 3.0 has no bfloat16 kernels, which the source compiled at 3.1 keeps.
    static var loadableVersions: [String] {
        let runs = versions.filter(\.1).map(\.0)
        return runs.contains("3.1") ? runs.filter { $0 != "3.0" } : runs
    }

    /// The path of the newest loadable version (``loadableVersions``), in the folder of the file this
    /// code was loaded from (the dylib, or the app when the package is linked statically), as loaded
    /// or with links resolved; nil when neither folder has one. Looked up once per process.
    static let path: String? = find(loadableVersions.map { fileName(version: $0) })

    /// The file name of the tensor-op kernels' .metallib built from the embedded tensor-op source.
    static var tensorFileName: String { "flash_attention-tensor-\(EmbeddedShaders.tensorSourceHash)-msl4.0.metallib" }

    /// The tensor-op kernels' .metallib (``tensorFileName``) beside the library as ``path`` looks,
    /// on macOS/iOS 26.2 or later only (the OS it is built for; an older Metal refuses the file);
    /// nil when there is none. Looked up once per process.
    static let tensorPath: String? = {
        guard #available(macOS 26.2, iOS 26.2, tvOS 26.2, visionOS 26.2, *) else { return nil }
        return find([tensorFileName])
    }()

    /// The first of `names` in the folder of the file this code was loaded from, as loaded or
    /// with links resolved; nil when neither folder has any.
    private static func find(_ names: [String]) -> String? {
        guard let file = fa_loaded_image_path() else { return nil }
        var images = [String(cString: file)]
        if let resolved = realpath(file, nil) {
            images.append(String(cString: resolved))
            free(resolved)
        }
        for name in names {
            if let found = images.map({ folder(of: $0) + name }).first(where: { access($0, F_OK) == 0 }) {
                return found
            }
        }
        return nil
    }

    /// `path` up to and including its last "/", or "./" when it has none.
    private static func folder(of path: String) -> String {
        guard let slash = path.lastIndex(of: "/") else { return "./" }
        return String(path[...slash])
    }
}
