#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif
import CFlashAttentionMetal

/// The precompiled kernels: `flash_attention-<source hash>.metallib`, which build.sh compiles on a
/// Mac from exactly ``EmbeddedShaders/source`` and links next to the library (and next to the
/// Python package).
enum PrecompiledShaders {
    /// The file name of the .metallib built from the embedded source.
    static var fileName: String { "flash_attention-\(EmbeddedShaders.sourceHash).metallib" }

    /// Its path in the folder of the file this code was loaded from (the dylib, or the app when the
    /// package is linked statically), as loaded or with links resolved; nil when neither folder has
    /// it. Looked up once per process.
    static let path: String? = {
        guard let file = fa_loaded_image_path() else { return nil }
        var images = [String(cString: file)]
        if let resolved = realpath(file, nil) {
            images.append(String(cString: resolved))
            free(resolved)
        }
        return images.map { folder(of: $0) + fileName }.first { access($0, F_OK) == 0 }
    }()

    /// `path` up to and including its last "/", or "./" when it has none.
    private static func folder(of path: String) -> String {
        guard let slash = path.lastIndex(of: "/") else { return "./" }
        return String(path[...slash])
    }
}
