// The stand-in `IOKit` module: the IORegistry calls the Metal backend makes to read the GPU's core
// count (Sources/FlashAttentionMetal/Metal/DeviceCores.swift) and the CoreFoundation types they
// take, with the signatures Swift imports from IOKitLib.h on macOS. Tests only:
// tests/metal_standin/build.sh compiles it before the stand-in Metal module. Signatures checked
// against IOKitLib.h's documentation (Apple's IOKit reference, https://developer.apple.com/documentation/iokit,
// whose text docs.rs/objc2-io-kit reproduces) and CoreFoundation's
// (https://developer.apple.com/documentation/corefoundation).
//
// The registry holds two `AGXAccelerator` services: another GPU's first (76 cores), then the
// stand-in Metal device's (registry ID `standInAcceleratorRegistryID`), whose `gpu-core-count` is
// `$FLASH_ATTENTION_METAL_STANDIN_GPU_CORE_COUNT` when set and absent otherwise, so that by default
// the Metal backend plans for the nominal GPU as the CPU engine does. Breaking a documented rule
// (releasing an object twice or one never handed out) stops the process.
#if canImport(Glibc)
import Glibc
#endif
import Foundation

// <mach/kern_return.h>
public typealias kern_return_t = Int32
// <mach/port.h>
public typealias mach_port_t = UInt32
// <IOKit/IOTypes.h>: io_object_t, io_iterator_t and io_registry_entry_t are mach_port_t
public typealias io_object_t = mach_port_t
public typealias io_iterator_t = io_object_t
public typealias io_registry_entry_t = io_object_t
// <IOKit/IOTypes.h>
public typealias IOOptionBits = UInt32
// <mach/kern_return.h>
public let KERN_SUCCESS: kern_return_t = 0
// IOKitLib.h kIOMainPortDefault (macOS 12 and later; 0, the default main port)
public let kIOMainPortDefault: mach_port_t = 0
/// Not an IOKit symbol: the registry entry ID of the stand-in Metal device's accelerator, which
/// the stand-in MTLDevice.registryID returns.
public let standInAcceleratorRegistryID: UInt64 = 0x1_0000_0a11

// https://developer.apple.com/documentation/corefoundation/cftyperef
public typealias CFTypeRef = AnyObject
// https://developer.apple.com/documentation/corefoundation/cfdictionary
public class CFDictionary {}
// https://developer.apple.com/documentation/corefoundation/cfmutabledictionary (passed where a
// CFDictionary is taken, as on macOS)
public final class CFMutableDictionary: CFDictionary {
    let className: String
    init(className: String) { self.className = className }
}
// https://developer.apple.com/documentation/corefoundation/cfstring (`"..." as CFString`, as
// Foundation bridges a string literal on macOS)
public final class CFString: ExpressibleByStringLiteral {
    let text: String
    public init(stringLiteral value: String) { text = value }
}
// https://developer.apple.com/documentation/corefoundation/cfallocator
public final class CFAllocator {}

/// One registry entry: its class, ID and properties.
private struct Entry {
    let className: String
    let registryID: UInt64
    let properties: [String: NSNumber]
}

/// The registry and the objects handed out (iterators and entries), guarded by `lock`.
private final class Registry: @unchecked Sendable {
    static let shared = Registry()
    let lock = NSLock()
    var entries: [Entry] {
        var own: [String: NSNumber] = [:]
        if let text = getenv("FLASH_ATTENTION_METAL_STANDIN_GPU_CORE_COUNT"), let cores = Int(String(cString: text)) {
            own["gpu-core-count"] = NSNumber(value: cores)
        }
        return [Entry(className: "AGXAccelerator", registryID: 0x1_0000_0b22, properties: ["gpu-core-count": 76]),
                Entry(className: "AGXAccelerator", registryID: standInAcceleratorRegistryID, properties: own)]
    }
    /// Live objects: an iterator's remaining entries, or an entry.
    var iterators: [io_object_t: [Entry]] = [:]
    var handed: [io_object_t: Entry] = [:]
    var next: io_object_t = 0x1000

    func newName() -> io_object_t {
        next += 1
        return next
    }
}

private func violation(_ rule: String, _ function: String) -> Never {
    fatalError("IOKit stand-in: \(rule) (IOKitLib.h, \(function))")
}

