// Fiber context switch, stack mapping and the stack cache (see msl_fiber.hpp).
#include "msl_fiber.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <mutex>
#include <vector>

#ifdef MSL_ENGINE_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace msl_engine {
namespace {

#ifdef MSL_ENGINE_ASAN
// ASan's instrumentation makes frames several times larger.
constexpr size_t kStackSize = 512 * 1024;
#else
constexpr size_t kStackSize = 256 * 1024;
#endif

std::mutex stack_cache_mutex;
std::vector<fiber_stack> &stack_cache() {
    static std::vector<fiber_stack> *cache = new std::vector<fiber_stack>();
    return *cache;
}

void announce_switch(fiber &from, const fiber &to, bool from_ends) {
#ifdef MSL_ENGINE_ASAN
    __sanitizer_start_switch_fiber(from_ends ? nullptr : &from.sanitizer_fake_stack, to.stack.base,
                                   to.stack.size);
#else
    (void)from;
    (void)to;
    (void)from_ends;
#endif
}

void complete_switch(fiber &self) {
#ifdef MSL_ENGINE_ASAN
    __sanitizer_finish_switch_fiber(self.sanitizer_fake_stack, nullptr, nullptr);
#else
    (void)self;
#endif
}

} // namespace

#ifdef MSL_ENGINE_FIBER_UCONTEXT

namespace {
// makecontext passes int arguments only, so the fiber's address travels as two halves.
void ucontext_start(unsigned high, unsigned low) {
    fiber *f = reinterpret_cast<fiber *>((static_cast<unsigned long>(high) << 32) | low);
    f->entry(f->entry_arg);
}
} // namespace

void fiber_prepare(fiber &f, fiber_stack stack, void (*entry)(void *), void *arg) {
    f.stack = stack;
    f.sanitizer_fake_stack = nullptr;
    f.entry = entry;
    f.entry_arg = arg;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stack.base;
    f.context.uc_stack.ss_size = stack.size;
    f.context.uc_link = nullptr;
    const unsigned long address = reinterpret_cast<unsigned long>(&f);
    makecontext(&f.context, reinterpret_cast<void (*)()>(ucontext_start), 2,
                unsigned(address >> 32), unsigned(address & 0xffffffffu));
}

void fiber_switch(fiber &from, fiber &to) {
    announce_switch(from, to, false);
    swapcontext(&from.context, &to.context);
    complete_switch(from);
}

void fiber_hop(fiber &from, fiber &to) { fiber_switch(from, to); }

[[noreturn]] void fiber_exit(fiber &self, fiber &to) {
    announce_switch(self, to, true);
    setcontext(&to.context);
    __builtin_trap();
}

#else

extern "C" {
// Saves callee-saved registers on the current stack, stores the stack pointer in *save, switches
// to load and restores what was saved there.
void msl_engine_fiber_switch(void **save, void *load);
// The same between fibers in the default floating-point control state (fiber_hop): the frame is
// the same, with the default state written in place of the saved one, and none is loaded.
void msl_engine_fiber_hop(void **save, void *load);
// First code of a new fiber: calls the entry (register slot 1) with the argument (slot 0).
void msl_engine_fiber_trampoline();
}

#if defined(__APPLE__)
#define MSL_ASM_SYMBOL(name) "_" #name
#define MSL_ASM_PRIVATE(name) ".private_extern " MSL_ASM_SYMBOL(name) "\n"
#else
#define MSL_ASM_SYMBOL(name) #name
#define MSL_ASM_PRIVATE(name) ".hidden " #name "\n.type " #name ", @function\n"
#endif
#define MSL_ASM_FUNCTION(name) \
    ".globl " MSL_ASM_SYMBOL(name) "\n" MSL_ASM_PRIVATE(name) ".p2align 4\n" MSL_ASM_SYMBOL(name) ":\n"

