// The accuracy rule of the project (design.md, "Accuracy rule"; python/flash_attention_metal/
// accuracy.py is the same rule in NumPy) and the empty-row checks, for the CUDA harness.
#ifndef FA_GPU_ACCURACY_H
#define FA_GPU_ACCURACY_H

#include <cstdint>
#include <string>
#include <vector>

#include "reference.h"

// The factors of FlashAttention's tests (Dao-AILab/flash-attention, hopper/test_flash_attn.py):
// max|ours - ref| <= factor * max|base - ref| + absolute_term(ref), max|base - ref| the largest
// over the dtype's baselines (reference.h's baselines(): one for float16 and bfloat16; for float32
// the kernels' streamed order and a blocked order, as accuracy.py).
constexpr double kOutFactor = 2.0;      // out
constexpr double kGradFactor = 2.0;     // dq, dk, dv
constexpr double kSoftcapFactor = 4.0;  // out and the gradients with a softcap
constexpr double kDsinksFactor = 4.0;   // dsinks, on the root sum of squares of its row errors
constexpr double kLseRelative = 1e-4;   // lse: |ours - ref| <= 1e-4 * max(1, |ref|) per element

// FlashAttention's atol, 2 * max|(ref + 0.3 - 0.3) - ref| with every step rounded to float32: twice
// the reference's own float32 rounding at its magnitude (accuracy.py's absolute_term). Non-finite
// entries of ref are left out.
double absolute_term(const std::vector<double> &ref);

// The factor of out and the gradients: kSoftcapFactor with a softcap, else `plain`.
inline double rule_factor(double plain, float softcap) { return softcap > 0.0f ? kSoftcapFactor : plain; }

// One tensor's verdict: error against bound. For lse, error is the largest relative error and
// base_error is unused (0).
struct Metric {
    std::string name;
    double error;
    double base_error;
    double bound;

    // False for a NaN or infinite error (any non-finite value where ref is finite).
    bool passed() const;
};

// out or a gradient: `ours` are the GPU's values (as float), `base` the baseline in their dtype,
// `ref` float64; bound = factor * max|base - ref| + absolute_term(ref).
Metric tensor_metric(const std::string &name, const std::vector<float> &ours,
                     const std::vector<float> &base, const std::vector<double> &ref, double factor);

// The same against several baselines (reference.h's baselines(); `tensor` picks out, dq, dk or
// dv): the base error is the largest of their max|base - ref| (accuracy.py's _metric). float32 has
// two, the kernels' streamed order and a blocked BLAS order: which one rounds a near one-hot row's
// dominant scores luckier is chance, so neither alone bounds a correct kernel (accuracy.py).
Metric tensor_metric(const std::string &name, const std::vector<float> &ours,
                     const std::vector<BaseResult> &bases, std::vector<float> BaseResult::*tensor,
                     const std::vector<double> &ref, double factor);

// lse: relative error where ref is finite; ours must be exactly -inf where ref is -inf.
Metric lse_metric(const std::vector<float> &ours, const std::vector<double> &ref);

// dsinks (accuracy.py's _dsinks_metric): error max|ours - ref.dsinks|; base error the root sum of
// squares of the base's row terms' errors, max_h sqrt(sum_{b,i} (base.sink_terms - ref.sink_terms)^2)
// (the rows' errors are independent: their sum grows with that, and the base's own signed sum
// can cancel by chance); bound kDsinksFactor * that + absolute_term(ref.dsinks). `base` is
// baselines().front(): for float32 the streamed order, as accuracy.py's base_backward.
Metric dsinks_metric(const AttentionShape &shape, const std::vector<float> &ours,
                     const ReferenceResult &ref, const BaseResult &base);

// Rows that see no key (ref.empty): out and dq must be exactly zero, lse exactly -inf, or exactly
// sinks[h] with sinks (tensors in the logical layouts of reference.h). Returns the number of such
// rows in *empty_rows and whether all of them are right.
bool empty_rows_correct(const AttentionShape &shape, const AttentionInputs &in,
                        const ReferenceResult &ref, const std::vector<float> &out,
                        const std::vector<float> &lse, const std::vector<float> &dq,
                        int *empty_rows);

#endif
