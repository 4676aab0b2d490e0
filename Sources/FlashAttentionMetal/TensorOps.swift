#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif
import CFlashAttentionMetal

/// What a backend offers the Metal 4 tensor-op kernels (issue 37, docs/tensor-ops.md): matrix units
/// with an OS that reaches them, and kernels it can run.
struct TensorOpsSupport: Equatable, Sendable {
    /// The GPU has matrix units and the OS the API: MLX's test (`is_nax_available` in
    /// mlx/backend/metal/device.cpp): macOS/iOS 26.2 or later and an architecture generation of
    /// at least 17 (18 for a phone's `p` suffix) in `MTLDevice.architecture.name`
    /// (`applegpu_g17s`: Apple GPU family 10, M5). Metal has no capability query for them.
    let hasUnits: Bool
    /// The backend can run the tensor-op kernels: Metal when their library compiled (MSL 4.0), the
    /// CPU engine always (its emulation of matmul2d).
    let hasKernels: Bool
    /// Why, for users: the architecture and OS, or what is missing.
    let detail: String

    /// The CPU engine: no matrix units; the kernels run through its emulation when forced.
    static let cpuEngine = TensorOpsSupport(hasUnits: false, hasKernels: true,
                                            detail: "the CPU engine has no matrix units (it emulates matmul2d)")
    /// Whether a device of architecture `name` has matrix units on this OS, and why, for users: the
    /// one test of the Metal host and of the hosts of exported plans. MLX's (`is_nax_available`,
    /// mlx/backend/metal/device.cpp at 846d176): macOS/iOS 26.2 or later (`__builtin_available`
    /// there, `#available` here) and an architecture generation of 17 or later (18 for `p`).
    static func units(architecture name: String) -> (has: Bool, detail: String) {
        guard #available(macOS 26.2, iOS 26.2, tvOS 26.2, visionOS 26.2, *) else {
            return (false, "\(name): the tensor ops need macOS 26.2 or iOS 26.2")
        }
        let has = hasMatrixUnits(architecture: name)
        return (has, has ? "\(name) has matrix units"
                    : "\(name) has no matrix units (architecture generation 17 and later have)")
    }

    /// What a host of exported plans (PyTorch's MPS and MLX's GPU paths) offers, from its
    /// `fa_plan_target`: the units of the device it encodes on (`architecture`, or the library's
    /// Metal device's when nil, the GPU those hosts use: `GPUArchitecture.libraryDevice`) and the
    /// tensor-op library it compiled (`library`; `error` the compiler's message when it failed).
    static func host(architecture: String?, library: fa_tensor_library, error: String?) -> TensorOpsSupport {
        let device: (has: Bool, detail: String)
        if let name = architecture ?? GPUArchitecture.libraryDevice {
            device = units(architecture: name)
        } else {
            device = (false, "no Metal device, and the host named no architecture")
        }
        switch library {
        case FA_TENSOR_LIBRARY_READY:
            return TensorOpsSupport(hasUnits: device.has, hasKernels: true, detail: device.detail)
        case FA_TENSOR_LIBRARY_FAILED:
            return TensorOpsSupport(hasUnits: device.has, hasKernels: false,
                                    detail: device.detail + "; the host's tensor-op library failed: "
                                        + (error ?? "no message"))
        default:
            return TensorOpsSupport(hasUnits: device.has, hasKernels: false,
                                    detail: device.detail + "; the host compiled no tensor-op library")
        }
    }

    /// Whether architecture `name` (`MTLArchitecture.name`, e.g. `applegpu_g17s`) is generation 17
    /// or later (18 for `p`), parsed as MLX parses it: the two digits before the last letter.
    static func hasMatrixUnits(architecture name: String) -> Bool {
        let chars = Array(name.utf8)
        guard chars.count >= 3, let tens = digit(chars[chars.count - 3]), let ones = digit(chars[chars.count - 2]) else {
            return false
        }
        return tens * 10 + ones >= (chars.last == UInt8(ascii: "p") ? 18 : 17)
    }

    private static func digit(_ c: UInt8) -> Int? {
        c >= UInt8(ascii: "0") && c <= UInt8(ascii: "9") ? Int(c - UInt8(ascii: "0")) : nil
    }
}

/// The architecture name (`MTLArchitecture.name`) of the Metal device the library runs on, the one
/// a Metal context takes: exported plans' default (`TensorOpsSupport.host`). Its hosts' device:
/// PyTorch's MPS device is the first Metal device that is not low-power (aten/src/ATen/mps/
/// MPSDevice.mm, `MPSDevice::MPSDevice`), the Apple-silicon Mac's one GPU, which is this one.
enum GPUArchitecture {
    /// Read once per process; nil off Metal, or before macOS 14 / iOS 17 (MTLArchitecture).
    static var libraryDevice: String? {
        #if canImport(Metal)
        return MetalBackend.defaultDeviceArchitecture
        #else
        return nil
        #endif
    }
}

/// The plan's decision on the tensor-op path, made once per call in `DispatchPlan.make`.
struct TensorOpsRoute: Equatable, Sendable {
    /// Take a tensor-op kernel wherever one serves the problem (`TensorOps.forwardServes`).
    let enabled: Bool
    /// The device has matrix units (an M5-class GPU established by the plan): the only case where a
    /// kernel may rely on the M5 fragment map (docs/tensor-ops.md, "Layout").
    let m5: Bool
    /// Why, for the profile: the override or the device's support.
    let reason: String

