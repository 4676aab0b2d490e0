/* Reuse from a non-Swift app: this program is compiled against flash_attention_metal.h and linked to
 * the built libFlashAttentionMetal. It runs forward and backward on the CPU backend (a small causal
 * GQA problem), checks the outputs are finite and that a query seeing one key copies that key's
 * value row, reads and prints the profile of each pass, merges a result with an empty part, and
 * checks one error path (its status and message). Exit status 0 on success. */
#include "flash_attention_metal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

enum { B = 1, H = 2, HKV = 1, NQ = 5, NK = 7, D = 16 };

static int failures = 0;

static void check(int condition, const char *what) {
    if (!condition) {
        fprintf(stderr, "FAIL: %s\n", what);
        failures++;
    }
}

/* float16 bits -> float, for the checks (normal and zero values only; enough here). */
static float half_to_float(uint16_t h) {
    int exponent = (h >> 10) & 0x1f;
    float mantissa = (float)(h & 0x3ff);
    float sign = (h & 0x8000) ? -1.0f : 1.0f;
    if (exponent == 0) return sign * ldexpf(mantissa, -24);
    if (exponent == 31) return mantissa ? NAN : sign * INFINITY;
    return sign * ldexpf(1.0f + mantissa / 1024.0f, exponent - 15);
}

/* Whether every float16 element is finite; one report per array. */
static void check_finite(const uint16_t *x, size_t n, const char *what) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += !isfinite(half_to_float(x[i]));
    if (bad) fprintf(stderr, "FAIL: %s: %zu of %zu values not finite\n", what, bad, n);
    failures += bad != 0;
}

/* Small values with an exact float16 form: (n % 17 - 8) / 16. */
static void fill(uint16_t *x, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) {
        int v = (int)((i * 7 + seed * 13) % 17) - 8;
        /* v / 16 as float16: sign, exponent and mantissa built from the integer. */
        uint16_t bits = 0;
        if (v != 0) {
            int a = v < 0 ? -v : v, e = 0;
            while ((a >> e) > 1) e++;
            bits = (uint16_t)(((v < 0) << 15) | ((e - 4 + 15) << 10) | (((a << 10) >> e) & 0x3ff));
        }
        x[i] = bits;
    }
}

/* Reads the calling thread's last profile on ctx, prints it, and checks it describes at least
 * `min_dispatches` kernels whose names start with `prefix`, measured by the CPU engine (counters
 * present, barriers executed, times that add up). */
static void check_profile(fa_context *ctx, uint32_t min_dispatches, const char *prefix) {
    fa_profile profile = {sizeof(fa_profile), 0, 0.0, 0, 0};
    check(fa_context_last_profile(ctx, &profile) == FA_STATUS_SUCCESS, fa_last_error_message());
    check(profile.dispatch_count >= min_dispatches, "profile: number of dispatches");
    check(profile.command_buffers == 1, "profile: the CPU engine runs a pass in one piece");
    check(profile.seconds > 0, "profile: seconds > 0");
    check(profile.gpu_cores >= 1, "profile: the GPU cores the plan was made for");
    double sum = 0;
    uint64_t barriers = 0;
    for (uint32_t i = 0; i < profile.dispatch_count; i++) {
        fa_dispatch_profile d;
        memset(&d, 0, sizeof d);
        d.struct_size = sizeof d;
        check(fa_context_last_profile_dispatch(ctx, i, &d) == FA_STATUS_SUCCESS, fa_last_error_message());
        printf("  %-34s grid %u x %u x %u, %u threads, %u B threadgroup memory, %llu MMAs, %llu barriers, "
               "%.6f s\n", d.kernel_name, d.threadgroups_per_grid[0], d.threadgroups_per_grid[1],
               d.threadgroups_per_grid[2], d.threads_per_threadgroup[0], d.threadgroup_memory_length,
               (unsigned long long)d.simdgroup_multiply_accumulates, (unsigned long long)d.threadgroup_barriers,
               d.seconds);
        check(strncmp(d.kernel_name, prefix, strlen(prefix)) == 0, "profile: kernel name");
        check(d.threadgroups_per_grid[0] >= 1 && d.threads_per_threadgroup[0] >= 1, "profile: sizes");
        check(d.simdgroup_multiply_accumulates != UINT64_MAX && d.threadgroup_barriers != UINT64_MAX,
              "profile: the CPU engine measures its counters");
        sum += d.seconds;
        barriers += d.threadgroup_barriers;
    }
    check(barriers > 0, "profile: barriers executed");
    check(fabs(sum - profile.seconds) <= 1e-9 * profile.seconds, "profile: seconds is the sum of the dispatches'");
    fa_dispatch_profile past = {0};
    past.struct_size = sizeof past;
    check(fa_context_last_profile_dispatch(ctx, profile.dispatch_count, &past) == FA_STATUS_INVALID_ARGUMENT,
          "profile: an index past the dispatches is an invalid argument");
}

