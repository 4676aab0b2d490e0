// Command queues, command buffers and compute encoders: an encoder records dispatches; a committed
// command buffer runs them in order on its queue's thread through the CPU engine, then completes.
import Foundation
import MSLEngine

// https://developer.apple.com/documentation/corefoundation/cftimeinterval (Core Foundation's, which
// Linux's Foundation lacks)
public typealias CFTimeInterval = Double

// https://developer.apple.com/documentation/metal/mtlcommandbufferstatus
public enum MTLCommandBufferStatus: UInt, Sendable {
    case notEnqueued = 0, enqueued = 1, committed = 2, scheduled = 3, completed = 4, error = 5
}

// https://developer.apple.com/documentation/metal/mtlcommandbuffererroroption
public struct MTLCommandBufferErrorOption: OptionSet, Sendable {
    public let rawValue: UInt
    public init(rawValue: UInt) { self.rawValue = rawValue }
    // https://developer.apple.com/documentation/metal/mtlcommandbuffererroroption/encoderexecutionstatus
    public static let encoderExecutionStatus = MTLCommandBufferErrorOption(rawValue: 1)
}

// https://developer.apple.com/documentation/metal/mtlcommandbufferdescriptor
public final class MTLCommandBufferDescriptor {
    public init() {}
    // https://developer.apple.com/documentation/metal/mtlcommandbufferdescriptor/erroroptions
    public var errorOptions: MTLCommandBufferErrorOption = []
}

// https://developer.apple.com/documentation/metal/mtlcommandencodererrorstate
public enum MTLCommandEncoderErrorState: Int, Sendable {
    case completed = 1, affected = 2, faulted = 4
}

// https://developer.apple.com/documentation/metal/mtlcommandbufferencoderinfo
public protocol MTLCommandBufferEncoderInfo: AnyObject {
    // https://developer.apple.com/documentation/metal/mtlcommandbufferencoderinfo/label
    var label: String { get }
    // https://developer.apple.com/documentation/metal/mtlcommandbufferencoderinfo/errorstate
    var errorState: MTLCommandEncoderErrorState { get }
}

// https://developer.apple.com/documentation/metal/mtlcommandbufferencoderinfoerrorkey
public let MTLCommandBufferEncoderInfoErrorKey = "MTLCommandBufferEncoderInfoErrorKey"

// https://developer.apple.com/documentation/metal/mtlcommandbuffererror
public struct MTLCommandBufferError: CustomNSError, @unchecked Sendable {
    // https://developer.apple.com/documentation/metal/mtlcommandbuffererror/code
    public enum Code: UInt, Sendable {
        case `internal` = 1, timeout = 2, pageFault = 3, accessRevoked = 4, notPermitted = 7, outOfMemory = 8
    }

    public let code: Code
    let message: String
    let encoderInfos: [MTLCommandBufferEncoderInfo]?

    // https://developer.apple.com/documentation/metal/mtlcommandbuffererrordomain
    public static var errorDomain: String { "MTLCommandBufferErrorDomain" }
    public var errorCode: Int { Int(code.rawValue) }
    public var errorUserInfo: [String: Any] {
        var info: [String: Any] = [NSLocalizedDescriptionKey: message]
        info[MTLCommandBufferEncoderInfoErrorKey] = encoderInfos
        return info
    }
}

// https://developer.apple.com/documentation/metal/mtlcommandbufferhandler
public typealias MTLCommandBufferHandler = @Sendable (MTLCommandBuffer) -> Void

// https://developer.apple.com/documentation/metal/mtlcommandqueue
public protocol MTLCommandQueue: AnyObject {
    // https://developer.apple.com/documentation/metal/mtlcommandqueue/makecommandbuffer(descriptor:)
    func makeCommandBuffer(descriptor: MTLCommandBufferDescriptor) -> MTLCommandBuffer?
}

// https://developer.apple.com/documentation/metal/mtlcommandbuffer
public protocol MTLCommandBuffer: AnyObject {
    // https://developer.apple.com/documentation/metal/mtlcommandbuffer/device
    var device: MTLDevice { get }
    // https://developer.apple.com/documentation/metal/mtlcommandbuffer/label
    var label: String? { get set }
    // https://developer.apple.com/documentation/metal/mtlcommandbuffer/status
    var status: MTLCommandBufferStatus { get }
    // https://developer.apple.com/documentation/metal/mtlcommandbuffer/error
    var error: Error? { get }
    // https://developer.apple.com/documentation/metal/mtlcommandbuffer/gpustarttime
    var gpuStartTime: CFTimeInterval { get }
    // https://developer.apple.com/documentation/metal/mtlcommandbuffer/gpuendtime
    var gpuEndTime: CFTimeInterval { get }
    // https://developer.apple.com/documentation/metal/mtlcommandbuffer/makecomputecommandencoder()
    func makeComputeCommandEncoder() -> MTLComputeCommandEncoder?
    // https://developer.apple.com/documentation/metal/mtlcommandbuffer/addcompletedhandler(_:)
    func addCompletedHandler(_ block: @escaping MTLCommandBufferHandler)
    // https://developer.apple.com/documentation/metal/mtlcommandbuffer/commit()
    func commit()
    // https://developer.apple.com/documentation/metal/mtlcommandbuffer/waituntilcompleted() (the tests
    // of the app path wait with it)
    func waitUntilCompleted()
}

// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder
public protocol MTLComputeCommandEncoder: AnyObject {
    // https://developer.apple.com/documentation/metal/mtlcommandencoder/label
    var label: String? { get set }
    // https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setcomputepipelinestate(_:)
    func setComputePipelineState(_ state: MTLComputePipelineState)
    // https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbuffer(_:offset:index:)
    func setBuffer(_ buffer: MTLBuffer?, offset: Int, index: Int)
    // https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbytes(_:length:index:)
    func setBytes(_ bytes: UnsafeRawPointer, length: Int, index: Int)
    // https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/dispatchthreadgroups(_:threadsperthreadgroup:)
    func dispatchThreadgroups(_ threadgroupsPerGrid: MTLSize, threadsPerThreadgroup: MTLSize)
    // https://developer.apple.com/documentation/metal/mtlcommandencoder/endencoding()
    func endEncoding()
}

/// Command buffers of one queue run in commit order on the queue's own thread.
final class StandInCommandQueue: MTLCommandQueue, @unchecked Sendable {
    let device: StandInDevice
    let thread = DispatchQueue(label: "Metal stand-in command queue")

    init(device: StandInDevice) { self.device = device }

    func makeCommandBuffer(descriptor: MTLCommandBufferDescriptor) -> MTLCommandBuffer? {
        StandInCommandBuffer(queue: self, errorOptions: descriptor.errorOptions)
    }
}

/// One recorded dispatch.
struct RecordedDispatch {
    var label: String
    let pipeline: StandInPipeline
    var buffers: [Int: (buffer: StandInBuffer, offset: Int)]
    var bytes: [Int: [UInt8]]
    let threadgroups: MTLSize
    let threads: MTLSize
}

final class StandInEncoderInfo: MTLCommandBufferEncoderInfo, @unchecked Sendable {
    let label: String
    let errorState: MTLCommandEncoderErrorState
    init(label: String, errorState: MTLCommandEncoderErrorState) {
        self.label = label
        self.errorState = errorState
    }
}

final class StandInCommandBuffer: MTLCommandBuffer, @unchecked Sendable {
    private let queue: StandInCommandQueue
    private let errorOptions: MTLCommandBufferErrorOption
    private let lock = NSCondition()
    private var handlers: [MTLCommandBufferHandler] = []
    private var dispatches: [RecordedDispatch] = []
    private var openEncoder: StandInComputeEncoder?
    private var state = MTLCommandBufferStatus.notEnqueued
    private var failure: MTLCommandBufferError?
    private var times = (start: 0.0, end: 0.0)
    var label: String?

    init(queue: StandInCommandQueue, errorOptions: MTLCommandBufferErrorOption) {
        self.queue = queue
        self.errorOptions = errorOptions
    }

    var device: MTLDevice { queue.device }
    var status: MTLCommandBufferStatus { lock.withLock { state } }
    var error: Error? { lock.withLock { failure } }
    var gpuStartTime: CFTimeInterval { lock.withLock { times.start } }
    var gpuEndTime: CFTimeInterval { lock.withLock { times.end } }

    private func requireNotCommitted(_ what: String, _ page: String) {
        if state.rawValue >= MTLCommandBufferStatus.committed.rawValue {
            violation("\(what) after commit() (command buffer \(label ?? "unlabelled"))", page)
        }
    }

    func makeComputeCommandEncoder() -> MTLComputeCommandEncoder? {
        lock.withLock {
            requireNotCommitted("makeComputeCommandEncoder()", "mtlcommandbuffer/makecomputecommandencoder()")
            if openEncoder != nil {
                violation("a new encoder while another is open: call endEncoding() first",
                          "mtlcommandencoder/endencoding()")
            }
            let encoder = StandInComputeEncoder(commandBuffer: self)
            openEncoder = encoder
            return encoder
        }
    }

    /// An encoder's endEncoding(): its dispatches join the command buffer.
    func ended(_ encoder: StandInComputeEncoder, recorded: [RecordedDispatch]) {
        lock.withLock {
            guard openEncoder === encoder else {
                violation("endEncoding() of an encoder that is not this command buffer's open one",
                          "mtlcommandencoder/endencoding()")
            }
            openEncoder = nil
            dispatches += recorded
        }
    }

