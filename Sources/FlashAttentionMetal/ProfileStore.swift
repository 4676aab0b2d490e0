#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The last profile of each context on the calling thread, behind one pthread key (threads that C
/// or Python start have no Swift task context, and the library avoids Foundation on Linux). A
/// thread's table is freed when the thread exits; entries point to their context weakly and are
/// dropped once it is gone, so a new context at a reused address never sees an old profile.
final class ProfileStore {
    private struct Entry {
        weak var context: Context?
        var profile: Profile
    }

    private var entries: [Entry] = []

    /// The key of the per-thread tables; nil if the process ran out of pthread keys, and then no
    /// profile is kept.
    private static let key: pthread_key_t? = {
        var key = pthread_key_t()
        return pthread_key_create(&key, { releaseProfileStore($0) }) == 0 ? key : nil
    }()

    /// The calling thread's table, created on first use when `create` is true.
    private static func current(create: Bool) -> ProfileStore? {
        guard let key else { return nil }
        if let pointer = pthread_getspecific(key) {
            return Unmanaged<ProfileStore>.fromOpaque(pointer).takeUnretainedValue()
        }
        guard create else { return nil }
        let store = ProfileStore()
        let retained = Unmanaged.passRetained(store)
        guard pthread_setspecific(key, retained.toOpaque()) == 0 else {
            retained.release()
            return nil
        }
        return store
    }

    /// Keeps `profile` as the calling thread's last profile of `context`.
    static func record(_ profile: Profile, for context: Context) {
        guard let store = current(create: true) else { return }
        store.entries.removeAll { $0.context == nil || $0.context === context }
        store.entries.append(Entry(context: context, profile: profile))
    }

    /// The calling thread's last profile of `context`, or nil when this thread has not completed a
    /// call on it.
    static func last(for context: Context) -> Profile? {
        current(create: false)?.entries.last { $0.context === context }?.profile
    }
}

/// The pthread key's destructor: runs when a thread that kept profiles exits.
private func releaseProfileStore(_ pointer: UnsafeMutableRawPointer?) {
    guard let pointer else { return }
    Unmanaged<ProfileStore>.fromOpaque(pointer).release()
}