int main(void) {
    static uint16_t q[B * H * NQ * D], k[B * HKV * NK * D], v[B * HKV * NK * D], out[B * H * NQ * D];
    static uint16_t dout[B * H * NQ * D], dq[B * H * NQ * D], dk[B * HKV * NK * D], dv[B * HKV * NK * D];
    static float lse[B * H * NQ];
    fill(q, sizeof q / 2, 1);
    fill(k, sizeof k / 2, 2);
    fill(v, sizeof v / 2, 3);
    fill(dout, sizeof dout / 2, 4);

    fa_context *ctx = NULL;
    fa_status status = fa_context_create(FA_BACKEND_CPU, &ctx);
    if (status != FA_STATUS_SUCCESS) {
        fprintf(stderr, "FAIL: fa_context_create: %s: %s\n", fa_status_name(status), fa_last_error_message());
        return 1;
    }
    printf("libFlashAttentionMetal %s, backend %s, device %s\n", fa_version(), fa_context_backend_name(ctx),
           fa_context_device_name(ctx));

    fa_problem problem = {.struct_size = sizeof(fa_problem), .batch = B, .num_heads = H, .num_kv_heads = HKV,
                          .seqlen_q = NQ, .seqlen_k = NK, .head_dim = D, .causal = 1, .softmax_scale = 0.25f};
    status = fa_forward(ctx, &problem, q, k, v, out, lse);
    check(status == FA_STATUS_SUCCESS, fa_last_error_message());
    check_finite(out, sizeof out / 2, "out");
    int lse_finite = 1;
    for (size_t i = 0; i < sizeof lse / 4; i++) lse_finite &= isfinite(lse[i]) != 0;
    check(lse_finite, "lse finite (NK >= NQ: every row sees a key)");
    printf("forward profile:\n");
    check_profile(ctx, 1, "flash_attention_forward_");

    /* Causal with seqlen_q 1 sees every key; with one key, out equals that value row. */
    fa_problem one = {.struct_size = sizeof(fa_problem), .batch = 1, .num_heads = 1, .num_kv_heads = 1,
                      .seqlen_q = 1, .seqlen_k = 1, .head_dim = D, .causal = 1, .softmax_scale = 0.25f};
    static uint16_t out1[D];
    float lse1;
    check(fa_forward(ctx, &one, q, k, v, out1, &lse1) == FA_STATUS_SUCCESS, "single key forward");
    check(memcmp(out1, v, sizeof out1) == 0, "one visible key: out equals its value row");

    status = fa_backward(ctx, &problem, dout, q, k, v, out, lse, dq, dk, dv);
    check(status == FA_STATUS_SUCCESS, fa_last_error_message());
    check_finite(dq, sizeof dq / 2, "dq");
    check_finite(dk, sizeof dk / 2, "dk");
    check_finite(dv, sizeof dv / 2, "dv");
    printf("backward profile:\n");
    check_profile(ctx, 2, "flash_attention_backward_"); /* dQ and dK/dV kernels, at least */

    /* Merging out with a part that saw no key (lse -inf) gives out and lse back unchanged. */
    static uint16_t merged[B * H * NQ * D];
    static float empty_lse[B * H * NQ], merged_lse[B * H * NQ];
    for (size_t i = 0; i < sizeof empty_lse / 4; i++) empty_lse[i] = -INFINITY;
    status = fa_merge_attention(ctx, B * H * NQ, D, out, lse, dq, empty_lse, merged, merged_lse);
    check(status == FA_STATUS_SUCCESS, fa_last_error_message());
    check(memcmp(merged, out, sizeof out) == 0 && memcmp(merged_lse, lse, sizeof lse) == 0,
          "merge with an empty part returns the other part");

    fa_problem bad = problem;
    bad.num_heads = 3;
    bad.num_kv_heads = 2;
    status = fa_forward(ctx, &bad, q, k, v, out, lse);
    check(status == FA_STATUS_INVALID_ARGUMENT, "bad GQA ratio gives FA_STATUS_INVALID_ARGUMENT");
    check(strcmp(fa_last_error_message(), "num_heads (3) must be a multiple of num_kv_heads (2)") == 0,
          "error message names the arguments and the rule");
    bad = problem;
    bad.head_dim = fa_max_head_dim() + 1;
    check(fa_forward(ctx, &bad, q, k, v, out, lse) == FA_STATUS_UNSUPPORTED, "head_dim above fa_max_head_dim() unsupported");

    fa_context_destroy(ctx);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("C ABI smoke test passed\n");
    return 0;
}
