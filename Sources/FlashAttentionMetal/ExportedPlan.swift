#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif
import CFlashAttentionMetal

/// What an `fa_plan` points to: a ``DispatchPlan`` cut into pieces and flattened into the
/// dispatches a framework encodes in order, each with its buffer offsets, parameter bytes and
/// specialisation, plus the C strings and bytes the exported records point into (valid while the
/// plan lives). Immutable, so it may be read from several threads.
final class ExportedPlan {
    /// One dispatch of one piece, as `fa_plan_get_dispatch` reports it.
    struct Record {
        let piece: Int
        let dispatch: Dispatch
        /// (binding, byte offset, byte length) in binding order, then the buffer that holds the
        /// parameter struct where the dispatch reads it from one (`dispatch.paramsRole`).
        let bindings: [(binding: BufferBinding, offset: Int, length: Int)]
        /// `paramsSize` bytes (calloc): the parameter struct, padded to its stride with zeros.
        let params: UnsafeMutableRawPointer
        let kernelName: UnsafeMutablePointer<CChar>
        /// One C string per specialisation constant, in the order of `dispatch.specialization`.
        let constantNames: [UnsafeMutablePointer<CChar>]
        /// ``functionConstantPrelude(_:)`` of the dispatch's specialisation.
        let prelude: UnsafeMutablePointer<CChar>
    }

    /// The whole pass; `fa_plan_execute` runs it.
    let plan: DispatchPlan
    let pieceCount: Int
    let records: [Record]
    /// Every role the dispatches bind, in order of first binding, with its use.
    let buffers: [(role: BufferRole, usage: fa_buffer_usage)]
    /// The plan's tensor-op route and why (`TensorOpsRoute.reason`), as a C string.
    let tensorOps: UnsafeMutablePointer<CChar>

    /// The parameter bytes of every dispatch: the struct's stride, as MSL's sizeof counts it.
    static let paramsSize = MemoryLayout<FlashAttentionParams>.stride

    /// `plan` in pieces of at most `maxFlopsPerPiece` (0: one piece).
    /// - Throws: ``FlashAttentionError/outOfMemory(_:)`` when the records' memory cannot be had.
    init(_ plan: DispatchPlan, maxFlopsPerPiece: UInt64) throws {
        self.plan = plan
        let pieces = maxFlopsPerPiece == 0
            ? [PlanPiece(whole: plan)] : plan.pieces(maxFlops: Int(clamping: maxFlopsPerPiece))
        pieceCount = pieces.count
        buffers = plan.boundRoles.map { role in
            let usage = plan.workspace.contains(role) ? FA_BUFFER_WORKSPACE
                : plan.outputs.contains(role) ? FA_BUFFER_OUTPUT
                : plan.caches.contains(role) ? FA_BUFFER_READ_WRITE : FA_BUFFER_INPUT
            return (role, usage)
        }
        guard let reason = strdup(plan.tensorOps.reason) else {
            throw FlashAttentionError.outOfMemory("cannot allocate the records of the plan")
        }
        tensorOps = reason
        var made: [Record] = []
        do {
            for (number, piece) in pieces.enumerated() {
                for dispatch in piece.plan.dispatches {
                    made.append(try ExportedPlan.record(dispatch, of: piece, number: number))
                }
            }
        } catch {
            ExportedPlan.release(made)
            free(reason)
            throw error
        }
        records = made
    }