#if defined(__x86_64__)
// A suspended context's saved stack pointer points at the address it resumes at; whatever it
// needs besides is below that on its stack. A full switch saves the callee-saved registers and
// the floating-point control state (MXCSR, x87 control word) and restores them on resuming; it
// loads the default state before continuing the other context, which is what a lane resumed or
// started by it needs (a context resumed by a full switch restores its own). A hop (here for
// ASan builds; inline in msl_fiber.hpp otherwise) saves the callee-saved registers only. A switch
// continues the other context by popping that address and jumping to it. A new fiber starts at the
// trampoline, its entry and argument above that address.
#define MSL_X86_PUSH_CALLEE_SAVED \
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
#define MSL_X86_POP_CALLEE_SAVED_AND_RETURN \
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
__asm__(".text\n"
        MSL_ASM_FUNCTION(msl_engine_fiber_switch)
        MSL_X86_PUSH_CALLEE_SAVED
        "  subq $8, %rsp\n"
        "  stmxcsr (%rsp)\n"
        "  fnstcw 4(%rsp)\n"
        "  leaq 1f(%rip), %rax\n"
        "  pushq %rax\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  movq $0x037F00001F80, %rax\n" // default MXCSR (low half) and x87 control word
        "  movq %rax, -8(%rsp)\n"
        "  ldmxcsr -8(%rsp)\n"
        "  fldcw -4(%rsp)\n"
        "  popq %rax\n"
        "  jmpq *%rax\n"
        "1:\n"
        "  ldmxcsr (%rsp)\n"
        "  fldcw 4(%rsp)\n"
        "  addq $8, %rsp\n"
        MSL_X86_POP_CALLEE_SAVED_AND_RETURN
        MSL_ASM_FUNCTION(msl_engine_fiber_hop)
        MSL_X86_PUSH_CALLEE_SAVED
        "  leaq 1f(%rip), %rax\n"
        "  pushq %rax\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %rax\n"
        "  jmpq *%rax\n"
        "1:\n"
        MSL_X86_POP_CALLEE_SAVED_AND_RETURN
        MSL_ASM_FUNCTION(msl_engine_fiber_trampoline)
        "  movq (%rsp), %rax\n"
        "  movq 8(%rsp), %rdi\n"
        "  addq $8, %rsp\n"
        "  callq *%rax\n"
        "  ud2\n");

void fiber_prepare(fiber &f, fiber_stack stack, void (*entry)(void *), void *arg) {
    f.stack = stack;
    f.sanitizer_fake_stack = nullptr;
    // The top is 16-byte aligned; after the switch pops the trampoline address and the trampoline
    // steps over the entry, the stack pointer is 16-byte aligned, as its call requires.
    auto *top = reinterpret_cast<unsigned long *>(
        reinterpret_cast<unsigned long>(stack.base + stack.size) & ~15ul);
    unsigned long *frame = top - 4;
    frame[0] = reinterpret_cast<unsigned long>(&msl_engine_fiber_trampoline);
    frame[1] = reinterpret_cast<unsigned long>(entry);
    frame[2] = reinterpret_cast<unsigned long>(arg);
    frame[3] = 0;
    f.stack_pointer = frame;
}

#elif defined(__aarch64__)
// Frame (176 bytes): x19..x28, x29, x30, d8..d15, fpcr.
#define MSL_ARM64_PUSH_CALLEE_SAVED \
    "  sub sp, sp, #176\n  stp x19, x20, [sp, #0]\n  stp x21, x22, [sp, #16]\n" \
    "  stp x23, x24, [sp, #32]\n  stp x25, x26, [sp, #48]\n  stp x27, x28, [sp, #64]\n" \
    "  stp x29, x30, [sp, #80]\n  stp d8, d9, [sp, #96]\n  stp d10, d11, [sp, #112]\n" \
    "  stp d12, d13, [sp, #128]\n  stp d14, d15, [sp, #144]\n"
