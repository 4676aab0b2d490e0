// The GPU core count of a Metal device, for the split-KV plan (GPUCores.planned, docs/decode.md).
// Metal has no API for it. The IORegistry has it: each Apple GPU is an `AGXAccelerator` service whose
// `gpu-core-count` property (a number) is what System Information shows as "Total Number of Cores";
// PyTorch's MPS backend (aten/src/ATen/mps/MPSDevice.mm) and philipturner/applegpuinfo read the
// same property. Not compiled on Linux (the stand-in IOKit in tests/swift/IOKitStandIn type-checks
// it); each call was checked against IOKitLib.h's documentation (Apple's IOKit reference, whose
// text docs.rs/objc2-io-kit reproduces) and the pages cited below.
#if canImport(Metal) && canImport(IOKit)
import Foundation
import IOKit
import Metal

enum DeviceCores {
    /// The `gpu-core-count` of the `AGXAccelerator` service whose registry entry ID is `registryID`
    /// (MTLDevice.registryID: developer.apple.com/documentation/metal/mtldevice/registryid, "the
    /// GPU device's registry identifier"), else of the first `AGXAccelerator` (a Mac has one Apple
    /// GPU); nil when there is none or it has no such number (then the plan takes the nominal GPU).
    static func read(registryID: UInt64) -> UInt32? {
        // IOServiceMatching(_:): a matching dictionary for the class and its subclasses.
        // IOServiceGetMatchingServices(_:_:_:) consumes one reference to it; kIOMainPortDefault is
        // the default main port (macOS 12 and later).
        var iterator: io_iterator_t = 0
        guard IOServiceGetMatchingServices(kIOMainPortDefault, IOServiceMatching("AGXAccelerator"), &iterator)
            == KERN_SUCCESS else { return nil }
        // IOObjectRelease(_:): the iterator and every object IOIteratorNext returns are the caller's.
        defer { IOObjectRelease(iterator) }
        var first: UInt32?
        // IOIteratorNext(_:) returns 0 (MACH_PORT_NULL) after the last object.
        while case let service = IOIteratorNext(iterator), service != 0 {
            defer { IOObjectRelease(service) }
            let cores = coreCount(of: service)
            // IORegistryEntryGetRegistryEntryID(_:_:): the ID global to all tasks that
            // MTLDevice.registryID gives for the same GPU.
            var entryID: UInt64 = 0
            if IORegistryEntryGetRegistryEntryID(service, &entryID) == KERN_SUCCESS, entryID == registryID {
                return cores
            }
            if first == nil { first = cores }
        }
        return first
    }

    /// The service's `gpu-core-count` when it is a positive whole number.
    private static func coreCount(of service: io_registry_entry_t) -> UInt32? {
        // IORegistryEntryCreateCFProperty(_:_:_:_:): a snapshot of the property that the caller
        // releases (takeRetainedValue); nil when the entry has no such property. A CFNumber is
        // toll-free bridged to NSNumber.
        guard let property = IORegistryEntryCreateCFProperty(service, "gpu-core-count" as CFString, nil, 0),
              let number = property.takeRetainedValue() as? NSNumber else { return nil }
        let value = number.int64Value
        return value > 0 && value <= Int64(UInt32.max) ? UInt32(value) : nil
    }
}
#endif
