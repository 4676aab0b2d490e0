// Fibers for the engine: cooperative execution contexts, each on its own mmap'ed stack with a
// guard page. The context switch is a few instructions of assembly on x86-64 (System V) and
// arm64 (AAPCS64, Linux and macOS): it saves the callee-saved registers and the floating-point
// control word on the old stack and loads them from the new one, no system call (on x86-64 a
// switch between two lanes is inline and saves only the frame pointer: fiber_hop). Elsewhere, or
// with MSL_ENGINE_USE_UCONTEXT defined, it uses POSIX ucontext (makecontext/swapcontext), which
// is slower because swapcontext changes the signal mask with a system call.
// Under AddressSanitizer every switch is announced with __sanitizer_start_switch_fiber /
// __sanitizer_finish_switch_fiber, so ASan tracks the stack in use.
// Stacks come from one reserved address range, each at the top of an aligned slot with a few
// words above it (fiber_locals): code running on a fiber finds them from its stack pointer, which
// is cheaper than a thread-local read (a call to __tls_get_addr in a shared library).
#ifndef MSL_FIBER_HPP
#define MSL_FIBER_HPP

#include <stddef.h>
#include <stdint.h>

#include <atomic>

#if defined(MSL_ENGINE_USE_UCONTEXT) || !(defined(__x86_64__) || defined(__aarch64__))
#define MSL_ENGINE_FIBER_UCONTEXT 1
#ifndef _XOPEN_SOURCE
#define _XOPEN_SOURCE 700
#endif
#include <ucontext.h>
#endif

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MSL_ENGINE_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(MSL_ENGINE_ASAN)
#define MSL_ENGINE_ASAN 1
#endif

// The engine's own calls to these functions are direct, not through the dynamic linker's table.
#pragma GCC visibility push(hidden)

namespace msl_engine {

/// A stack region [base, base + size) with an inaccessible guard page below base. A stack from
/// acquire_fiber_stack has kFiberLocalWords words at base + size (fiber_locals_of).
struct fiber_stack {
    char *base = nullptr;
    size_t size = 0;
};

constexpr size_t kFiberLocalWords = 8;
/// Stacks from the reserved range sit at the top of slots of this many bytes, aligned to it.
constexpr size_t kFiberSlotBytes = size_t(1) << 20;

/// The reserved range of stack slots, [base, base + size); empty until the first stack.
extern std::atomic<uintptr_t> fiber_region_base;
extern std::atomic<uintptr_t> fiber_region_size;

/// The words above an acquired stack (its size as acquired), for its owner to fill.
inline void **fiber_locals_of(const fiber_stack &s) {
    return reinterpret_cast<void **>(s.base + s.size);
}

/// The words above the stack the caller runs on, when that is a stack of the reserved range;
/// null on any other stack (an OS thread's, or one mapped alone when the range was full).
__attribute__((always_inline)) inline void **fiber_locals() {
    const uintptr_t sp = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
    if (sp - fiber_region_base.load(std::memory_order_relaxed) >=
        fiber_region_size.load(std::memory_order_relaxed)) {
        return nullptr;
    }
    return reinterpret_cast<void **>((sp | (kFiberSlotBytes - 1)) + 1) - kFiberLocalWords;
}

/// An execution context. A default-constructed fiber stands for the OS thread's own context (the
/// scheduler) and needs no stack; others are prepared on a stack with fiber_prepare.
struct fiber {
#ifdef MSL_ENGINE_FIBER_UCONTEXT
    ucontext_t context;
    void (*entry)(void *) = nullptr; // makecontext passes only ints: the start reads these
    void *entry_arg = nullptr;
#else
    void *stack_pointer = nullptr;
#endif
    fiber_stack stack;                      ///< empty for the OS thread's context
    void *sanitizer_fake_stack = nullptr;   ///< ASan bookkeeping while switched away
};

/// Arranges for `f` to run entry(arg) on `stack` when first switched to. entry must never return;
/// it ends with fiber_exit.
void fiber_prepare(fiber &f, fiber_stack stack, void (*entry)(void *), void *arg);

/// Saves the current context into `from` and continues `to`. Returns when something switches back.
void fiber_switch(fiber &from, fiber &to);

/// fiber_switch between two fibers made by fiber_prepare, for code that keeps the floating-point
/// control state fiber_prepare gives (round to nearest, no flush to zero, exceptions masked), as
/// kernel code does: skips saving and loading that state, the dearest part of a switch.
#if defined(MSL_ENGINE_FIBER_UCONTEXT) || defined(MSL_ENGINE_ASAN)
void fiber_hop(fiber &from, fiber &to);
#elif defined(__x86_64__)
// Inline, nothing to announce to a sanitizer: a suspended context's stack pointer points at the
// address it resumes at (msl_fiber.cpp), so this saves only the frame pointer and that address,
// and the compiler saves no more than what it keeps in registers across the switch (everything
// else is declared clobbered). Steps over the red zone, which the caller may use. It continues the
// other context with an indirect jump, not `ret`, which the return-address predictor would miss.
__attribute__((always_inline)) inline void fiber_hop(fiber &from, fiber &to) {
    void **save = &from.stack_pointer;
    void *load = to.stack_pointer;
    __asm__ volatile("lea -128(%%rsp), %%rsp\n\t"
                     "push %%rbp\n\t"
                     "lea 1f(%%rip), %%rax\n\t"
                     "push %%rax\n\t"
                     "mov %%rsp, (%0)\n\t"
                     "mov %1, %%rsp\n\t"
                     "pop %%rax\n\t"
                     "jmp *%%rax\n"
                     "1:\n\t"
                     "pop %%rbp\n\t"
                     "lea 128(%%rsp), %%rsp"
                     : "+D"(save), "+S"(load)
                     :
                     : "rax", "rbx", "rcx", "rdx", "r8", "r9", "r10", "r11", "r12", "r13", "r14",
                       "r15", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
                       "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15",
                       "memory", "cc");
}
#else
extern "C" void msl_engine_fiber_hop(void **save, void *load); // msl_fiber.cpp
// Inline: nothing to announce to a sanitizer, one call into the assembly.
inline void fiber_hop(fiber &from, fiber &to) {
    msl_engine_fiber_hop(&from.stack_pointer, to.stack_pointer);
}
#endif

/// Called first by a fiber's entry function: completes the switch that started it (ASan).
/// `scheduler` receives the bounds of the stack that switched in.
void fiber_started(fiber &scheduler);

/// Leaves the current fiber `self` for good and continues `to`; never returns.
[[noreturn]] void fiber_exit(fiber &self, fiber &to);

/// Forgets a fiber that was suspended and will never be resumed (its threadgroup failed), so
/// its stack can be reused. Frames on it are abandoned without running destructors, which MSL
/// kernel code does not have.
void fiber_discard(fiber &f);

/// A stack for a fiber: reused from earlier dispatches or newly mapped. Returns an empty stack
/// when the system refuses the memory.
fiber_stack acquire_fiber_stack();

/// Gives stacks back for reuse by later dispatches.
void release_fiber_stacks(const fiber_stack *stacks, size_t count);

} // namespace msl_engine

#pragma GCC visibility pop

#endif