/// The entry `object` names; stops the process when it is not one handed out and not released.
private func liveEntry(_ object: io_registry_entry_t, _ function: String) -> Entry {
    let registry = Registry.shared
    registry.lock.lock()
    defer { registry.lock.unlock() }
    guard let found = registry.handed[object] else {
        violation("\(function) on an object that is not a live registry entry", function)
    }
    return found
}

// IOKitLib.h IOServiceMatching: https://docs.rs/objc2-io-kit/latest/objc2_io_kit/fn.IOServiceMatching.html
public func IOServiceMatching(_ name: UnsafePointer<CChar>!) -> CFMutableDictionary! {
    CFMutableDictionary(className: String(cString: name))
}

// IOKitLib.h IOServiceGetMatchingServices: https://docs.rs/objc2-io-kit/latest/objc2_io_kit/fn.IOServiceGetMatchingServices.html
// (consumes one reference to `matching`; the iterator is released with IOObjectRelease)
public func IOServiceGetMatchingServices(_ mainPort: mach_port_t, _ matching: CFDictionary!,
                                         _ existing: UnsafeMutablePointer<io_iterator_t>!) -> kern_return_t {
    guard let dictionary = matching as? CFMutableDictionary else {
        violation("IOServiceGetMatchingServices needs a matching dictionary", "IOServiceGetMatchingServices")
    }
    let registry = Registry.shared
    registry.lock.lock()
    defer { registry.lock.unlock() }
    let name = registry.newName()
    registry.iterators[name] = registry.entries.filter { $0.className == dictionary.className }
    existing.pointee = name
    return KERN_SUCCESS
}

// IOKitLib.h IOIteratorNext (0 after the last object; each object returned is released with
// IOObjectRelease): https://docs.rs/objc2-io-kit/latest/objc2_io_kit/fn.IOIteratorNext.html
public func IOIteratorNext(_ iterator: io_iterator_t) -> io_object_t {
    let registry = Registry.shared
    registry.lock.lock()
    defer { registry.lock.unlock() }
    guard var remaining = registry.iterators[iterator] else {
        violation("IOIteratorNext on an object that is not a live iterator", "IOIteratorNext")
    }
    guard !remaining.isEmpty else { return 0 }
    let name = registry.newName()
    registry.handed[name] = remaining.removeFirst()
    registry.iterators[iterator] = remaining
    return name
}

// IOKitLib.h IORegistryEntryGetRegistryEntryID: https://docs.rs/objc2-io-kit/latest/objc2_io_kit/fn.IORegistryEntryGetRegistryEntryID.html
public func IORegistryEntryGetRegistryEntryID(_ entry: io_registry_entry_t,
                                              _ entryID: UnsafeMutablePointer<UInt64>!) -> kern_return_t {
    entryID.pointee = liveEntry(entry, "IORegistryEntryGetRegistryEntryID").registryID
    return KERN_SUCCESS
}

// IOKitLib.h IORegistryEntryCreateCFProperty (a snapshot the caller releases; NULL when the entry
// has no such property): https://docs.rs/objc2-io-kit/latest/objc2_io_kit/fn.IORegistryEntryCreateCFProperty.html
public func IORegistryEntryCreateCFProperty(_ entry: io_registry_entry_t, _ key: CFString!,
                                            _ allocator: CFAllocator!, _ options: IOOptionBits)
    -> Unmanaged<CFTypeRef>! {
    liveEntry(entry, "IORegistryEntryCreateCFProperty").properties[key.text].map {
        Unmanaged.passRetained($0 as CFTypeRef)
    }
}

// IOKitLib.h IOObjectRelease: https://docs.rs/objc2-io-kit/latest/objc2_io_kit/fn.IOObjectRelease.html
@discardableResult
public func IOObjectRelease(_ object: io_object_t) -> kern_return_t {
    let registry = Registry.shared
    registry.lock.lock()
    defer { registry.lock.unlock() }
    guard registry.iterators.removeValue(forKey: object) != nil || registry.handed.removeValue(forKey: object) != nil
    else {
        violation("IOObjectRelease of an object released already or never handed out", "IOObjectRelease")
    }
    return KERN_SUCCESS
}
