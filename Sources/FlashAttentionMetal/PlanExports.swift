#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif
import CFlashAttentionMetal

// The fa_plan_* entry points of flash_attention_metal.h: the dispatch plan, exported for frameworks
// that encode the kernels themselves, and fa_plan_execute. Conventions as in CExports.swift.

/// The plan behind a handle, or an `invalidArgument` error for null.
private func exportedPlan(_ handle: OpaquePointer?) throws -> ExportedPlan {
    guard let handle else { throw FlashAttentionError.invalidArgument("plan must not be null") }
    return Unmanaged<ExportedPlan>.fromOpaque(UnsafeRawPointer(handle)).takeUnretainedValue()
}

/// Hands `plan` to C through `outPlan` (retained; fa_plan_destroy releases it).
private func publish(_ plan: ExportedPlan, _ outPlan: UnsafeMutablePointer<OpaquePointer?>) {
    outPlan.pointee = OpaquePointer(Unmanaged.passRetained(plan).toOpaque())
}

/// `index` must be below `count`; `name` names the index in the message.
private func checkIndex(_ index: UInt32, _ count: Int, _ name: String, _ what: String) throws -> Int {
    guard Int(index) < count else {
        throw FlashAttentionError.invalidArgument("\(name) (\(index)) must be less than \(what) (\(count))")
    }
    return Int(index)
}

/// Writes `value` to the caller's versioned struct at `pointer`, keeping the caller's struct_size.
private func fill<T>(_ pointer: UnsafeMutablePointer<T>?, _ name: String, _ type: String,
                     _ value: (UInt32) -> T) throws {
    let out = try required(pointer, name)
    try checkStructSize(out, name, type)
    out.pointee = value(UnsafeRawPointer(out).load(as: UInt32.self))
}

/// fa_plan_create: see flash_attention_metal.h.
@_cdecl("fa_plan_create")
public func _exportPlanCreate(_ problem: UnsafePointer<fa_problem>?, _ pass: fa_pass, _ maxFlopsPerPiece: UInt64,
                              _ outPlan: UnsafeMutablePointer<OpaquePointer?>?) -> fa_status {
    _exportPlanCreateFor(problem, pass, maxFlopsPerPiece, nil, outPlan)
}

/// What `target` (an fa_plan_target; nil: the library's Metal device without a tensor-op library)
/// offers the tensor-op kernels.
private func tensorOpsSupport(_ target: UnsafePointer<fa_plan_target>?) throws -> TensorOpsSupport {
    guard let target else { return .host(architecture: nil, library: FA_TENSOR_LIBRARY_NONE, error: nil) }
    try checkStructSize(UnsafeMutablePointer(mutating: target), "target", "fa_plan_target")
    let t = target.pointee
    let library = fa_tensor_library(rawValue: t.tensor_library)
    guard [FA_TENSOR_LIBRARY_NONE, FA_TENSOR_LIBRARY_READY, FA_TENSOR_LIBRARY_FAILED].contains(library) else {
        throw FlashAttentionError.invalidArgument(
            "target->tensor_library (\(t.tensor_library)) must be FA_TENSOR_LIBRARY_NONE, _READY or _FAILED")
    }
    return TensorOpsSupport.host(architecture: t.architecture.map { String(cString: $0) }, library: library,
                                 error: t.tensor_library_error.map { String(cString: $0) })
}

