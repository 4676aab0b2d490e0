import CFlashAttentionMetal

// The C entry points of flash_attention_metal.h that are not in flash_attention_metal.c. Each one
// validates its own arguments, reports failures through fa_set_last_error and a status, and never
// traps on user input. Swift names carry an `_export` prefix so they do not collide with the C
// declarations imported from the header; they are public only so that the dynamic library exports
// their C symbols, and the underscore keeps them out of the Swift API's completion and docs.

/// Converts a thrown error to a status and records its message for fa_last_error_message().
func report(_ error: Error) -> fa_status {
    let failure = error as? FlashAttentionError ?? .internalError("unexpected error: \(error)")
    fa_set_last_error(failure.message)
    return failure.status
}

/// The context behind a handle, or an `invalidArgument` error for null.
func context(_ handle: OpaquePointer?) throws -> Context {
    guard let handle else { throw FlashAttentionError.invalidArgument("context must not be null") }
    return Unmanaged<Context>.fromOpaque(UnsafeRawPointer(handle)).takeUnretainedValue()
}

/// `name` must not be null; returns it unwrapped.
func required<P>(_ pointer: P?, _ name: String) throws -> P {
    guard let pointer else { throw FlashAttentionError.invalidArgument("\(name) must not be null") }
    return pointer
}

/// Binds attn_mask, alibi_slopes, sinks and the cu_seqlens tables where the descriptor gives them
/// (validated in `p`).
private func bindOptionalInputs(_ buffers: inout HostBuffers, _ d: fa_problem, _ p: Problem) throws {
    if let mask = d.attn_mask, p.scores.maskType != UInt32(FA_MASK_NONE) {
        buffers.bindInput(.attnMask, mask, for: p)
    }
    if let slopes = d.alibi_slopes {
        buffers.bindInput(.alibiSlopes, slopes, for: p)
    }
    if let sinks = d.sinks {
        buffers.bindInput(.sinks, sinks, for: p)
    }
    if p.varlen != nil, let cuQ = d.cu_seqlens_q, let cuK = d.cu_seqlens_k {
        buffers.bindInput(.cuSeqlensQ, cuQ, for: p)
        buffers.bindInput(.cuSeqlensK, cuK, for: p)
    }
}

/// Binds a KV cache's block table and quantization scales and biases (fa_problem's `kv_*` fields).
private func bindKVCache(_ buffers: inout HostBuffers, _ d: fa_problem, _ p: Problem) throws {
    guard let kv = p.kvCache else { return }
    try kv.checkBlockTable(d.kv_block_table, p)
    if kv.paged, let table = d.kv_block_table {
        buffers.bindInput(.blockTable, table, for: p)
    }
    if kv.quantized {
        for (role, pointer) in [(BufferRole.kScales, d.k_scales), (.kBiases, d.k_biases), (.vScales, d.v_scales),
                                (.vBiases, d.v_biases)] {
            buffers.bindInput(role, try required(pointer, role.name), for: p)
        }
    }
}

/// Throws `unsupported` for a KV-cache problem in a pass other than the forward.
func requireNoKVCache(_ p: Problem) throws {
    guard p.kvCache == nil else {
        throw FlashAttentionError.unsupported("KV caches (kv_cache_rows != 0) are read by the forward pass only")
    }
}

/// fa_context_create: see flash_attention_metal.h.
@_cdecl("fa_context_create")
public func _exportContextCreate(_ backend: fa_backend, _ outContext: UnsafeMutablePointer<OpaquePointer?>?)
    -> fa_status {
    withAutoreleasePool {
        do {
            let out = try required(outContext, "out_context")
            let kind: Backend
            switch backend {
            case FA_BACKEND_AUTO: kind = .auto
            case FA_BACKEND_METAL: kind = .metal
            case FA_BACKEND_CPU: kind = .cpu
            default:
                throw FlashAttentionError.invalidArgument(
                    "backend (\(backend.rawValue)) must be FA_BACKEND_AUTO, FA_BACKEND_METAL or FA_BACKEND_CPU")
            }
            out.pointee = nil
            let created = try Context(kind)
            out.pointee = OpaquePointer(Unmanaged.passRetained(created).toOpaque())
            return FA_STATUS_SUCCESS
        } catch {
            return report(error)
        }
    }
}

