import CFlashAttentionMetal

/// One kernel of the catalogue (Shaders/flash_attention_catalogue.h, read through `fa_kernel`): the
/// names of its instances, the buffers it binds and the function constants it reads.
struct CatalogueKernel {
    /// A buffer the kernel binds at `[[buffer(index)]]`, named as the kernels spell it.
    struct Buffer {
        let index: Int
        let name: String
        /// The parameter struct (constant address space).
        let isParams: Bool
    }

    let name: String
    let instances: Int
    let buffers: [Buffer]
    /// `FA_FUNCTION_CONSTANT_*` indices, ascending.
    let constants: [Int32]

    /// Every kernel, indexed by `FA_KERNEL_*`.
    private static let all: [CatalogueKernel] = (0..<Int(FA_KERNEL_COUNT)).map(CatalogueKernel.init(row:))

    /// The kernel `FA_KERNEL_<name>`.
    static func kernel(_ id: Int) -> CatalogueKernel { all[id] }

    private init(row id: Int) {
        var row = FlashAttentionKernel()
        let found = fa_kernel(UInt32(id), &row) != 0
        precondition(found, "no kernel \(id) in the catalogue")
        name = String(cString: row.name)
        instances = Int(row.instances)
        buffers = (0..<Int(row.buffer_count)).map { i in
            let buffer = row.buffers[i]
            return Buffer(index: Int(buffer.index), name: String(cString: buffer.name), isParams: buffer.constant != 0)
        }
        constants = (0..<Int32(FA_FUNCTION_CONSTANT_COUNT)).filter { row.constants & (1 << UInt32($0)) != 0 }
    }

    /// The instance that serves `problem`: flash_attention_<name>_<dtype>_d<head_dim_max> (per
    /// bucket), flash_attention_<name>_<dtype> (per dtype) or flash_attention_<name>.
    func instanceName(for problem: Problem) -> String {
        switch instances {
        case Int(FA_KERNEL_INSTANCES_bucket), Int(FA_KERNEL_INSTANCES_decode_bucket),
             Int(FA_KERNEL_INSTANCES_decode_mma_bucket), Int(FA_KERNEL_INSTANCES_tensor_bucket):
            return "flash_attention_\(name)_\(problem.dtype.kernelSuffix)_d\(problem.bucket.head_dim_max)"
        case Int(FA_KERNEL_INSTANCES_dtype):
            return "flash_attention_\(name)_\(problem.dtype.kernelSuffix)"
        default:
            return "flash_attention_\(name)"
        }
    }

    /// The index of the parameter struct.
    var paramsIndex: Int {
        guard let params = buffers.first(where: \.isParams) else {
            preconditionFailure("kernel \(name) binds no parameter struct")
        }
        return params.index
    }

    /// The buffers bound for `problem`, by index: each listed buffer's role
    /// (`BufferRole.bound(toKernelBuffer:in:)`), and `lse` as a placeholder at every index below the
    /// last that the kernel does not read (the dense KV-cache kernel's partial results), so that the
    /// indices stay gapless.
    func bindings(for problem: Problem) -> [BufferBinding] {
        let listed = Dictionary(uniqueKeysWithValues: buffers.map { ($0.index, $0) })
        let last = buffers.map(\.index).max() ?? -1
        return (0...max(last, 0)).compactMap { index in
            guard let buffer = listed[index] else { return BufferBinding(index: index, role: .lse) }
            if buffer.isParams { return nil }
            return BufferBinding(index: index, role: BufferRole.bound(toKernelBuffer: buffer.name, in: problem))
        }
    }
}

extension BufferRole {
    /// The role bound to the kernel buffer named `name` (the catalogue's spelling) for `problem`: an
    /// optional input the problem lacks (attn_mask, alibi_slopes, sinks, a contiguous cache's block
    /// table, an unquantized cache's scales and biases) is bound to `lse` as a placeholder that the
    /// kernels never read.
    static func bound(toKernelBuffer name: String, in problem: Problem) -> BufferRole {
        let s = problem.scores
        let paged = problem.kvCache?.paged ?? false
        let quantized = problem.kvCache?.quantized ?? false
        switch name {
        case "q": return .q
        case "k": return .k
        case "v": return .v
        case "out": return .out
        case "lse": return .lse
        case "dout": return .dout
        case "dq": return .dq
        case "dk": return .dk
        case "dv": return .dv
        case "delta": return .delta
        case "lse_residual": return .lseResidual
        case "partial_out": return .partialOut
        case "partial_lse": return .partialLse
        case "partial_dk": return .partialDk
        case "partial_dv": return .partialDv
        case "mask": return s.maskType == UInt32(FA_MASK_NONE) ? .lse : .attnMask
        case "alibi": return s.hasAlibi ? .alibiSlopes : .lse
        case "sinks": return s.hasSinks ? .sinks : .lse
        case "dsinks": return .dsinks
        case "out_a": return .outA
        case "lse_a": return .lseA
        case "out_b": return .outB
        case "lse_b": return .lseB
        case "kv_table": return paged ? .blockTable : .lse
        case "k_scales": return quantized ? .kScales : .lse
        case "k_biases": return quantized ? .kBiases : .lse
        case "v_scales": return quantized ? .vScales : .lse
        case "v_biases": return quantized ? .vBiases : .lse
        case "cu_seqlens_q": return .cuSeqlensQ
        case "cu_seqlens_k": return .cuSeqlensK
        case "table": return .sequenceTable
        default: preconditionFailure("kernel buffer \(name) has no role")
        }
    }
}
