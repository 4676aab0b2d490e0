// The accuracy rule of the project (design.md, "Accuracy rule"; python/flash_attention_metal/
// accuracy.py is the same rule in NumPy) and the empty-row checks, for the CUDA harness.
#ifndef FA_GPU_ACCURACY_H
#define FA_GPU_ACCURACY_H

#include <cstdint>
#include <string>
#include <vector>

#include "reference.h"

constexpr double kOutFactor = 2.0;     // out: max|ours - ref| <= 2 * max|base - ref| + slack
constexpr double kGradFactor = 3.0;    // dq, dk, dv: factor 3
constexpr double kLseRelative = 1e-4;  // lse: |ours - ref| <= 1e-4 * max(1, |ref|) per element

// The additive slack per dtype, as python/flash_attention_metal/accuracy.py: 1e-5 for float16 and
// bfloat16 (1/100 of float16's epsilon, as FlashAttention's tests), 1e-6 for float32 (the backward
// recomputes P from the float32 lse, whose rounding every probability of a row inherits).
inline double abs_slack(DType dtype) { return dtype == DType::f32 ? 1e-6 : 1e-5; }

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

// out or a gradient: `ours` are the GPU's values (of `dtype`, as float), `base` the baseline in
// that dtype, `ref` float64; bound = factor * max|base - ref| + abs_slack(dtype).
Metric tensor_metric(const std::string &name, const std::vector<float> &ours,
                     const std::vector<float> &base, const std::vector<double> &ref, double factor,
                     DType dtype);

// lse: relative error where ref is finite; ours must be exactly -inf where ref is -inf.
Metric lse_metric(const std::vector<float> &ours, const std::vector<double> &ref);

// dsinks (accuracy.py's _dsinks_metric): error max|ours - ref.dsinks|; base error the base's row
// terms' errors summed in absolute value, max_h sum_{b,i} |base.sink_terms - ref.sink_terms| (the
// signed sum can cancel by chance); bound GRAD_FACTOR * that + abs_slack(dtype).
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