/// fa_tensor_ops_wanted: see flash_attention_metal.h.
@_cdecl("fa_tensor_ops_wanted")
public func _exportTensorOpsWanted(_ architecture: UnsafePointer<CChar>?,
                                   _ outWanted: UnsafeMutablePointer<UInt32>?) -> fa_status {
    do {
        let out = try required(outWanted, "out_wanted")
        let support = TensorOpsSupport.host(architecture: architecture.map { String(cString: $0) },
                                            library: FA_TENSOR_LIBRARY_NONE, error: nil)
        out.pointee = TensorOps.wantsLibrary(hasUnits: support.hasUnits) ? 1 : 0
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// fa_plan_create_for: see flash_attention_metal.h.
@_cdecl("fa_plan_create_for")
public func _exportPlanCreateFor(_ problem: UnsafePointer<fa_problem>?, _ pass: fa_pass, _ maxFlopsPerPiece: UInt64,
                                 _ target: UnsafePointer<fa_plan_target>?,
                                 _ outPlan: UnsafeMutablePointer<OpaquePointer?>?) -> fa_status {
    do {
        let out = try required(outPlan, "out_plan")
        out.pointee = nil
        let p = try Problem.validate(problem)
        let kind: Pass
        switch pass {
        case FA_PASS_FORWARD: kind = .forward
        case FA_PASS_BACKWARD:
            try requireNoKVCache(p)
            kind = .backward
        default:
            throw FlashAttentionError.invalidArgument("pass (\(pass.rawValue)) must be FA_PASS_FORWARD or "
                                                          + "FA_PASS_BACKWARD (FA_PASS_MERGE: fa_plan_create_merge)")
        }
        // For the GPU its hosts encode it on, as a Metal context plans (fa_gpu_cores with no context).
        let plan = try DispatchPlan.make(kind, p, device: GPUCores.libraryDevice, tensorOps: try tensorOpsSupport(target))
        publish(try ExportedPlan(plan, maxFlopsPerPiece: maxFlopsPerPiece), out)
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// fa_plan_create_merge: see flash_attention_metal.h.
@_cdecl("fa_plan_create_merge")
public func _exportPlanCreateMerge(_ rows: UInt64, _ headDim: UInt32,
                                   _ outPlan: UnsafeMutablePointer<OpaquePointer?>?) -> fa_status {
    do {
        let out = try required(outPlan, "out_plan")
        out.pointee = nil
        let plan = try DispatchPlan.make(.merge, try Problem.merge(rows: rows, headDim: Int(headDim)),
                                         device: GPUCores.libraryDevice)
        publish(try ExportedPlan(plan, maxFlopsPerPiece: 0), out)
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// fa_plan_destroy: see flash_attention_metal.h.
@_cdecl("fa_plan_destroy")
public func _exportPlanDestroy(_ handle: OpaquePointer?) {
    guard let handle else { return }
    Unmanaged<ExportedPlan>.fromOpaque(UnsafeRawPointer(handle)).release()
}

/// fa_plan_get_info: see flash_attention_metal.h.
@_cdecl("fa_plan_get_info")
public func _exportPlanGetInfo(_ handle: OpaquePointer?, _ info: UnsafeMutablePointer<fa_plan_info>?) -> fa_status {
    do {
        let plan = try exportedPlan(handle)
        let pass: fa_pass
        switch plan.plan.pass {
        case .forward: pass = FA_PASS_FORWARD
        case .backward: pass = FA_PASS_BACKWARD
        case .merge: pass = FA_PASS_MERGE
        }
        try fill(info, "info", "fa_plan_info") { size in
            fa_plan_info(struct_size: size, pass: pass.rawValue, dispatch_count: UInt32(plan.records.count),
                         buffer_count: UInt32(plan.buffers.count), piece_count: UInt32(plan.pieceCount))
        }
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// fa_plan_tensor_ops: see flash_attention_metal.h.
@_cdecl("fa_plan_tensor_ops")
public func _exportPlanTensorOps(_ handle: OpaquePointer?) -> UnsafePointer<CChar>? {
    (try? exportedPlan(handle)).map { UnsafePointer($0.tensorOps) }
}

/// fa_plan_get_buffer: see flash_attention_metal.h.
@_cdecl("fa_plan_get_buffer")
public func _exportPlanGetBuffer(_ handle: OpaquePointer?, _ index: UInt32,
                                 _ buffer: UnsafeMutablePointer<fa_plan_buffer>?) -> fa_status {
    do {
        let plan = try exportedPlan(handle)
        let (role, usage) = plan.buffers[try checkIndex(index, plan.buffers.count, "index", "the plan's buffer_count")]
        try fill(buffer, "buffer", "fa_plan_buffer") { size in
            fa_plan_buffer(struct_size: size, role: role.abi.rawValue, usage: usage.rawValue,
                           element_size: UInt32(role.elementSize(for: plan.plan.problem)),
                           byte_count: UInt64(role.byteCount(for: plan.plan.problem)))
        }
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// fa_plan_get_dispatch: see flash_attention_metal.h.
@_cdecl("fa_plan_get_dispatch")
public func _exportPlanGetDispatch(_ handle: OpaquePointer?, _ index: UInt32,
                                   _ dispatch: UnsafeMutablePointer<fa_plan_dispatch>?) -> fa_status {
    do {
        let plan = try exportedPlan(handle)
        let out = try required(dispatch, "dispatch")
        // Callers built before params_from_buffer pass the struct up to constants_prelude: they get
        // every dispatch but one that binds its parameters from a buffer, where they would bind the
        // bytes instead.
        let declared = Int(UnsafeRawPointer(out).load(as: UInt32.self))
        let size = MemoryLayout<fa_plan_dispatch>.size
        let legacy = MemoryLayout<fa_plan_dispatch>.offset(of: \fa_plan_dispatch.params_from_buffer)!
        guard declared >= legacy else {
            throw FlashAttentionError.invalidArgument(
                "dispatch->struct_size (\(declared)) must be at least \(legacy) "
                    + "(fa_plan_dispatch up to constants_prelude)")
        }
        let record = plan.records[try checkIndex(index, plan.records.count, "index", "the plan's dispatch_count")]
        let d = record.dispatch
        if let role = d.paramsRole, declared < size {
            throw FlashAttentionError.invalidArgument(
                "dispatch->struct_size (\(declared)) must be at least sizeof(fa_plan_dispatch) (\(size)) for dispatch "
                    + "\(index), which reads its parameters from the \(role.name) buffer (params_from_buffer)")
        }
        var value = fa_plan_dispatch(
            struct_size: UInt32(declared), piece: UInt32(record.piece),
            threadgroups_per_grid: (d.threadgroupsPerGrid.width, d.threadgroupsPerGrid.height,
                                    d.threadgroupsPerGrid.depth),
            threads_per_threadgroup: (d.threadsPerThreadgroup.width, d.threadsPerThreadgroup.height,
                                      d.threadsPerThreadgroup.depth),
            binding_count: UInt32(record.bindings.count), specialization_count: UInt32(d.specialization.count),
            params_index: UInt32(d.paramsIndex), params_size: UInt32(ExportedPlan.paramsSize),
            params: UnsafeRawPointer(record.params), kernel_name: UnsafePointer(record.kernelName),
            constants_prelude: UnsafePointer(record.prelude), params_from_buffer: d.paramsRole == nil ? 0 : 1)
        withUnsafeBytes(of: &value) { bytes in
            UnsafeMutableRawPointer(out).copyMemory(from: bytes.baseAddress!, byteCount: min(declared, size))
        }
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// The record of dispatch `index` of `plan`.
private func record(_ plan: ExportedPlan, _ index: UInt32) throws -> ExportedPlan.Record {
    plan.records[try checkIndex(index, plan.records.count, "dispatch", "the plan's dispatch_count")]
}

/// fa_plan_get_binding: see flash_attention_metal.h.
@_cdecl("fa_plan_get_binding")
public func _exportPlanGetBinding(_ handle: OpaquePointer?, _ dispatch: UInt32, _ index: UInt32,
                                  _ binding: UnsafeMutablePointer<fa_plan_binding>?) -> fa_status {
    do {
        let r = try record(exportedPlan(handle), dispatch)
        let b = r.bindings[try checkIndex(index, r.bindings.count, "index", "the dispatch's binding_count")]
        try fill(binding, "binding", "fa_plan_binding") { size in
            fa_plan_binding(struct_size: size, index: UInt32(b.binding.index), role: b.binding.role.abi.rawValue,
                            byte_offset: UInt64(b.offset), byte_length: UInt64(b.length))
        }
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// fa_plan_get_specialization: see flash_attention_metal.h.
@_cdecl("fa_plan_get_specialization")
public func _exportPlanGetSpecialization(_ handle: OpaquePointer?, _ dispatch: UInt32, _ index: UInt32,
                                         _ specialization: UnsafeMutablePointer<fa_plan_specialization>?)
    -> fa_status {
    do {
        let r = try record(exportedPlan(handle), dispatch)
        let n = try checkIndex(index, r.dispatch.specialization.count, "index", "the dispatch's specialization_count")
        let constant = r.dispatch.specialization[n]
        try fill(specialization, "specialization", "fa_plan_specialization") { size in
            fa_plan_specialization(struct_size: size, index: UInt32(constant.index), type: constant.type.abi.rawValue,
                                   value: constant.value, name: UnsafePointer(r.constantNames[n]))
        }
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// A C string made once and never written or freed afterwards, so threads may share it (Swift 6
/// language mode requires a global to be Sendable).
private struct SharedCString: @unchecked Sendable {
    let pointer: UnsafeMutablePointer<CChar>?
}

/// The embedded kernel source as a C string, made once (nil only when out of memory).
private let kernelSource = SharedCString(pointer: strdup(EmbeddedShaders.source))
/// The tensor-op kernels' source as a C string, made once (nil only when out of memory).
private let tensorKernelSource = SharedCString(pointer: strdup(EmbeddedShaders.tensorSource))
/// The .metallib's path as a C string, made once; nil when there is none.
private let metallibPath = SharedCString(pointer: PrecompiledShaders.path.flatMap { strdup($0) })

/// The tensor-op .metallib's path as a C string, made once; nil when there is none.
private let tensorMetallibPath = SharedCString(pointer: PrecompiledShaders.tensorPath.flatMap { strdup($0) })

/// fa_plan_kernel_source: see flash_attention_metal.h.
@_cdecl("fa_plan_kernel_source")
public func _exportPlanKernelSource() -> UnsafePointer<CChar>? { kernelSource.pointer.map { UnsafePointer($0) } }

/// fa_plan_tensor_kernel_source: see flash_attention_metal.h.
@_cdecl("fa_plan_tensor_kernel_source")
public func _exportPlanTensorKernelSource() -> UnsafePointer<CChar>? {
    tensorKernelSource.pointer.map { UnsafePointer($0) }
}

/// fa_plan_metallib_path: see flash_attention_metal.h.
@_cdecl("fa_plan_metallib_path")
public func _exportPlanMetallibPath() -> UnsafePointer<CChar>? { metallibPath.pointer.map { UnsafePointer($0) } }

/// fa_plan_tensor_metallib_path: see flash_attention_metal.h.
@_cdecl("fa_plan_tensor_metallib_path")
public func _exportPlanTensorMetallibPath() -> UnsafePointer<CChar>? {
    tensorMetallibPath.pointer.map { UnsafePointer($0) }
}

/// fa_plan_execute: see flash_attention_metal.h.
@_cdecl("fa_plan_execute")
public func _exportPlanExecute(_ contextHandle: OpaquePointer?, _ planHandle: OpaquePointer?,
                               _ pointers: UnsafePointer<UnsafeMutableRawPointer?>?, _ count: UInt32) -> fa_status {
    withAutoreleasePool {
        do {
            let ctx = try context(contextHandle)
            let exported = try exportedPlan(planHandle)
            let given = count == 0 ? nil : try required(pointers, "buffers (buffer_count is \(count))")
            func pointer(_ role: BufferRole) -> UnsafeMutableRawPointer? {
                let slot = Int(role.abi.rawValue)
                return slot < Int(count) ? given?[slot] : nil
            }
            let plan = exported.plan
            var buffers = HostBuffers()
            for role in BufferRole.allCases {
                let name = "buffers[\(role.abi.rawValue)] (\(role.name))"
                guard let (_, usage) = exported.buffers.first(where: { $0.role == role }) else {
                    guard pointer(role) == nil else {
                        throw FlashAttentionError.invalidArgument("\(name) must be NULL: the plan does not use it")
                    }
                    continue
                }
                if usage == FA_BUFFER_WORKSPACE {
                    guard pointer(role) == nil else {
                        throw FlashAttentionError.invalidArgument(
                            "\(name) must be NULL: it is a workspace, which the library allocates")
                    }
                    continue
                }
                let use = usage == FA_BUFFER_OUTPUT ? "writes" : usage == FA_BUFFER_READ_WRITE ? "reads and appends to" : "reads"
                let memory = try required(pointer(role), "\(name), which the plan \(use),")
                buffers.bindOutput(role, memory, for: plan.problem)
            }
            try buffers.checkOutputsDisjoint(plan)
            try ctx.run(plan, buffers: buffers)
            return FA_STATUS_SUCCESS
        } catch {
            return report(error)
        }
    }
}