    /// A problem not planned yet, and the merge pass: off.
    static let off = TensorOpsRoute(enabled: false, m5: false, reason: "not planned")
}

/// The routing of the tensor-op path: the override `FLASH_ATTENTION_TENSOR_OPS` (`1` forces it on
/// every backend that can run the kernels, the CPU engine included; `0` forbids it), else the
/// device's support.
enum TensorOps {
    static let environmentVariable = "FLASH_ATTENTION_TENSOR_OPS"

    /// Whether a host compiles the tensor-op library: only where the route may take it, a device
    /// with matrix units (`hasUnits`) or FLASH_ATTENTION_TENSOR_OPS=1 on macOS/iOS 26.2 or later
    /// (MetalPerformancePrimitives' floor in MLX, `is_nax_available`, and in PyTorch,
    /// `gemm_use_mpp`: neither uses it on 26.0 or 26.1); never with 0. A value the route refuses
    /// compiles nothing (the plan then reports it).
    static func wantsLibrary(hasUnits: Bool) -> Bool {
        switch getenv(environmentVariable).map({ String(cString: $0) }) {
        case nil: return hasUnits
        case "1":
            guard #available(macOS 26.2, iOS 26.2, tvOS 26.2, visionOS 26.2, *) else { return false }
            return true
        default: return false
        }
    }

    /// The route for a backend offering `support`.
    /// - Throws: `invalidArgument` when FLASH_ATTENTION_TENSOR_OPS is set to anything but 0 or 1.
    static func route(_ support: TensorOpsSupport) throws -> TensorOpsRoute {
        guard let value = getenv(environmentVariable) else {
            let on = support.hasUnits && support.hasKernels
            return TensorOpsRoute(enabled: on, m5: support.hasUnits,
                                  reason: (on ? "tensor ops: " : "simdgroup kernels: ") + support.detail)
        }
        switch String(cString: value) {
        case "0":
            return TensorOpsRoute(enabled: false, m5: support.hasUnits,
                                  reason: "simdgroup kernels: \(environmentVariable)=0")
        case "1":
            guard support.hasKernels else {
                return TensorOpsRoute(enabled: false, m5: support.hasUnits,
                                      reason: "simdgroup kernels: \(environmentVariable)=1, but \(support.detail)")
            }
            return TensorOpsRoute(enabled: true, m5: support.hasUnits,
                                  reason: "tensor ops: \(environmentVariable)=1 (\(support.detail))")
        case let text:
            throw FlashAttentionError.invalidArgument(
                "\(environmentVariable) (\(text)) must be 1 (force the tensor-op kernels) or 0 (forbid them); "
                    + "unset lets the device decide")
        }
    }

    /// Whether the tensor-op forward serves `problem` (a planned one): float16 or bfloat16, a
    /// head-dim bucket of FA_TENSOR_BUCKET_MASK (64, 96, 128, 256), plain k and v (no KV cache), the
    /// dense forward (no split-KV: at 1-64 rows per KV head the split and decode kernels stay,
    /// docs/tensor-ops.md), row strides that fit a tensor (`rowStridesFitTensors`).
    static func forwardServes(_ problem: Problem) -> Bool {
        problem.dtype != .float32 && problem.kvCache == nil && problem.split == nil
            && UInt32(FA_TENSOR_BUCKET_MASK) & (1 << (problem.bucket.head_dim_max / 32)) != 0
            && rowStridesFitTensors(problem)
    }

    /// Query rows per threadgroup of the tensor-op forward and dQ of `bucket`: FA_TENSOR_BLOCK_Q (4
    /// SIMD-groups of 16 rows), or FA_TENSOR_PAIR_BLOCK_Q from FA_TENSOR_PAIR_DP up, where two
    /// SIMD-groups share 16 rows, each owning half of head_dim (`tensor_block_q`,
    /// flash_attention_tensor.h). dK/dV keeps FA_TENSOR_BLOCK_Q keys.
    static func queryBlock(_ bucket: FlashAttentionBucket) -> UInt32 {
        bucket.head_dim_max >= UInt32(FA_TENSOR_PAIR_DP) ? UInt32(FA_TENSOR_PAIR_BLOCK_Q) : UInt32(FA_TENSOR_BLOCK_Q)
    }

    /// Whether every tensor's row stride fits the int32 strides of a Metal tensor, through which the
    /// tensor-op kernels read and write rows (`rows_tensor`, flash_attention_tensor.h).
    static func rowStridesFitTensors(_ problem: Problem) -> Bool {
        problem.layouts.values.allSatisfy { $0.strides.seq <= Int(Int32.max) }
    }

    /// Whether the tensor-op dQ and dK/dV serve `problem` (a planned one): float16 or bfloat16, a
    /// head-dim bucket of FA_TENSOR_BUCKET_MASK, and row strides that fit the int32 strides of a
    /// Metal tensor (the kernels read rows as tensors); every option of the simdgroup backward is
    /// theirs too.
    static func backwardServes(_ problem: Problem) -> Bool {
        problem.dtype != .float32 && UInt32(FA_TENSOR_BUCKET_MASK) & (1 << (problem.bucket.head_dim_max / 32)) != 0
            && rowStridesFitTensors(problem)
    }
}