#define MSL_ARM64_POP_CALLEE_SAVED_AND_RETURN \
    "  ldp x19, x20, [sp, #0]\n  ldp x21, x22, [sp, #16]\n  ldp x23, x24, [sp, #32]\n" \
    "  ldp x25, x26, [sp, #48]\n  ldp x27, x28, [sp, #64]\n  ldp x29, x30, [sp, #80]\n" \
    "  ldp d8, d9, [sp, #96]\n  ldp d10, d11, [sp, #112]\n  ldp d12, d13, [sp, #128]\n" \
    "  ldp d14, d15, [sp, #144]\n  add sp, sp, #176\n  ret\n"
__asm__(".text\n"
        MSL_ASM_FUNCTION(msl_engine_fiber_switch)
        MSL_ARM64_PUSH_CALLEE_SAVED
        "  mrs x9, fpcr\n"
        "  str x9, [sp, #160]\n"
        "  mov x9, sp\n"
        "  str x9, [x0]\n"
        "  mov sp, x1\n"
        "  ldr x9, [sp, #160]\n"
        "  msr fpcr, x9\n"
        MSL_ARM64_POP_CALLEE_SAVED_AND_RETURN
        MSL_ASM_FUNCTION(msl_engine_fiber_hop)
        MSL_ARM64_PUSH_CALLEE_SAVED
        "  str xzr, [sp, #160]\n"
        "  mov x9, sp\n"
        "  str x9, [x0]\n"
        "  mov sp, x1\n"
        MSL_ARM64_POP_CALLEE_SAVED_AND_RETURN
        MSL_ASM_FUNCTION(msl_engine_fiber_trampoline)
        "  mov x0, x19\n"
        "  blr x20\n"
        "  brk #0\n");

void fiber_prepare(fiber &f, fiber_stack stack, void (*entry)(void *), void *arg) {
    f.stack = stack;
    f.sanitizer_fake_stack = nullptr;
    auto *top = reinterpret_cast<unsigned long *>(
        reinterpret_cast<unsigned long>(stack.base + stack.size) & ~15ul);
    unsigned long *frame = top - 22; // 176 bytes
    for (int i = 0; i < 22; ++i) frame[i] = 0; // fpcr 0 (default), as msl_engine_fiber_hop writes
    frame[0] = reinterpret_cast<unsigned long>(arg);    // x19
    frame[1] = reinterpret_cast<unsigned long>(entry);  // x20
    frame[11] = reinterpret_cast<unsigned long>(&msl_engine_fiber_trampoline); // x30
    f.stack_pointer = frame;
}
#endif

void fiber_switch(fiber &from, fiber &to) {
    announce_switch(from, to, false);
    msl_engine_fiber_switch(&from.stack_pointer, to.stack_pointer);
    complete_switch(from);
}

#ifdef MSL_ENGINE_ASAN
void fiber_hop(fiber &from, fiber &to) {
    announce_switch(from, to, false);
    msl_engine_fiber_hop(&from.stack_pointer, to.stack_pointer);
    complete_switch(from);
}
#endif

[[noreturn]] void fiber_exit(fiber &self, fiber &to) {
    // No address-taken locals here: under ASan they may live on the fake stack, which the
    // announcement of a final switch frees.
    announce_switch(self, to, true);
    msl_engine_fiber_switch(&self.stack_pointer, to.stack_pointer);
    __builtin_trap();
}

#endif

void fiber_started(fiber &scheduler) {
#ifdef MSL_ENGINE_ASAN
    const void *bottom = nullptr;
    size_t size = 0;
    __sanitizer_finish_switch_fiber(nullptr, &bottom, &size);
    scheduler.stack.base = static_cast<char *>(const_cast<void *>(bottom));
    scheduler.stack.size = size;
#else
    (void)scheduler;
#endif
}

void fiber_discard(fiber &f) {
#ifdef MSL_ENGINE_ASAN
    // The abandoned frames leave their redzones poisoned; clear them before the stack is reused.
    __asan_unpoison_memory_region(f.stack.base, f.stack.size);
#else
    (void)f;
#endif
}