    /// The record of `dispatch` in piece `number`, with its C memory.
    private static func record(_ dispatch: Dispatch, of piece: PlanPiece, number: Int) throws -> Record {
        let names = [dispatch.kernelName, functionConstantPrelude(dispatch.specialization)]
            + dispatch.specialization.map(\.name)
        let strings = names.compactMap { strdup($0) }
        guard strings.count == names.count, let params = calloc(1, paramsSize) else {
            strings.forEach { free($0) }
            throw FlashAttentionError.outOfMemory("cannot allocate the records of the plan")
        }
        params.storeBytes(of: dispatch.params, as: FlashAttentionParams.self)
        // The struct's tail padding holds whatever the Swift value's copy had: zeroed, so that one
        // problem always exports the same bytes.
        let fields = fa_params_field_bytes()
        memset(params + fields, 0, paramsSize - fields)
        let bound = dispatch.bindings
            + (dispatch.paramsRole.map { [BufferBinding(index: dispatch.paramsIndex, role: $0)] } ?? [])
        let bindings = bound.map { binding in
            (binding, piece.byteOffset(of: binding.role), binding.role.byteCount(for: piece.plan.problem))
        }
        return Record(piece: number, dispatch: dispatch, bindings: bindings, params: params, kernelName: strings[0],
                      constantNames: Array(strings.dropFirst(2)), prelude: strings[1])
    }

    /// Frees the C memory of `records`.
    private static func release(_ records: [Record]) {
        for record in records {
            free(record.params)
            free(record.kernelName)
            free(record.prelude)
            record.constantNames.forEach { free($0) }
        }
    }

    deinit {
        ExportedPlan.release(records)
        free(tensorOps)
    }
}

extension BufferRole {
    /// The role's `fa_buffer_role`.
    var abi: fa_buffer_role {
        switch self {
        case .q: return FA_BUFFER_ROLE_Q
        case .k: return FA_BUFFER_ROLE_K
        case .v: return FA_BUFFER_ROLE_V
        case .out: return FA_BUFFER_ROLE_OUT
        case .lse: return FA_BUFFER_ROLE_LSE
        case .dout: return FA_BUFFER_ROLE_DOUT
        case .dq: return FA_BUFFER_ROLE_DQ
        case .dk: return FA_BUFFER_ROLE_DK
        case .dv: return FA_BUFFER_ROLE_DV
        case .delta: return FA_BUFFER_ROLE_DELTA
        case .lseResidual: return FA_BUFFER_ROLE_LSE_RESIDUAL
        case .partialOut: return FA_BUFFER_ROLE_PARTIAL_OUT
        case .partialLse: return FA_BUFFER_ROLE_PARTIAL_LSE
        case .partialDk: return FA_BUFFER_ROLE_PARTIAL_DK
        case .partialDv: return FA_BUFFER_ROLE_PARTIAL_DV
        case .attnMask: return FA_BUFFER_ROLE_ATTN_MASK
        case .alibiSlopes: return FA_BUFFER_ROLE_ALIBI_SLOPES
        case .sinks: return FA_BUFFER_ROLE_SINKS
        case .dsinks: return FA_BUFFER_ROLE_DSINKS
        case .outA: return FA_BUFFER_ROLE_OUT_A
        case .lseA: return FA_BUFFER_ROLE_LSE_A
        case .outB: return FA_BUFFER_ROLE_OUT_B
        case .lseB: return FA_BUFFER_ROLE_LSE_B
        case .blockTable: return FA_BUFFER_ROLE_BLOCK_TABLE
        case .kScales: return FA_BUFFER_ROLE_K_SCALES
        case .kBiases: return FA_BUFFER_ROLE_K_BIASES
        case .vScales: return FA_BUFFER_ROLE_V_SCALES
        case .vBiases: return FA_BUFFER_ROLE_V_BIASES
        case .cuSeqlensQ: return FA_BUFFER_ROLE_CU_SEQLENS_Q
        case .cuSeqlensK: return FA_BUFFER_ROLE_CU_SEQLENS_K
        case .sequenceTable: return FA_BUFFER_ROLE_SEQUENCE_TABLE
        }
    }
}

extension SpecializationType {
    /// The type's `fa_specialization_type`.
    var abi: fa_specialization_type {
        switch self {
        case .bool: return FA_SPECIALIZATION_BOOL
        case .uint32: return FA_SPECIALIZATION_UINT32
        }
    }
}