    func addCompletedHandler(_ block: @escaping MTLCommandBufferHandler) {
        lock.withLock {
            requireNotCommitted("addCompletedHandler(_:)", "mtlcommandbuffer/addcompletedhandler(_:)")
            handlers.append(block)
        }
    }

    func commit() {
        lock.withLock {
            requireNotCommitted("commit()", "mtlcommandbuffer/commit()")
            if openEncoder != nil {
                violation("commit() with an encoder that was not ended (endEncoding())", "mtlcommandbuffer/commit()")
            }
            state = .committed
        }
        queue.thread.async { self.execute() }
    }

    func waitUntilCompleted() {
        lock.withLock {
            if state.rawValue < MTLCommandBufferStatus.committed.rawValue {
                violation("waitUntilCompleted() before commit() never returns",
                          "mtlcommandbuffer/waituntilcompleted()")
            }
            while state != .completed && state != .error { lock.wait() }
        }
    }

    /// Runs the dispatches in order; the first failure stops the rest, as a GPU fault does.
    private func execute() {
        let start = hostSeconds()
        lock.withLock { state = .scheduled }
        var outcome: MTLCommandBufferError?
        var faulted = dispatches.count
        if let code = FaultPlan.shared.commitFault() {
            outcome = MTLCommandBufferError(code: code, message: "stand-in fault: \(code)", encoderInfos: nil)
            faulted = 0
        } else {
            for (n, dispatch) in dispatches.enumerated() {
                if let failure = run(dispatch) {
                    outcome = failure
                    faulted = n
                    break
                }
            }
        }
        if let failed = outcome, errorOptions.contains(.encoderExecutionStatus) {
            let infos = dispatches.enumerated().map { n, dispatch in
                StandInEncoderInfo(label: dispatch.label,
                                   errorState: n < faulted ? .completed : n == faulted ? .faulted : .affected)
            }
            outcome = MTLCommandBufferError(code: failed.code, message: failed.message, encoderInfos: infos)
        }
        let end = hostSeconds()
        let completed: [MTLCommandBufferHandler] = lock.withLock {
            times = (start, end)
            failure = outcome
            state = outcome == nil ? .completed : .error
            dispatches = []
            lock.broadcast()
            return handlers
        }
        for handler in completed { handler(self) }
    }

    /// One dispatch on the CPU engine; nil when it ran.
    private func run(_ dispatch: RecordedDispatch) -> MTLCommandBufferError? {
        let function = dispatch.pipeline.function
        var info = msl_engine_kernel_info()
        _ = msl_engine_describe_kernel(function.name, &info)
        var slots = [msl_engine_buffer](repeating: msl_engine_buffer(contents: nil, length: 0),
                                        count: Int(info.buffer_count))
        // setBytes data, copied into 16-byte-aligned memory for the dispatch (as for a struct).
        var copies: [UnsafeMutableRawPointer] = []
        defer { copies.forEach { $0.deallocate() } }
        for index in 0..<Int(info.buffer_count) {
            if let bound = dispatch.buffers[index] {
                slots[index] = msl_engine_buffer(contents: bound.buffer.memory + bound.offset,
                                                 length: bound.buffer.length - bound.offset)
            } else if let bytes = dispatch.bytes[index] {
                let copy = UnsafeMutableRawPointer.allocate(byteCount: bytes.count, alignment: 16)
                copy.copyMemory(from: bytes, byteCount: bytes.count)
                copies.append(copy)
                slots[index] = msl_engine_buffer(contents: copy, length: bytes.count)
            } else {
                violation("\(function.name) reads [[buffer(\(index))]], which \(dispatch.label) does not bind",
                          "mtlcomputecommandencoder/setbuffer(_:offset:index:)")
            }
        }
        var message = [CChar](repeating: 0, count: 1024)
        let constants = function.constants ?? []
        let status = msl_engine_dispatch_specialized(
            function.name, slots, UInt32(slots.count), constants, UInt32(constants.count),
            engineSize(dispatch.threadgroups), engineSize(dispatch.threads), nil, 0, &message, message.count)
        let text = String(decoding: message.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
        switch status {
        case MSL_ENGINE_SUCCESS:
            return nil
        case MSL_ENGINE_OUT_OF_MEMORY:
            return MTLCommandBufferError(code: .outOfMemory, message: text, encoderInfos: nil)
        case MSL_ENGINE_FUNCTION_CONSTANT_UNSET:
            violation("\(text): a pipeline needs a value for every function constant its kernel uses",
                      "mtllibrary/makefunction(name:constantvalues:)")
        default:
            // Divergent barriers, a bad grid: undefined behaviour on a GPU, stopped loudly here.
            violation("\(function.name) did not run: \(text)",
                      "mtlcomputecommandencoder/dispatchthreadgroups(_:threadsperthreadgroup:)")
        }
    }
}

private func engineSize(_ size: MTLSize) -> msl_engine_size {
    msl_engine_size(width: UInt32(size.width), height: UInt32(size.height), depth: UInt32(size.depth))
}

/// Records the state set before each dispatch, as the argument table does.
final class StandInComputeEncoder: MTLComputeCommandEncoder, @unchecked Sendable {
    /// Entries of the buffer argument table: indices 0...30.
    static let bufferArgumentTableLength = 31
    /// setBytes(_:length:index:) takes less than 4 KB.
    static let maxBytesLength = 4096

