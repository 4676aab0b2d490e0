/* The exported dispatch plan from C, as a framework that encodes the kernels itself reads it: the
 * plan's buffers (allocated from their byte counts, workspaces included), each dispatch with its
 * bindings, parameter bytes and function constants, checked for the invariants an encoder relies on
 * (every [[buffer(i)]] bound once, every binding inside its buffer, every constant in the prelude a
 * host without function constants compiles); then fa_plan_execute on the CPU
 * engine, whose results must be bit for bit those of fa_forward and fa_backward. Exit status 0 on
 * success. */
#include "flash_attention_metal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 2, H = 4, HKV = 2, NQ = 9, NK = 13, D = 24 };

static int failures = 0;

static void check(int condition, const char *what) {
    if (!condition) {
        fprintf(stderr, "FAIL: %s (last error: %s)\n", what, fa_last_error_message());
        failures++;
    }
}

/* Walks every record of plan as an encoder would, prints it, checks its invariants and returns
 * the number of dispatches. */
static uint32_t walk(const fa_plan *plan, fa_pass pass) {
    fa_plan_info info = {.struct_size = sizeof info};
    check(fa_plan_get_info(plan, &info) == FA_STATUS_SUCCESS, "fa_plan_get_info");
    check(info.pass == (uint32_t)pass && info.piece_count == 1, "plan info");
    uint64_t bytes[FA_BUFFER_ROLE_COUNT] = {0};
    for (uint32_t i = 0; i < info.buffer_count; i++) {
        fa_plan_buffer buffer = {.struct_size = sizeof buffer};
        check(fa_plan_get_buffer(plan, i, &buffer) == FA_STATUS_SUCCESS, "fa_plan_get_buffer");
        check(buffer.role < FA_BUFFER_ROLE_COUNT && bytes[buffer.role] == 0, "each role listed once");
        check(buffer.byte_count > 0 && buffer.byte_count % buffer.element_size == 0, "buffer size");
        bytes[buffer.role] = buffer.byte_count;
    }
    for (uint32_t n = 0; n < info.dispatch_count; n++) {
        fa_plan_dispatch d = {.struct_size = sizeof d};
        check(fa_plan_get_dispatch(plan, n, &d) == FA_STATUS_SUCCESS, "fa_plan_get_dispatch");
        printf("  %-44s grid %u x %u x %u, %u threads, %u buffers + params at %u (%u bytes)\n", d.kernel_name,
               d.threadgroups_per_grid[0], d.threadgroups_per_grid[1], d.threadgroups_per_grid[2],
               d.threads_per_threadgroup[0], d.binding_count, d.params_index, d.params_size);
        check(d.params != NULL && d.params_size > 0 && d.params_size % 8 == 0, "parameter bytes");
        check(strncmp(d.constants_prelude, "#define FA_FUNCTION_CONSTANTS_PREDEFINED 1\n", 43) == 0,
              "the constants prelude starts with the define");
        for (uint32_t i = 0; i < d.specialization_count; i++) {
            fa_plan_specialization s = {.struct_size = sizeof s};
            check(fa_plan_get_specialization(plan, n, i, &s) == FA_STATUS_SUCCESS, "fa_plan_get_specialization");
            check(s.name != NULL && strstr(d.constants_prelude, s.name) != NULL, "each constant is in the prelude");
            check(s.type != FA_SPECIALIZATION_BOOL || s.value <= 1, "a bool's value is 0 or 1");
        }
        unsigned bound = 1u << d.params_index;
        for (uint32_t i = 0; i < d.binding_count; i++) {
            fa_plan_binding binding = {.struct_size = sizeof binding};
            check(fa_plan_get_binding(plan, n, i, &binding) == FA_STATUS_SUCCESS, "fa_plan_get_binding");
            check(binding.index <= d.binding_count && !(bound & (1u << binding.index)), "each index bound once");
            bound |= 1u << binding.index;
            check(binding.role < FA_BUFFER_ROLE_COUNT && bytes[binding.role] > 0, "binding names a plan buffer");
            check(binding.byte_offset + binding.byte_length <= bytes[binding.role], "binding inside its buffer");
        }
        check(bound == (1u << (d.binding_count + 1)) - 1, "indices 0 ... binding_count all bound");
    }
    return info.dispatch_count;
}

/* Deterministic float16 bit patterns of small values in [-1, 1). */
static void fill(uint16_t *x, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) {
        unsigned r = (unsigned)(i * 2654435761u + seed * 40503u) >> 22; /* 0 ... 1023 */
        x[i] = (uint16_t)((r & 1 ? 0x8000 : 0) | (0x3800 + (r >> 1))); /* +-[0.5, 1) */
    }
}