/// fa_context_destroy: see flash_attention_metal.h.
@_cdecl("fa_context_destroy")
public func _exportContextDestroy(_ handle: OpaquePointer?) {
    guard let handle else { return }
    withAutoreleasePool {
        Unmanaged<Context>.fromOpaque(UnsafeRawPointer(handle)).release()
    }
}

/// fa_context_backend_name: see flash_attention_metal.h.
@_cdecl("fa_context_backend_name")
public func _exportContextBackendName(_ handle: OpaquePointer?) -> UnsafePointer<CChar>? {
    guard let ctx = try? context(handle) else { return nil }
    // StaticString literals are NUL-terminated and live in the binary's constant data.
    return UnsafeRawPointer(ctx.backend.name.utf8Start).assumingMemoryBound(to: CChar.self)
}

/// fa_context_device_name: see flash_attention_metal.h.
@_cdecl("fa_context_device_name")
public func _exportContextDeviceName(_ handle: OpaquePointer?) -> UnsafePointer<CChar>? {
    guard let ctx = try? context(handle) else { return nil }
    return ctx.cString(ctx.backend.deviceName)
}

/// fa_context_backend_note: see flash_attention_metal.h.
@_cdecl("fa_context_backend_note")
public func _exportContextBackendNote(_ handle: OpaquePointer?) -> UnsafePointer<CChar>? {
    guard let ctx = try? context(handle) else { return nil }
    return ctx.cString(ctx.backend.note)
}

