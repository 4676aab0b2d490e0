import CFlashAttentionMetal

/// An error reported by the library: one case per failing `fa_status` of the C ABI, each with a
/// message that names the argument (or the device call) and the rule that failed.
public enum FlashAttentionError: Error, Equatable, CustomStringConvertible {
    /// A null pointer, a zero or inconsistent dimension, a bad flag or scale, a buffer of the wrong
    /// length (`FA_STATUS_INVALID_ARGUMENT`).
    case invalidArgument(String)
    /// A valid problem outside what the kernels support, e.g. `headDim` above 576 (256 in
    /// float32) (`FA_STATUS_UNSUPPORTED`).
    case unsupported(String)
    /// The requested backend does not exist here, e.g. Metal on Linux
    /// (`FA_STATUS_BACKEND_UNAVAILABLE`).
    case backendUnavailable(String)
    /// The device or the host could not allocate what the call needs (`FA_STATUS_OUT_OF_MEMORY`).
    case outOfMemory(String)
    /// The GPU or the CPU engine reported a failure while running a kernel
    /// (`FA_STATUS_EXECUTION_FAILED`).
    case executionFailed(String)
    /// A broken invariant inside the library (`FA_STATUS_INTERNAL_ERROR`).
    case internalError(String)
    /// The call was cancelled while it ran (`fa_context_cancel`, ``FlashAttention/cancel()``;
    /// `FA_STATUS_CANCELLED`); its outputs hold NaN.
    case cancelled(String)

    /// The human-readable explanation.
    public var message: String {
        switch self {
        case .invalidArgument(let m), .unsupported(let m), .backendUnavailable(let m),
             .outOfMemory(let m), .executionFailed(let m), .internalError(let m), .cancelled(let m):
            return m
        }
    }

    /// The C ABI status this error is reported as.
    var status: fa_status {
        switch self {
        case .invalidArgument: return FA_STATUS_INVALID_ARGUMENT
        case .unsupported: return FA_STATUS_UNSUPPORTED
        case .backendUnavailable: return FA_STATUS_BACKEND_UNAVAILABLE
        case .outOfMemory: return FA_STATUS_OUT_OF_MEMORY
        case .executionFailed: return FA_STATUS_EXECUTION_FAILED
        case .internalError: return FA_STATUS_INTERNAL_ERROR
        case .cancelled: return FA_STATUS_CANCELLED
        }
    }

    /// The status name and the message, e.g. `FA_STATUS_UNSUPPORTED: head_dim (300) ...`.
    public var description: String {
        String(cString: fa_status_name(status)) + ": " + message
    }
}