    private weak var commandBuffer: StandInCommandBuffer?
    private var pipeline: StandInPipeline?
    private var buffers: [Int: (buffer: StandInBuffer, offset: Int)] = [:]
    private var bytes: [Int: [UInt8]] = [:]
    private var recorded: [RecordedDispatch] = []
    private var ended = false
    var label: String?

    init(commandBuffer: StandInCommandBuffer) { self.commandBuffer = commandBuffer }

    private func requireOpen(_ call: String, _ page: String) {
        if ended { violation("\(call) after endEncoding()", page) }
    }

    private func checkIndex(_ index: Int, _ page: String) {
        if index < 0 || index >= Self.bufferArgumentTableLength {
            violation("buffer index \(index) outside the argument table (0..<\(Self.bufferArgumentTableLength))", page)
        }
    }

    func setComputePipelineState(_ state: MTLComputePipelineState) {
        let page = "mtlcomputecommandencoder/setcomputepipelinestate(_:)"
        requireOpen("setComputePipelineState(_:)", page)
        guard let state = state as? StandInPipeline else { violation("a pipeline of another device", page) }
        pipeline = state
    }

    func setBuffer(_ buffer: MTLBuffer?, offset: Int, index: Int) {
        let page = "mtlcomputecommandencoder/setbuffer(_:offset:index:)"
        requireOpen("setBuffer(_:offset:index:)", page)
        checkIndex(index, page)
        guard let buffer else {
            buffers[index] = nil
            return
        }
        guard let buffer = buffer as? StandInBuffer, buffer.device === commandBuffer?.device else {
            violation("a buffer of another device", page)
        }
        if offset < 0 || offset >= buffer.length {
            violation("offset \(offset) outside the buffer (\(buffer.length) bytes) at index \(index)", page)
        }
        buffers[index] = (buffer, offset)
        bytes[index] = nil
    }

    func setBytes(_ bytes: UnsafeRawPointer, length: Int, index: Int) {
        let page = "mtlcomputecommandencoder/setbytes(_:length:index:)"
        requireOpen("setBytes(_:length:index:)", page)
        checkIndex(index, page)
        if length <= 0 || length >= Self.maxBytesLength {
            violation("setBytes of \(length) bytes: only for data smaller than 4 KB", page)
        }
        self.bytes[index] = Array(UnsafeRawBufferPointer(start: bytes, count: length))
        buffers[index] = nil
    }

    func dispatchThreadgroups(_ threadgroupsPerGrid: MTLSize, threadsPerThreadgroup: MTLSize) {
        let page = "mtlcomputecommandencoder/dispatchthreadgroups(_:threadsperthreadgroup:)"
        requireOpen("dispatchThreadgroups(_:threadsPerThreadgroup:)", page)
        guard let pipeline else { violation("a dispatch before setComputePipelineState(_:)", page) }
        let threads = threadsPerThreadgroup.width * threadsPerThreadgroup.height * threadsPerThreadgroup.depth
        if threads > pipeline.maxTotalThreadsPerThreadgroup {
            violation("\(threads) threads per threadgroup; \(pipeline.function.name)'s pipeline allows "
                          + "\(pipeline.maxTotalThreadsPerThreadgroup) (maxTotalThreadsPerThreadgroup)", page)
        }
        // Device buffers: offsets aligned to the type the kernel reads. The stand-in knows the
        // kernels' element type from their names (half and bfloat 2 bytes, float and uint 4).
        let alignment = ["_f16", "_bf16"].contains { pipeline.function.name.contains($0) } ? 2 : 4
        for (index, bound) in buffers where bound.offset % alignment != 0 {
            violation("offset \(bound.offset) at index \(index) of \(pipeline.function.name) is not aligned to "
                          + "its \(alignment)-byte elements", "mtlcomputecommandencoder/setbuffer(_:offset:index:)")
        }
        recorded.append(RecordedDispatch(label: label ?? pipeline.function.name, pipeline: pipeline, buffers: buffers,
                                         bytes: bytes, threadgroups: threadgroupsPerGrid,
                                         threads: threadsPerThreadgroup))
    }

    func endEncoding() {
        requireOpen("endEncoding()", "mtlcommandencoder/endencoding()")
        ended = true
        commandBuffer?.ended(self, recorded: recorded)
    }
}