/// fa_gpu_cores: see flash_attention_metal.h.
@_cdecl("fa_gpu_cores")
public func _exportGPUCores(_ handle: OpaquePointer?, _ outCores: UnsafeMutablePointer<UInt32>?,
                            _ outSource: UnsafeMutablePointer<UInt32>?) -> fa_status {
    do {
        let cores = try required(outCores, "out_cores")
        let source = try required(outSource, "out_source")
        let device = try handle.map { try context($0).backend.gpuCores } ?? GPUCores.libraryDevice
        let planned = try GPUCores.plan(device: device)
        cores.pointee = planned.cores
        source.pointee = planned.source.abi.rawValue
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// fa_context_cancel: see flash_attention_metal.h. No autorelease pool: it touches no Objective-C
/// object, only the context's atomic epoch.
@_cdecl("fa_context_cancel")
public func _exportContextCancel(_ handle: OpaquePointer?) -> fa_status {
    do {
        try context(handle).cancel()
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// fa_forward: see flash_attention_metal.h.
@_cdecl("fa_forward")
public func _exportForward(_ handle: OpaquePointer?, _ problem: UnsafePointer<fa_problem>?,
                          _ q: UnsafeRawPointer?, _ k: UnsafeRawPointer?, _ v: UnsafeRawPointer?,
                          _ out: UnsafeMutableRawPointer?, _ lse: UnsafeMutablePointer<Float>?) -> fa_status {
    withAutoreleasePool {
        do {
            let ctx = try context(handle)
            let descriptor = try Problem.descriptor(problem)
            let p = try Problem.validate(descriptor)
            var buffers = HostBuffers()
            try buffers.bindInput(.q, required(q, "q"), for: p)
            try buffers.bindInput(.k, required(k, "k"), for: p)
            try buffers.bindInput(.v, required(v, "v"), for: p)
            try buffers.bindOutput(.out, required(out, "out"), for: p)
            try buffers.bindOutput(.lse, required(lse, "lse"), for: p)
            try bindOptionalInputs(&buffers, descriptor, p)
            try bindKVCache(&buffers, descriptor, p)
            try ctx.run(.forward, p, buffers: buffers)
            return FA_STATUS_SUCCESS
        } catch {
            return report(error)
        }
    }
}

/// fa_backward: see flash_attention_metal.h.
@_cdecl("fa_backward")
public func _exportBackward(_ handle: OpaquePointer?, _ problem: UnsafePointer<fa_problem>?,
                           _ dout: UnsafeRawPointer?, _ q: UnsafeRawPointer?,
                           _ k: UnsafeRawPointer?, _ v: UnsafeRawPointer?,
                           _ out: UnsafeRawPointer?, _ lse: UnsafePointer<Float>?,
                           _ dq: UnsafeMutableRawPointer?, _ dk: UnsafeMutableRawPointer?,
                           _ dv: UnsafeMutableRawPointer?) -> fa_status {
    withAutoreleasePool {
        do {
            let ctx = try context(handle)
            let descriptor = try Problem.descriptor(problem)
            let p = try Problem.validate(descriptor)
            try requireNoKVCache(p)
            var buffers = HostBuffers()
            try buffers.bindInput(.dout, required(dout, "dout"), for: p)
            try buffers.bindInput(.q, required(q, "q"), for: p)
            try buffers.bindInput(.k, required(k, "k"), for: p)
            try buffers.bindInput(.v, required(v, "v"), for: p)
            try buffers.bindInput(.out, required(out, "out"), for: p)
            try buffers.bindInput(.lse, required(lse, "lse"), for: p)
            try buffers.bindOutput(.dq, required(dq, "dq"), for: p)
            try buffers.bindOutput(.dk, required(dk, "dk"), for: p)
            try buffers.bindOutput(.dv, required(dv, "dv"), for: p)
            try bindOptionalInputs(&buffers, descriptor, p)
            if p.scores.hasSinks {
                buffers.bindOutput(.dsinks, try required(descriptor.dsinks, "dsinks (sinks are given)"), for: p)
            }
            try ctx.run(.backward, p, buffers: buffers)
            return FA_STATUS_SUCCESS
        } catch {
            return report(error)
        }
    }
}

/// `struct_size` of a caller's versioned struct must cover the fields this library writes.
func checkStructSize<T>(_ pointer: UnsafeMutablePointer<T>, _ name: String, _ type: String) throws {
    let declared = UnsafeRawPointer(pointer).load(as: UInt32.self)
    guard Int(declared) >= MemoryLayout<T>.size else {
        throw FlashAttentionError.invalidArgument(
            "\(name)->struct_size (\(declared)) must be at least sizeof(\(type)) (\(MemoryLayout<T>.size))")
    }
}

/// Writes `text` into the C char array `field` as a NUL-terminated string, truncated to fit.
private func copyCString<Field>(_ text: String, to field: inout Field) {
    withUnsafeMutableBytes(of: &field) { bytes in
        let utf8 = Array(text.utf8.prefix(bytes.count - 1))
        bytes.copyBytes(from: utf8)
        bytes[utf8.count] = 0
    }
}

/// fa_context_last_profile: see flash_attention_metal.h.
@_cdecl("fa_context_last_profile")
public func _exportContextLastProfile(_ handle: OpaquePointer?, _ profile: UnsafeMutablePointer<fa_profile>?)
    -> fa_status {
    do {
        let ctx = try context(handle)
        let out = try required(profile, "profile")
        try checkStructSize(out, "profile", "fa_profile")
        let last = ctx.lastProfile
        out.pointee.dispatch_count = UInt32(last?.dispatches.count ?? 0)
        out.pointee.seconds = last?.seconds ?? 0
        out.pointee.command_buffers = UInt32(clamping: last?.commandBuffers ?? 0)
        out.pointee.gpu_cores = UInt32(clamping: last?.gpuCores ?? 0)
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// fa_context_last_profile_dispatch: see flash_attention_metal.h.
@_cdecl("fa_context_last_profile_dispatch")
public func _exportContextLastProfileDispatch(_ handle: OpaquePointer?, _ index: UInt32,
                                              _ dispatch: UnsafeMutablePointer<fa_dispatch_profile>?) -> fa_status {
    do {
        let ctx = try context(handle)
        let out = try required(dispatch, "dispatch")
        // Callers built before device_bytes_read pass the struct up to specialization only.
        let declared = Int(UnsafeRawPointer(out).load(as: UInt32.self))
        let counted = MemoryLayout<fa_dispatch_profile>.offset(of: \fa_dispatch_profile.device_bytes_read)!
        guard declared >= counted else {
            throw FlashAttentionError.invalidArgument(
                "dispatch->struct_size (\(declared)) must be at least \(counted) (fa_dispatch_profile up to specialization)")
        }
        let dispatches = ctx.lastProfile?.dispatches ?? []
        guard Int(index) < dispatches.count else {
            throw FlashAttentionError.invalidArgument(
                "index (\(index)) must be less than the last profile's dispatch_count (\(dispatches.count))")
        }
        let d = dispatches[Int(index)]
        out.pointee.threadgroups_per_grid = (UInt32(d.threadgroupsPerGrid.width), UInt32(d.threadgroupsPerGrid.height),
                                             UInt32(d.threadgroupsPerGrid.depth))
        out.pointee.threads_per_threadgroup = (UInt32(d.threadsPerThreadgroup.width),
                                               UInt32(d.threadsPerThreadgroup.height),
                                               UInt32(d.threadsPerThreadgroup.depth))
        out.pointee.threadgroup_memory_length = UInt32(clamping: d.threadgroupMemoryLength)
        out.pointee.simdgroup_multiply_accumulates = d.simdgroupMultiplyAccumulates ?? .max
        out.pointee.threadgroup_barriers = d.threadgroupBarriers ?? .max
        out.pointee.seconds = d.seconds ?? .nan
        copyCString(d.kernelName, to: &out.pointee.kernel_name)
        copyCString(SpecializationConstant.text(d.specialization), to: &out.pointee.specialization)
        if declared >= MemoryLayout<fa_dispatch_profile>.size {
            let counts = d.deviceBytesRead ?? []
            withUnsafeMutableBytes(of: &out.pointee.device_bytes_read) { raw in
                let slots = raw.bindMemory(to: UInt64.self)
                for i in slots.indices { slots[i] = i < counts.count ? counts[i] : .max }
            }
        }
        return FA_STATUS_SUCCESS
    } catch {
        return report(error)
    }
}

/// fa_merge_attention: see flash_attention_metal.h (fa_merge_attention_v2 with FA_DTYPE_FLOAT16).
@_cdecl("fa_merge_attention")
public func _exportMergeAttention(_ handle: OpaquePointer?, _ rows: UInt64, _ headDim: UInt32,
                                 _ outA: UnsafePointer<UInt16>?, _ lseA: UnsafePointer<Float>?,
                                 _ outB: UnsafePointer<UInt16>?, _ lseB: UnsafePointer<Float>?,
                                 _ out: UnsafeMutablePointer<UInt16>?, _ lse: UnsafeMutablePointer<Float>?)
    -> fa_status {
    _exportMergeAttentionV2(handle, rows, headDim, FA_DTYPE_FLOAT16.rawValue, outA, lseA, outB, lseB, out, lse)
}

/// fa_merge_attention_v2: see flash_attention_metal.h.
@_cdecl("fa_merge_attention_v2")
public func _exportMergeAttentionV2(_ handle: OpaquePointer?, _ rows: UInt64, _ headDim: UInt32, _ dtype: UInt32,
                                   _ outA: UnsafeRawPointer?, _ lseA: UnsafePointer<Float>?,
                                   _ outB: UnsafeRawPointer?, _ lseB: UnsafePointer<Float>?,
                                   _ out: UnsafeMutableRawPointer?, _ lse: UnsafeMutablePointer<Float>?)
    -> fa_status {
    withAutoreleasePool {
        do {
            let ctx = try context(handle)
            guard let type = AttentionDType(rawValue: dtype) else {
                throw FlashAttentionError.invalidArgument(
                    "dtype (\(dtype)) must be FA_DTYPE_FLOAT16, FA_DTYPE_BFLOAT16 or FA_DTYPE_FLOAT32")
            }
            let p = try Problem.merge(rows: rows, headDim: Int(headDim), dtype: type)
            var buffers = HostBuffers()
            try buffers.bindInput(.outA, required(outA, "out_a"), for: p)
            try buffers.bindInput(.lseA, required(lseA, "lse_a"), for: p)
            try buffers.bindInput(.outB, required(outB, "out_b"), for: p)
            try buffers.bindInput(.lseB, required(lseB, "lse_b"), for: p)
            try buffers.bindOutput(.out, required(out, "out"), for: p)
            try buffers.bindOutput(.lse, required(lse, "lse"), for: p)
            try ctx.run(.merge, p, buffers: buffers)
            return FA_STATUS_SUCCESS
        } catch {
            return report(error)
        }
    }
}