std::atomic<uintptr_t> fiber_region_base{0};
std::atomic<uintptr_t> fiber_region_size{0};

namespace {

// 16 GiB of address space, reserved without memory: 16384 stacks (16 workers of 1024 threads).
constexpr size_t kRegionSlots = 16384;
static_assert(kStackSize + kFiberLocalWords * sizeof(void *) + 4096 <= kFiberSlotBytes,
              "a stack, its words and a guard page fill one slot at most");

// Slots of the reserved range handed out so far (under stack_cache_mutex).
size_t region_slots_used = 0;

// A new stack at the top of the next slot of the range; the rest of the slot below it stays
// inaccessible (the guard). Empty when the range is full or cannot be reserved.
fiber_stack region_stack(size_t page) {
    if (fiber_region_size.load(std::memory_order_relaxed) == 0) {
        int flags = MAP_PRIVATE | MAP_ANON;
#ifdef MAP_NORESERVE
        flags |= MAP_NORESERVE;
#endif
        const size_t bytes = (kRegionSlots + 1) * kFiberSlotBytes; // one more slot to align
        void *range = mmap(nullptr, bytes, PROT_NONE, flags, -1, 0);
        if (range == MAP_FAILED) return fiber_stack{};
        const uintptr_t base =
            (reinterpret_cast<uintptr_t>(range) + kFiberSlotBytes - 1) & ~(kFiberSlotBytes - 1);
        fiber_region_base.store(base, std::memory_order_relaxed);
        fiber_region_size.store(kRegionSlots * kFiberSlotBytes, std::memory_order_relaxed);
    }
    if (region_slots_used == kRegionSlots) return fiber_stack{};
    char *slot_end = reinterpret_cast<char *>(fiber_region_base.load(std::memory_order_relaxed)) +
                     (region_slots_used + 1) * kFiberSlotBytes;
    // The stack and its words, rounded out to whole pages.
    const size_t used = (kStackSize + kFiberLocalWords * sizeof(void *) + page - 1) & ~(page - 1);
    if (mprotect(slot_end - used, used, PROT_READ | PROT_WRITE) != 0) return fiber_stack{};
    ++region_slots_used;
    char *top = slot_end - kFiberLocalWords * sizeof(void *);
    return fiber_stack{top - kStackSize, kStackSize};
}

} // namespace

fiber_stack acquire_fiber_stack() {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    {
        std::lock_guard<std::mutex> lock(stack_cache_mutex);
        auto &cache = stack_cache();
        if (!cache.empty()) {
            fiber_stack s = cache.back();
            cache.pop_back();
            return s;
        }
        const fiber_stack s = region_stack(page);
        if (s.base != nullptr) return s;
    }
    // Outside the range: found by no stack pointer, so its fibers take the thread-local path.
    const size_t bytes = (kStackSize + kFiberLocalWords * sizeof(void *) + page - 1) & ~(page - 1);
    int flags = MAP_PRIVATE | MAP_ANON;
#ifdef MAP_NORESERVE
    flags |= MAP_NORESERVE;
#endif
    void *region = mmap(nullptr, bytes + page, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (region == MAP_FAILED) return fiber_stack{};
    // The lowest page traps a stack overflow instead of letting it run into other memory.
    if (mprotect(region, page, PROT_NONE) != 0) {
        munmap(region, bytes + page);
        return fiber_stack{};
    }
    char *top = static_cast<char *>(region) + page + bytes - kFiberLocalWords * sizeof(void *);
    return fiber_stack{top - kStackSize, kStackSize};
}

void release_fiber_stacks(const fiber_stack *stacks, size_t count) {
    std::lock_guard<std::mutex> lock(stack_cache_mutex);
    auto &cache = stack_cache();
    cache.insert(cache.end(), stacks, stacks + count);
}

} // namespace msl_engine