int main(void) {
    static uint16_t q[B * H * NQ * D], k[B * HKV * NK * D], v[B * HKV * NK * D], dout[B * H * NQ * D];
    static uint16_t out[2][B * H * NQ * D], dq[2][B * H * NQ * D], dk[2][B * HKV * NK * D], dv[2][B * HKV * NK * D];
    static float lse[2][B * H * NQ];
    fill(q, sizeof q / 2, 1);
    fill(k, sizeof k / 2, 2);
    fill(v, sizeof v / 2, 3);
    fill(dout, sizeof dout / 2, 4);
    fa_context *ctx = NULL;
    if (fa_context_create(FA_BACKEND_CPU, &ctx) != FA_STATUS_SUCCESS) {
        fprintf(stderr, "FAIL: fa_context_create: %s\n", fa_last_error_message());
        return 1;
    }
    fa_problem problem = {.struct_size = sizeof(fa_problem), .batch = B, .num_heads = H, .num_kv_heads = HKV,
                          .seqlen_q = NQ, .seqlen_k = NK, .head_dim = D, .causal = 1, .softmax_scale = 0.2f};
    check(fa_forward(ctx, &problem, q, k, v, out[0], lse[0]) == FA_STATUS_SUCCESS, "fa_forward");
    check(fa_backward(ctx, &problem, dout, q, k, v, out[0], lse[0], dq[0], dk[0], dv[0]) == FA_STATUS_SUCCESS,
          "fa_backward");

    fa_plan *forward = NULL, *backward = NULL;
    check(fa_plan_create(&problem, FA_PASS_FORWARD, 0, &forward) == FA_STATUS_SUCCESS, "forward plan");
    check(fa_plan_create(&problem, FA_PASS_BACKWARD, 0, &backward) == FA_STATUS_SUCCESS, "backward plan");
    if (forward == NULL || backward == NULL) return 1;
    printf("forward plan:\n");
    check(walk(forward, FA_PASS_FORWARD) == 1, "the dense forward is one dispatch");
    printf("backward plan:\n");
    /* Delta, lse residual, dQ, then dK/dV: its 4 threadgroups leave the nominal GPU's slots idle,
     * so each GQA group is split over 2 (backward_dkv_split) and reduced (backward_dkv_reduce). */
    check(walk(backward, FA_PASS_BACKWARD) == 5, "the backward is five dispatches");

    void *buffers[FA_BUFFER_ROLE_COUNT] = {0};
    buffers[FA_BUFFER_ROLE_Q] = q;
    buffers[FA_BUFFER_ROLE_K] = k;
    buffers[FA_BUFFER_ROLE_V] = v;
    buffers[FA_BUFFER_ROLE_OUT] = out[1];
    buffers[FA_BUFFER_ROLE_LSE] = lse[1];
    check(fa_plan_execute(ctx, forward, buffers, FA_BUFFER_ROLE_COUNT) == FA_STATUS_SUCCESS, "execute forward");
    check(memcmp(out[0], out[1], sizeof out[0]) == 0 && memcmp(lse[0], lse[1], sizeof lse[0]) == 0,
          "the forward plan gives fa_forward's bits");
    buffers[FA_BUFFER_ROLE_DOUT] = dout;
    buffers[FA_BUFFER_ROLE_DQ] = dq[1];
    buffers[FA_BUFFER_ROLE_DK] = dk[1];
    buffers[FA_BUFFER_ROLE_DV] = dv[1];
    check(fa_plan_execute(ctx, backward, buffers, FA_BUFFER_ROLE_COUNT) == FA_STATUS_SUCCESS, "execute backward");
    check(memcmp(dq[0], dq[1], sizeof dq[0]) == 0 && memcmp(dk[0], dk[1], sizeof dk[0]) == 0 &&
              memcmp(dv[0], dv[1], sizeof dv[0]) == 0,
          "the backward plan gives fa_backward's bits");
    /* The forward plan does not use dout: its entry must be NULL. */
    check(fa_plan_execute(ctx, forward, buffers, FA_BUFFER_ROLE_COUNT) == FA_STATUS_INVALID_ARGUMENT &&
              strcmp(fa_last_error_message(), "buffers[5] (dout) must be NULL: the plan does not use it") == 0,
          "an unused buffer is refused by name");
    check(strlen(fa_plan_kernel_source()) > 10000 && strstr(fa_plan_kernel_source(), "#include \"") == NULL,
          "the kernel source is self-contained");

    fa_plan_destroy(forward);
    fa_plan_destroy(backward);
    fa_plan_destroy(NULL);
    fa_context_destroy(ctx);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("C plan test passed\n");
    return 0;
}
